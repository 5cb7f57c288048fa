"""Large placements: a count-and-mass LP over tiers, then a per-layer realisation with local search.

The expert-level MILP of :mod:`colibri_plan.planner.solve` has rows × E × tiers binaries (GLM-5.2 on six
GPUs: 154k) and its LP relaxation alone is slow. Every expert of a model has the same bytes and the
cost is linear in selection probability, so a layer's cost depends only on, per tier t, the number of
experts n_t (capacity) and their probability mass m_t (time). This module solves a linear program over
(n_t, m_t) (HiGHS interior point), refining the cuts below at the counts each round chose:

* Σ_t n_t = E_l, Σ_t m_t = M_l (the layer's total p);
* per tier, S_l(n_t) <= m_t <= P_l(n_t), where P_l(n) is the mass of the n hottest experts (concave)
  and S_l(n) that of the n coldest (convex): a set of n experts never carries more or less; likewise
  the GPU side together, and the disk tier carries at least the mass of its n_disk coldest experts.
  P and S enter through tangent lines at a few breakpoints, each of which bounds the curve from the
  right side, so the program is a *relaxation*;
* the epigraph of the layer max and the capacities, as in the expert-level MILP, with the per-layer
  GPU-use indicators relaxed to [0, 1] (then fixed from the relaxation for the placement itself).

Its optimum is therefore a lower bound of the true optimum (for fixed LRU miss factors). A layer is then
realised: the n_disk coldest experts go to disk, the rest are dealt to GPUs and RAM hottest-first toward
the target masses, and pairwise swaps between tiers reduce the layer's slowest resource until no swap
helps. The reported gap is (realised cost − bound) / realised cost: a certificate, not a guess.
"""

from __future__ import annotations

import time

import numpy as np
from scipy import sparse
from scipy.optimize import linprog

from colibri_plan.errors import BudgetError, SolverError
from colibri_plan.planner.costmodel import (
    TIER_DISK,
    TIER_RAM,
    cpu_path_parts,
    cpu_path_rows,
    cpu_path_seconds,
    gpu_fixed_seconds,
    miss_seconds,
    verify_seconds,
)
from colibri_plan.planner.path_rows import gpu_expert_seconds, solver_rates
from colibri_plan.planner.quiet import no_native_stdout

N_BREAKPOINTS = 5
CUT_ROUNDS = 6
CUT_TOLERANCE = 1e-3
CUT_TIME_S = 2.0          # stop refining the cuts after this (the gap says how close we are)
CANDIDATE_TIME_S = 1.5    # extra roundings of the GPU-use indicators tried within this time
SWAP_MIN_GAIN = 1e-5      # relative gain below which a swap is not worth another pass


def _breakpoints(n: int) -> np.ndarray:
    pts = np.unique(np.round(np.concatenate([np.arange(min(n, 2) + 1),
                                             np.geomspace(1, max(n, 1), N_BREAKPOINTS)])).astype(int))
    return pts[(pts >= 0) & (pts < n)] if n > 0 else np.array([], dtype=int)


def _lp(cost, mat, lo, hi, lb, ub):
    """min cost·x s.t. lo <= mat x <= hi, lb <= x <= ub with HiGHS interior point (+ crossover): on
    these degenerate programs it is several times faster than simplex."""
    eq = np.isfinite(lo) & np.isfinite(hi) & (lo == hi)
    up = np.isfinite(hi) & ~eq
    dn = np.isfinite(lo) & ~eq
    a_ub = sparse.vstack([mat[up], -mat[dn]]).tocsr()
    b_ub = np.concatenate([hi[up], -lo[dn]])
    with no_native_stdout():   # HiGHS can print to fd 1
        return linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=mat[eq], b_eq=lo[eq], bounds=np.c_[lb, ub],
                       method="highs-ipm")


