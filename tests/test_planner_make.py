"""planner/make: the warning for a synthesised heat says so once."""

from __future__ import annotations

from colibri_plan.model import load_model_spec
from colibri_plan.planner.make import heat_for
from colibri_plan.planner.options import SolveOptions


def test_synth_heat_warning_says_synthesised_once():
    spec = load_model_spec("glm-5.2")
    w = heat_for(spec, None).warnings[-1]
    assert w.lower().count("synthesised") == 1 and "--heat" in w


def test_profile_without_disk_says_so_unless_every_expert_fits_in_memory():
    import pytest
    from _solver_fixtures import toy_profile, toy_spec

    from colibri_plan.errors import BudgetError, InputError
    from colibri_plan.planner.make import make_plan

    spec = toy_spec(n_experts=64, hidden=2048, inter=1024)   # 192 experts of ~3 MB
    prof = toy_profile(disk_gbps=None)
    with pytest.raises((InputError, BudgetError), match=r"no disk measurement \(not measured") as err:
        make_plan(prof, spec, None, SolveOptions(ram="0.8", context_tokens=100, trunk="cpu"))
    assert "re-profile with `colibri-plan profile --path DIR`" in str(err.value)
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="4", context_tokens=100,
                                                          trunk="cpu"))   # all pinned: no disk needed
    assert plan.counts()["disk"] == 0
