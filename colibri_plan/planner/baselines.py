"""Placements other tools would choose, evaluated with the same cost model as ours (``solve --compare``).

* ``hot_first`` — colibrì's PIN fill: one global ranking of (layer, expert) by raw count; the ranked
  prefix goes to VRAM, each expert whole to the least-loaded device that can hold it, until the next one
  would cross the VRAM budget; the ranking continues into RAM pins until the RAM budget (less the LRU
  reserve) is full — each pin to the least-loaded (in seconds) of the CPU and the unified-memory GPUs,
  which share the RAM pool; everything else streams through the LRU. Priced with the same ``compute``
  choice as ours (a unified GPU may compute the host tiers), so it is not handicapped.
* ``fit_layers`` — llama.cpp ``--fit`` style: a layer's experts move as one merged tensor, so whole
  layers go to the GPUs from the last layer backwards while they fit, then whole layers to RAM, the rest
  streams (the page cache plays the LRU).
* ``uniform`` — no heat: each layer gets the same share of every tier, experts in id order.

All three use the same budgets and LRU reserve as the optimiser, so differences are placement only; a
VRAM expert takes ``expert_bytes + problem.vram_overhead_bytes`` of its device and, with
``problem.keep_host_copies``, its bytes of RAM as well (as in the solver): with host copies the GPU fill
also stops where their RAM would eat into the LRU reserve, so every baseline stays within both budgets
(``validate_placement`` passes; tests/test_planner_baselines.py).
"""

from __future__ import annotations

import numpy as np

from colibri_plan.formats.plan import TIER_DISK, TIER_RAM


