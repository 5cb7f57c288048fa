"""Where the dense trunk, attention and the KV cache run: the options and their cost (pure, hand-checkable).

The trunk is everything outside the routed experts a decode token computes: norms, attention, shared
experts, dense FFN layers, routers and the LM head. Its weights (``dense_read_bytes``: the dense trunk
less the embedding table, which stays in RAM: a token looks up one row) and the KV cache live with it,
and attention runs where the KV cache is. Per decode token, with the trunk on device d (or the CPU)::

    dense_s     = c_dense · dense_bytes / dense_gbps(d)  +  n_layers · ops_per_layer · op_s(d)
                  [+ n_moe_layers · roundtrip_s(d) when d is a discrete GPU]
    attention_s = c_attention · context · kv_bytes_per_token / kv_gbps(d, context)

(``kv_bytes_per_token`` is all layers' together, so this is n_layers · context · per-layer bytes /
kv_gbps.) The round trip is the normed hidden state down to the host for the routed experts and their
sum back up, once per MoE layer; ``dense_s`` includes it (``roundtrip_s`` reports the share). On a
discrete GPU the trunk's bytes and the KV cache's (whole 64-token pages,
:func:`~colibri_plan.formats.plan_trunk.kv_bytes`) come out of that device's expert budget, and the RAM
budget gets back what it charged for them; that is the trade the solver weighs (:mod:`.trunk_solve`).

Figures, from the profile's optional sections (``dense_gemv``, ``device_ops``, ``attention``) with
fallbacks for older and published profiles that lack them:

* ``dense_gbps``: ``dense_gemv`` of the device at the dense format, nearest measured shape to
  [hidden, hidden]; else the device's ``matmul`` figure at that format and shape; else the device's
  routed-expert GB/s (``GpuResource.matmul_gbps``). The CPU: ``dense_gemv`` of backend cpu/numpy, else
  the CPU path as before (``Resources.dense_gbps``, else min(CPU matmul, RAM read)).
* ``op_s``: ``device_ops.op_seconds`` (median); else :data:`DEFAULT_GPU_OP_S` on a GPU (a kernel
  launch in a chain) and 0 on the CPU (as before: the CPU trunk had no per-op term).
* ``roundtrip_s``: ``device_ops.roundtrip_seconds`` (median); else c_transfer · (hidden-state H2D +
  D2H at the ``links`` GB/s + 2 link latencies) (:func:`~colibri_plan.planner.costmodel.
  transfer_seconds`); 0 on the CPU and on unified memory.
* ``kv_gbps``: ``attention.kv_gbps`` of the device at the nearest measured context (log distance); else
  RAM read GB/s on the CPU (as before) and the device's ``dense_gbps`` on a GPU (a memory-bound read).

``ops_per_layer`` (:data:`DEFAULT_OPS_PER_LAYER`) counts the small device ops a decoder layer launches
beside its matmuls (norms, rope, residual adds, cache writes, the attention call, activation).

When the profile measured a whole decoder layer on the device (section ``trunk_layer``: the device path
of a GPU, the host path of the CPU), that figure prices the trunk instead of the formula above, which
misses the host work between the ops (:mod:`colibri_plan.planner.trunk_layer`); ``sources`` says which
was used.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from colibri_plan import quant
from colibri_plan.errors import InputError
from colibri_plan.formats.plan_trunk import CPU, device_kv_bytes_per_token, kv_bytes
from colibri_plan.formats.plan_trunk import host_kv_bytes_per_token as host_kv_bytes
from colibri_plan.formats.profile_trunk import (
    attention_kv_table,
    dense_gemv_gbps,
    device_op_s,
    kv_gbps_at,
    roundtrip_s,
    trunk_layer,
)
from colibri_plan.planner.costmodel import transfer_seconds
from colibri_plan.planner.trunk_layer import LayerFigures, TrunkWork, layer_trunk_seconds, lm_head_bytes
from colibri_plan.planner.trunk_step import StepFigures, replays_step, step_figures, step_trunk_seconds

#: seconds of one small device op in a chain (launch-bound) when the profile has no ``device_ops`` figure
DEFAULT_GPU_OP_S = 8e-6
#: small device ops per decoder layer beside the matmuls: 2 norms, rope ×2, 2 residual adds, cache
#: write ×2, attention, softmax/scale, SiLU·mul, router, 2 copies
DEFAULT_OPS_PER_LAYER = 14
#: CPU backends the profile names the host by in its trunk sections
CPU_BACKENDS = ("cpu", "numpy", "numba")


@dataclass(frozen=True)
class TrunkFigures:
    """One device's trunk figures (see the module docstring).

    Attributes:
        key: "cpu" or a device key ("cuda:0"). dense_gbps: trunk weight GB/s (1e9 B/s) at 1 token.
        op_s: seconds per small device op. roundtrip_s: seconds of one host round trip of the hidden state
            (0 on the CPU and unified memory). kv_gbps: ((context tokens, KV GB/s), ...), ascending
            context; one pair (0, g) when the figure does not depend on context.
        discrete: a discrete GPU (its memory is VRAM, apart from RAM). sources: figure -> where it came from.
        layer: the measured decoder layer (None: priced by the formula). lm_gbps: trunk GEMV GB/s at
            the LM head's shape (None: ``dense_gbps``).
        step: the replayed decode step measured at the model's shapes (:mod:`.trunk_step`; None: no
            matching ``step_graph`` entry, the eager pricing).
    """

    key: str
    dense_gbps: float
    op_s: float
    roundtrip_s: float
    kv_gbps: tuple[tuple[int, float], ...]
    discrete: bool = False
    sources: dict = field(default_factory=dict)
    layer: LayerFigures | None = None
    lm_gbps: float | None = None
    step: StepFigures | None = None

    def kv_gbps_at(self, context_tokens: int) -> float:
        """KV GB/s at the measured context nearest ``context_tokens`` (log distance)."""
        return kv_gbps_at(self.kv_gbps, context_tokens)


def trunk_seconds(fig: TrunkFigures, work: TrunkWork, ops_per_layer: int = DEFAULT_OPS_PER_LAYER,
                  c_dense: float = 1.0, c_attention: float = 1.0) -> tuple[float, float, float]:
    """(dense_s, attention_s, roundtrip_s) per decode token of ``work`` (:class:`~colibri_plan.planner.
    trunk_layer.TrunkWork`) on ``fig``'s device.

    ``dense_s`` includes ``roundtrip_s`` = n_moe_layers · fig.roundtrip_s. Bytes are bytes; seconds are
    seconds per token. Pure: e.g. 1 GB at 100 GB/s + 10 layers · 10 ops · 1 µs + 5 MoE layers · 20 µs =
    0.01 + 0.0001 + 0.0001 s.
    """
    roundtrip = work.n_moe_layers * fig.roundtrip_s
    dense = (c_dense * work.dense_bytes / (fig.dense_gbps * 1e9) + work.n_layers * ops_per_layer * fig.op_s
             + roundtrip)
    ctx = work.context_tokens
    attention = c_attention * ctx * work.kv_bytes_per_token / (fig.kv_gbps_at(ctx) * 1e9)
    return dense, attention, roundtrip


def price_trunk(fig: TrunkFigures, spec, dense_fmt: str, work: TrunkWork, ops_per_layer: int, coef,
                lm_share: float = 1.0) -> tuple[float, float, float]:
    """(dense_s, attention_s, roundtrip_s) of ``work``'s layers on ``fig``'s device: from its measured
    layer when it has one (:func:`~colibri_plan.planner.trunk_layer.layer_trunk_seconds`; the LM head
    counted in proportion ``lm_share`` of a split), else :func:`trunk_seconds`."""
    if fig.layer is None:
        return trunk_seconds(fig, work, ops_per_layer, coef.dense, coef.attention)
    lm = int(lm_head_bytes(spec, dense_fmt) * lm_share)
    return layer_trunk_seconds(fig.layer, work, lm, fig.dense_gbps, fig.lm_gbps or fig.dense_gbps, fig.op_s,
                               fig.kv_gbps, coef.dense, coef.attention)


def split_layers(n_layers: int, free_bytes: dict[str, int]) -> tuple[tuple[int, int, str], ...]:
    """llama.cpp-style layer split: consecutive layer ranges per device, in the order given, sized in
    proportion to ``free_bytes`` (largest remainders get the rounding); devices that get no layer are left
    out. Returns ((first_layer, last_layer, key), ...) covering 0..n_layers-1."""
    total = sum(max(0, v) for v in free_bytes.values())
    if total <= 0 or n_layers <= 0:
        return ()
    share = {k: n_layers * max(0, v) / total for k, v in free_bytes.items()}
    count = {k: int(s) for k, s in share.items()}
    for k in sorted(share, key=lambda k: -(share[k] - count[k]))[:n_layers - sum(count.values())]:
        count[k] += 1
    out, first = [], 0
    for k, n in count.items():
        if n:
            out.append((first, first + n - 1, k))
            first += n
    return tuple(out)


# -- the profile's trunk sections (readers: formats.profile_trunk), with fallbacks ------------------------

def _layer_and_lm(profile, backend: str | None, index: int, path: str, dense_fmt: str,
                  spec, src: dict) -> tuple[LayerFigures | None, float | None]:
    """The device's measured layer (the host CPU: under any of :data:`CPU_BACKENDS`) and its GEMV GB/s at
    the LM head's shape (None: not measured); notes the sources in ``src``."""
    lay = None
    for b in ((backend,) if backend else CPU_BACKENDS):
        lay = lay or LayerFigures.from_reader(trunk_layer(profile, b, index, path))
    src["layer"] = (f"profile trunk_layer ({lay.path} path, {lay.fmt})" if lay
                    else "none (formula: GEMV bytes + small ops)")
    return lay, dense_gemv_gbps(profile, backend or CPU_BACKENDS, index, dense_fmt, spec.vocab_size,
                                spec.hidden_size)


