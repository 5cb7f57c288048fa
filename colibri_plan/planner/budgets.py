"""Memory budgets (``--ram auto|GB``, ``--vram auto|GB[,GB…]``) and cost-model resources from a profile.

``--ram auto`` = available memory − OS / page-cache headroom − dense trunk − KV cache − working buffers;
each subtraction is returned as a named line so the plan and the CLI can explain it. An explicit
``--ram GB`` is the whole process budget (like colibrì's ``RAM_GB``): dense, KV and buffers still come
out of it, the headroom does not. VRAM: per device, free (else total) memory − ``vram_reserve`` (2 GB
by default, as colibrì's ``CUDA_RESERVE_GB``); an explicit list gives each device's expert budget. The
dense trunk and the KV cache stay in RAM (the CPU computes them, colibrì's default ``CUDA_DENSE=0``), so
they come out of the RAM budget only. A
unified-memory device has no VRAM budget of its own: its experts come out of the RAM budget (one pool,
never counted twice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from colibri_plan.errors import BudgetError, InputError
from colibri_plan.formats.plan_trunk import host_kv_bytes_per_token
from colibri_plan.formats.profile_trunk import expert_call_s
from colibri_plan.planner.costmodel import GpuResource, Resources
from colibri_plan.planner.options import DEFAULTS

GB = 1_000_000_000
#: page-cache reserve colibrì measured as necessary (2.5 GB) and the fraction of RAM left to the OS
PAGE_CACHE_RESERVE_BYTES = int(2.5 * GB)
OS_RESERVE_FRACTION = 0.05
RUNTIME_BYTES = int(0.5 * GB)     # interpreter, logits, activations, thread stacks
DEFAULT_VRAM_RESERVE_BYTES = DEFAULTS.vram_reserve_bytes   # solve --vram-reserve
#: largest GB figure accepted for a memory option (1 PB): beyond any machine, and float-to-int safe
MAX_GB = 1_000_000.0


def ram_kv_bytes_per_token(spec, target: str = "colibri-plan") -> int:
    """KV bytes per context token a cache in RAM takes for the engine ``target``: ours (colibri-plan)
    keeps float32 K/V (or MLA latent rows) on the host
    (:func:`~colibri_plan.formats.plan_trunk.host_kv_bytes_per_token`, e.g. a bf16 spec's 3072 -> 6144);
    colibrì keeps the 16-bit cache the spec's ``kv_bytes_per_token`` counts."""
    if target == "colibri-plan":
        return host_kv_bytes_per_token(spec.kv_bytes_per_token, getattr(spec, "source", None))
    return int(spec.kv_bytes_per_token)


def fmt_gb(n_bytes: float) -> str:
    """Bytes as GB with enough digits to tell small figures apart: "12.34", "0.515", "0.005"."""
    v = n_bytes / GB
    return f"{v:.2f}" if abs(v) >= 1 or v == 0 else f"{v:.3g}"


@dataclass
class Budgets:
    """Bytes available for experts, and how they were derived.

    Attributes:
        ram_budget_bytes: RAM for pinned experts + LRU slots (+ unified-GPU experts).
        vram_budget_bytes: per GPU key ("cuda:0") expert bytes (0 for unified devices).
        explain: list of {"what", "bytes"} lines, start value first, each subtraction negative.
        headroom_bytes, context_tokens, dense_bytes, kv_bytes, working_bytes: the parts (dense and KV
            as RAM holds them: with the trunk on a GPU, the embedding only and no KV).
        trunk_device, trunk_vram_bytes: where the trunk lives and the bytes it took from each device's
            expert budget (empty on the CPU).
    """

    ram_budget_bytes: int
    vram_budget_bytes: dict[str, int]
    explain: list[dict] = field(default_factory=list)
    headroom_bytes: int = 0
    context_tokens: int = 0
    dense_bytes: int = 0
    kv_bytes: int = 0
    working_bytes: int = 0
    ram_mode: str = "auto"
    vram_mode: str = "auto"
    trunk_device: str = "cpu"     # where the dense trunk + KV cache live (planner.trunk_solve)
    trunk_vram_bytes: dict[str, int] = field(default_factory=dict)   # their bytes per device

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def parse_gb(value: str, what: str) -> float:
    """Parse a decimal GB figure (ASCII digits: "1_0" and Unicode digits are refused, as Python's float
    would read them); InputError if it is not a finite number, BudgetError if negative."""
    from colibri_plan.formats.fields import decimal_text

    v = value if isinstance(value, (int, float)) and not isinstance(value, bool) else decimal_text(value)
    if v is None:
        raise InputError(f"{what}: expected 'auto' or a finite number of GB written with the digits 0-9 "
                         f"(such as 1.5), got {value!r}")
    if not math.isfinite(v):
        raise InputError(f"{what}: expected a finite number of GB, got {value!r}")
    if v < 0:
        raise BudgetError(f"{what}: a memory budget cannot be negative ({value} GB)")
    if v > MAX_GB:
        raise InputError(f"{what}: {value} GB is beyond any machine's memory (at most {MAX_GB:.0f} GB)")
    return v


def ram_budget(spec, available_bytes: int, ram: str = "auto", headroom_gb: float | None = None,
               context_tokens: int = DEFAULTS.context_tokens, dense_fmt: str | None = None,
               moved_bytes: int = 0,
               kv_bytes_per_token: int | None = None) -> tuple[int, list[dict], dict]:
    """RAM for experts, with the explanation lines.

    ``kv_bytes_per_token``: what the KV cache in RAM takes per context token (:func:`ram_kv_bytes_per_token`
    of the target engine); None: that of our engine (colibri-plan).

    ``moved_bytes``: of the dense trunk and KV cache charged here, the bytes a trunk forced onto a
    discrete GPU gives back (planner.trunk: ``TrunkOption.ram_freed_bytes``). Only the rest must fit:
    the budget returned may then be negative by up to that much (the CPU option does not fit).

    An explicit ``--ram`` of (nearly: within 5%) all the available memory keeps the page-cache headroom
    of ``--ram auto`` (max(2.5 GB, 5%) of available) anyway, with a warning in ``parts["warnings"]``:
    without it the OS page cache that buffered reads and the dense trunk rely on is strangled (colibrì
    measured buffered reads falling from about 800 to 180 MB/s).

    Returns:
        (bytes, explain, parts) — parts: headroom_bytes, dense_bytes, kv_bytes, working_bytes, warnings.

    Raises:
        BudgetError: negative inputs, no memory available at all, or the dense trunk + KV + buffers do
            not fit.
    """
    if context_tokens < 0:
        raise BudgetError(f"--context must be >= 0 tokens, got {context_tokens}")
    if available_bytes <= 0:
        raise BudgetError("the profile says no memory is available on this machine "
                          f"(machine.ram_available_bytes = {int(available_bytes)}): nothing can be "
                          "budgeted; close what holds the memory and re-run `colibri-plan profile`, or fix "
                          "the profile's figure")
    warnings: list[str] = []
    dense = spec.dense_bytes(dense_fmt or spec.expert_format)
    kv_bpt = int(ram_kv_bytes_per_token(spec) if kv_bytes_per_token is None else kv_bytes_per_token)
    kv = int(context_tokens) * kv_bpt
    b = spec.expert_bytes()
    working = 2 * spec.top_k * b + RUNTIME_BYTES   # double-buffered reads of one token's misses
    if ram == "auto":
        start = int(available_bytes)
        if headroom_gb is None:
            headroom = max(PAGE_CACHE_RESERVE_BYTES, int(OS_RESERVE_FRACTION * start))
            why = "OS and page-cache headroom (max(2.5 GB, 5% of available); --headroom to change)"
        else:
            headroom = int(parse_gb(headroom_gb, "--headroom") * GB)
            why = "OS and page-cache headroom (--headroom)"
        explain = [{"what": "available memory (profile: machine.ram_available_bytes)", "bytes": start},
                   {"what": why, "bytes": -headroom}]
    else:
        start = int(parse_gb(ram, "--ram") * GB)
        if start > available_bytes:
            raise BudgetError(f"--ram {ram} GB is more than the {fmt_gb(available_bytes)} GB available "
                              "on this machine (profile); lower it or use --ram auto")
        headroom = 0
        explain = [{"what": "--ram budget (dense, KV and buffers come out of it)", "bytes": start}]
        keep = max(PAGE_CACHE_RESERVE_BYTES, int(OS_RESERVE_FRACTION * available_bytes))
        if start > (1 - OS_RESERVE_FRACTION) * available_bytes:   # (nearly) all of it: keep the headroom
            headroom = max(0, min(start, start - (available_bytes - keep)))
            explain.append({"what": "page-cache headroom kept (--ram is all available memory)",
                            "bytes": -headroom})
            warnings.append(f"--ram {ram} GB is {'all' if start >= available_bytes else 'nearly all'} of "
                            f"the {fmt_gb(available_bytes)} GB available: the OS page cache needs "
                            f"{fmt_gb(keep)} GB of headroom (buffered reads and the dense trunk slow down "
                            f"several times without it), so {fmt_gb(headroom)} GB of it is kept out of the "
                            "budget; give at most "
                            f"{fmt_gb(available_bytes - keep)} GB, or --ram auto")
    explain += [{"what": f"dense trunk ({dense_fmt or spec.expert_format})", "bytes": -dense},
                {"what": f"KV cache ({context_tokens} tokens x {kv_bpt} B)", "bytes": -kv},
                {"what": f"working buffers (2 x top-{spec.top_k} expert reads + runtime)",
                 "bytes": -working}]
    left = start - headroom - dense - kv - working
    explain.append({"what": "RAM for experts (pinned + LRU)", "bytes": left})
    if left < 0 and not moved_bytes and kv > max(start - headroom, 0):
        raise BudgetError(f"the RAM budget is too small for --context {context_tokens} tokens: their KV "
                          f"cache alone needs {fmt_gb(kv)} GB and the budget is "
                          f"{fmt_gb(start - headroom)} GB after headroom; give more --ram or a smaller "
                          "--context")
    if left + int(moved_bytes) < 0:
        raise BudgetError(f"RAM budget too small: {fmt_gb(start)} GB minus headroom {fmt_gb(headroom)}, "
                          f"dense {fmt_gb(dense)}, KV {fmt_gb(kv)} and buffers {fmt_gb(working)} GB leaves "
                          f"{fmt_gb(left)} GB; give more --ram or a smaller --context")
    return left, explain, {"headroom_bytes": headroom, "dense_bytes": dense, "kv_bytes": kv,
                           "working_bytes": working, "warnings": warnings}


def vram_budgets(gpus: list[dict], vram: str = "auto",
                 reserve_bytes: int = DEFAULT_VRAM_RESERVE_BYTES) -> tuple[dict[str, int], list[dict]]:
    """Per-device expert budgets from profile GPU dicts (backend, index, total/free memory, unified).

    ``vram`` is "auto" (each device's free memory), "0" (no VRAM tier), one GB figure (each discrete
    device) or one per device: the card's memory, as on its box. Either way ``reserve_bytes`` is taken off
    each device (the CUDA context, the runtime's buffers, other programs) and shown in ``explain``; a
    figure of 0 means no VRAM tier on that device, with nothing taken off.

    Raises:
        BudgetError: negative figures; InputError: a list of the wrong length.
    """
    keys = [f"{g['backend']}:{g['index']}" for g in gpus]
    discrete = [g for g in gpus if not g.get("unified_memory")]
    out: dict[str, int] = {}
    explain = []
    if vram == "auto":
        for g, k in zip(gpus, keys):
            if g.get("unified_memory"):
                out[k] = 0
                explain.append({"what": f"{k}: unified memory, experts share the RAM budget", "bytes": 0})
                continue
            free = g.get("free_memory_bytes") or g["total_memory_bytes"]
            out[k] = max(0, int(free) - reserve_bytes)
            explain.append({"what": f"{k} ({g.get('name', '?')}): free {free / GB:.2f} GB - reserve "
                                    f"{reserve_bytes / GB:.2f} GB", "bytes": out[k]})
        return out, explain
    vals = [parse_gb(v, "--vram") for v in str(vram).split(",")]
    if len(vals) == 1:
        vals = vals * len(discrete)
    if len(vals) != len(discrete):
        raise InputError(f"--vram gives {len(vals)} figures but the profile has {len(discrete)} discrete "
                         "GPUs; give one figure, or one per GPU")
    it = iter(vals)
    for g, k in zip(gpus, keys):
        card = 0 if g.get("unified_memory") else int(next(it) * GB)
        total = int(g.get("total_memory_bytes") or 0)
        if total and card > total:
            raise BudgetError(f"--vram: {card / GB:.2f} GB for {k} ({g.get('name', '?')}) is more than its "
                              f"{total / GB:.2f} GB of memory; give at most that, or 'auto'")
        out[k] = max(0, card - reserve_bytes) if card else 0
        what = (f"{k}: --vram {card / GB:.2f} GB - reserve {reserve_bytes / GB:.2f} GB (--vram-reserve)"
                if card else f"{k}: --vram 0 (no VRAM tier)")
        explain.append({"what": what, "bytes": out[k]})
    return out, explain


def best_queue_depth(profile, top_k: int) -> int:
    """The measured random-read queue depth with the highest median GB/s among those <= ``top_k``.

    A decode token reads at most top-k experts of a layer at once, so deeper queues are never filled; on
    some disks (network or virtual block devices) a deeper queue is slower than a shallower one, so the
    best measured depth is taken rather than the deepest. Ties go to the shallower depth; when every
    measured depth exceeds top-k, the smallest measured one.

    Raises:
        InputError: the profile has no disk figure (from MachineProfile).
    """
    disk = profile.doc.get("disk")
    entries = disk.get("random") if isinstance(disk, dict) else None
    if not entries:
        profile.disk_read_gbps(1)   # raises the profile's InputError saying how to measure the disk
        return 1
    depths = sorted({int(e["queue_depth"]) for e in entries})
    usable = [q for q in depths if q <= max(1, int(top_k))] or depths[:1]
    return max(usable, key=lambda q: (profile.disk_read_gbps(q), -q))


def disk_depth_table(profile) -> tuple[tuple[int, float], ...]:
    """((queue depth, random-read GB/s), ...) for every depth the profile measured, shallowest first."""
    disk = profile.doc.get("disk")
    entries = disk.get("random") if isinstance(disk, dict) else None
    depths = sorted({int(e["queue_depth"]) for e in entries or ()})
    return tuple((q, float(profile.disk_read_gbps(q))) for q in depths)


def gpu_expert_gbps(profile, backend: str, index: int, fmt: str, spec) -> float:
    """Weight GB/s of a GPU on routed experts: from the batched ``expert_ffn`` timing of top-k experts
    when the profile has it (the call the engine makes per layer), else from single ``matmul`` calls.

    One matmul of an expert-sized matrix is too short to fill an H200 (launch and sync dominate: about
    155 GB/s against 900 GB/s for eight experts in one call), so the matmul figure made GPUs look slower
    than they are and pushed hot experts onto the CPU.
    """
    try:
        s = profile.expert_ffn_s(backend, index, fmt, spec.top_k)
        return spec.top_k * spec.expert_bytes(fmt) / s / 1e9
    except InputError:
        return profile.matmul_weight_gbps(backend, index, fmt, 1, spec.moe_intermediate_size,
                                          spec.hidden_size)


def gpu_mapped_gbps(profile, backend: str, index: int, fmt: str, spec) -> float:
    """Weight GB/s of a discrete GPU on routed experts in mapped page-locked host memory (the zero-copy
    pinned tier), from the profile's ``"memory": "mapped"`` expert_ffn row: its bytes / seconds (k
    experts of the probed shape; e.g. 8 of 18.9 MB in 3.36 ms: 45 GB/s), which is top-k · b / seconds
    when the probe ran at this model's shape and, the call being bound by the link, the rate a model of
    other expert bytes gets too (the device rows' seconds are not: :func:`gpu_expert_gbps`). A row
    without bytes: top-k · b / its seconds. 0.0 without such a row (no zero-copy pins)."""
    try:
        gbps = profile.mapped_expert_ffn_gbps(backend, index, fmt, spec.top_k)
        if gbps is None:
            return spec.top_k * spec.expert_bytes(fmt) / profile.mapped_expert_ffn_s(
                backend, index, fmt, spec.top_k) / 1e9
    except InputError:
        return 0.0
    return gbps


def _matmul_kinds(profile, fmt: str) -> list[tuple[dict, str | None]]:
    """[(row, device kind)] of the profile's ``matmul`` rows at ``fmt``: the kind as measured, else as its
    device lists it (None: unknown)."""
    matmul, devices = profile.doc.get("matmul"), profile.doc.get("devices")
    kinds = {(d.get("backend"), d.get("index")): d.get("kind") for d in devices
             if isinstance(d, dict)} if isinstance(devices, list) else {}
    return [(r, r.get("device_kind") or kinds.get((r["backend"], r["device_index"])))
            for r in (matmul if isinstance(matmul, list) else []) if r["fmt"] == fmt]


def cpu_matmul_devices(profile, fmt: str) -> set[tuple[str, int]]:
    """{(backend, device_index)} of the profile's ``matmul`` rows at ``fmt`` measured on a CPU (empty when
    none). A row of unknown kind is never taken for the CPU's: a GPU figure would make the CPU path look
    many times faster than it is."""
    return {(r["backend"], r["device_index"]) for r, kind in _matmul_kinds(profile, fmt) if kind == "cpu"}


def resources_from_profile(profile, spec, vram_budget: dict[str, int], fmt: str | None = None) -> Resources:
    """Cost-model figures from a MachineProfile for ``spec`` at expert format ``fmt``.

    CPU matmul: the best CPU-device backend measured at ``fmt`` (1 token, nearest expert shape). Disk: the
    random-read GB/s at :func:`best_queue_depth` (<= top-k), recorded as ``disk_queue_depth``: the plan
    carries it and the engine reads with that many threads; None when the profile has no disk section.
    GPUs: every gpu/igpu device with its matmul and link figures (and a discrete one's mapped-memory
    expert GB/s, :func:`gpu_mapped_gbps`).

    Raises:
        InputError: a needed figure is missing (the message says how to measure it).
    """
    fmt = fmt or spec.expert_format
    h, i = spec.hidden_size, spec.moe_intermediate_size
    cpu_rows = cpu_matmul_devices(profile, fmt)
    if not cpu_rows:
        unknown = sorted({f"{r['backend']}:{r['device_index']}" for r, kind in _matmul_kinds(profile, fmt)
                          if not kind})
        why = (f" (rows of {', '.join(unknown)} do not say which kind of device they measured)"
               if unknown else "")
        raise InputError(f"profile has no CPU matmul figure at {fmt}{why}; measure it with "
                         f"`colibri-plan profile --formats {fmt}`")
    cpu = max(profile.matmul_weight_gbps(b, d, fmt, 1, i, h) for b, d in cpu_rows)
    try:
        qd = best_queue_depth(profile, spec.top_k)
        disk = profile.disk_read_gbps(qd)
    except InputError:
        disk, qd = None, 1
    gpus = []
    for g in profile.gpus():
        key = f"{g['backend']}:{g['index']}"
        unified = bool(g.get("unified_memory"))
        gbps = gpu_expert_gbps(profile, g["backend"], g["index"], fmt, spec)
        h2d = d2h = mapped = 0.0
        if not unified:
            h2d = profile.h2d_gbps(g["backend"], g["index"], pinned=True)
            d2h = profile.d2h_gbps(g["backend"], g["index"], pinned=True)
            mapped = gpu_mapped_gbps(profile, g["backend"], g["index"], fmt, spec)
        gpus.append(GpuResource(key=key, matmul_gbps=gbps, h2d_gbps=h2d, d2h_gbps=d2h,
                                budget_bytes=int(vram_budget.get(key, 0)), unified=unified,
                                mapped_gbps=mapped))
    return Resources(cpu_matmul_gbps=cpu, ram_read_gbps=profile.ram_read_gbps(), disk_read_gbps=disk,
                     disk_queue_depth=qd, gpus=tuple(gpus), checksum_gbps=profile.checksum_gbps(),
                     disk_depth_gbps=disk_depth_table(profile) if disk is not None else (),
                     cpu_call_s=expert_call_s(profile) or 0.0)
