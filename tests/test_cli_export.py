"""`colibri-plan export`: --out is written, never empty and never the plan it reads."""

from __future__ import annotations

import json
import shlex

import pytest
from _cli_fixtures import invoke, pack_and_profile, refused, same_bytes, solve_json


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "exportfiles", plan=True)


def test_export_llama_cpp_out_writes_the_command(files, tmp_path):
    if not (files / "plan.json").is_file():
        solve_json(files, "--ram", "1.5", "--out", files / "plan.json")
    gguf = tmp_path / "fx.gguf"
    r = invoke("export", files / "plan.json", "--to", "llama.cpp", "--out", tmp_path / "cmd.txt",
               "--gguf", gguf, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    line = (tmp_path / "cmd.txt").read_text()
    assert line == doc["command"] + "\n"
    words = shlex.split(line)       # pasteable: the shell reads it back as llama.cpp's own arguments
    assert words[:3] == ["llama-server", "-m", str(gguf)] and words[3:5] == ["-ngl", "0"]  # a CPU trunk
    assert "--tensor-split" not in words and words[5] == "-ot"
    assert words[6] == r"blk\.(0|1)\.ffn_(gate|up|down)_exps=CPU"
    # the prediction is of exactly these arguments: every layer through mmap, none pinned
    plan = json.loads((files / "plan.json").read_text())
    assert 0 < doc["predicted"]["tok_s"] and doc["predicted"]["tok_s"] != plan["predicted"]["tok_s"]
    human = invoke("export", files / "plan.json", "--to", "llama.cpp")
    assert human.stdout.splitlines()[0].startswith("llama-server -m /path/to/fx.gguf -ngl 0 -ot ")
    assert "# predicted " in human.stdout and "as this engine runs exactly these arguments" in human.stdout
    assert "replace /path/to/fx.gguf, or pass --gguf FILE" in human.stdout


def test_export_colibri_prints_the_full_line_with_absolute_paths(files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.json").write_bytes((files / "plan.json").read_bytes())
    r = invoke("export", "p.json", "--to", "colibri", "--colibri-model", "model-dir", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["vars"]["PIN"] == str(tmp_path / "p.coli_usage") and (tmp_path / "p.coli_usage").is_file()
    words = shlex.split(doc["command"])
    assert words[0] == f"COLI_MODEL={tmp_path / 'model-dir'}" and words[-2:] == ["./coli", "chat"]
    assert f"PIN={tmp_path / 'p.coli_usage'}" in words and "DIRECT=1" in words
    assert doc["predicted"]["tok_s"] > 0 and "vram_experts" not in doc


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