def device_figures(profile, res, spec, dense_fmt: str, coef) -> dict[str, TrunkFigures]:
    """"cpu" and every GPU of ``res`` -> its :class:`TrunkFigures` (module docstring for the fallbacks).

    Raises:
        InputError: a figure that is not a positive finite number.
    """
    h = spec.hidden_size
    act = h * 4                                 # the hidden state crosses the link as f32 [1, H]
    out = {}
    g = dense_gemv_gbps(profile, CPU_BACKENDS, 0, dense_fmt, h, h)
    src = {"dense_gbps": "profile dense_gemv" if g else "CPU path (matmul, RAM read)"}
    g = g or (res.dense_gbps if res.dense_gbps is not None else res.cpu_gbps)
    op = device_op_s(profile, CPU_BACKENDS, 0)
    src["op_s"] = "profile device_ops" if op else "none (0: as before)"
    kv = attention_kv_table(profile, CPU_BACKENDS, 0)
    src["kv_gbps"] = "profile attention" if kv else "RAM read"
    lay, lm = _layer_and_lm(profile, None, 0, "host", dense_fmt, spec, src)
    out[CPU] = TrunkFigures(CPU, g, op or 0.0, 0.0, kv or ((0, res.ram_read_gbps),), False, src, lay, lm)
    for gpu in res.gpus:
        backend, _, idx = gpu.key.partition(":")
        i = int(idx)
        g = dense_gemv_gbps(profile, backend, i, dense_fmt, h, h)
        src = {"dense_gbps": "profile dense_gemv"}
        if not g:
            try:
                g = profile.matmul_weight_gbps(backend, i, dense_fmt, 1, h, h)
                src["dense_gbps"] = f"profile matmul at {dense_fmt}"
            except (InputError, KeyError, ValueError):
                g = gpu.matmul_gbps
                src["dense_gbps"] = "routed-expert GB/s of the device"
        op, rt = device_op_s(profile, backend, i), roundtrip_s(profile, backend, i)
        src["op_s"] = "profile device_ops" if op else f"default {DEFAULT_GPU_OP_S * 1e6:g} µs"
        if gpu.unified:
            rt, src["roundtrip_s"] = 0.0, "unified memory (no transfer)"
        elif rt is None:
            rt = coef.transfer * transfer_seconds(gpu, act)
            src["roundtrip_s"] = "links (2 latencies + H2D/D2H of the hidden state)"
        else:
            src["roundtrip_s"] = "profile device_ops"
        kv = attention_kv_table(profile, backend, i)
        src["kv_gbps"] = "profile attention" if kv else "dense GB/s of the device"
        lay, lm = _layer_and_lm(profile, backend, i, "device", dense_fmt, spec, src)
        step = step_figures(profile, backend, i, spec, dense_fmt)
        src["step"] = "profile step_graph" if step else "none (eager trunk figures)"
        out[gpu.key] = TrunkFigures(gpu.key, g, op or DEFAULT_GPU_OP_S, rt, kv or ((0, g),),
                                    not gpu.unified, src, lay, lm, step)
    for f in out.values():
        bad = [n for n, v in (("dense_gbps", f.dense_gbps), *((f"kv_gbps@{c}", v) for c, v in f.kv_gbps))
               if not (math.isfinite(v) and v > 0)]
        if bad or not (math.isfinite(f.op_s) and f.op_s >= 0 and math.isfinite(f.roundtrip_s)):
            raise InputError(f"trunk figures of {f.key} are not positive finite numbers ({', '.join(bad)}); "
                             "re-measure them with `colibri-plan profile`")
    return out