def solve_counts(problem, miss_factor_row: np.ndarray, z_fixed: np.ndarray | None = None,
                 extra_points: dict | None = None):
    """Solve the count-and-mass linear program.

    Counts are continuous (rounded down afterwards). ``z_fixed`` (float ``[rows, G]`` of 0/1) fixes which
    discrete GPUs each row uses; None relaxes z to [0, 1], which makes the optimum a lower bound of the
    true optimum (for the given miss factors). ``extra_points`` {(row, tier group): counts} adds tangents
    (cutting planes at the counts a previous solve chose).

    Returns:
        (counts [rows, T] int, masses [rows, T], z [rows, G], objective_s, ok); tiers are ordered
        GPUs 0..G-1, RAM, disk; rows of weight 0 get everything on disk (placed later).
    """
    res, b, coef, w = problem.res, problem.expert_bytes, problem.coef, problem.weights
    probs = problem.probs
    n_gpu = len(res.gpus)
    n_t = n_gpu + 2
    t_ram, t_disk = n_gpu, n_gpu + 1
    rows = [r for r in range(probs.shape[0]) if w[r] > 0 and probs[r].sum() > 0]
    xfer = [gpu_fixed_seconds(g, problem.activation_bytes, coef) for g in res.gpus]
    zdev = [d for d in range(len(res.gpus)) if xfer[d] > 0]
    # per host tier (pinned, LRU hit, miss), calls included; zero-copy pins go on GPU zc's row instead
    cpu_c, zc, map_s = solver_rates(res, b, coef)
    gpu_c = [gpu_expert_seconds(g, b, coef) for g in res.gpus]
    t_miss = miss_seconds(b, res) if res.disk_read_gbps is not None else 0.0
    nl = len(rows)
    per = 2 * n_t + len(zdev) + 1                          # n_t counts, n_t masses, z's, tau
    nvar = nl * per
    ncol = lambda i, t: i * per + t                         # noqa: E731
    mcol = lambda i, t: i * per + n_t + t                   # noqa: E731
    zcol = lambda i, j: i * per + 2 * n_t + j               # noqa: E731
    tcol = lambda i: i * per + per - 1                      # noqa: E731
    ri, ci, vals, lo, hi = [], [], [], [], []
    k = 0

    def row(cols, coefs, lower, upper):
        nonlocal k
        ri.extend([k] * len(cols))
        ci.extend(cols)
        vals.extend(coefs)
        lo.append(lower)
        hi.append(upper)
        k += 1

    # groups of tiers whose joint mass is bounded by P(joint count): each GPU, RAM, the GPUs together,
    # and everything but disk (i.e. disk holds at least the mass of its coldest experts)
    groups = [(t,) for t in range(n_t - 1)] + ([tuple(range(n_gpu))] if n_gpu > 1 else [])
    groups.append(tuple(range(n_t - 1)))
    active = []
    for i, r in enumerate(rows):
        p = np.sort(probs[r][probs[r] > 0])[::-1]
        e = len(p)
        active.append(e)
        pref = np.concatenate([[0.0], np.cumsum(p)])        # P(n): mass of the n hottest
        asc = p[::-1]
        suf = np.concatenate([[0.0], np.cumsum(asc)])       # S(n): mass of the n coldest (convex)
        row([ncol(i, t) for t in range(n_t)], [1.0] * n_t, e, e)
        row([mcol(i, t) for t in range(n_t)], [1.0] * n_t, pref[-1], pref[-1])
        base = _breakpoints(e)
        for g in groups:                                    # tangent of P at q (slope p[q]) per group:
            pts = base                                      # sum_G m - p[q] sum_G n <= P(q) - p[q] q
            if extra_points and (r, g) in extra_points:
                pts = np.union1d(base, [q for q in extra_points[(r, g)] if 0 <= q < e]).astype(int)
            for q in pts:
                row([mcol(i, t) for t in g] + [ncol(i, t) for t in g],
                    [1.0] * len(g) + [-p[q]] * len(g), -np.inf, pref[q] - p[q] * q)
                if len(g) == 1:                             # and at least the mass of its coldest experts:
                    t = g[0]                                # m_t - a[q] n_t >= S(q) - a[q] q, a ascending
                    row([mcol(i, t), ncol(i, t)], [1.0, -asc[q]], suf[q] - asc[q] * q, np.inf)
        # the CPU path as the max of its two linear forms (costmodel.cpu_path_rows), one row each
        ram_c, disk_c = cpu_path_rows(miss_factor_row[r], cpu_c, coef.disk * t_miss, verify_seconds(b, res),
                                      coef.overlap)
        for j in range(2):
            row([tcol(i), mcol(i, t_ram), mcol(i, t_disk)], [1.0, -ram_c[j], -float(disk_c[j])], 0.0, np.inf)
        for d in range(n_gpu):
            cols, cf = [tcol(i), mcol(i, d)], [1.0, -gpu_c[d]]
            if d == zc:                                     # the zero-copy pins run on d's path
                cols, cf = cols + [mcol(i, t_ram)], cf + [-map_s]
            if d in zdev:
                j = zdev.index(d)
                cols.append(zcol(i, j))
                cf.append(-xfer[d])
                mine = [ncol(i, d)] + ([ncol(i, t_ram)] if d == zc else [])
                row(mine + [zcol(i, j)], [1.0] * len(mine) + [-float(e)], -np.inf, 0.0)
            row(cols, cf, 0.0, np.inf)
    slot_bytes = int(np.sum(problem.lru_slots)) * b
    fixed_ram = slot_bytes + 0
    ram_cap = (problem.ram_budget_bytes - fixed_ram) // b
    if ram_cap < 0:
        raise BudgetError(f"the LRU slots alone ({slot_bytes} B) exceed the RAM budget "
                          f"({problem.ram_budget_bytes} B); lower --lru-slots or give more --ram")
    ram_tiers = [t_ram] + [d for d, g in enumerate(res.gpus) if g.unified or problem.keep_host_copies]
    row([ncol(i, t) for i in range(nl) for t in ram_tiers], [1.0] * (nl * len(ram_tiers)), -np.inf, ram_cap)
    for d, g in enumerate(res.gpus):
        if not g.unified:
            row([ncol(i, d) for i in range(nl)], [1.0] * nl, -np.inf, problem.gpu_capacity(d))
    ub = np.full(nvar, np.inf)
    lb = np.zeros(nvar)
    for i in range(nl):
        for t in range(n_t):   # counts stay continuous (rounded down below): the bound stays valid
            ub[ncol(i, t)] = active[i]
        for j, d in enumerate(zdev):
            ub[zcol(i, j)] = 1 if z_fixed is None else z_fixed[rows[i], d]
            lb[zcol(i, j)] = 0 if z_fixed is None else z_fixed[rows[i], d]
        if res.disk_read_gbps is None:
            ub[ncol(i, t_disk)] = 0
            ub[mcol(i, t_disk)] = 0
    cost = np.zeros(nvar)
    for i, r in enumerate(rows):
        cost[tcol(i)] = w[r]
    mat = sparse.csr_matrix((vals, (ri, ci)), shape=(k, nvar))
    out = _lp(cost, mat, np.array(lo), np.array(hi), lb, ub)
    counts = np.zeros((probs.shape[0], n_t), dtype=np.int64)
    masses = np.zeros((probs.shape[0], n_t))
    z = np.zeros((probs.shape[0], n_gpu))
    if out.x is None:
        return counts, masses, z, np.inf, False
    counts[:, t_disk] = probs.shape[1]
    raw = np.zeros((probs.shape[0], n_t))
    for i, r in enumerate(rows):
        raw[r] = out.x[[ncol(i, t) for t in range(n_t)]]
        masses[r] = out.x[[mcol(i, t) for t in range(n_t)]]
        for j, d in enumerate(zdev):
            z[r, d] = out.x[zcol(i, j)]
    counts[:, :t_disk] = np.floor(raw[:, :t_disk] + 1e-6).astype(np.int64)
    # largest-remainder rounding: what flooring left of each tier's capacity goes to the rows with the
    # largest fractional counts (one expert each, taken from that row's disk share)
    caps = {t: problem.gpu_capacity(t) for t in range(n_gpu) if not res.gpus[t].unified}
    caps[t_ram] = ram_cap
    for t, cap in caps.items():
        tiers = ram_tiers if t == t_ram else [t]
        left = int(cap - counts[:, tiers].sum())
        if t in ram_tiers and t != t_ram:   # a host copy too: within what RAM has left as well
            left = min(left, int(ram_cap - counts[:, ram_tiers].sum()))
        frac = raw[:, t] - counts[:, t]
        for r in np.argsort(-frac, kind="stable"):
            room = int(np.sum(probs[r] > 0)) - int(counts[r, :t_disk].sum())
            if left <= 0 or frac[r] <= 1e-6:
                break
            if room > 0 and (t >= n_gpu or z_fixed is None or z_fixed[r, t] > 0 or t not in zdev):
                counts[r, t] += 1
                left -= 1
    counts[:, t_disk] = probs.shape[1] - counts[:, :t_disk].sum(axis=1)   # p = 0 experts and the rest
    return counts, masses, z, float(out.fun), True


