"""Which processor computes each host tier (pinned, LRU hits, streamed misses): the CPU, a unified GPU,
or (pinned only) the discrete GPU that holds the trunk, zero-copy.

On a unified-memory device (an integrated GPU, Apple silicon, lavapipe) the GPU reads the RAM pool the
CPU reads, so it can compute the experts the CPU path would: pinned ones (uploaded once into
device-visible memory) and streamed ones (uploaded once per slot fill, a copy at RAM GB/s). The engine
does what the plan's ``compute`` section says (docs/engine.md); the cost model prices it here.

A discrete GPU that holds the dense trunk and can read mapped page-locked host memory
(``GpuResource.mapped_gbps`` > 0: the profile's ``"memory": "mapped"`` expert_ffn row) may compute the
pinned tier zero-copy: the pinned experts live in mapped host memory (still the RAM budget's bytes) and
the GPU runs them inside its decode step with its VRAM experts, reading them over the link. Never the LRU
or streamed tiers: each slot fill would need its own mapped host copy. Seconds per pinned expert there:
c_gpu · b / mapped GB/s + the GPU's ``expert_call_s`` (:func:`mapped_expert_seconds`).
"""

from __future__ import annotations

import dataclasses

from colibri_plan.errors import InputError
from colibri_plan.formats.coefficients import Coefficients

#: the host tiers, in the plan's vocabulary
HOST_TIERS = ("ram_pinned", "lru", "disk")


def mapped_candidates(res) -> list:
    """Keys of the GPUs that may compute the pinned tier zero-copy: discrete, holding the trunk, with a
    mapped-memory figure (``mapped_gbps`` > 0)."""
    return [g.key for g in res.gpus if not g.unified and g.holds_trunk and g.mapped_gbps > 0]


def mapped_gpu(res) -> int | None:
    """Index of the discrete GPU ``res.compute`` names for the pinned tier (zero-copy), else None."""
    who = dict(res.compute).get("ram_pinned", "cpu")
    return next((d for d, g in enumerate(res.gpus) if g.key == who and not g.unified), None)


def mapped_expert_seconds(gpu, expert_bytes: int, coef: Coefficients) -> float:
    """Seconds one pinned expert computed zero-copy on discrete ``gpu`` adds to its path: c_gpu · b /
    mapped GB/s (``step_mapped_gbps`` inside a replayed step, when > 0) + ``gpu.expert_call_s``.
    E.g. b = 1e9 B at 50 GB/s, c_gpu 1, no call cost: 0.02 s.

    Raises:
        InputError: the GPU has no mapped-memory figure (``mapped_gbps`` 0).
    """
    if gpu.mapped_gbps <= 0:
        raise InputError(f"compute.ram_pinned names {gpu.key}, which has no mapped-memory expert_ffn figure "
                         "(mapped_gbps 0): it cannot compute pinned experts zero-copy; re-profile it with a "
                         "backend that has upload_expert_mapped, or compute the pinned tier on the cpu")
    # inside a replayed step the link rate of a zero-copy read is the step's figure when it has one
    gbps = gpu.step_mapped_gbps if gpu.step_mapped_gbps > 0 else gpu.mapped_gbps
    return coef.gpu_expert * expert_bytes / (gbps * 1e9) + float(gpu.expert_call_s)


def host_seconds(res, expert_bytes: int, coef: Coefficients) -> tuple[float, float, float]:
    """Seconds to compute one expert of each host tier, (pinned, LRU hit, streamed miss), c_cpu included.

    A tier on the CPU: b / min(CPU matmul, RAM read) GB/s. A tier on a unified GPU (``res.compute``): b /
    min(its matmul, RAM read) GB/s; a streamed expert there also pays its upload into device-visible
    memory, a copy at RAM GB/s (the engine uploads each slot fill: docs/engine.md), so does an LRU hit
    whose slot was filled for the CPU (never, when lru and disk share a processor). Pinned on the discrete
    GPU that holds the trunk: :func:`mapped_expert_seconds` (c_gpu, not c_cpu: the GPU's kernels).
    """
    who = dict(res.compute)
    gpus = {g.key: g for g in res.gpus}
    copy_s = expert_bytes / (res.ram_read_gbps * 1e9)

    def rate(tier: str) -> float:
        k = who.get(tier, "cpu")
        if k == "cpu" or k not in gpus:
            return res.cpu_gbps
        return min(gpus[k].matmul_gbps, res.ram_read_gbps)

    def on_gpu(tier: str) -> bool:
        return who.get(tier, "cpu") in gpus

    def copy(tier: str) -> float:   # a zero-copy GPU reads the slab where the read put it
        return 0.0 if gpus[who[tier]].zero_copy else copy_s

    out = [coef.cpu_expert * expert_bytes / (rate(t) * 1e9) for t in ("ram_pinned", "lru", "disk")]
    out[2] += copy("disk") if on_gpu("disk") else 0.0
    out[1] += copy("lru") if on_gpu("lru") and who.get("lru") != who.get("disk", "cpu") else 0.0
    d = mapped_gpu(res)
    if d is not None:
        out[0] = mapped_expert_seconds(res.gpus[d], expert_bytes, coef)
    return out[0], out[1], out[2]


