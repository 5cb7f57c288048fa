"""Which processor computes each host tier (pinned, LRU hits, streamed misses): the CPU or a unified GPU.

On a unified-memory device (an integrated GPU, Apple silicon, lavapipe) the GPU reads the RAM pool the
CPU reads, so it can compute the experts the CPU path would: pinned ones (uploaded once into
device-visible memory) and streamed ones (uploaded once per slot fill, a copy at RAM GB/s). The engine
does what the plan's ``compute`` section says (docs/engine.md); the cost model prices it here.
"""

from __future__ import annotations

import dataclasses

from colibri_plan.formats.coefficients import Coefficients

#: the host tiers, in the plan's vocabulary
HOST_TIERS = ("ram_pinned", "lru", "disk")


def host_seconds(res, expert_bytes: int, coef: Coefficients) -> tuple[float, float, float]:
    """Seconds to compute one expert of each host tier, (pinned, LRU hit, streamed miss), c_cpu included.

    A tier on the CPU: b / min(CPU matmul, RAM read) GB/s. A tier on a unified GPU (``res.compute``): b /
    min(its matmul, RAM read) GB/s; a streamed expert there also pays its upload into device-visible
    memory, a copy at RAM GB/s (the engine uploads each slot fill: docs/engine.md), so does an LRU hit
    whose slot was filled for the CPU (never, when lru and disk share a processor).
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
    GPU). LRU hits go where the misses go (a hit reuses the slot's upload).

    Returns:
        (resources with ``compute`` set, {tier: {processor: seconds per expert}}: the comparison).
    """
    keys = ["cpu"] + [g.key for g in res.gpus if g.unified]
    explain: dict = {}
    for tier, i in (("ram_pinned", 0), ("disk", 2)):
        explain[tier] = {k: host_seconds(dataclasses.replace(res, compute=((tier, k),)), expert_bytes,
                                         coef)[i] for k in keys}
    choice = {t: min(explain[t], key=explain[t].get) for t in explain}
    choice["lru"] = choice["disk"]
    explain["lru"] = {k: host_seconds(dataclasses.replace(res, compute=(("lru", k), ("disk", k))),
                                      expert_bytes, coef)[1] for k in keys}
    return dataclasses.replace(res, compute=tuple(sorted(choice.items()))), explain