def realise_layer(p: np.ndarray, counts: np.ndarray, masses: np.ndarray, rate: np.ndarray,
                  extra: np.ndarray, max_swaps: int = 400, ram_on: int | None = None) -> np.ndarray:
    """Assign one layer's experts to tiers with the given counts, then improve by pairwise swaps.

    Args:
        p: ``[E]`` probabilities; counts, masses: ``[T]`` targets (GPUs, RAM, disk).
        rate: ``[T]`` seconds per unit of p on each tier (disk = CPU + miss cost);
        extra: ``[T]`` fixed seconds of a tier when it holds any expert (GPU transfers).
        ram_on: the GPU whose resource the RAM tier uses (zero-copy pins; None: the CPU's).
    Resources: each GPU alone, and the CPU (RAM and disk together, or disk alone with ``ram_on``).

    Returns:
        int ``[E]`` tier index 0..T-1 (GPUs, then RAM = T-2, disk = T-1).
    """
    n_t = len(counts)
    t_ram, t_disk = n_t - 2, n_t - 1
    order = np.argsort(-p, kind="stable")
    n_disk = int(counts[t_disk])
    hot = order[: len(p) - n_disk]
    # RAM and disk share the CPU resource, unless the trunk's GPU computes the pins zero-copy
    res_of = np.array(list(range(t_ram)) + [t_ram if ram_on is None else ram_on, t_ram])
    n_res = t_ram + 1

    def times(tr):
        out = np.zeros(n_res)
        for t in range(n_t):
            sel = tr == t
            if sel.any():
                out[res_of[t]] += rate[t] * p[sel].sum() + extra[t]
        return out

    # two deals of the hot experts, keep the better: (a) contiguous blocks, densest target first;
    # (b) hottest-first to the tier furthest below its target mass
    deals = []
    tier = np.full(len(p), t_disk)
    density = np.where(counts[:t_disk] > 0, masses[:t_disk] / np.maximum(counts[:t_disk], 1), -1.0)
    pos = 0
    for t in np.argsort(-density, kind="stable"):
        k = int(counts[t])
        tier[hot[pos:pos + k]] = t
        pos += k
    deals.append(tier)
    tier = np.full(len(p), t_disk)
    left = counts.astype(np.int64).copy()
    left[t_disk] = 0
    got = np.zeros(n_t)
    for e in hot:
        open_t = np.flatnonzero(left[:t_disk] > 0)
        t = open_t[np.argmax(masses[open_t] - got[open_t])]
        tier[e] = t
        got[t] += p[e]
        left[t] -= 1
    deals.append(tier)
    tier = min(deals, key=lambda tr: times(tr).max())
    cur = times(tier)
    for _ in range(max_swaps):
        worst = int(np.argmax(cur))
        best = (cur.max(), None, None)
        for a in np.flatnonzero(res_of == worst):
            ia = np.flatnonzero(tier == a)
            if ia.size == 0:
                continue
            for t in range(n_t):
                if t == a:
                    continue
                ib = np.flatnonzero(tier == t)
                if ib.size == 0:
                    continue
                d = p[ia][:, None] - p[ib][None, :]              # p moved from a to t: [|a|, |t|]
                new_w = cur[worst] - rate[a] * d + (rate[t] * d if res_of[t] == worst else 0.0)
                new_o = cur[res_of[t]] + rate[t] * d if res_of[t] != worst else new_w
                others = np.delete(cur, [worst, res_of[t]]).max(initial=0.0)
                new_max = np.maximum(np.maximum(new_w, new_o), others)
                j = np.unravel_index(np.argmin(new_max), new_max.shape)
                if new_max[j] < best[0] - SWAP_MIN_GAIN * cur.max():
                    best = (new_max[j], ia[j[0]], ib[j[1]])
        if best[1] is None:
            break
        ea, eb = best[1], best[2]
        tier[ea], tier[eb] = tier[eb], tier[ea]
        cur = times(tier)
    return tier


