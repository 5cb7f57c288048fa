"""`colibri-plan report PLAN [VERIFY...] --out report.html`: the page, its --json summary, refusals."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke, pack_and_profile, refused


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """A small fixture pack, a toy profile, a plan and a verify report of it."""
    d = pack_and_profile(tmp_path_factory, "clireport", plan=True)
    r = invoke("verify", "--plan", d / "plan.json", "--model", d / "fx", "--tokens", "1", "--no-reference",
               "--report", d / "v.json")
    assert r.exit_code == 0, r.output
    return d


def test_report_writes_the_page_and_says_where(planned, tmp_path):
    out = tmp_path / "report.html"
    r = invoke("report", planned / "plan.json", planned / "v.json", "--out", out, "--time-limit", "5")
    assert r.exit_code == 0, r.output
    assert f"wrote {out}" in r.stdout and "needs no network" in r.stdout
    assert "report 5/5" in r.stderr  # progress on stderr, one line per counted step in a log
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and "v.json" in text and "What-if" in text


def test_report_json_is_one_document(planned, tmp_path):
    out = tmp_path / "r.html"
    r = invoke("report", planned / "plan.json", "--out", out, "--no-what-if", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["out"] == str(out) and doc["verify_reports"] == [] and doc["what_if"] is False
    assert doc["bytes"] == out.stat().st_size


def test_report_refuses_bad_inputs_with_typed_errors(planned, tmp_path):
    out = tmp_path / "r.html"
    refused(invoke("report", tmp_path / "nope.json", "--out", out), "nope.json", "does not exist")
    r = invoke("report", planned / "plan.json", planned / "plan.json", "--out", out)  # a plan as VERIFY
    assert r.exit_code == 1 and "Error: " in r.output and "Traceback" not in r.output
    (tmp_path / "junk.json").write_text("[1, 2")
    r = invoke("report", tmp_path / "junk.json", "--out", out)
    assert r.exit_code == 1 and "Error: " in r.output
    assert not out.exists()


def test_report_never_writes_over_an_input(planned):
    before = (planned / "plan.json").read_bytes()
    r = invoke("report", planned / "plan.json", "--out", planned / "plan.json")
    assert r.exit_code == 1 and r.output.count("Error: ") == 1 and "InputError" not in r.output
    assert (planned / "plan.json").read_bytes() == before


def test_report_option_errors_are_usage_errors(planned, tmp_path):
    r = invoke("report", planned / "plan.json", "--out", tmp_path / "r.html", "--time-limit", "0")
    assert r.exit_code == 2
    r = invoke("report", planned / "plan.json")
    assert r.exit_code == 2 and "--out" in r.output