@dataclass(frozen=True)
class TrunkOption:
    """One place for the trunk, priced.

    Attributes:
        name: "cpu", a device key, or "split". device: where the trunk section says it runs (a split: its
            first device). split: ((first_layer, last_layer, key), ...) or (). dense_s, attention_s,
            roundtrip_s: seconds per decode token (dense_s includes roundtrip_s). dense_bytes: trunk bytes
            (less the embedding). kv_bytes: the paged KV cache. vram_bytes: key -> trunk + KV bytes taken
            out of that device's expert budget. ram_freed_bytes: bytes the RAM budget gets back.
        sources: device key -> figure sources.
        kv_bytes_per_token: the KV cache's bytes per context token as priced (a single GPU: the engine's
            float32 device cache, :func:`~colibri_plan.formats.plan_trunk.device_kv_bytes_per_token`;
            the CPU: the engine's float32 host cache,
            :func:`~colibri_plan.formats.plan_trunk.host_kv_bytes_per_token`; a split: the model spec's
            figure, as llama.cpp's 16-bit cache). MLA's latent cache is priced like GQA's K and V: it
            lives on the trunk's device with its attention.
        expert_call_s: host seconds per routed expert run on this GPU's own hidden state (the device's
            small-op seconds: the engine launches them from the host each layer; 0 on the CPU and split).
        expert_devices: the only GPUs that may hold experts with this option (() = all): colibrì's one
            device list (COLI_GPU) holds trunk and experts alike (:mod:`.trunk_gpus`).
        handoff_s: seconds per token of the hidden state's hops between GPUs (a spread; in roundtrip_s).
        step_expert_gbps: GB/s (1e9 B/s) of a VRAM expert inside the replayed step (priced from the
            profile's ``step_graph``, :mod:`.trunk_step`); 0: eager pricing, the device's matmul figure.
        step_mapped_gbps: GB/s of a mapped host expert inside the replayed step; 0: the GPU's
            ``mapped_gbps``.
    """

    name: str
    device: str
    split: tuple = ()
    dense_s: float = 0.0
    attention_s: float = 0.0
    roundtrip_s: float = 0.0
    dense_bytes: int = 0
    kv_bytes: int = 0
    vram_bytes: dict = field(default_factory=dict)
    ram_freed_bytes: int = 0
    sources: dict = field(default_factory=dict)
    kv_bytes_per_token: int = 0
    expert_call_s: float = 0.0
    expert_devices: tuple = ()
    handoff_s: float = 0.0
    step_expert_gbps: float = 0.0
    step_mapped_gbps: float = 0.0

    @property
    def seconds(self) -> float:
        """dense_s + attention_s: the fixed seconds per token this option adds to the expert layers."""
        return self.dense_s + self.attention_s


