"""`colibri-plan solve`: budget options (ignored, out of range, not finite), coefficients from another
machine, --out never one of the inputs."""

from __future__ import annotations

import pytest
from _cli_fixtures import (
    assert_one_line,
    cli_run,
    good_plan,
    invoke,
    pack_and_profile,
    refused,
    report,
    same_bytes,
    solve,
    solve_json,
    toy_plan,
    write_reports,
)

from colibri_plan.model import load_model_spec


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "polish")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A folder with a toy profile, model spec and a plan solved from them (and the plan's document)."""
    return good_plan(tmp_path_factory)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A profile, a model spec and a plan solved from them."""
    return toy_plan(tmp_path_factory)


def test_solve_on_a_pack_budgets_the_f32_trunk_without_dense_format(files):
    spec = load_model_spec(files / "fx")
    doc, _ = solve_json(files, "--ram", "1.5")
    lines = {e["what"]: e["bytes"] for e in doc["budgets"]["explain"]}
    assert lines["dense trunk (f32)"] == -4 * spec.dense_params
    explicit, _ = solve_json(files, "--ram", "1.5", "--dense-format", "f32")
    assert explicit["budgets"] == doc["budgets"] and explicit["counts"] == doc["counts"]
    int4, _ = solve_json(files, "--ram", "1.5", "--dense-format", "int4")   # an explicit choice still wins
    assert int4["budgets"]["dense_bytes"] == spec.dense_bytes("int4") < doc["budgets"]["dense_bytes"]


def test_headroom_with_a_fixed_ram_budget_warns(files):
    doc, r = solve_json(files, "--ram", "1.5", "--headroom", "3")
    assert any("--headroom 3 does not apply" in w for w in doc["warnings"])
    assert doc["budgets"]["headroom_bytes"] == 0
    auto, _ = solve_json(files, "--headroom", "3")
    assert not any("--headroom" in w for w in auto["warnings"]) and auto["budgets"]["headroom_bytes"] == 3e9


@pytest.mark.parametrize("vram", ["80", "1,2"])
def test_vram_on_a_profile_without_gpu_is_refused_whatever_the_count(files, vram):
    r = invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", "--vram", vram)
    assert r.exit_code == 1 and "--vram" in r.output
    if vram == "80":
        assert "no GPU" in r.output


def test_vram_zero_without_gpu_is_accepted(files):
    doc, _ = solve_json(files, "--vram", "0")
    assert doc["budgets"]["vram_budget_bytes"] == {}


@pytest.mark.parametrize("option", [("--ram", "x"), ("--vram", "-1"), ("--headroom", "abc"),
                                    ("--lru-slots", "q")])
def test_bad_budget_option_values_exit_2(files, option):
    r = invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", *option)
    assert r.exit_code == 2 and option[0] in r.output


def test_memory_figures_beyond_any_machine(files):
    refused(solve(files, "--ram", "auto", "--headroom", "1e300"), 2, "--headroom", "beyond any machine")
    refused(solve(files, "--ram", "1e300"), 2, "--ram", "beyond any machine")
    refused(solve(files, "--ram", "0.515", "--context", "9999999"), 1,
            "too small for --context 9999999 tokens", "0.515 GB")
    refused(solve(files, "--context", "99999999999999"), 2, "--context")


def test_small_budgets_keep_their_digits(files):
    r = solve(files, "--ram", "0.005", "--context", "0")
    refused(r, 1, "0.005 GB")
    assert "0.01 GB" not in r.output


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_seed_range(files, tmp_path, seed):
    refused(solve(files, "--seed", seed), 2, "--seed")
    refused(invoke("heat", "synth", files / "fx", "--out", tmp_path / "h.json", "--seed", seed), 2, "--seed")
    refused(invoke("model", "fixture", "--small", tmp_path / "fx", "--seed", seed), 2, "--seed")
    assert not (tmp_path / "h.json").exists() and not (tmp_path / "fx").exists()


@pytest.mark.parametrize("flag", ["--heat", "--profile", "--coefficients"])
def test_solve_out_is_not_an_input(toy, tmp_path, flag):
    src = tmp_path / "in.json"
    src.write_text('{"precious": 1}')
    args = {"--profile": toy / "profile.json", "--heat": "uniform", "--coefficients": None, flag: src}
    cmd = ["solve", "--model", toy / "model.json", "--out", src]
    for k, v in args.items():
        if v is not None:
            cmd += [k, v]
    refused(invoke(*cmd), "is the input")
    assert same_bytes(src, b'{"precious": 1}')


def test_solve_warns_when_coefficients_come_from_another_machine(tmp_path, good):
    d, _, prof = good
    out = tmp_path / "c.json"
    paths = write_reports(tmp_path, report(machine="elsewhere"), report(machine="elsewhere", disk=0.0))
    assert cli_run("calibrate", *paths, "--out", out).exit_code == 0
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                "--coefficients", out)
    assert r.exit_code == 0, r.output
    assert "fitted on machine(s) elsewhere" in r.stderr and prof.fingerprint in r.stderr
    paths = write_reports(tmp_path, report(machine=prof.fingerprint), report(machine=prof.fingerprint,
                                                                              disk=0.0))
    assert cli_run("calibrate", *paths, "--out", out).exit_code == 0
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                "--coefficients", out)
    assert r.exit_code == 0 and "fitted on machine" not in r.stderr


@pytest.mark.parametrize("option, value", [("--vram-reserve", "nan"), ("--vram-reserve", "inf"),
                                           ("--time-limit", "nan"), ("--time-limit", "inf")])
def test_solve_refuses_non_finite_options(good, option, value):
    d, _, _ = good
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                option, value)
    assert_one_line(r, f"{option} must be a finite number")