def _layer_time(p, tier, rate, fixed, n_gpu, cpu_path, ram_on=None) -> float:
    """Slowest resource of one realised layer: each GPU alone (GPU ``ram_on`` with the pinned experts,
    zero-copy), and the CPU path ``cpu_path(p_ram, p_disk)`` (seconds; the cost model's
    :func:`~colibri_plan.planner.costmodel.cpu_path_seconds`)."""
    held = [tier == d for d in range(n_gpu)]
    times = [rate[d] * p[held[d]].sum() for d in range(n_gpu)]
    p_ram = p[tier == n_gpu].sum()
    if ram_on is not None:
        held[ram_on] = held[ram_on] | (tier == n_gpu)
        times[ram_on] += rate[n_gpu] * p_ram
        p_ram = 0.0
    times = [t + (fixed[d] if np.any(held[d]) else 0.0) for d, t in enumerate(times)]
    times.append(cpu_path(p_ram, p[tier == n_gpu + 1].sum()))
    return max(times)


def place_large(problem, miss_factor: np.ndarray, time_limit_s: float) -> tuple[np.ndarray, float]:
    """Count-and-mass LP, then per-layer realisation. Returns (tiers [rows, E] codes, lower bound s)."""
    res, b, coef = problem.res, problem.expert_bytes, problem.coef
    n_gpu = len(res.gpus)
    row_miss = np.array([float(np.average(m, weights=np.maximum(p, 1e-300)))
                         for m, p in zip(miss_factor, problem.probs)])
    extra: dict[int, set] = {}
    bound = -np.inf
    t0 = time.perf_counter()
    for k in range(CUT_ROUNDS):                # relaxed z: each round's optimum is a lower bound
        if k >= 2 and time.perf_counter() - t0 > CUT_TIME_S:
            break
        counts, _, z_lp, obj, ok = solve_counts(problem, row_miss, extra_points=extra)
        if not ok:
            break
        if obj <= bound * (1 + CUT_TOLERANCE):
            bound = max(bound, obj)
            break                              # the new tangents no longer move the bound
        bound = obj
        groups = [(t,) for t in range(n_gpu + 1)] + ([tuple(range(n_gpu))] if n_gpu > 1 else [])
        groups.append(tuple(range(n_gpu + 1)))
        for r in range(counts.shape[0]):       # tangents at the chosen counts (and one above)
            for g in groups:
                n = int(counts[r, list(g)].sum())
                extra.setdefault((r, g), set()).update((n, n + 1))
    if not ok:
        raise BudgetError("no placement fits the budgets: the experts do not fit in VRAM + RAM and the "
                          "profile has no disk figure; measure the disk with `colibri-plan profile` or "
                          "give more memory")
    # which GPUs each row uses: several roundings of the relaxed indicators, each realised and costed
    n_exp = problem.probs.shape[1]
    candidates = []
    for z in (z_lp * n_exp >= 1 - 1e-6, z_lp > 0.5, z_lp > 1e-6, np.ones_like(z_lp, dtype=bool)):
        z = z.astype(float)
        if not any(np.array_equal(z, c) for c in candidates):
            candidates.append(z)
    cpu_c, zc, map_s = solver_rates(res, b, coef)   # (pinned, LRU hit, miss) on the host; zero-copy pins
    t_miss = miss_seconds(b, res) if res.disk_read_gbps is not None else 0.0
    t_verify = verify_seconds(b, res)
    rate = np.array([gpu_expert_seconds(g, b, coef) for g in res.gpus]
                    + [cpu_c[0] if zc is None else map_s, cpu_c[2]])
    fixed = np.array([gpu_fixed_seconds(g, problem.activation_bytes, coef) for g in res.gpus] + [0.0, 0.0])
    best = None
    t1 = time.perf_counter()
    for i, z in enumerate(candidates):
        if i > 0 and time.perf_counter() - t1 > CANDIDATE_TIME_S:
            break
        counts, masses, _, _, ok = solve_counts(problem, row_miss, z, extra_points=extra)
        if not ok:
            continue
        tiers = np.full(problem.probs.shape, TIER_DISK, dtype=np.int64)
        total = 0.0
        for r in range(problem.probs.shape[0]):
            if problem.weights[r] <= 0 or problem.probs[r].sum() <= 0:
                continue
            f = row_miss[r]
            rr = rate.copy()   # the swaps' additive rate of a disk-tier expert: all four CPU-path parts
            rr[-1] = sum(cpu_path_parts(0.0, 1.0 - f, f, cpu_c, coef.disk * t_miss, t_verify))
            t = realise_layer(problem.probs[r], counts[r], masses[r], rr, fixed, ram_on=zc)
            tiers[r] = np.where(t < n_gpu, t, np.where(t == n_gpu, TIER_RAM, TIER_DISK))

            def cpu_path(p_ram, p_disk, f=f):
                parts = cpu_path_parts(p_ram, p_disk * (1.0 - f), p_disk * f, cpu_c, coef.disk * t_miss,
                                       t_verify)
                return float(cpu_path_seconds(*parts, coef.overlap))

            total += problem.weights[r] * _layer_time(problem.probs[r], t, rr, fixed, n_gpu, cpu_path, zc)
        if best is None or total < best[1]:
            best = (tiers, total)
    if best is None:
        raise SolverError("the count-and-mass program found no placement with integral GPU use")
    tiers = best[0]
    return tiers, bound
