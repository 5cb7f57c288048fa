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