def _ram_capacity(problem) -> int:
    """Experts the RAM budget can pin after the LRU reserve of rows that will stream."""
    return int((problem.ram_budget_bytes - int(problem.lru_slots.sum()) * problem.expert_bytes)
               // problem.expert_bytes)


def _finish(problem, tiers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """LRU slots for the rows that stream: the reserve, raised evenly with whatever RAM the pins left
    (as colibrì's cap auto-raise and llama.cpp's page cache would use it)."""
    b = problem.expert_bytes
    streaming = (tiers == TIER_DISK).any(axis=1) & (problem.weights > 0)
    unified = [d for d, g in enumerate(problem.res.gpus) if g.unified]
    pinned = int(np.sum(tiers == TIER_RAM)) + sum(int(np.sum(tiers == d)) for d in unified) \
        + problem.host_copies(tiers)
    left = problem.ram_budget_bytes // b - pinned
    slots = np.where(streaming, problem.lru_slots, 0)
    if streaming.any():
        extra = max(0, int(left - slots.sum())) // int(streaming.sum())
        slots = np.where(streaming, np.minimum(slots + extra, (tiers == TIER_DISK).sum(axis=1)), 0)
    return tiers, slots


def _copy_room(problem) -> float:
    """VRAM experts the RAM budget can hold host copies of (after the LRU reserve): unbounded without
    ``keep_host_copies``."""
    return _ram_capacity(problem) if problem.keep_host_copies else float("inf")


def hot_first(problem, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """colibrì-style hot-first fill. ``counts`` ``[rows, E]`` ranks the experts (default: the problem's
    probabilities, i.e. the heat). Returns (tiers, lru_slots)."""
    rank_by = problem.probs if counts is None else np.asarray(counts, dtype=np.float64)
    rows, n_exp = rank_by.shape
    b = problem.expert_bytes + problem.vram_overhead_bytes      # device bytes of one VRAM expert
    tiers = np.full((rows, n_exp), TIER_DISK, dtype=np.int64)
    order = np.argsort(-rank_by, axis=None, kind="stable")
    gpus = [(d, g) for d, g in enumerate(problem.res.gpus) if not g.unified]
    placed = {d: 0 for d, _ in gpus}
    vram_total = sum(g.budget_bytes for _, g in gpus)
    used, n_vram, copies = 0, 0, _copy_room(problem)
    stop = len(order)
    for i, flat in enumerate(order):
        fits = [d for d, g in gpus if placed[d] + b <= g.budget_bytes]
        if used + b > vram_total or not fits or n_vram + 1 > copies:   # a host copy must fit in RAM too
            stop = i
            break
        d = min(fits, key=lambda k: placed[k])         # least-loaded device that can hold it
        tiers.flat[flat] = d
        placed[d] += b
        used += b
        n_vram += 1
    room = _ram_capacity(problem) - problem.host_copies(tiers)
    targets = _pin_targets(problem)
    load = dict.fromkeys(targets, 0.0)
    for flat in order[stop:]:
        if room <= 0:
            break
        if tiers.flat[flat] == TIER_DISK:   # least-loaded in seconds among the CPU and unified GPUs
            t = min(targets, key=lambda k: load[k] + rank_by.flat[flat] * targets[k])
            tiers.flat[flat] = t
            load[t] += rank_by.flat[flat] * targets[t]
            room -= 1
    return _finish(problem, tiers)


def _pin_targets(problem) -> dict[int, float]:
    """Where hot-first puts RAM pins, with seconds per expert computed: TIER_RAM (the pinned tier, on its
    processor) and each unified GPU (its experts share the RAM pool) when the pinned tier runs on the
    CPU; a unified GPU computing the pinned tier already gets them all as pins."""
    from colibri_plan.planner.compute import host_seconds

    res, b = problem.res, problem.expert_bytes
    out = {TIER_RAM: host_seconds(res, b, problem.coef)[0]}
    if dict(res.compute).get("ram_pinned", "cpu") == "cpu":
        out.update({d: problem.coef.gpu_expert * b / (min(g.matmul_gbps, res.ram_read_gbps) * 1e9)
                    for d, g in enumerate(res.gpus) if g.unified})
    return out


def fit_layers(problem) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp ``--fit``-style whole-layer offload (see module docstring). Returns (tiers, slots)."""
    rows, n_exp = problem.probs.shape
    b = problem.expert_bytes
    tiers = np.full((rows, n_exp), TIER_DISK, dtype=np.int64)
    layer_bytes = n_exp * (b + problem.vram_overhead_bytes)
    free = {d: g.budget_bytes for d, g in enumerate(problem.res.gpus) if not g.unified}
    order = [r for r in range(rows) if problem.weights[r] > 0][::-1] + \
            [r for r in range(rows) if problem.weights[r] <= 0]
    rest, copies = [], _copy_room(problem)
    for r in order:                                    # last decode layers first, onto the GPUs in order
        d = next((d for d in sorted(free) if free[d] >= layer_bytes), None)
        if d is None or copies < n_exp:                # (with host copies, the layer's copies fit in RAM)
            rest.append(r)
            continue
        tiers[r] = d
        free[d] -= layer_bytes
        copies -= n_exp
    room = _ram_capacity(problem) - problem.host_copies(tiers)
    for r in rest:                                     # then whole layers into RAM
        if room >= n_exp:
            tiers[r] = TIER_RAM
            room -= n_exp
    return _finish(problem, tiers)


def uniform(problem) -> tuple[np.ndarray, np.ndarray]:
    """Heat-blind even split: every row gets floor(capacity / rows) experts per tier, in id order."""
    rows, n_exp = problem.probs.shape
    tiers = np.full((rows, n_exp), TIER_DISK, dtype=np.int64)
    start = np.zeros(rows, dtype=np.int64)
    ram, shares = _ram_capacity(problem), []
    for d, g in enumerate(problem.res.gpus):
        if g.unified:
            continue
        cap = problem.gpu_capacity(d)
        if problem.keep_host_copies:   # every VRAM expert also takes RAM: no more than it can hold
            cap = min(cap, max(0, ram))
            ram -= min(n_exp, cap // rows) * rows
        shares.append((d, cap))
    shares.append((TIER_RAM, max(0, ram)))
    for code, cap in shares:
        per_row = int(min(n_exp, cap // rows))
        for r in range(rows):
            k = int(min(per_row, n_exp - start[r]))
            tiers[r, start[r]:start[r] + k] = code
            start[r] += k
    return _finish(problem, tiers)


BASELINES = {"colibri hot-first": hot_first, "llama.cpp --fit layers": fit_layers, "uniform": uniform}
