"""The decode cost model: expected seconds per token of an expert placement, term by term.

Pure functions on plain numbers, so every term can be checked by hand (docs/plan-format.md and
DESIGN.md §7). Per decode token:

    decode_s = dense_s + attention_s + Σ_layers w_l · max(cpu_path_l, gpu_l,d + xfer_l,d for each d)
    cpu_path_l = max(a, d) + (1 − c_overlap) · min(a, d) + cpu_stream_l,  a = cpu_resident_l + verify_l,
                 d = disk_l (c_overlap = 1: the reads hide behind the resident compute or vice versa)

* ``dense_s``     = c_dense · dense read bytes / (dense GB/s)  (the trunk is read once per token)
* ``attention_s`` = c_attention · context · KV bytes per token / RAM GB/s
* ``cpu_resident_l`` = c_cpu · Σ_{e in RAM} p_e · b / CPU GB/s + c_cpu · Σ_{e on disk} p_e · h_e · b / CPU
                     GB/s: compute of the pinned experts and the LRU hits (CPU GB/s is capped by RAM GB/s)
  + call_s · (1 − Π_{e in RAM} (1 − p_e) · Π_{e on disk} (1 − p_e · h_e)): the CPU backend is called once
  for a layer's resident experts, when any is selected (call_s: the profile's measured fixed cost of
  one call, ``Resources.cpu_call_s``; selections taken as independent)
* ``cpu_stream_l`` = c_cpu · Σ_{e on disk} p_e · (1 − h_e) · b / CPU GB/s + call_s · Σ_{e on disk}
                     p_e · (1 − h_e): compute of the streamed misses, one call each
* ``verify_l``    = Σ_{e on disk} p_e · (1 − h_e) · b / all-core crc32 GB/s: the reader threads check every
                     streamed expert, CPU time taken from the resident compute (0 without a figure)
* ``disk_l``      = c_disk · Σ_{e on disk} p_e · (1 − h_e) · b / disk GB/s at the queue depth the engine
                     reads with (``Resources.disk_queue_depth``; the profile measures expert-sized blocks at
                     that depth, so a read's latency is inside this figure)
* ``gpu_l,d``     = Σ_{e on d} p_e · (c_gpu · b / GPU d matmul GB/s + expert_call_d): expert_call_d is the
                     host's launch cost per expert on the GPU that holds the trunk (its device_ops op
                     seconds; 0 elsewhere, where the layer call's cost is in xfer_l,d)
* segmented step (the GPU that holds the trunk replays its decode step as graph segments, engine/
  decode_graph.py): a layer with experts off that GPU t costs max(gpu_l,t, handoff_s + the host's paths)
  instead of the max of all paths: the step is cut after the router, the host waits for the copy down
  (routing and x), computes its experts while t computes its own, and the next segment adds the host's
  sum copied up; handoff_s (``GpuResource.handoff_s``: the wait, both copies and the next launches) is
  paid at every such layer, whatever the token chose; a layer whose experts all live on t adds gpu_l,t
  alone (no sync), and expert_call_t is 0 (the launches are captured)
* zero-copy pinned tier (``compute.ram_pinned`` = t, the discrete GPU that holds the trunk,
  :mod:`colibri_plan.planner.compute`): the pinned experts move from the CPU path to t's:
  gpu_l,t += Σ_{e in RAM} p_e · (c_gpu · b / mapped GB/s + expert_call_t), cpu_resident_l loses their
  compute and their share of the resident call, and for the segmentation they count as on t (a layer
  whose off-t experts are all pinned has no hand-off). Their bytes stay in the RAM budget. E.g. two
  pinned experts of p = 0.5, b = 1e9 B, 50 GB/s: 1.0 · 0.02 = 0.02 s on t's path, no handoff_s
* ``xfer_l,d``    = c_transfer · (activation H2D + D2H + 2 link latencies) + gpu_call_s, paid by each
                     GPU that holds any expert of the layer (the hidden state goes there and back once;
                     the host's call costs about the same for 1 expert or 8); no transfer on the GPU
                     that holds the dense trunk (its experts read the device's own hidden state)

The CPU path follows the residency manager (engine/residency.py): it submits the reads of all of a
layer's misses first, computes the resident experts while they are in flight, then computes each streamed
expert after its read lands. Reads in flight together share the disk's bandwidth and land together at
about ``disk_l``, so the resident compute hides behind the reads (or the reads behind it) and the streamed
experts' compute comes after both: max(resident, disk) + stream. The part of ``disk_l`` the resident
compute does not hide, max(0, disk_l − cpu_resident_l), is the predicted disk wait, the figure the engine
measures as the time the CPU path waited for reads.

``p_e`` is the selection probability of expert ``e`` per token (a layer's p sum to top-k), ``b`` the
expert's bytes, ``h_e`` the LRU hit rate of a non-pinned expert (:mod:`colibri_plan.planner.cache_model`:
from the stack distances of a routing trace when the heat has one, else the characteristic-time (Che)
approximation), and ``w_l`` the decode weight of the row (1; 0 for MTP rows, which plain decode skips).
For an engine that reads through the OS page cache (``Resources.page_cache_pool_bytes`` > 0: llama.cpp's
mmap, colibrì without DIRECT), a share g_e of the misses is served by the page cache at a copy's cost
instead of a disk read (:mod:`colibri_plan.planner.page_cache`); ours reads with O_DIRECT (g = 0).
The layer's expert time is the slowest of its concurrently working resources, taken on expected loads
(max of expectations, a lower bound of the expected max). The ``c_*`` multipliers live in
:class:`Coefficients` so measured runs can refit them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM
from colibri_plan.planner.cache_model import che_hit_rates, lru_hit_rates, simulate_lru
from colibri_plan.planner.compute import host_seconds, mapped_gpu
from colibri_plan.planner.page_cache import page_cache_experts, page_cache_hit_rates
from colibri_plan.planner.path_rows import (
    cpu_path_bounds,
    cpu_path_parts,
    cpu_path_rows,
    cpu_path_seconds,
    gpu_expert_seconds,
)

# re-exported: the LRU models (Che, trace replay) live in cache_model, the per-selection rows in path_rows
__all__ = ["che_hit_rates", "cpu_path_bounds", "cpu_path_parts", "cpu_path_rows", "cpu_path_seconds",
           "simulate_lru"]


@dataclass(frozen=True)
class GpuResource:
    """One GPU as the cost model sees it.

    Attributes:
        key: "<backend>:<index>", e.g. "cuda:0".
        matmul_gbps: expert matmul weight GB/s (1e9 B/s) at 1 token.
        h2d_gbps, d2h_gbps: pinned activation transfer GB/s (ignored when ``unified``).
        budget_bytes: bytes of experts this device may hold (after dense, KV and headroom).
        unified: computes on host memory (its experts use the RAM pool; no transfers).
        link_latency_s: fixed seconds per transfer direction.
        holds_trunk: the dense trunk runs on this device: its experts read the device's own hidden
            state and add into it there (no transfer; the trunk's hand-off is the trunk's term).
        expert_call_s: host seconds per selected expert on this device beyond its matmul time: the
            engine's launches of the experts on the trunk's GPU (:func:`.path_rows.gpu_expert_seconds`;
            0 on other GPUs and without a figure).
        segmented: the trunk's GPU replays its decode step as graph segments cut at the layers with
            experts elsewhere (module docstring); handoff_s: seconds of one such cut.
        zero_copy: a unified GPU that reads the host's expert slabs in place (colibrì's
            COLI_CUDA_UNIFIED): no upload copy for a streamed expert it computes (planner.compute).
        mapped_gbps: expert GB/s (1e9 B/s) of this discrete GPU on experts in mapped page-locked host
            memory (the profile's ``"memory": "mapped"`` expert_ffn row: top-k · b / seconds); 0 = it
            cannot compute pinned experts zero-copy.
        step_expert_gbps: GB/s of a VRAM expert inside the trunk GPU's replayed step (the profile's
            fastest GEMV, :mod:`.trunk_step`); 0: ``matmul_gbps``.
        step_mapped_gbps: GB/s of a mapped host expert inside that replay; 0: ``mapped_gbps``.
    """

    key: str
    matmul_gbps: float
    h2d_gbps: float = 0.0
    d2h_gbps: float = 0.0
    budget_bytes: int = 0
    unified: bool = False
    link_latency_s: float = 10e-6
    holds_trunk: bool = False
    expert_call_s: float = 0.0
    segmented: bool = False
    handoff_s: float = 0.0
    zero_copy: bool = False
    mapped_gbps: float = 0.0
    step_expert_gbps: float = 0.0
    step_mapped_gbps: float = 0.0


@dataclass(frozen=True)
class Resources:
    """Machine figures the cost model needs (from a profile, or written by hand in tests).

    Attributes:
        cpu_matmul_gbps: CPU expert matmul weight GB/s at 1 token.
        ram_read_gbps: all-core RAM read GB/s (caps the CPU matmul and bounds attention).
        disk_read_gbps: random-read GB/s at expert blocks and ``disk_queue_depth``; None = no figure.
        disk_queue_depth: concurrent reads the engine issues (its read threads) and the queue depth the
            disk figure was taken at; a plan records it and the engine reads with it.
        gpus: the GPUs, in plan order.
        dense_gbps: GB/s of the dense trunk's per-token read (defaults to the CPU path).
        checksum_gbps: all-core crc32 GB/s: the engine checks every streamed expert in its reader
            threads, CPU time the resident compute cannot use; None = not measured (no term).
        disk_depth_gbps: ((queue depth, random-read GB/s), ...) as the profile measured them, so a
            placement can be priced at another engine's depth (:meth:`at_queue_depth`).
        page_cache_pool_bytes: bytes the OS page cache may hold of the expert file before a placement's
            pins, LRU slots and host copies (:mod:`colibri_plan.planner.page_cache`); 0 = the engine reads
            with O_DIRECT and the page cache serves nothing (ours).
        compute: ((host tier, "cpu" | unified GPU key), ...): who computes each host tier (planner.compute).
        cpu_call_s: fixed seconds of one CPU ``expert_ffn`` call in the engine's rhythm (the profile's
            ``trunk_layer`` host figure; 0 without one).
    """

    cpu_matmul_gbps: float
    ram_read_gbps: float
    disk_read_gbps: float | None = None
    disk_queue_depth: int = 1
    gpus: tuple[GpuResource, ...] = field(default_factory=tuple)
    dense_gbps: float | None = None
    checksum_gbps: float | None = None
    disk_depth_gbps: tuple = ()
    page_cache_pool_bytes: int = 0
    compute: tuple = ()
    cpu_call_s: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "disk_depth_gbps",   # a plan's JSON gives lists: back to pairs
                           tuple((int(q), float(g)) for q, g in self.disk_depth_gbps))
        object.__setattr__(self, "compute", tuple((str(t), str(k)) for t, k in self.compute))
        rates = [("CPU expert matmul", self.cpu_matmul_gbps), ("RAM read", self.ram_read_gbps)]
        rates += [(f"{g.key} GPU expert matmul", g.matmul_gbps) for g in self.gpus]
        if self.disk_read_gbps is not None:
            rates.append(("disk random-read", self.disk_read_gbps))
        if self.dense_gbps is not None:
            rates.append(("dense trunk read", self.dense_gbps))
        bad = [f"{name} {r!r} GB/s" for name, r in rates if not np.isfinite(r) or r <= 0]
        if bad:
            raise InputError(f"machine figures must be positive GB/s, got {', '.join(bad)}; re-measure "
                             "them with `colibri-plan profile` (or fix the profile's figure)")
        for g in self.gpus:
            if not g.unified and (g.h2d_gbps <= 0 or g.d2h_gbps <= 0):
                raise InputError(f"{g.key}: host<->device GB/s must be positive for a discrete GPU")

    @property
    def cpu_gbps(self) -> float:
        """Effective CPU expert GB/s: min(matmul, RAM read)."""
        return min(self.cpu_matmul_gbps, self.ram_read_gbps)

    def at_queue_depth(self, depth: int) -> Resources:
        """These resources with the disk read at ``depth`` (the deepest measured depth <= depth, else the
        shallowest measured): the figure an engine reading ``depth`` experts at a time gets."""
        if not self.disk_depth_gbps:
            return self
        rows = sorted(self.disk_depth_gbps)
        q, g = ([r for r in rows if r[0] <= depth] or rows[:1])[-1]
        return dataclasses.replace(self, disk_read_gbps=g, disk_queue_depth=q)


def miss_seconds(expert_bytes: int, res: Resources) -> float:
    """Seconds of disk time per expected miss: b / disk GB/s (InputError without a disk figure)."""
    if res.disk_read_gbps is None:
        raise InputError("the profile has no disk figure but the placement streams experts from disk; "
                         "measure the disk with `colibri-plan profile` or give enough RAM/VRAM")
    return expert_bytes / (res.disk_read_gbps * 1e9)


def verify_seconds(expert_bytes: int, res: Resources) -> float:
    """CPU seconds per streamed expert for its crc32 check: b / all-core checksum GB/s (0 unmeasured)."""
    return expert_bytes / (res.checksum_gbps * 1e9) if res.checksum_gbps else 0.0


def transfer_seconds(gpu: GpuResource, activation_bytes: int) -> float:
    """Seconds to send one token's hidden state to ``gpu`` and its result back (0 on unified memory and
    on the device that holds the trunk)."""
    if gpu.unified or gpu.holds_trunk:
        return 0.0
    return (activation_bytes / (gpu.h2d_gbps * 1e9) + activation_bytes / (gpu.d2h_gbps * 1e9)
            + 2 * gpu.link_latency_s)


def gpu_fixed_seconds(gpu: GpuResource, activation_bytes: int, coef: Coefficients) -> float:
    """Seconds a GPU adds to a layer it holds experts of, whatever they compute: c_transfer · transfer
    + gpu_call_s (the solver's per-(layer, GPU) fixed cost; the ``xfer_l,d`` term)."""
    return coef.transfer * transfer_seconds(gpu, activation_bytes) + coef.gpu_call_s


def layer_terms(p: np.ndarray, tier: np.ndarray, slots: int, expert_bytes: int, res: Resources,
                coef: Coefficients, activation_bytes: int, hits: np.ndarray | None = None,
                page_hits: np.ndarray | None = None) -> dict:
    """Expected seconds of one MoE layer for one token, term by term (module docstring).

    Args:
        p: float ``[E]`` selection probabilities of the layer's experts.
        tier: int ``[E]``: GPU index 0..G-1, TIER_RAM (pinned) or TIER_DISK (LRU-cached or streamed).
        slots: LRU slots of the layer (shared by its disk-tier experts).
        expert_bytes: bytes of one expert; activation_bytes: bytes of one token's hidden state.
        hits: float ``[E]`` LRU hit rate of each disk-tier expert (default: Che on the disk experts; a
            routing trace gives them through :mod:`colibri_plan.planner.cache_model`).
        page_hits: float ``[E]`` page-cache hit rate of each read (default none: O_DIRECT); a page-cache
            hit costs a copy at RAM GB/s instead of a disk read (:mod:`colibri_plan.planner.page_cache`).

    Returns:
        dict: cpu_resident_s, cpu_stream_s, cpu_s (their sum), verify_s (crc32 checks of the misses),
        disk_s (read time of the misses), disk_wait_s (the CPU path's time beyond its CPU work), cpu_path_s
        (max(a, disk_s) + (1 − c_overlap) · min(a, disk_s) + cpu_stream_s, a = cpu_resident_s +
        verify_s), gpu_s [G], transfer_s [G] (transfers + call overhead), gpu_calls, time_s (the slowest
        path, or a segmented step's max(device, hand-off + host), + the layer overhead), handoff_s (the
        cut's seconds when the layer has one, else 0), and expected selections per tier: vram,
        ram_pinned, lru, disk (misses: reads the engine issues), page_cache (of those reads, the ones
        the page cache serves).
    """
    p = np.asarray(p, dtype=np.float64)
    tier = np.asarray(tier)
    on_disk = tier == TIER_DISK
    h = che_hit_rates(np.where(on_disk, p, 0.0), slots) if hits is None else np.asarray(hits, float)
    misses = float(np.sum(p * (1 - h) * on_disk))
    lru_hits = float(np.sum(p * h * on_disk))
    cached = 0.0 if page_hits is None else float(np.sum(p * (1 - h) * on_disk * page_hits))
    per_sel = host_seconds(res, expert_bytes, coef)   # seconds per expert computed, per host tier
    ram_p = float(p[tier == TIER_RAM].sum())
    zc = mapped_gpu(res)   # the trunk's GPU computing the pinned tier zero-copy (None: a host path does)
    map_s = per_sel[0] if zc is not None else 0.0
    per_miss = 0.0
    if misses > 0:   # a read from disk, or (page cache) a copy at RAM GB/s
        copy_s = expert_bytes / (res.ram_read_gbps * 1e9)
        disk_part = (misses - cached) * miss_seconds(expert_bytes, res) if misses - cached > 1e-15 else 0.0
        per_miss = coef.disk * (disk_part + cached * copy_s) / misses
    cpu_res_s, cpu_stream_s, disk_s, verify_s = cpu_path_parts(
        ram_p if zc is None else 0.0, lru_hits, misses, per_sel, per_miss, verify_seconds(expert_bytes, res))
    if res.cpu_call_s > 0:   # the host's per-call cost: resident experts in one call, each miss alone
        on_cpu = {t: dict(res.compute).get(t, "cpu") == "cpu" for t in ("ram_pinned", "lru", "disk")}
        q = np.where(tier == TIER_RAM, p * on_cpu["ram_pinned"], p * h * on_disk * on_cpu["lru"])
        q = np.clip(q, 0.0, 1.0)   # P(e is selected and computed in the resident call)
        cpu_res_s += res.cpu_call_s * float(1.0 - np.prod(1.0 - q))
        cpu_stream_s += res.cpu_call_s * misses * on_cpu["disk"]
    # reads of the misses overlap the resident compute, which shares the cores with the reads' checksums
    # (a share ``overlap`` of the shorter one hides); each streamed expert is computed after its read
    a = cpu_res_s + verify_s
    cpu_path_s = float(cpu_path_seconds(cpu_res_s, cpu_stream_s, disk_s, verify_s, coef.overlap))
    where = tier if zc is None else np.where(tier == TIER_RAM, zc, tier)   # zero-copy pins: on the GPU
    gpu_s, xfer_s, calls = [], [], 0
    for d, g in enumerate(res.gpus):
        mine = where == d
        calls += int(mine.any())
        gpu_s.append(float(p[tier == d].sum()) * gpu_expert_seconds(g, expert_bytes, coef)
                     + (ram_p * map_s if d == zc else 0.0))
        xfer_s.append(gpu_fixed_seconds(g, activation_bytes, coef) if mine.any() else 0.0)
    time_s, handoff_s = segmented_layer_seconds(res.gpus, where, cpu_path_s, gpu_s, xfer_s)
    time_s += coef.layer_overhead_s
    return {"cpu_resident_s": cpu_res_s, "cpu_stream_s": cpu_stream_s, "cpu_s": cpu_res_s + cpu_stream_s,
            "handoff_s": handoff_s,
            "verify_s": verify_s, "disk_s": disk_s, "disk_wait_s": max(0.0, cpu_path_s - cpu_stream_s - a),
            "cpu_path_s": cpu_path_s,
            "gpu_s": gpu_s, "transfer_s": xfer_s, "gpu_calls": calls,
            "time_s": time_s,
            "vram": float(p[tier >= 0].sum()), "ram_pinned": float(p[tier == TIER_RAM].sum()),
            "lru": lru_hits, "disk": misses, "page_cache": cached}


def segmented_layer_seconds(gpus, tier: np.ndarray, cpu_path_s: float, gpu_s: list, xfer_s: list
                            ) -> tuple[float, float]:
    """(the layer's expert seconds, its hand-off seconds) from its paths (module docstring): the slowest
    path, or on a segmented trunk GPU t, max(gpu_t, handoff_s + the slowest other path) when some of the
    layer's experts (``tier`` [E]) live off t, gpu_t alone when none does. E.g. gpu_t 0.1 ms, CPU 1 ms,
    hand-off 0.05 ms: 1.05 ms; CPU 0.02 ms: 0.1 ms (the host's work hides behind the device's)."""
    paths = [a + b for a, b in zip(gpu_s, xfer_s)]
    seg = next((d for d, g in enumerate(gpus) if g.segmented and g.holds_trunk and not g.unified), None)
    if seg is None:
        return max([cpu_path_s] + paths), 0.0
    others = max([cpu_path_s] + [p for d, p in enumerate(paths) if d != seg])
    if not np.any(np.asarray(tier) != seg):
        return max(paths[seg], others), 0.0
    cut = float(gpus[seg].handoff_s)
    return max(paths[seg], cut + others), cut


def dense_seconds(dense_read_bytes: int, res: Resources, coef: Coefficients) -> float:
    """Seconds per token to read the dense trunk once: c_dense · bytes / dense GB/s."""
    gbps = res.dense_gbps if res.dense_gbps is not None else res.cpu_gbps
    return coef.dense * dense_read_bytes / (gbps * 1e9)


def attention_seconds(context_tokens: int, kv_bytes_per_token: int, res: Resources,
                      coef: Coefficients) -> float:
    """Seconds per token to read the KV cache of ``context_tokens`` tokens from RAM."""
    return coef.attention * context_tokens * kv_bytes_per_token / (res.ram_read_gbps * 1e9)


@dataclass(frozen=True)
class TokenBytes:
    """Bytes a decode token moves besides the routed experts (0: not priced): the dense trunk read
    (``dense_s``), the KV cache of ``context_tokens`` read by attention (``attention_s``) and the hidden
    state a GPU layer call moves each way (``activation_bytes``: transfers)."""

    dense_read_bytes: int = 0
    context_tokens: int = 0
    kv_bytes_per_token: int = 0
    activation_bytes: int = 0


def decode_cost(probs: np.ndarray, tiers: np.ndarray, slots: np.ndarray, expert_bytes: int,
                res: Resources, coef: Coefficients | None = None, *, token: TokenBytes = TokenBytes(),
                layer_weights: np.ndarray | None = None, trace_hits=None, resident_extra: int = 0) -> dict:
    """Expected decode seconds per token of a whole placement, with its terms.

    Args:
        probs: float ``[rows, E]`` selection probabilities; tiers: int ``[rows, E]`` tier codes;
        slots: int ``[rows]`` LRU slots; layer_weights: float ``[rows]`` (default ones).
        token: the dense, KV and activation bytes of a token (:class:`TokenBytes`; default: none, the
            caller adds the fixed terms).
        trace_hits: a :class:`~colibri_plan.planner.cache_model.TraceHits` (LRU hit rates from a routing
            trace for the rows it covers; Che for the others and without one).
        resident_extra: experts the process holds in RAM beyond pins and unified GPUs (host copies of
            VRAM experts): only the page cache (``res.page_cache_pool_bytes``) feels them.

    Returns:
        dict with decode_s_per_token, tok_s, terms {dense_s, attention_s, expert_layers_s,
        expert_compute_s {"cpu", "<gpu key>"...}, disk_wait_s (reads not hidden by compute), disk_read_s
        (all reads), transfer_s (transfers and GPU call overhead), gpu_calls (GPU layer calls per
        token: Σ_l w_l · GPUs holding experts of l), handoff_s and handoffs (a segmented trunk GPU's
        cuts per token and their seconds, inside expert_layers_s)}, hit_rate {vram, ram_pinned, lru,
        disk} (shares of expert selections),
        disk_bytes_per_token (read from the disk itself), per_layer_s [rows], cpu_path_layers {weight,
        cpu_resident_s, cpu_stream_s, disk_s, verify_s} (lists [rows], the CPU path's parts per layer;
        calibrate refits on them), page_cache {capacity_experts, hit_rate (share of selections the page
        cache serves; 0 for an O_DIRECT engine)} and cache_model ("trace" or "che": the LRU model used).
    """
    coef = coef or Coefficients()
    probs = np.asarray(probs, dtype=np.float64)
    rows = probs.shape[0]
    w = np.ones(rows) if layer_weights is None else np.asarray(layer_weights, dtype=np.float64)
    dense_s = dense_seconds(token.dense_read_bytes, res, coef)
    attn_s = attention_seconds(token.context_tokens, token.kv_bytes_per_token, res, coef)
    comp = {"cpu": 0.0, **{g.key: 0.0 for g in res.gpus}}
    disk_s = read_s = xfer_s = layers_s = calls = handoff_s = handoffs = 0.0
    parts = {"weight": [float(x) for x in w], "cpu_resident_s": [], "cpu_stream_s": [], "disk_s": [],
             "verify_s": []}
    share = dict.fromkeys(("vram", "ram_pinned", "lru", "disk", "page_cache"), 0.0)
    per_layer = []
    tiers = np.asarray(tiers)
    on_disk = tiers == TIER_DISK
    hits = np.array([lru_hit_rates(probs[i], on_disk[i], int(slots[i]), i, trace_hits) for i in range(rows)])
    pc_hits, n_pc = None, 0
    if res.page_cache_pool_bytes > 0:   # the reads the engine's own tiers miss, one LRU over all layers
        unified = [d for d, g in enumerate(res.gpus) if g.unified]
        resident = int(np.sum(tiers == TIER_RAM)) + int(np.isin(tiers, unified).sum()) + int(resident_extra)
        n_pc = page_cache_experts(res.page_cache_pool_bytes, expert_bytes, resident, int(np.sum(slots)))
        reads = np.where(on_disk, probs * (1.0 - hits), 0.0) * (w[:, None] > 0)
        pc_hits = page_cache_hit_rates(reads, n_pc)
    for i in range(rows):
        t = layer_terms(probs[i], tiers[i], int(slots[i]), expert_bytes, res, coef, token.activation_bytes,
                        hits=hits[i], page_hits=None if pc_hits is None else pc_hits[i])
        per_layer.append(t["time_s"])
        layers_s += w[i] * t["time_s"]
        comp["cpu"] += w[i] * t["cpu_s"]
        for g, s in zip(res.gpus, t["gpu_s"]):
            comp[g.key] += w[i] * s
        disk_s += w[i] * t["disk_wait_s"]
        read_s += w[i] * t["disk_s"]
        for k in ("cpu_resident_s", "cpu_stream_s", "disk_s", "verify_s"):
            parts[k].append(t[k])
        xfer_s += w[i] * sum(t["transfer_s"])
        handoff_s += w[i] * t["handoff_s"]
        handoffs += w[i] * (t["handoff_s"] > 0)
        calls += w[i] * t["gpu_calls"]
        for k in share:
            share[k] += w[i] * t[k]
    cached = share.pop("page_cache")
    total_sel = sum(share.values())
    total = dense_s + attn_s + layers_s
    return {"decode_s_per_token": total, "tok_s": 1.0 / total if total > 0 else float("inf"),
            "terms": {"dense_s": dense_s, "attention_s": attn_s, "expert_layers_s": layers_s,
                      "expert_compute_s": comp, "disk_wait_s": disk_s, "disk_read_s": read_s,
                      "transfer_s": xfer_s, "gpu_calls": calls, "handoff_s": handoff_s,
                      "handoffs": handoffs},
            "hit_rate": {k: (v / total_sel if total_sel else 0.0) for k, v in share.items()},
            "disk_bytes_per_token": (share["disk"] - cached) * expert_bytes,
            "per_layer_s": per_layer, "cpu_path_layers": parts,
            "page_cache": {"capacity_experts": n_pc, "hit_rate": cached / total_sel if total_sel else 0.0},
            "cache_model": "trace" if trace_hits is not None and trace_hits.rows_covered() else "che"}