def dense_read_bytes(spec, dense_fmt: str) -> int:
    """Dense bytes a decode token reads (and a device holds): the trunk less the embedding table."""
    embed = spec.vocab_size * spec.hidden_size * quant.bits(dense_fmt) // 8
    return max(0, spec.dense_bytes(dense_fmt) - embed)


def trunk_options(figs: dict[str, TrunkFigures], spec, dense_fmt: str, context_tokens: int,
                  vram_budget: dict[str, int], coef, ops_per_layer: int = DEFAULT_OPS_PER_LAYER,
                  host_kv_bytes_per_token: int | None = None, target: str = "colibri-plan") -> list:
    """The CPU, every GPU, and (when no single discrete GPU's budget holds trunk + KV but their budgets
    together do) a layer split over the discrete GPUs in proportion to their budgets. ``target``
    "colibri": colibrì's options instead (:mod:`.trunk_gpus`): a one-GPU trunk keeps the experts on that
    GPU, and with two or more discrete CUDA GPUs the split is colibrì's round-robin spread over all of them.

    Args:
        figs: :func:`device_figures`. vram_budget: key -> the device's expert budget with the trunk on the
            CPU (free - reserve). context_tokens: the KV cache's context.
        host_kv_bytes_per_token: bytes per context token of a KV cache in RAM (a CPU trunk's) as the RAM
            budget charged it
            (:func:`~colibri_plan.planner.budgets.ram_kv_bytes_per_token`: the engine's float32 host
            cache); None: that of our engine (colibri-plan).

    Returns:
        [:class:`TrunkOption`], the CPU first. Budget fit is checked by the caller (:mod:`.trunk_solve`).
    """
    dense = dense_read_bytes(spec, dense_fmt)
    kv_paged = kv_bytes(context_tokens, spec.kv_bytes_per_token)
    bpt_host = int(host_kv_bytes_per_token if host_kv_bytes_per_token is not None
                   else host_kv_bytes(spec.kv_bytes_per_token, spec.source))
    kv_ram = int(context_tokens) * bpt_host                   # what budgets.ram_budget charged for the KV
    ram_charged = dense + kv_ram
    n_moe = sum(1 for lid in spec.moe_layers if lid < spec.n_layers)
    bpt_dev = device_kv_bytes_per_token(spec.kv_bytes_per_token, spec.source)   # the engine's device cache

    def price(f, bpt=bpt_host):
        return price_trunk(f, spec, dense_fmt, TrunkWork(dense, spec.n_layers, n_moe, context_tokens, bpt),
                           ops_per_layer, coef)

    out = [TrunkOption(CPU, CPU, (), *price(figs[CPU]), dense, kv_ram, {}, 0, {CPU: figs[CPU].sources},
                       bpt_host)]
    for key, f in figs.items():
        if key == CPU:
            continue
        kv_dev = kv_bytes(context_tokens, bpt_dev)  # GQA's K and V or MLA's latent rows, on the device
        step = f.step if replays_step(key, (), spec) else None
        if step is None:
            secs, rates = price(f, bpt_dev), (0.0, 0.0)
        else:  # the replayed step as measured; its experts come back per placement (trunk_step)
            per_layer = (dense - lm_head_bytes(spec, dense_fmt)) // max(1, spec.n_layers)
            secs = step_trunk_seconds(step, spec.n_layers, per_layer, context_tokens, bpt_dev,
                                      f.kv_gbps_at(context_tokens), n_moe * f.roundtrip_s, coef)
            rates = (step.gemv_gbps, step.mapped_gbps)
        out.append(TrunkOption(key, key, (), *secs, dense, kv_dev,
                               {key: dense + kv_dev} if f.discrete else {}, ram_charged if f.discrete else 0,
                               {key: f.sources}, bpt_dev, f.op_s, step_expert_gbps=rates[0],
                               step_mapped_gbps=rates[1]))
    if target == "colibri":
        from colibri_plan.planner.trunk_gpus import colibri_gpus, spread_option

        out = [dataclasses.replace(o, expert_devices=(o.name,)) if o.vram_bytes else o for o in out]
        keys = colibri_gpus(figs)
        if len(keys) > 1:
            def price(key, work, share):  # one GPU's layers of the spread, as the one-GPU options price
                return price_trunk(figs[key], spec, dense_fmt, work, ops_per_layer, coef, share)
            out.append(spread_option(figs, spec, keys, context_tokens, ram_charged, bpt_dev, price,
                                     TrunkOption, dense_bytes=dense))
        return out
    discrete = {k: int(v) for k, v in vram_budget.items() if k in figs and figs[k].discrete}
    need = dense + kv_paged
    if len(discrete) > 1 and all(v < need for v in discrete.values()) and sum(discrete.values()) >= need:
        out.append(split_option(figs, spec, dense_fmt, discrete, context_tokens, ram_charged, coef,
                                ops_per_layer))
    return out


