"""planner/calibrate: fitting coefficients from verify reports (bad reports, terms fitted to 0)."""

from __future__ import annotations

import pytest
from _cli_fixtures import report

from colibri_plan.errors import FormatError
from colibri_plan.planner.calibrate import fit_coefficients


def test_string_coefficients_in_a_report_name_the_report(tmp_path):
    rep = report()
    rep["plan"]["coefficients"] = "x"
    with pytest.raises(FormatError, match=r"r\.json: plan\.coefficients must be an object"):
        fit_coefficients([rep], names=["r.json"])


def test_coefficient_fitted_to_zero_warns():
    reps = [report(disk=0.0), report(cpu=0.1)]
    for rep in reps:
        rep["measured"]["terms"]["dense_s"] = 0.01      # all of it is attention: c_dense fits to 0
    _, detail = fit_coefficients(reps)
    assert any("dense fitted to 0" in w for w in detail["warnings"])


def _run_of(rep: dict, scale: float) -> dict:
    """Another verify run of the same plan (same predicted section), measuring ``scale`` x the time."""
    import copy

    out = copy.deepcopy(rep)
    t = out["measured"]["terms"]
    t["expert_layers_s"] *= scale
    t["expert_compute_s"]["cpu"] *= scale
    return out


@pytest.mark.parametrize("n_runs", [1, 2, 3])
def test_reports_of_one_placement_cannot_fit_cpu_and_disk(n_runs):
    from colibri_plan.formats.coefficients import Coefficients

    one = report(cpu=0.2, disk=0.3)
    reps = [_run_of(one, 1.0 + 0.3 * i) for i in range(n_runs)]   # e.g. 16 and 4 tokens of one plan
    base = Coefficients(cpu_expert=1.2, disk=0.9)
    c, detail = fit_coefficients(reps, base=base)
    assert (c.cpu_expert, c.disk) == (1.2, 0.9)                    # under-determined: base values kept
    assert not detail["cpu_expert"]["fitted"] and not detail["disk"]["fitted"]
    assert any("one report cannot tell them apart" in w for w in detail["warnings"])


def test_nearly_proportional_reports_warn_and_distinct_shares_fit():
    from colibri_plan.planner.calibrate import design_rank, report_terms

    a, b = report(cpu=0.2, disk=0.3), report(cpu=0.2, disk=0.3001)
    assert design_rank([report_terms(r) for r in (a, b)]) == 1
    _, detail = fit_coefficients([a, b])
    assert any("cannot tell them apart" in w for w in detail["warnings"])
    c = report(cpu=0.2, disk=0.0)
    assert design_rank([report_terms(r) for r in (a, c)]) == 2
    _, detail = fit_coefficients([a, c])
    assert detail["cpu_expert"]["fitted"] and detail["disk"]["fitted"]
    assert not any("cannot tell them apart" in w for w in detail["warnings"])
