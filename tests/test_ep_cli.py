"""`colibri-plan ep solve / show / export`: JSON documents, the per-layer table, and bad input refused
with one line before anything is written."""

import json

from click.testing import CliRunner

from colibri_plan.cli import cli


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_solve_show_export(tmp_path):
    out = tmp_path / "ep.json"
    r = invoke("ep", "solve", "--model", "olmoe-1b-7b", "--gpus", 16, "--redundant", 16, "--out", out,
               "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    s = data["summary"]
    assert s["balancedness"] >= s["eplb"]["balancedness"] and data["topology"]["nodes"] == 2
    assert s["sends_per_token"] > 0 and "synthesising" in r.stderr
    r = invoke("ep", "show", out, "--layers")
    assert r.exit_code == 0, r.output
    rows = [ln for ln in r.stdout.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert len(rows) == 16 and "DeepSeek eplb (global)" in r.stdout
    shown = json.loads(invoke("ep", "show", out, "--json", "--layers").stdout)
    assert [x["layer"] for x in shown["layers"]] == list(range(16)) and "physical_to_logical" not in \
        shown["layers"][0]
    for target in ("sglang", "sglang-count", "vllm", "eplb"):
        r = invoke("ep", "export", out, "--to", target, "--out", tmp_path / f"{target}.json", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["target"] == target
    sg = json.loads((tmp_path / "sglang.json").read_text())["physical_to_logical_map"]
    assert len(sg) == 16 and len(sg[0]) == 80


def _one_line(r, *words):
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: ")]
    assert len(err) == 1 and all(w in err[0] for w in words), r.stderr


def test_bad_input_is_refused_with_one_line(tmp_path):
    out = tmp_path / "ep.json"
    _one_line(invoke("ep", "solve", "--model", "deepseek-v3", "--gpus", 300, "--out", out),
              "300 GPUs but only 256 expert slots")
    _one_line(invoke("ep", "solve", "--model", "deepseek-v3", "--gpus", 64, "--redundant", -1, "--out", out),
              "redundant slots must be >= 0")
    heat = tmp_path / "olmoe.json"
    assert invoke("heat", "synth", "olmoe-1b-7b", "--out", heat).exit_code == 0
    _one_line(invoke("ep", "solve", "--model", "deepseek-v3", "--gpus", 8, "--heat", heat, "--out", out),
              "not deepseek-v3")
    _one_line(invoke("ep", "solve", "--model", "deepseek-v3", "--gpus", 8, "--redundant", 64, "--quant",
                     "int8", "--gpu-memory-gb", 80, "--out", out), "holds 31")
    assert not out.exists()
