"""`colibri-plan verify` and `calibrate`: a bad plan or report is refused in one line before any work,
the report is never the plan, warnings about what the reports can determine."""

from __future__ import annotations

import json
import math

import pytest
from _cli_fixtures import (
    assert_one_line,
    cli_run,
    edited,
    invoke,
    refused,
    report,
    same_bytes,
    write_raw_report,
    write_reports,
)


def test_verify_report_is_not_the_plan(toy, tiny_pack):
    plan = toy / "plan.json"
    before = plan.read_bytes()
    refused(invoke("verify", "--plan", plan, "--model", tiny_pack, "--report", plan), "is the input")
    refused(invoke("verify", "--plan", plan, "--model", tiny_pack, "--report", tiny_pack / "r.json"),
            "is inside the input")
    assert same_bytes(plan, before) and not (tiny_pack / "r.json").exists()


def test_verify_and_run_refuse_a_bad_plan_before_any_work(tmp_path, good):
    _, doc, _ = good
    f = edited(tmp_path, doc, "predicted.terms", None)
    # verify: no pack at all, the plan must be refused before anything looks for one
    assert_one_line(cli_run("verify", "--plan", f, "--model", tmp_path / "no-pack"), str(f),
                    "predicted.terms must be an object")
    # run: a tiny pack (of another model: the plan is refused before it is even compared with it)
    assert cli_run("model", "fixture", tmp_path / "pack", "--small", "--layers", "2", "--experts", "8",
                   "--top-k", "2").exit_code == 0
    r = cli_run("run", "--model", tmp_path / "pack", "--plan", f, "--prompt-ids", "1,2", "--tokens", "2")
    assert_one_line(r, str(f), "predicted.terms must be an object")


def test_two_unknowns_from_one_report_warn(tmp_path):
    paths = write_reports(tmp_path, report())
    r = cli_run("calibrate", *paths, "--out", tmp_path / "c.json")
    assert r.exit_code == 0, r.output
    assert "from these 1 report(s)" in r.stderr and "keep their base values" in r.stderr
    # two reports with different disk shares determine both: c_cpu 2, c_disk 0.5, no warning
    paths = write_reports(tmp_path, report(disk=0.0), report())
    r = cli_run("calibrate", *paths, "--out", tmp_path / "c.json", "--json")
    # (these reports' plans lack per-layer parts: only that warning, one per report, may appear)
    others = [ln for ln in r.stderr.splitlines() if "warning" in ln and "predates per-layer" not in ln]
    assert r.exit_code == 0 and not others, r.stderr
    c = json.loads(r.stdout)["coefficients"]
    assert c["cpu_expert"] == pytest.approx(2.0) and c["disk"] == pytest.approx(0.5)


@pytest.mark.parametrize("field, value", [("dense_s", -5), ("expert_wall_s", math.inf),
                                          ("disk_wait_s", math.nan)])
def test_bad_measured_time_is_a_format_error(tmp_path, field, value):
    rep = report()
    rep["measured"]["terms"][field] = value
    f = write_raw_report(tmp_path / "r.json", rep)
    r = cli_run("calibrate", f, "--out", tmp_path / "c.json")
    assert_one_line(r, f, f"measured.terms.{field} must be a finite number >= 0")
    assert not (tmp_path / "c.json").exists()


def test_mixed_models_refused_mixed_machines_and_duplicates_warn(tmp_path):
    paths = write_reports(tmp_path, report(model="m1"), report(model="m2", disk=0.0))
    assert_one_line(cli_run("calibrate", *paths, "--out", tmp_path / "c.json"), "different models",
                    paths[0], paths[1])
    paths = write_reports(tmp_path, report(machine="hostA"), report(machine="hostB", disk=0.0))
    r = cli_run("calibrate", *paths, "--out", tmp_path / "c.json")
    assert r.exit_code == 0 and "2 different machines" in r.stderr
    assert json.loads((tmp_path / "c.json").read_text())["machine_fingerprints"] == ["hostA", "hostB"]
    paths = write_reports(tmp_path, report(), report(disk=0.0))
    r = cli_run("calibrate", paths[0], paths[1], paths[0], "--out", tmp_path / "c.json")
    assert r.exit_code == 0 and "same report" in r.stderr
