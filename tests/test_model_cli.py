"""`colibri-plan model show/list` through click's test runner."""

import json

from click.testing import CliRunner

from colibri_plan.cli import cli


def _run(*args):
    return CliRunner().invoke(cli, list(args))


def test_help_lists_commands():
    r = _run("--help")
    assert r.exit_code == 0
    for name in ("profile", "solve", "run", "model", "heat", "plan", "export", "verify", "backends"):
        assert name in r.output


def test_show_glm52_json():
    r = _run("model", "show", "glm-5.2", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["n_routed_experts"] == 19_456
    assert doc["by_format"]["int4"]["expert_bytes"] == 18_915_328
    assert doc["by_format"]["int4-g64"]["expert_bytes"] == 21_233_664
    assert doc["expert_format"] == "int4" and doc["expert_bytes"] == 18_915_328
    assert doc["mtp_layers"] == [78] and doc["kv_bytes_per_token"] == 296_704


def test_show_quant_and_global_json_flag():
    r = _run("--json", "model", "show", "glm-5.2", "--quant", "int4-g64")
    doc = json.loads(r.output)
    assert doc["expert_format"] == "int4-g64" and doc["expert_bytes"] == 21_233_664
    assert doc["cold_bytes_per_token"] == 75 * 8 * 21_233_664


def test_show_json_is_a_spec_file(tmp_path):
    out = tmp_path / "mixtral.json"
    out.write_text(_run("model", "show", "mixtral-8x7b", "--json").output)
    r = _run("model", "show", str(out), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["n_routed_experts"] == 32 * 8


def test_show_human_table():
    r = _run("model", "show", "glm-5.2")
    assert r.exit_code == 0
    assert "19,456 in all" in r.output and "18,915,328" in r.output and "21,233,664" in r.output
    assert "3..77 + 1 MTP row(s) (id 78)" in r.output


def test_errors_are_one_line_exit_1():
    r = _run("model", "show", "no-such-model")
    assert r.exit_code == 1
    assert "Error: " in r.output and "known models" in r.output and "Traceback" not in r.output
    r = _run("model", "show", "glm-5.2", "--quant", "int5")
    assert r.exit_code == 1 and "Error: " in r.output


def test_list():
    r = _run("model", "list", "--json")
    names = [m["name"] for m in json.loads(r.output)["models"]]
    assert "glm-5.2" in names and "kimi-k2" in names and len(names) >= 22
