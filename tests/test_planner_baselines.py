"""planner/baselines.py: every baseline placement stays within the plan's budgets, host copies or not.

Regression (issue 16 follow-up): ``hot_first`` ignored the RAM host copies take, so with tight RAM and
``--keep-host-copies`` it filled VRAM past what RAM could copy, and the solver's "never worse than
hot-first" safeguard then returned that invalid placement (``SolverError: placement uses ... of RAM``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import BudgetError
from colibri_plan.formats.plan import Plan, validate_plan
from colibri_plan.planner import solve as solve_mod
from colibri_plan.planner.baselines import BASELINES, hot_first
from colibri_plan.planner.make import build_setup, make_plan, plan_document
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.solve import solve_placement, validate_placement

_GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}
_SPEC = dict(n_experts=16, hidden=2048, inter=1024)


def _tight(keep: bool = True):
    prof = toy_profile(gpus=[_GPU], ram_available_bytes=3 * 10**9)
    opts = SolveOptions(ram="0.58", keep_host_copies=keep)
    return prof, toy_spec(**_SPEC), build_setup(prof, toy_spec(**_SPEC), None, opts)


def test_hot_first_counts_host_copies_against_ram():
    _, _, setup = _tight()
    pr = setup.problem
    tiers, slots = hot_first(pr)
    validate_placement(pr, tiers, slots)                      # raised SolverError before the fix
    ram = (int(np.sum(tiers == -1)) + int(slots.sum()) + pr.host_copies(tiers)) * pr.expert_bytes
    assert ram <= pr.ram_budget_bytes and pr.host_copies(tiers) > 0


def test_solve_with_host_copies_and_tight_ram():
    """The CLI case of the report: toy GPU profile, --ram 0.58, default --context 4096."""
    prof, spec, _ = _tight()
    plan, sol, setup = make_plan(prof, spec, None, SolveOptions(ram="0.58", keep_host_copies=True,
                                                                trunk="cpu"))
    validate_plan(plan)
    assert plan.doc["knobs"]["keep_host_copies"] is True and plan.counts()["cuda:0"] > 0


def test_safeguard_skips_an_invalid_hot_first(monkeypatch):
    """A baseline breaking a budget is never what the solver returns, however fast it prices."""
    _, _, setup = _tight()
    pr = setup.problem

    def overfull(problem, counts=None):
        return np.zeros_like(problem.probs, dtype=np.int64), np.zeros(len(problem.probs), dtype=np.int64)

    monkeypatch.setattr(solve_mod, "hot_first", overfull)
    for method in ("exact", "aggregate"):
        sol = solve_placement(pr, time_limit_s=5, method=method)
        validate_placement(pr, sol.tiers, sol.lru_slots)
    assert solve_mod._hot_first_fill(pr) is None


_GPUS = {"none": [], "one": [_GPU], "two": [_GPU, {"gbps": 30.0, "free_bytes": 1_100_000_000}],
         "unified": [{"gbps": 30.0, "free_bytes": 4 * 10**9, "unified": True}],
         "mixed": [_GPU, {"gbps": 30.0, "free_bytes": 4 * 10**9, "unified": True}]}


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("gpus", sorted(_GPUS))
def test_every_baseline_passes_validate_plan(gpus, keep):
    """Property over a grid of budgets: each baseline's plan passes the plan file's independent budget
    checks (validate_plan) with keep_host_copies on and off."""
    checked = 0
    for ram, context, slots in itertools.product(("0.2", "0.4", "0.58", "0.9", "1.6"), (100, 4096),
                                                 ("auto", "0", "3")):
        prof = toy_profile(gpus=_GPUS[gpus], ram_available_bytes=3 * 10**9)
        try:
            setup = build_setup(prof, toy_spec(**_SPEC), None, SolveOptions(ram=ram, context_tokens=context,
                                                                            lru_slots=slots,
                                                                            keep_host_copies=keep))
        except BudgetError:
            continue
        for name, fn in BASELINES.items():
            tiers, lru = fn(setup.problem)
            validate_placement(setup.problem, tiers, lru)
            plan = plan_document(setup, prof, tiers, lru, {"method": name})
            validate_plan(Plan(plan.doc), where=f"{name} ram {ram} slots {slots}")
            checked += 1
    assert checked >= 3 * 10