def colibri_unified_compute(res):
    """Resources as colibrì runs a unified-memory GPU (reference notes; its ENVIRONMENT.md:
    ``COLI_CUDA_UNIFIED`` auto-on for GB10/Grace, "all experts are GPU-served"; Metal computes the routed
    experts zero-copy from the RAM slabs): every host tier (pinned, LRU hits, streamed misses) on the
    first unified GPU, which reads the slabs in place (``zero_copy``: no upload copy). Not a choice:
    colibrì does it whatever the speeds (a CPU faster than the GPU is priced as the slower path it is)."""
    gpu = next(g for g in res.gpus if g.unified)
    gpus = tuple(dataclasses.replace(g, zero_copy=True) if g.key == gpu.key else g for g in res.gpus)
    return dataclasses.replace(res, gpus=gpus, compute=tuple((t, gpu.key) for t in sorted(HOST_TIERS)))


def choose_compute(res, expert_bytes: int, coef: Coefficients) -> tuple:
    """Pick the processor of each host tier: the CPU or a unified GPU, whichever computes one expert of
    the tier in fewer seconds (:func:`host_seconds`, the upload copy included for a streamed expert on a
    GPU); for the pinned tier, the trunk's discrete GPU zero-copy too (:func:`mapped_candidates`). LRU
    hits go where the misses go (a hit reuses the slot's upload). Per expert only: the trunk's solve
    (planner.trunk_solve) prices a zero-copy choice against the best other by the whole placement.

    Returns:
        (resources with ``compute`` set, {tier: {processor: seconds per expert}}: the comparison).
    """
    keys = ["cpu"] + [g.key for g in res.gpus if g.unified]
    explain: dict = {}
    for tier, i in (("ram_pinned", 0), ("disk", 2)):
        cand = keys + (mapped_candidates(res) if tier == "ram_pinned" else [])
        explain[tier] = {k: host_seconds(dataclasses.replace(res, compute=((tier, k),)), expert_bytes,
                                         coef)[i] for k in cand}
    choice = {t: min(explain[t], key=explain[t].get) for t in explain}
    choice["lru"] = choice["disk"]
    explain["lru"] = {k: host_seconds(dataclasses.replace(res, compute=(("lru", k), ("disk", k))),
                                      expert_bytes, coef)[1] for k in keys}
    return dataclasses.replace(res, compute=tuple(sorted(choice.items()))), explain


def pinned_alternative(res, expert_bytes: int, coef: Coefficients):
    """``res`` with the pinned tier on the fastest processor per expert other than a zero-copy discrete
    GPU (the CPU or a unified GPU), or None when ``res`` does not compute it zero-copy: the other side of
    the trunk solve's whole-placement comparison."""
    if mapped_gpu(res) is None:
        return None
    base = dataclasses.replace(res, gpus=tuple(dataclasses.replace(g, mapped_gbps=0.0) for g in res.gpus))
    best = choose_compute(base, expert_bytes, coef)[0]
    who = dict(res.compute)
    who["ram_pinned"] = dict(best.compute)["ram_pinned"]
    return dataclasses.replace(res, compute=tuple(sorted(who.items())))


def compute_section(setup) -> tuple[dict, dict]:
    """The plan's ``compute`` ({host tier: processor}) and ``compute_explain`` ({tier: {processor:
    seconds per expert}}, plus ``ram_pinned_decode_s`` {processor: decode seconds per token of the whole
    placement} when the trunk's solve priced zero-copy pins both ways) of a planner.make Setup."""
    res = setup.res
    explain = choose_compute(res, setup.spec.expert_bytes(), setup.problem.coef)[1]
    if getattr(setup, "pinned_decode_s", None):
        explain["ram_pinned_decode_s"] = dict(setup.pinned_decode_s)
    return dict(res.compute), explain
