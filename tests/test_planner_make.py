"""planner/make: the warning for a synthesised heat says so once."""

from __future__ import annotations

from colibri_plan.model import load_model_spec
from colibri_plan.planner.make import heat_for


def test_synth_heat_warning_says_synthesised_once():
    spec = load_model_spec("glm-5.2")
    w = heat_for(spec, None).warnings[-1]
    assert w.lower().count("synthesised") == 1 and "--heat" in w
