"""The solve / heat / plan / export commands end to end on a hand-made profile."""

import json

import pytest
from _solver_fixtures import write_toy_files
from click.testing import CliRunner

from colibri_plan.cli import cli


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_toy_files(tmp_path_factory.mktemp("cli"))


def run(*args):
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    return r


def test_solve_compare_json(files):
    r = run("solve", "--profile", files / "profile.json", "--model", files / "model.json", "--ram", "0.58",
            "--out", files / "plan.json", "--compare", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    names = [row["placement"] for row in doc["compare"]]
    assert names[:6] == ["colibri-plan (optimised)", "colibri hot-first", "colibri hot-first (DIRECT=0)",
                         "colibri hot-first (CUDA_DENSE=1 COLI_CUDA_ATTN=1)", "llama.cpp --fit layers",
                         "uniform"]
    ours = doc["compare"][0]["tok_s"]      # placements alone (all on our engine's knobs): ours is the best
    assert all(ours >= row["tok_s_our_engine"] * (1 - 1e-9) for row in doc["compare"][:6])
    assert doc["knobs"]["target"] == "colibri-plan" and all("knobs" in row for row in doc["compare"])
    assert doc["budgets"]["ram_mode"] == "0.58" and (files / "plan.json").is_file()


def test_solve_human_output_explains_budget(files):
    r = run("solve", "--profile", files / "profile.json", "--model", files / "model.json", "--context", "100",
            "-v")
    assert r.exit_code == 0, r.output
    for text in ("available memory", "headroom", "dense trunk", "KV cache (100 tokens", "working buffers",
                 "Predicted:", "Solver:"):
        assert text in r.stdout


def test_what_if_png(files):
    png = files / "ram.png"
    r = run("solve", "--profile", files / "profile.json", "--model", files / "model.json", "--what-if", "ram",
            "--png", png, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["what_if"]["rows"]
    assert len(rows) == 7 and rows[-1]["tok_s"] >= rows[0]["tok_s"]      # more RAM never predicts slower
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_inputs_exit_1_with_one_line(files, tmp_path):
    # a bad option value is a usage error (exit 2), like --time-limit 0
    r = run("solve", "--profile", files / "profile.json", "--model", files / "model.json", "--ram", "-3")
    assert r.exit_code == 2 and "--ram" in r.output and "negative" in r.output
    run("heat", "synth", "mixtral-8x7b", "--out", tmp_path / "mix.json")
    r = run("solve", "--profile", files / "profile.json", "--model", files / "model.json",
            "--heat", tmp_path / "mix.json")
    assert r.exit_code == 1 and "Error: " in r.output
    r = run("solve", "--profile", tmp_path / "nope.json", "--model", files / "model.json")
    assert r.exit_code == 1 and "not found" in r.output


def test_heat_commands(tmp_path):
    r = run("heat", "synth", "olmoe-1b-7b", "--out", tmp_path / "h.json", "--json")
    assert r.exit_code == 0, r.output
    r = run("heat", "convert", tmp_path / "h.json", tmp_path / "h.txt", "--to", "usage")
    assert r.exit_code == 0 and (tmp_path / "h.txt").read_text().startswith("-1 16 64")
    r = run("heat", "show", tmp_path / "h.txt", "--model", "olmoe-1b-7b", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["rows"] == 16 and doc["n_experts"] == 64 and doc["top_k"] == 8
    assert all(0.125 < row["top_k_share"] < 1 for row in doc["layers"])     # skewed, like OLMoE
    r = run("heat", "synth", "olmoe-1b-7b", "--uniform", "--out", tmp_path / "u.json")
    assert r.exit_code == 0 and "uniform" in r.stderr


def test_plan_show_and_exports(files, tmp_path):
    run("solve", "--profile", files / "profile.json", "--model", files / "model.json", "--ram", "0.58",
        "--out", tmp_path / "plan.json")
    r = run("plan", "show", tmp_path / "plan.json", "--layers", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["model"] == "toy-moe" and len(doc["layers"]) == 3
    r = run("plan", "show", tmp_path / "plan.json")
    assert "tok/s" in r.stdout
    r = run("export", tmp_path / "plan.json", "--to", "colibri", "--out", tmp_path / "x.coli_usage")
    assert r.exit_code == 0 and "PIN_GB=" in r.stdout and "CUDA_EXPERT_GB=" in r.stdout
    r = run("export", tmp_path / "plan.json", "--to", "llama.cpp", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["patterns"]
    (tmp_path / "broken.json").write_text("{")
    r = run("plan", "show", tmp_path / "broken.json")
    assert r.exit_code == 1 and "Error: " in r.output
