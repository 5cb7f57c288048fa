"""`colibri-plan export`: --out is written, never empty and never the plan it reads."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke, pack_and_profile, refused, same_bytes, solve_json


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "exportfiles", plan=True)


def test_export_llama_cpp_out_writes_the_args(files, tmp_path):
    if not (files / "plan.json").is_file():
        solve_json(files, "--ram", "1.5", "--out", files / "plan.json")
    r = invoke("export", files / "plan.json", "--to", "llama.cpp", "--out", tmp_path / "ot.txt", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (tmp_path / "ot.txt").read_text() == doc["args"] + "\n" and doc["args"].startswith("-ot ")


def test_empty_output_names_refused(files):
    before = sorted(p.name for p in files.iterdir())
    refused(invoke("export", files / "plan.json", "--to", "colibri", "--out", ""), 1, "output path is empty")
    refused(invoke("export", files / "plan.json", "--to", "llama.cpp", "--out", ""), 1,
            "output path is empty")
    refused(invoke("verify", "--plan", files / "plan.json", "--model", files / "fx", "--report", ""), 1,
            "output path is empty")
    assert sorted(p.name for p in files.iterdir()) == before   # no default file written instead


def test_export_and_calibrate_do_not_overwrite_their_input(toy, tmp_path):
    plan = toy / "plan.json"
    before = plan.read_bytes()
    for target in ("colibri", "llama.cpp"):
        refused(invoke("export", plan, "--to", target, "--out", plan), "is the input")
    assert same_bytes(plan, before)
    rep = tmp_path / "r.json"
    rep.write_text("{}")
    refused(invoke("calibrate", rep, "--out", rep), "is the input")
    refused(invoke("calibrate", rep, "--base", plan, "--out", plan), "is the input")
    assert rep.read_text() == "{}" and same_bytes(plan, before)
