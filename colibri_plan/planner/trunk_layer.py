"""The trunk priced from a measured decoder layer (profile section ``trunk_layer``; pure, hand-checkable).

A decode token on a device trunk is a host-driven sequence of small ops: per layer a dozen launches,
their Python dispatch, and on a MoE layer one synchronising ``d_get`` of x, the routing in numpy and a
``d_put`` of the experts' sum. Those costs, not the GEMV bytes, dominate a GPU trunk at decode, and the
CPU trunk's many small matmul calls (q, k, v, o one call each) run far below the large-GEMV rate. So when
the profile holds a ``trunk_layer`` figure of the device (:mod:`colibri_plan.profiler.trunk_layer_probe`:
one whole layer timed on that device's own path), the trunk is priced from it, per decode token::

    layer_s     = block_s − attn0_s + (b_layer − probe_bytes) / dense_gbps
    dense_s     = c_dense · (n_layers · layer_s + lm_bytes / lm_gbps + 2 · op_s) + n_moe · handoff_s
    attention_s = c_attention · n_layers · (attn0_s + max(0, context − c0) · growth_s · kv_scale)
    roundtrip_s = n_moe · handoff_s            (device path only; reported, inside dense_s)

* ``block_s``: one layer from the attention norm to the FFN norm (q/k/v, RoPE, KV write, attention at
  ``c0`` keys, o-proj, residual add), measured; ``attn0_s``: its KV write + attention call at ``c0``.
* ``handoff_s``: what a MoE layer adds beyond that: x to the host (``d_get``, which waits for the queued
  ops), the router GEMV, softmax, top-k and the grouping in numpy, and the experts' sum back (``d_put`` +
  add); on the host path only the routing. The routed experts' own time is the expert cost model's.
* ``b_layer`` = (trunk read bytes − ``lm_bytes``) / n_layers: the model's per-layer trunk bytes
  (attention, routers, shared experts, dense FFN), swapped in for the probe's q/k/v/o bytes
  (``probe_bytes``) at the device's trunk GEMV rate; 0 difference when the probe ran at the model's shapes
  and the layer holds nothing else.
* ``lm_bytes``: the LM head [vocab, H] in the dense format, read once per token at ``lm_gbps`` (the
  ``dense_gemv`` rate nearest that shape); ``2 · op_s``: the final norm and the logits' ``d_get``.
* ``growth_s``: seconds per extra context token of one attention call, from the layer probe's second
  context (``(attn_long_s − attn0_s) / (c_long − c0)``) times ``kv_scale`` = the model's K+V bytes per
  token and layer / the probe's (2 · kv_heads · head_dim · 4 B, float32); else the model's K+V bytes
  per token and layer times the ``attention`` section's seconds per extra byte
  (:func:`kv_growth_s_per_byte`).
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_plan.quant import tensor_bytes


@dataclass(frozen=True)
class TrunkWork:
    """What one decode token asks of a trunk (or of a split's share of it).

    Attributes:
        dense_bytes: trunk weight bytes read (less the embedding; the LM head included).
        n_layers: decoder layers it runs. n_moe_layers: of them, MoE layers (a host round trip each).
        context_tokens: tokens in the KV cache. kv_bytes_per_token: the cache's bytes per context token,
            all these layers together.
    """

    dense_bytes: int
    n_layers: int
    n_moe_layers: int
    context_tokens: int
    kv_bytes_per_token: int


@dataclass(frozen=True)
class LayerFigures:
    """One device's measured layer (seconds per layer; see the module docstring).

    Attributes:
        block_s, handoff_s, attn0_s: medians of the probe. context_tokens: c0. growth_s: seconds per
            extra context token of one attention call at the probe's geometry (None: not measured).
        probe_bytes: the probe's q/k/v/o stored bytes of one layer. kv_bytes_per_token: the probe's K+V
            bytes per token of one layer. path: "device" or "host". fmt: the probe's dense format.
    """

    block_s: float
    handoff_s: float
    attn0_s: float
    context_tokens: int
    probe_bytes: int
    kv_bytes_per_token: int
    growth_s: float | None = None
    path: str = "device"
    fmt: str = "int8"

    @classmethod
    def from_reader(cls, row: dict | None) -> LayerFigures | None:
        """From :func:`colibri_plan.formats.profile_trunk.trunk_layer`'s dict (None passes through)."""
        if row is None:
            return None
        growth = None
        if "attention_long_s" in row and row["long_context_tokens"] > row["context_tokens"]:
            growth = max(0.0, (row["attention_long_s"] - row["attention_s"])
                         / (row["long_context_tokens"] - row["context_tokens"]))
        return cls(row["block_s"], row["handoff_s"], row["attention_s"], int(row["context_tokens"]),
                   int(row["weight_bytes"]), 8 * int(row["n_kv_heads"]) * int(row["head_dim"]), growth,
                   row["path"], row["fmt"])


def lm_head_bytes(spec, dense_fmt: str) -> int:
    """Stored bytes of the LM head [vocab, H] in ``dense_fmt``."""
    return int(tensor_bytes(dense_fmt, spec.vocab_size, spec.hidden_size))


def kv_growth_s_per_byte(kv_gbps: tuple[tuple[int, float], ...], context_tokens: int) -> float:
    """Seconds per extra K+V byte of one attention call, from the ``attention`` section's (context, GB/s)
    pairs: the slope between the two measured contexts around ``context_tokens`` (else the two nearest),
    (c2 / g2 − c1 / g1) / (c2 − c1) / 1e9 (a call's fixed cost cancels); with one pair, 1 / (g · 1e9).
    E.g. ((256, 10.0), (4096, 40.0)): (102.4 − 25.6) / 3840 / 1e9 = 2e-11 s per byte."""
    pairs = sorted((c, g) for c, g in kv_gbps if c > 0)
    if len(pairs) < 2:
        return 1.0 / (kv_gbps[0][1] * 1e9)
    i = next((j for j in range(1, len(pairs)) if pairs[j][0] >= context_tokens), len(pairs) - 1)
    (c1, g1), (c2, g2) = pairs[i - 1], pairs[i]
    return max(0.0, (c2 / g2 - c1 / g1) / (c2 - c1) / 1e9)


def layer_trunk_seconds(lay: LayerFigures, work: TrunkWork, lm_bytes: int, dense_gbps: float, lm_gbps: float,
                        op_s: float, kv_gbps: tuple[tuple[int, float], ...], c_dense: float = 1.0,
                        c_attention: float = 1.0) -> tuple[float, float, float]:
    """(dense_s, attention_s, roundtrip_s) per decode token from a measured layer (module docstring).

    Args:
        work: the token's trunk work (:class:`TrunkWork`: read bytes with the LM head, layers, MoE layers,
            context, the model's KV bytes per token). lm_bytes: the LM head's bytes.
        dense_gbps, lm_gbps: the device's trunk GEMV GB/s (1e9 B/s) at a layer's and at the LM head's
            shape. op_s: one small device op, s.
        kv_gbps: the ``attention`` section's ((context, K+V GB/s), ...): the growth when the layer probe
            has no second context (:func:`kv_growth_s_per_byte`).

    ``roundtrip_s`` is the hand-off on the device path only (the host path has no round trip; its
    routing stays in ``dense_s``).

    E.g. block 300 µs, attn0 50 µs, handoff 100 µs, probe bytes = b_layer, 10 layers (5 MoE), 1 GB LM
    head at 100 GB/s, op 5 µs, context = c0: dense = 10 · 250 µs + 10 ms + 10 µs + 5 · 100 µs.
    """
    n_layers, n_moe_layers, context_tokens = work.n_layers, work.n_moe_layers, work.context_tokens
    n = max(1, int(n_layers))
    b_layer = max(0, int(work.dense_bytes) - int(lm_bytes)) / n
    layer_s = max(0.0, lay.block_s - lay.attn0_s + (b_layer - lay.probe_bytes) / (dense_gbps * 1e9))
    handoff = n_moe_layers * lay.handoff_s
    dense = c_dense * (n_layers * layer_s + lm_bytes / (lm_gbps * 1e9) + 2 * op_s) + handoff
    kv_layer = work.kv_bytes_per_token / n
    if lay.growth_s is not None:
        per_token = lay.growth_s * kv_layer / max(1, lay.kv_bytes_per_token)
    else:
        per_token = kv_layer * kv_growth_s_per_byte(kv_gbps, context_tokens)
    extra = max(0, int(context_tokens) - lay.context_tokens)
    attention = c_attention * n_layers * (lay.attn0_s + extra * per_token)
    return dense, attention, handoff if lay.path == "device" else 0.0
