"""formats/report: verify-report figures are checked without tracebacks (issue 17)."""

from __future__ import annotations

import json

import pytest
from _reports import toy_report

from colibri_plan.errors import FormatError
from colibri_plan.formats.report import check_figures, load_report


@pytest.mark.parametrize("value", [2**64, 10**400, float("inf"), -1, "1", None, True])
def test_bad_figures_are_format_errors(value):
    with pytest.raises(FormatError, match="decode_s_per_token"):
        check_figures({"decode_s_per_token": value, "tok_s": 1.0, "terms": {}}, "r", "measured")
    if value is not None:  # a null term is "not measured"
        with pytest.raises(FormatError, match="terms.dense_s"):
            check_figures({"decode_s_per_token": 1.0, "tok_s": 1.0, "terms": {"dense_s": value}}, "r", "m")


@pytest.mark.parametrize("value", [2**64, 10**400])
def test_a_report_file_with_a_huge_integer_is_refused(tmp_path, value):
    rep = toy_report()
    rep["measured"]["terms"]["disk_wait_s"] = value
    (tmp_path / "r.verify.json").write_text(json.dumps(rep))
    with pytest.raises(FormatError, match="disk_wait_s|larger than any field"):
        load_report(tmp_path / "r.verify.json")
