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


BAD_SECTIONS = [("comparison", "oops"), ("comparison", [1, 2]), ("comparison", {"a": 1}),
                ("comparison", [{"term": "tok/s", "unit": "s", "predicted": "x", "measured": 1.0}]),
                ("comparison", [{"term": "t", "unit": ["s"], "predicted": 1.0}]),
                ("comparison", [{"term": "t", "predicted": float("inf")}]),
                ("comparison", [{"term": "t", "diff_points": "x"}]),
                ("verdict", {"tok_s_ratio": "x"}), ("verdict", {"token_exact": [1]}),
                ("verdict", {"ok": "yes"}), ("verdict", {"hit_rate_diff_points": None}),
                ("settings", "x"), ("machine", "x"), ("model", "x"), ("model", {"fingerprint": 3})]


@pytest.mark.parametrize("section, value", BAD_SECTIONS)
def test_wrongly_typed_sections_are_one_format_error(tmp_path, section, value):
    rep = toy_report()
    rep[section] = value
    (tmp_path / "r.json").write_text(json.dumps(rep))
    with pytest.raises(FormatError, match=f"{section}.*re-run `colibri-plan verify`"):
        load_report(tmp_path / "r.json")


def test_well_typed_sections_are_accepted(tmp_path):
    rep = toy_report()
    rep["comparison"] = [{"term": "tok/s", "unit": "tok/s", "predicted": 1.0, "measured": None,
                          "ratio": None},
                         {"term": "share disk", "unit": "share", "predicted": 0.5, "measured": 0.4,
                          "diff_points": -10.0}]
    rep["verdict"] = {"ok": False, "token_exact": None, "tok_s_ratio": None, "hit_rate_diff_points": -1.5}
    rep["settings"] = {"tokens": 4}
    (tmp_path / "r.json").write_text(json.dumps(rep))
    assert load_report(tmp_path / "r.json")["verdict"]["ok"] is False


BAD_PREFILL = [("verdict", "prefill_ratio", -2.0, "verdict.prefill_ratio must be a finite number >= 0"),
               ("verdict", "tok_s_ratio", -0.5, "verdict.tok_s_ratio must be a finite number >= 0 or null"),
               ("verdict", "prefill_ok", "yes", "verdict.prefill_ok must be true, false or null"),
               ("measured", "prefill_s", "slow", "measured.prefill_s must be a finite number >= 0"),
               ("measured", "prefill_s", -1.0, "measured.prefill_s must be a finite number >= 0"),
               ("measured", "prompt_tokens", -4, "measured.prompt_tokens must be a whole number >= 1"),
               ("measured", "prompt_tokens", 0, "measured.prompt_tokens must be a whole number >= 1 or null"),
               ("measured", "prompt_tokens", 8.5, "measured.prompt_tokens must be a whole number >= 1"),
               ("measured", "prompt_tokens", True, "measured.prompt_tokens must be a whole number >= 1")]


@pytest.mark.parametrize("section, key, value, message", BAD_PREFILL)
def test_bad_prefill_figures_are_one_format_error(tmp_path, section, key, value, message):
    rep = toy_report()
    rep[section][key] = value
    (tmp_path / "r.json").write_text(json.dumps(rep))
    with pytest.raises(FormatError) as exc:
        load_report(tmp_path / "r.json")
    assert message in str(exc.value) and "re-run `colibri-plan verify`" in str(exc.value)


def test_prefill_figures_in_range_or_null_are_accepted(tmp_path):
    rep = toy_report()
    rep["measured"].update(prefill_s=0.25, prompt_tokens=64)
    rep["verdict"].update(prefill_ratio=0.48, prefill_ok=False)
    (tmp_path / "r.json").write_text(json.dumps(rep))
    doc = load_report(tmp_path / "r.json")
    assert doc["measured"]["prompt_tokens"] == 64 and doc["verdict"]["prefill_ratio"] == 0.48
    rep["measured"].update(prefill_s=None, prompt_tokens=None)
    rep["verdict"].update(prefill_ratio=None, prefill_ok=None)
    (tmp_path / "r.json").write_text(json.dumps(rep))
    assert load_report(tmp_path / "r.json")["verdict"]["prefill_ratio"] is None


#: a prefill of 64 tokens: 0.5 s in the expert layers (0.3 s cpu compute, 0.1 s waiting for the disk),
#: 4 reads of 1 MB
PREFILL_TERMS = {"experts_s": 0.5, "expert_compute_s": {"cpu": 0.3}, "disk_wait_s": 0.1, "disk_read_s": 0.2,
                 "disk_busy_s": 0.15, "disk_bytes": 4_000_000,
                 "hit_rate": {"vram": 0.0, "ram_pinned": 0.75, "lru": 0.0, "disk": 0.25}}


def test_prefill_terms_round_trip_through_a_report_file(tmp_path):
    from colibri_plan.formats.report import RunReport, save_report

    run = RunReport(tok_s=2.0, decode_s_per_token=0.5, prefill_s=0.8, prompt_tokens=64,
                    prefill_terms=PREFILL_TERMS)
    measured = run.to_dict()
    assert measured["prefill_terms"] == PREFILL_TERMS and "prefill_terms" not in measured["terms"]
    rep = toy_report()
    rep["measured"] = measured
    doc = load_report(save_report(rep, tmp_path / "r.verify.json"))
    back = RunReport.from_dict(doc["measured"], "r", "measured")
    assert back.prefill_terms == PREFILL_TERMS and back.prefill_s == 0.8


def test_a_report_written_before_prefill_terms_still_loads(tmp_path):
    from colibri_plan.formats.report import SCHEMA_VERSION, RunReport

    rep = toy_report()                                   # a version-2 report without prefill_terms
    assert SCHEMA_VERSION == 2 and "prefill_terms" not in rep["measured"]
    (tmp_path / "r.json").write_text(json.dumps(rep))
    doc = load_report(tmp_path / "r.json")
    assert RunReport.from_dict(doc["measured"], "r", "measured").prefill_terms is None


BAD_PREFILL_TERMS = [("experts_s", -0.5, "measured.prefill_terms.experts_s must be a finite number >= 0"),
                     ("disk_wait_s", "slow", "measured.prefill_terms.disk_wait_s must be a finite number"),
                     ("expert_compute_s", {"cpu": float("inf")},
                      "measured.prefill_terms.expert_compute_s.cpu must be a finite number"),
                     ("expert_compute_s", [0.3], "measured.prefill_terms.expert_compute_s must map devices"),
                     ("expert_compute_s", [], "measured.prefill_terms.expert_compute_s must map devices"),
                     ("disk_bytes", -1, "measured.prefill_terms.disk_bytes must be a finite number >= 0"),
                     ("hit_rate", {"disk": 1.5}, "measured.prefill_terms.hit_rate must map vram")]


@pytest.mark.parametrize("key, value, message", BAD_PREFILL_TERMS)
def test_bad_prefill_terms_are_one_format_error(tmp_path, key, value, message):
    rep = toy_report()
    rep["measured"]["prefill_terms"] = dict(PREFILL_TERMS, **{key: value})
    (tmp_path / "r.json").write_text(json.dumps(rep))
    with pytest.raises(FormatError) as exc:
        load_report(tmp_path / "r.json")
    assert message in str(exc.value) and "re-run `colibri-plan verify`" in str(exc.value)
    rep["measured"]["prefill_terms"] = "fast"
    (tmp_path / "r.json").write_text(json.dumps(rep))
    with pytest.raises(FormatError, match="measured.prefill_terms must be an object or null"):
        load_report(tmp_path / "r.json")