def split_option(figs, spec, dense_fmt: str, free: dict[str, int], context_tokens: int, ram_charged: int,
                 coef, ops_per_layer: int = DEFAULT_OPS_PER_LAYER) -> TrunkOption:
    """A trunk split over ``free``'s devices by layers (:func:`split_layers`). Each device holds its
    layers' share of the trunk (:func:`dense_read_bytes` in ``dense_fmt``) and of the paged KV cache of
    ``context_tokens`` and reads them at its own GB/s; the devices work one after the other, so the
    seconds add, plus one hidden-state hop (a round trip) per boundary. ``ram_charged``: the bytes the
    RAM budget charged for trunk + KV, which it gets back."""
    dense, kv_paged = dense_read_bytes(spec, dense_fmt), kv_bytes(context_tokens, spec.kv_bytes_per_token)
    n_moe = sum(1 for lid in spec.moe_layers if lid < spec.n_layers)
    parts = split_layers(spec.n_layers, free)
    n = spec.n_layers
    dense_s = attention_s = roundtrip_s = 0.0
    vram = {}
    for a, b, key in parts:
        share = (b - a + 1) / n
        f = figs[key]
        work = TrunkWork(int(dense * share), b - a + 1, 0, context_tokens,
                         int(spec.kv_bytes_per_token * share))
        d, at, _ = price_trunk(f, spec, dense_fmt, work, ops_per_layer, coef, share)
        dense_s, attention_s = dense_s + d, attention_s + at
        vram[key] = int(math.ceil((dense + kv_paged) * share))
    first = figs[parts[0][2]]
    roundtrip_s = n_moe * first.roundtrip_s + (len(parts) - 1) * first.roundtrip_s
    return TrunkOption("split", parts[0][2], parts, dense_s + roundtrip_s, attention_s, roundtrip_s, dense,
                       kv_paged, vram, ram_charged, {k: figs[k].sources for _, _, k in parts},
                       spec.kv_bytes_per_token)
