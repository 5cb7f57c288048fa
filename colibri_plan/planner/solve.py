"""Optimal expert placement: per MoE layer, which experts live on which GPU, pinned in RAM, or on disk.

The placement minimises the cost model of :mod:`colibri_plan.planner.costmodel` as a mixed-integer
linear program solved by HiGHS (``scipy.optimize.milp``):

* ``x[l,e,t]`` ∈ {0,1}: expert e of row l lives in tier t (each GPU, RAM pinned, disk); Σ_t x = 1.
* ``z[l,d]`` ∈ {0,1}: discrete GPU d holds some expert of row l (then it pays one activation round
  trip per token): Σ_e x[l,e,d] <= E · z[l,d].
* ``τ_l`` >= the CPU path max(resident, disk) + stream, written as two linear rows because
  max(a, b) + s <= τ  ⇔  a + s <= τ and b + s <= τ:
  τ_l >= Σ_e p_e (x_RAM + x_disk) c_cpu + Σ_e p_e (1 − h_e) v x_disk (all CPU compute: resident +
  stream, and the crc32 check v of each streamed expert) and
  τ_l >= Σ_e p_e (m_e + (1 − h_e) c_cpu) x_disk (disk + stream); and τ_l >= each GPU's
  Σ_e p_e x[l,e,d] c_d + xfer_d z[l,d] — the epigraph of the layer's max, which is exact at the optimum.
  When the trunk's discrete GPU d computes the pinned tier zero-copy (planner.compute), the pinned
  columns leave the CPU rows and join d's: + Σ_e p_e x_RAM c_mapped (and d's linking row).
* capacities: per discrete GPU Σ b x[·,·,d] <= budget_d; RAM Σ b x_RAM + b·(unified-GPU experts) +
  b·LRU slots <= RAM budget (a unified device shares the RAM pool and is never counted twice).
* objective Σ_l w_l τ_l (w_l = 1 for decode rows, 0 for MTP rows).

Because every term is linear in x once the per-expert miss factor m_e = c_disk · (1 − h_e) · t_miss is
fixed, the MILP optimum is the exact optimum of the cost model whenever the LRU holds no slots (h = 0);
with LRU slots the hit rates h_e (from the routing trace's stack distances, else Che;
:mod:`colibri_plan.planner.cache_model`) depend on the disk set, so the solver iterates: solve with h = 0,
recompute h for the chosen disk sets, solve again, and keep the better placement by the full cost model.
A VRAM expert takes ``expert_bytes + vram_overhead_bytes`` of its device, and with ``keep_host_copies``
also ``expert_bytes`` of RAM (the RAM row then counts the discrete GPUs' columns too).
Experts a token never selects (p = 0) and rows of weight 0 cannot change the cost; they are excluded
from the MILP and placed afterwards into whatever RAM (then VRAM) is left, hottest first. After solving,
:func:`validate_placement` re-checks every budget without trusting the solver status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from colibri_plan.errors import BudgetError, SolverError
from colibri_plan.planner.baselines import hot_first
from colibri_plan.planner.cache_model import lru_hit_rates
from colibri_plan.planner.costmodel import (
    TIER_DISK,
    TIER_RAM,
    Coefficients,
    Resources,
    TokenBytes,
    cpu_path_rows,
    decode_cost,
    gpu_fixed_seconds,
    miss_seconds,
    verify_seconds,
)
from colibri_plan.planner.options import DEFAULTS
from colibri_plan.planner.path_rows import gpu_expert_seconds, solver_rates
from colibri_plan.planner.quiet import no_native_stdout

#: above this many expert-level binaries the count-and-mass method is used (method="auto")
EXACT_MAX_BINARIES = 12_000


@dataclass
class Problem:
    """One placement problem.

    Attributes:
        probs: float ``[rows, E]`` selection probabilities per token.
        weights: float ``[rows]`` decode weight of each row (0 for MTP rows).
        expert_bytes: bytes of one expert; activation_bytes: one token's hidden state in bytes.
        res: machine resources (GPU budgets inside); ram_budget_bytes: RAM for experts + LRU slots.
        lru_slots: int ``[rows]`` LRU slots reserved per row (only rows that keep disk experts use them).
        trace_hits: LRU hit rates from a routing trace (planner.cache_model.TraceHits); None = Che's.
        keep_host_copies: VRAM experts keep a host copy (colibrì CUDA_RELEASE_HOST=0), charged to the RAM.
        vram_overhead_bytes: device bytes per VRAM expert beyond expert_bytes (colibrì: 0.741 MiB; ours 0).
    """

    probs: np.ndarray
    weights: np.ndarray
    expert_bytes: int
    res: Resources
    ram_budget_bytes: int
    lru_slots: np.ndarray
    coef: Coefficients = field(default_factory=Coefficients)
    activation_bytes: int = 0
    fixed_cost_s: float = 0.0   # dense + attention seconds, added to the reported objective
    trace_hits: object = None
    keep_host_copies: bool = False
    vram_overhead_bytes: int = 0

    def __post_init__(self):
        self.probs = np.asarray(self.probs, dtype=np.float64)
        self.weights = np.asarray(self.weights, dtype=np.float64)
        self.lru_slots = np.asarray(self.lru_slots, dtype=np.int64)
        if self.ram_budget_bytes < 0 or any(g.budget_bytes < 0 for g in self.res.gpus):
            raise BudgetError("memory budgets cannot be negative")
        if self.expert_bytes <= 0:
            raise BudgetError(f"expert bytes must be positive, got {self.expert_bytes}")
        if self.vram_overhead_bytes < 0:
            raise BudgetError(f"VRAM overhead per expert cannot be negative ({self.vram_overhead_bytes} B)")

    def gpu_capacity(self, d: int) -> int:
        """Experts discrete GPU ``d`` can hold: budget // (expert bytes + VRAM overhead per expert)."""
        return int(self.res.gpus[d].budget_bytes // (self.expert_bytes + self.vram_overhead_bytes))

    def host_copies(self, tiers: np.ndarray) -> int:
        """Host copies the placement keeps in RAM: its discrete-GPU experts when ``keep_host_copies``."""
        if not self.keep_host_copies:
            return 0
        return sum(int(np.sum(np.asarray(tiers) == d)) for d, g in enumerate(self.res.gpus) if not g.unified)


@dataclass
class Solution:
    """A placement: ``tiers`` int ``[rows, E]`` (GPU index, TIER_RAM or TIER_DISK), ``lru_slots``
    ``[rows]``, the cost breakdown (:func:`decode_cost`) and solver facts."""

    tiers: np.ndarray
    lru_slots: np.ndarray
    cost: dict
    status: str
    gap: float | None
    seconds: float
    method: str
    iterations: list = field(default_factory=list)


def evaluate(problem: Problem, tiers: np.ndarray, lru_slots: np.ndarray | None = None) -> dict:
    """The full cost model (:func:`decode_cost`) of a placement, fixed costs included."""
    slots = problem.lru_slots if lru_slots is None else lru_slots
    c = decode_cost(problem.probs, tiers, slots, problem.expert_bytes, problem.res, problem.coef,
                    token=TokenBytes(activation_bytes=problem.activation_bytes),
                    layer_weights=problem.weights, trace_hits=problem.trace_hits,
                    resident_extra=problem.host_copies(tiers))
    c["decode_s_per_token"] += problem.fixed_cost_s
    c["tok_s"] = 1.0 / c["decode_s_per_token"] if c["decode_s_per_token"] > 0 else float("inf")
    return c


def _milp(problem: Problem, miss_factor: np.ndarray, time_limit_s: float, gap: float):
    """Build and solve the MILP for rows of positive weight; returns (tiers, status, gap, objective)."""
    res, b, coef = problem.res, problem.expert_bytes, problem.coef
    probs, w = problem.probs, problem.weights
    rows_all, n_exp = probs.shape
    n_gpu = len(res.gpus)
    n_t = n_gpu + 2                                    # tiers: GPUs, RAM, disk
    t_ram, t_disk = n_gpu, n_gpu + 1
    act = [(r, e) for r in range(rows_all) if w[r] > 0 for e in np.flatnonzero(probs[r] > 0)]
    tiers = np.full((rows_all, n_exp), TIER_DISK, dtype=np.int64)
    if not act:
        return tiers, "optimal", 0.0, 0.0
    rows = sorted({r for r, _ in act})
    rpos = {r: i for i, r in enumerate(rows)}
    n_x = len(act) * n_t
    xfer = [gpu_fixed_seconds(g, problem.activation_bytes, coef) for g in res.gpus]
    zdev = [d for d in range(len(res.gpus)) if xfer[d] > 0]
    n_z = len(rows) * len(zdev)
    n_tau = len(rows)
    n_var = n_x + n_z + n_tau
    zcol = {(rpos[r], d): n_x + i * len(zdev) + j for i, r in enumerate(rows) for j, d in enumerate(zdev)}
    taucol = n_x + n_z
    # per host tier (pinned, LRU hit, miss), calls included; zero-copy pins go on GPU zc's row instead
    cpu_c, zc, map_s = solver_rates(res, b, coef)
    gpu_c = [gpu_expert_seconds(g, b, coef) for g in res.gpus]
    t_miss = miss_seconds(b, res) if res.disk_read_gbps is not None else 0.0
    t_verify = verify_seconds(b, res)
    idx = np.arange(len(act))
    r_of = np.array([rpos[r] for r, _ in act])
    p_of = np.array([probs[r, e] for r, e in act])
    f_of = np.array([miss_factor[r, e] for r, e in act])   # 1 - h: the share of selections that miss
    A = []        # (row index array, col index array, values) blocks
    lo, hi = [], []
    nrow = 0

    def add(ri, ci, v, lower, upper, n):
        nonlocal nrow
        A.append((np.asarray(ri) + nrow, np.asarray(ci), np.asarray(v, dtype=np.float64)))
        lo.extend(lower)
        hi.extend(upper)
        nrow += n

    # each expert in exactly one tier
    add(np.repeat(idx, n_t), (idx[:, None] * n_t + np.arange(n_t)).ravel(), np.ones(len(act) * n_t),
        [1.0] * len(act), [1.0] * len(act), len(act))
    # CPU epigraph: the cost model's CPU path is the max of two linear forms (costmodel.cpu_path_bounds),
    # one row each: tau >= sum_e p_e (ram[j] x_ram + disk[j](f_e) x_disk), coefficients from cpu_path_rows
    ram_c, disk_c = cpu_path_rows(f_of, cpu_c, coef.disk * t_miss, t_verify, coef.overlap)
    for j in range(2):
        ci = np.concatenate([idx * n_t + t_ram, idx * n_t + t_disk, taucol + np.arange(n_tau)])
        ri = np.concatenate([r_of, r_of, np.arange(n_tau)])
        v = np.concatenate([-p_of * ram_c[j], -p_of * disk_c[j], np.ones(n_tau)])
        add(ri, ci, v, [0.0] * n_tau, [np.inf] * n_tau, n_tau)
    for d in range(n_gpu):   # GPU epigraph: tau_r - sum p c_d x_d - xfer_d z_rd >= 0 (+ zero-copy pins)
        ci = [idx * n_t + d, taucol + np.arange(n_tau)]
        ri = [r_of, np.arange(n_tau)]
        v = [-p_of * gpu_c[d], np.ones(n_tau)]
        if d == zc:
            ci, ri, v = ci + [idx * n_t + t_ram], ri + [r_of], v + [-p_of * map_s]
        if d in zdev:
            ci.append(np.array([zcol[(i, d)] for i in range(n_tau)]))
            ri.append(np.arange(n_tau))
            v.append(np.full(n_tau, -xfer[d]))
        add(np.concatenate(ri), np.concatenate(ci), np.concatenate(v), [0.0] * n_tau, [np.inf] * n_tau, n_tau)
        if d in zdev:        # linking: sum_e x_rd (+ x_r,RAM for zero-copy pins) - E z_rd <= 0
            zs = np.array([zcol[(i, d)] for i in range(n_tau)])
            mine = [idx * n_t + d] + ([idx * n_t + t_ram] if d == zc else [])
            add(np.concatenate([np.tile(r_of, len(mine)), np.arange(n_tau)]), np.concatenate([*mine, zs]),
                np.concatenate([np.ones(len(act) * len(mine)), np.full(n_tau, -float(n_exp))]),
                [-np.inf] * n_tau, [0.0] * n_tau, n_tau)
    # capacities (in experts: every expert has the same bytes)
    slot_bytes = int(np.sum(problem.lru_slots)) * b
    if slot_bytes > problem.ram_budget_bytes:
        raise BudgetError(f"the LRU slots alone ({slot_bytes} B) exceed the RAM budget "
                          f"({problem.ram_budget_bytes} B); lower --lru-slots or give more --ram")
    ram_cols = [idx * n_t + t_ram] + [idx * n_t + d for d, g in enumerate(res.gpus)
                                      if g.unified or problem.keep_host_copies]
    ram_cols = np.concatenate(ram_cols)
    add(np.zeros(len(ram_cols)), ram_cols, np.ones(len(ram_cols)), [-np.inf],
        [float((problem.ram_budget_bytes - slot_bytes) // b)], 1)
    for d, g in enumerate(res.gpus):
        if not g.unified:
            add(np.zeros(len(act)), idx * n_t + d, np.ones(len(act)), [-np.inf],
                [float(problem.gpu_capacity(d))], 1)
    mat = sparse.csr_matrix((np.concatenate([a[2] for a in A]),
                             (np.concatenate([a[0] for a in A]), np.concatenate([a[1] for a in A]))),
                            shape=(nrow, n_var))
    ub = np.ones(n_var)
    ub[taucol:] = np.inf
    if res.disk_read_gbps is None:
        ub[idx * n_t + t_disk] = 0.0                   # no disk figure: nothing may stream
    cost = np.zeros(n_var)
    cost[taucol:] = [w[r] for r in rows]
    integrality = np.r_[np.ones(taucol), np.zeros(n_var - taucol)]
    with no_native_stdout():   # HiGHS can print to fd 1 (a --json stdout holds one document)
        out = milp(cost, constraints=LinearConstraint(mat, np.array(lo), np.array(hi)), bounds=Bounds(
            np.zeros(n_var), ub), integrality=integrality, options={"time_limit": time_limit_s,
                                                                   "mip_rel_gap": gap, "presolve": True})
    if out.x is None:
        if out.status == 2 or "infeasible" in str(out.message).lower():
            raise BudgetError("no placement fits the budgets: the experts do not fit in VRAM + RAM and the "
                              "profile has no disk figure (or the LRU reserve is too large); re-profile with "
                              "`colibri-plan profile --path DIR` (DIR on the pack's disk) or more memory")
        raise SolverError(f"HiGHS found no placement: {out.message}")
    x = out.x[:n_x].reshape(len(act), n_t)
    choice = np.argmax(x, axis=1)
    for (r, e), t in zip(act, choice):
        tiers[r, e] = t if t < n_gpu else (TIER_RAM if t == t_ram else TIER_DISK)
    status = "optimal" if out.status == 0 else ("time_limit" if out.status == 1 else f"status {out.status}")
    return tiers, status, float(getattr(out, "mip_gap", 0.0) or 0.0), float(out.fun)


def _fill(problem: Problem, tiers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Place what the MILP left on disk into leftover RAM (then VRAM for cost-free experts), hottest
    first; a row with no disk experts left needs no LRU slots. Never increases the modelled cost."""
    res, b = problem.res, problem.expert_bytes
    tiers = tiers.copy()
    slots = np.where((tiers == TIER_DISK).any(axis=1), problem.lru_slots, 0)
    unified = [d for d, g in enumerate(res.gpus) if g.unified]
    value = problem.probs * np.maximum(problem.weights, 1e-9)[:, None]
    order = np.argsort(-value, axis=None, kind="stable")
    ram_used = lambda: (np.sum(tiers == TIER_RAM) + sum(np.sum(tiers == d) for d in unified)  # noqa: E731
                        + problem.host_copies(tiers) + int(slots.sum())) * b
    room = (problem.ram_budget_bytes - ram_used()) // b
    for flat in order:
        if room <= 0:
            break
        r, e = divmod(int(flat), tiers.shape[1])
        if tiers[r, e] != TIER_DISK:
            continue
        tiers[r, e] = TIER_RAM
        room -= 1
        if not (tiers[r] == TIER_DISK).any() and slots[r] > 0:   # row left streaming: free its slots
            room += int(slots[r])
            slots[r] = 0
    for d, g in enumerate(res.gpus):  # cost-free experts (weight-0 rows, p = 0 on a used device) to VRAM
        if g.unified or problem.keep_host_copies:    # (a host copy would take RAM the pins may need)
            continue
        room = problem.gpu_capacity(d) - int(np.sum(tiers == d))
        for r in range(tiers.shape[0]):
            free_row = problem.weights[r] == 0
            cand = np.flatnonzero((tiers[r] == TIER_DISK) & (free_row | ((problem.probs[r] == 0)
                                                                          & (tiers[r] == d).any())))
            take = cand[: max(0, int(room))]
            tiers[r, take] = d
            room -= len(take)
            if not (tiers[r] == TIER_DISK).any():
                slots[r] = 0
    return tiers, slots


def _hot_first_fill(problem: Problem):
    """((tiers, slots), cost) of colibrì's hot-first fill; None if it breaks a budget (never returned)."""
    hot = _fill(problem, hot_first(problem)[0])
    try:
        validate_placement(problem, *hot)
    except SolverError:
        return None
    return hot, evaluate(problem, *hot)


def _solve_large(problem: Problem, miss: np.ndarray, time_limit_s: float):
    """The count-and-mass method (:mod:`colibri_plan.planner.aggregate`), never worse than hot-first."""
    from colibri_plan.planner.aggregate import place_large

    tiers, bound = place_large(problem, miss, time_limit_s)
    tiers, slots = _fill(problem, tiers)
    cost = evaluate(problem, tiers, slots)
    # safeguard: the realisation is a heuristic; never return worse than colibrì's hot-first fill
    hot = _hot_first_fill(problem)
    if hot is not None and hot[1]["decode_s_per_token"] < cost["decode_s_per_token"]:
        (tiers, slots), cost = hot
    total = cost["decode_s_per_token"]
    g = max(0.0, (total - (bound + problem.fixed_cost_s)) / total) if total > 0 else 0.0
    if problem.lru_slots.any():
        g = None        # the bound holds for fixed miss factors, not for the Che fixed point
    return tiers, slots, cost, "feasible (count-and-mass bound)", g


def solve_placement(problem: Problem, time_limit_s: float = DEFAULTS.time_limit_s, gap: float = 1e-9,
                    lru_iterations: int = 2, method: str = DEFAULTS.method) -> Solution:
    """Minimise expected decode seconds per token over placements within the budgets.

    ``method``: "exact" (expert-level MILP), "aggregate" (count-and-mass LP + realisation, with a certified
    gap; :mod:`colibri_plan.planner.aggregate`) or "auto" (exact up to EXACT_MAX_BINARIES binaries; when
    HiGHS stops at the time limit, the count-and-mass placement too, keeping the better).

    Returns a :class:`Solution` whose placement passed :func:`validate_placement`.

    Raises:
        BudgetError: nothing fits; SolverError: HiGHS failed or returned a placement breaking a budget.
    """
    t0 = time.perf_counter()
    miss = np.ones_like(problem.probs)
    best = None
    history = []
    n_bin = int(np.sum((problem.probs > 0) & (problem.weights[:, None] > 0))) * (len(problem.res.gpus) + 2)
    large = method == "aggregate" or (method == "auto" and n_bin > EXACT_MAX_BINARIES)
    for it in range(max(1, lru_iterations if problem.lru_slots.any() else 1)):
        found = None
        if not large:
            try:
                tiers, status, g, _ = _milp(problem, miss, time_limit_s, gap)
                tiers, slots = _fill(problem, tiers)
                found = (tiers, slots, evaluate(problem, tiers, slots), status, g)
            except SolverError:
                if method != "auto":
                    raise
            if method == "auto" and (found is None or found[3] != "optimal"):
                large = True            # HiGHS ran out of time: the count-and-mass method as well
        if large:
            agg = _solve_large(problem, miss, time_limit_s)
            if found is None or agg[2]["decode_s_per_token"] < found[2]["decode_s_per_token"]:
                found = agg
        tiers, slots, cost, status, g = found
        history.append({"iteration": it, "decode_s_per_token": cost["decode_s_per_token"], "status": status})
        if best is None or cost["decode_s_per_token"] < best[2]["decode_s_per_token"]:
            best = (tiers, slots, cost, status, g)
        for r in range(tiers.shape[0]):   # LRU hit rates of this disk set (trace or Che) for the next round
            miss[r] = 1.0 - lru_hit_rates(problem.probs[r], tiers[r] == TIER_DISK, int(slots[r]), r,
                                          problem.trace_hits)
    if problem.lru_slots.any():   # the Che fixed point is a heuristic: never worse than colibrì's fill
        hot = _hot_first_fill(problem)
        if hot is not None and hot[1]["decode_s_per_token"] < best[2]["decode_s_per_token"]:
            best = (*hot[0], hot[1], best[3], best[4])
    tiers, slots, cost, status, g = best
    validate_placement(problem, tiers, slots)
    name = ("HiGHS count-and-mass LP (cutting planes) + per-layer realisation"
            if status.startswith("feasible (count") else "HiGHS expert-level MILP (scipy.optimize.milp)")
    name += ", LRU hit-rate fixed point" if len(history) > 1 else ""
    return Solution(tiers=tiers, lru_slots=slots, cost=cost, status=status, gap=g,
                    seconds=time.perf_counter() - t0, method=name, iterations=history)


def validate_placement(problem: Problem, tiers: np.ndarray, lru_slots: np.ndarray) -> None:
    """Re-check a placement independently of the solver: shape, tier codes, every budget.

    Raises:
        SolverError: a tier code is invalid or a budget is exceeded (the message gives the bytes).
    """
    res, b = problem.res, problem.expert_bytes
    tiers = np.asarray(tiers)
    if tiers.shape != problem.probs.shape:
        raise SolverError(f"placement has shape {tiers.shape}, expected {problem.probs.shape}")
    ok = (tiers == TIER_RAM) | (tiers == TIER_DISK) | ((tiers >= 0) & (tiers < len(res.gpus)))
    if not ok.all():
        raise SolverError(f"placement has invalid tier codes {sorted(set(tiers[~ok].tolist()))}")
    if np.any(np.asarray(lru_slots) < 0):
        raise SolverError("negative LRU slot count")
    ram = (int(np.sum(tiers == TIER_RAM)) + int(np.sum(lru_slots)) + problem.host_copies(tiers)) * b
    for d, g in enumerate(res.gpus):
        n = int(np.sum(tiers == d))
        used = n * (b + (0 if g.unified else problem.vram_overhead_bytes))
        if g.unified:
            ram += used
        elif used > g.budget_bytes:
            raise SolverError(f"{g.key}: placement uses {used} B of VRAM ({n} experts of {b} B + "
                              f"{problem.vram_overhead_bytes} B overhead), budget {g.budget_bytes} B")
    if ram > problem.ram_budget_bytes:
        raise SolverError(f"placement uses {ram} B of RAM (pinned + LRU + unified GPU + host copies), budget "
                          f"{problem.ram_budget_bytes} B")
    streamed = (tiers == TIER_DISK) & (problem.probs > 0) & (problem.weights[:, None] > 0)
    if res.disk_read_gbps is None and streamed.any():
        raise SolverError("placement streams experts from disk but the profile has no disk figure")
