"""planner.whatif.setup_from_plan: the what-if problem rebuilt from a plan file alone."""

from __future__ import annotations

import dataclasses

import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import InputError
from colibri_plan.formats.plan import Plan
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.whatif import setup_from_plan, what_if


def _plan(**profile_kw) -> tuple[Plan, object]:
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)
    plan, _, setup = make_plan(toy_profile(ram_available_bytes=3 * 10**9, **profile_kw), spec, None,
                               SolveOptions(ram="0.58", context_tokens=100, trunk="cpu"))
    return plan, setup


def test_rebuilt_problem_predicts_what_the_plan_predicts():
    plan, setup = _plan()
    rebuilt, notes = setup_from_plan(plan)
    assert notes == []
    ram_gb = plan.doc["budgets"]["ram_budget_bytes"] / 1e9
    [row] = what_if(rebuilt, "ram", values=[ram_gb])
    assert row["tok_s"] == pytest.approx(plan.doc["predicted"]["tok_s"], rel=1e-5)
    # the curves agree with the ones solve --what-if draws from the full setup (within a few %: the plan
    # stores probabilities to 6 significant digits, and the MILP may stop at another near-optimum)
    ours = what_if(rebuilt, "nvme")
    full = what_if(setup, "nvme")
    assert [r["value"] for r in ours] == pytest.approx([r["value"] for r in full])
    assert [r["tok_s"] for r in ours] == pytest.approx([r["tok_s"] for r in full], rel=0.05)


def test_a_discrete_gpu_is_noted():
    plan, _ = _plan(gpus=[{"gbps": 60.0, "free_bytes": 2_060_000_000}])
    setup, notes = setup_from_plan(plan)
    assert setup.res.gpus and "activation transfers" in notes[0]


def test_a_plan_without_what_it_needs_is_refused():
    plan, _ = _plan()
    doc = dict(plan.doc, layers=[{k: v for k, v in e.items() if k != "p"} for e in plan.doc["layers"]])
    with pytest.raises(InputError, match="selection probabilities"):
        setup_from_plan(dataclasses.replace(plan, doc=doc))
    doc = {k: v for k, v in plan.doc.items() if k != "resources"}
    with pytest.raises(InputError, match="resources"):
        setup_from_plan(Plan(doc))
    doc = dict(plan.doc, resources={**plan.doc["resources"], "cpu_matmul_gbps": -1.0})
    with pytest.raises(InputError, match="cannot be read back"):
        setup_from_plan(Plan(doc))
