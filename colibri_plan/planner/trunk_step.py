"""The trunk of a GPU that replays its decode step, priced from the profile's ``step_graph`` (pure).

The eager trunk figures (:mod:`.trunk`, :mod:`.trunk_layer`) time ops launched one by one from the host.
On a CUDA GPU the engine instead replays the whole decode step from a captured graph
(engine/decode_graph.py): one launch, the routing and the VRAM experts on the device. The step probe
(:mod:`colibri_plan.profiler.step_probe`) measured that replay on synthetic packs of the model's widths
with every expert in VRAM: ``layer_s`` (one MoE layer: its trunk and its top-k experts) and ``fixed_s``
(once a token: embedding row, final norm, LM head, logits down). Per decode token, with ``n_layers``
layers, top-k ``K``, expert bytes ``b`` and the device's fastest GEMV rate ``g`` (``fastest_gemv_gbps``:
the rate of a memory-bound read inside the replay)::

    dense_s     = c_dense · (fixed_s + n_layers · (layer_s − K · b / g) + extra_bytes / g) + roundtrip_s
    attention_s = c_attention · max(0, context − probe context) · kv_bytes_per_token / kv_gbps(context)

The per-layer figure holds its K experts' reads at ``g``; they are taken out here because the placement
adds each selected expert back where it lies (a VRAM expert at ``g``: ``GpuResource.step_expert_gbps``;
a mapped host expert at ``step_mapped_gbps``; :func:`~colibri_plan.planner.path_rows.gpu_expert_seconds`,
:func:`~colibri_plan.planner.compute.mapped_expert_seconds`). ``extra_bytes``: the model's dense bytes
per layer beyond the probe's layer (shared experts, a dense FFN layer's weights), 0 when the probe's
layer holds them all. The probe's layer already holds attention at its own context; only the growth
beyond it is added. ``roundtrip_s`` (n_moe · the device's round trip) is the same figure the eager
pricing carries: a segmented step turns it into a hand-off at hybrid layers only
(:func:`~colibri_plan.planner.trunk_solve.option_setup`).

The figure holds for the model's shapes only (:func:`step_match`); any other model keeps the eager
pricing unchanged. The probe's attention heads are not in the model spec and so are not matched.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_plan.errors import InputError
from colibri_plan.formats.profile_trunk import fastest_gemv_gbps, step_graph

#: backends whose trunk replays its decode step as captured graph segments (engine/decode_graph.py)
SEGMENTED_BACKENDS = ("cuda",)
#: families whose attention the captured step does not take (MLA writes its cache rows in blocks)
UNCAPTURED_FAMILIES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa",
                       "glm4_moe_lite")


@dataclass(frozen=True)
class StepFigures:
    """One device's replayed decode step (seconds per token; see the module docstring).

    Attributes:
        layer_s: one MoE layer, its top-k VRAM experts included. fixed_s: once a token.
        context_tokens: the probe's context (its attention is in ``layer_s``). top_k, expert_bytes: the
            probe's K and bytes of one expert. layer_trunk_bytes: the probe's per-layer trunk bytes.
        gemv_gbps: the device's fastest GEMV GB/s (1e9 B/s): the in-replay rate of a VRAM expert.
        mapped_gbps: GB/s of mapped host experts read inside a replay (0: no figure; the GPU's
            ``mapped_gbps`` is used).
    """

    layer_s: float
    fixed_s: float
    context_tokens: int
    top_k: int
    expert_bytes: int
    layer_trunk_bytes: int
    gemv_gbps: float
    mapped_gbps: float = 0.0


def replays_step(key: str, split: tuple, spec) -> bool:
    """Whether the engine replays the decode step of a trunk on ``key`` (one CUDA GPU, no layer split,
    a family the capture takes)."""
    return (not split and key.split(":")[0] in SEGMENTED_BACKENDS
            and getattr(spec, "family", "") not in UNCAPTURED_FAMILIES)


def step_match(spec, dense_fmt: str) -> dict:
    """The ``step_graph`` keys a model's entry must match: its hidden size, vocabulary, experts, top-k,
    expert width and the dense and expert formats."""
    return {"hidden": spec.hidden_size, "vocab": spec.vocab_size, "n_experts": spec.n_experts,
            "top_k": spec.top_k, "expert_width": spec.moe_intermediate_size, "fmt": dense_fmt,
            "expert_fmt": spec.expert_format}


def step_figures(profile, backend: str, index: int, spec, dense_fmt: str) -> StepFigures | None:
    """The device's :class:`StepFigures` for ``spec``'s shapes; None when the profile has no matching
    ``step_graph`` entry or no ``dense_gemv`` figure (then the trunk is priced eagerly, as before).

    Raises:
        InputError: a matching entry whose figures are not positive.
    """
    row = step_graph(profile, backend, index, step_match(spec, dense_fmt))
    gemv = fastest_gemv_gbps(profile, backend, index)
    if row is None or not gemv:
        return None
    fig = StepFigures(row["layer_s"], row["fixed_s"], int(row["context_tokens"]), int(row["top_k"]),
                      int(row["expert_bytes"]), int(row["layer_trunk_bytes"]), float(gemv))
    if not (fig.layer_s > 0 and fig.fixed_s > 0 and fig.gemv_gbps > 0):
        raise InputError(f"step_graph of {backend}:{index}: layer {fig.layer_s} s, fixed {fig.fixed_s} s, "
                         f"GEMV {fig.gemv_gbps} GB/s must be positive; re-measure with `colibri-plan "
                         "profile --model`")
    return fig


def step_trunk_seconds(step: StepFigures, n_layers: int, layer_dense_bytes: int, context_tokens: int,
                       kv_bytes_per_token: int, kv_gbps: float, roundtrip_s: float,
                       coef) -> tuple[float, float, float]:
    """(dense_s, attention_s, roundtrip_s) per decode token of a replayed step (module docstring).

    Args:
        n_layers: the model's layers. layer_dense_bytes: the model's dense bytes per layer (LM head
            excluded). context_tokens: the KV context. kv_bytes_per_token: all layers' K+V bytes per
            context token as the device caches them. kv_gbps: the device's KV GB/s at that context.
        roundtrip_s: n_moe · the device's round trip, seconds (added to dense_s, reported apart).
        coef: c_dense and c_attention.

    E.g. 24 layers, fixed 100 µs, layer 105 µs of which 8 experts · 4.73 MB at 2000 GB/s = 18.92 µs,
    no extra bytes, no growth, no round trip: dense 100 + 24 · (105 − 18.92) µs = 2.166 ms (the
    placement then adds 24 · 8 selections back).
    """
    expert_s = step.top_k * step.expert_bytes / (step.gemv_gbps * 1e9)
    layer_s = max(0.0, step.layer_s - expert_s)
    extra_s = n_layers * max(0, int(layer_dense_bytes) - step.layer_trunk_bytes) / (step.gemv_gbps * 1e9)
    dense = coef.dense * (step.fixed_s + n_layers * layer_s + extra_s) + roundtrip_s
    grow = max(0, int(context_tokens) - step.context_tokens)
    attention = coef.attention * grow * kv_bytes_per_token / (kv_gbps * 1e9)
    return dense, attention, roundtrip_s
