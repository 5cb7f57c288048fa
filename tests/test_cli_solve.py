"""`colibri-plan solve`: budget options (ignored, out of range, not finite), coefficients from another
machine, --out never one of the inputs, the engine knobs and --compare's tables."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import (
    assert_one_line,
    cli_run,
    invoke,
    pack_and_profile,
    refused,
    report,
    same_bytes,
    solve,
    solve_json,
    write_reports,
)
from _solver_fixtures import toy_spec

from colibri_plan.model import load_model_spec
from colibri_plan.planner.knobs import COLIBRI_VRAM_OVERHEAD_BYTES


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "polish")


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


# ---- issue 16: the engine knobs (--target, --queue-depth, --keep-host-copies) and --compare's tables ----

def _good_solve(good, *extra):
    d, _, _ = good
    return cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                   "--context", "100", *extra)


def _good_json(good, *extra):
    r = _good_solve(good, "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)     # exactly one JSON document on stdout (json.loads refuses trailing text)


def test_target_colibri_counts_its_vram_overhead(good):
    ours, colibri = _good_json(good), _good_json(good, "--target", "colibri")
    assert ours["knobs"]["target"] == "colibri-plan" and ours["knobs"]["vram_overhead_bytes_per_expert"] == 0
    k = colibri["knobs"]
    assert k["target"] == "colibri" and k["vram_overhead_bytes_per_expert"] == COLIBRI_VRAM_OVERHEAD_BYTES
    b = colibri["counts"]
    per = toy_spec(n_experts=16, hidden=2048, inter=1024).expert_bytes() + COLIBRI_VRAM_OVERHEAD_BYTES
    assert b["cuda:0"] == colibri["budgets"]["vram_budget_bytes"]["cuda:0"] // per < ours["counts"]["cuda:0"]
    refused(_good_solve(good, "--target", "llama"), 2, "--target")


def test_keep_host_copies_keeps_them_and_charges_ram(good):
    released, kept = _good_json(good), _good_json(good, "--keep-host-copies")
    b = toy_spec(n_experts=16, hidden=2048, inter=1024).expert_bytes()
    c, k = kept["counts"], kept["knobs"]
    assert k["keep_host_copies"] is True and k["host_copy_bytes"] == c["cuda:0"] * b > 0
    assert (c["ram_pinned"] + c["lru_slots"] + c["cuda:0"]) * b <= kept["budgets"]["ram_budget_bytes"]
    assert c["ram_pinned"] < released["counts"]["ram_pinned"]          # the copies took pins' RAM
    assert released["knobs"]["keep_host_copies"] is False and released["knobs"]["host_copy_bytes"] == 0


def test_queue_depth_reaches_the_plan(files):
    auto, _ = solve_json(files, "--heat", "synth")                       # top-4: the depth-4 figure
    assert auto["knobs"]["queue_depth"] == 4 and auto["knobs"]["disk_read_gbps"] == 2.0
    one, _ = solve_json(files, "--heat", "synth", "--queue-depth", "1")
    assert one["knobs"]["queue_depth"] == 1 and one["knobs"]["disk_read_gbps"] == 1.0
    assert "--queue-depth 1" in one["knobs"]["queue_depth_source"]
    assert one["predicted"]["tok_s"] <= auto["predicted"]["tok_s"]
    for bad in ("0", "65", "x", "1.5"):
        refused(solve(files, "--queue-depth", bad), 2, "--queue-depth")


def test_compare_tables_show_every_row_and_knob(good):
    doc = _good_json(good, "--compare", "--trunk", "cpu")   # the GPU-trunk row: test_planner_trunk_cli.py
    names = [r["placement"] for r in doc["compare"]]
    assert names == ["colibri-plan (optimised)", "colibri hot-first", "colibri hot-first (DIRECT=0)",
                     "llama.cpp --fit layers", "uniform", "colibri-plan (host copies kept)",
                     "colibri DIRECT=0 (beyond --ram)", "llama.cpp (colibri-plan choice)"]
    r = _good_solve(good, "--compare", "--trunk", "cpu")
    assert r.exit_code == 0, r.output
    out = r.stdout
    tables = out[out.index("Predicted as each engine runs it"):]
    for col in ("tok/s", "ms/token", "disk MB/tok", "vs best baseline", "vs best (our engine)", "VRAM %",
                "pinned %", "LRU %", "disk %", "page cache %", "engine", "queue depth", "reads", "pins",
                "LRU slots", "host copies"):
        assert col in tables, col
    for name in names:
        assert tables.count(name + "  ") == 3, name           # a row in each of the three tables
    for engine in ("colibri (DIRECT=1)", "colibri (DIRECT=0)", "llama.cpp (mmap)", "buffered", "O_DIRECT"):
        assert engine in tables
    assert max(len(line) for line in tables.splitlines()) <= 110
    kept = next(line for line in tables.splitlines()[::-1] if line.startswith("colibri-plan (host copies"))
    assert kept.split()[-2:] != ["0.00", "GB"]                            # the kept row shows its copies


def test_solve_prints_the_knobs_lines(good):
    r = _good_solve(good, "--target", "colibri", "--keep-host-copies", "-v")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("Solver: "))
    knobs, lru, page = lines[i + 1: i + 4]
    assert knobs.startswith("Knobs: target colibri; O_DIRECT reads; VRAM overhead 0.741 MiB/expert; "
                            "host copies kept (0.0")
    assert "queue depth 1, disk 1.00 GB/s (colibrì reads at depth 1-2" in knobs
    assert lru == ("LRU model: Che (independent requests; no routing trace in the heat); slots auto: max 1, "
                   "mean 1.0")
    assert page.startswith("Page cache: could hold ") and page.endswith("; not used: O_DIRECT")


def test_compare_survives_a_failed_host_copy_resolve(good, monkeypatch):
    from colibri_plan.errors import SolverError
    from colibri_plan.planner import compare

    real = compare.compare_placements

    def failing(setup, sol, host_copy_toggle=True, **kw):
        if host_copy_toggle:
            raise SolverError("placement uses too much RAM")
        return real(setup, sol, host_copy_toggle=False, **kw)

    monkeypatch.setattr(compare, "compare_placements", failing)
    r = _good_solve(good, "--compare", "--json", "--trunk", "cpu")
    assert r.exit_code == 0, r.output
    # 5 baselines, the page-cache row apart and the llama.cpp pick (it beats --fit on this toy machine)
    assert len(json.loads(r.stdout)["compare"]) == 7
    assert "no row with the other --keep-host-copies setting (placement uses too much RAM)" in r.stderr


# ---- issue 16 follow-up: --repin-every / --repin-window write the plan's repin section ------------------

def test_repin_every_writes_the_section_and_verify_repins_token_exact(files, tmp_path):
    """A plan solved with --repin-every re-pins on the engine: verify is token-exact against the all-RAM
    reference and its report counts the swaps (pins from uniform heat, so the real routing moves them)."""
    plan = tmp_path / "repin.json"
    doc, r = solve_json(files, "--heat", "uniform", "--ram", "0.503", "--context", "100",
                        "--repin-every", "2", "--out", plan)
    assert doc["repin"] == {"enabled": True, "every_tokens": 2, "window_tokens": 8, "max_swaps": 4}
    assert doc["counts"]["ram_pinned"] > 0 and doc["counts"]["disk"] > 0
    assert json.loads(plan.read_text())["repin"] == doc["repin"]
    human = solve(files, "--ram", "0.503", "--context", "100", "--repin-every", "2", "--repin-window", "5",
                  "-v")
    assert "Re-pinning: every 2 tokens, window 5 tokens, at most 4 swaps per layer and round" in human.stdout
    v = invoke("verify", "--plan", plan, "--model", files / "fx", "--tokens", "12", "--json",
               "--report", tmp_path / "v.json")
    assert v.exit_code == 0, v.output
    rep = json.loads(v.stdout)
    assert rep["verdict"]["token_exact"] is True
    assert rep["measured"]["repins"] > 0 and rep["measured"]["repin_bytes"] > 0
    text = invoke("verify", "--plan", plan, "--model", files / "fx", "--tokens", "12", "--no-reference",
                  "--report", tmp_path / "v2.json")
    assert text.exit_code == 0, text.output
    assert "re-pins: " in text.stdout and " swaps, " in text.stdout


def test_repin_options_are_checked(files):
    off, _ = solve_json(files, "--ram", "0.503", "--context", "100", "--repin-every", "0")
    assert off["repin"] is None
    assert "Re-pinning: off" in solve(files, "--ram", "0.503", "--context", "100", "-v").stdout
    refused(solve(files, "--repin-window", "8"), 2, "--repin-window needs --repin-every")
    for opt, bad in (("--repin-every", "-1"), ("--repin-every", "x"), ("--repin-window", "0"),
                     ("--repin-every", "1000001")):
        refused(solve(files, opt, bad), 2, opt)


def test_compare_and_solve_show_where_host_tiers_are_computed(tmp_path):
    """A unified GPU (toy): solve --json carries compute/compute_explain, the human text prints them, and
    every --compare row says where its host tiers are computed (hot-first priced with the same choice)."""
    from _solver_fixtures import toy_profile

    from colibri_plan.formats.profile import save_profile
    from colibri_plan.model import save_model_spec

    save_profile(toy_profile(gpus=[{"gbps": 80.0, "free_bytes": 4 * 10**9, "unified": True}],
                             ram_available_bytes=3 * 10**9), tmp_path / "uni.json")
    save_model_spec(toy_spec(n_experts=16, hidden=2048, inter=1024), tmp_path / "model.json")
    args = ("solve", "--profile", tmp_path / "uni.json", "--model", tmp_path / "model.json", "--ram", "0.58",
            "--context", "100", "--compare")
    r = cli_run(*args, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["compute"]["ram_pinned"] == "cuda:0" and set(doc["compute_explain"]) == {"ram_pinned", "lru",
                                                                                       "disk"}
    for row in doc["compare"]:
        assert row["knobs"]["compute"] == {"ram_pinned": "cuda:0", "lru": "cpu", "disk": "cpu"}
        assert set(row["knobs"]["unified_experts"]) == {"cuda:0"}
    out = cli_run(*args, "-v").stdout
    assert "Compute: pinned on cuda:0, LRU hits on cpu, streamed on cpu" in out
    assert "host tiers on" in out and out.count("pin cuda:0, LRU cpu, miss cpu") == len(doc["compare"])


def test_solve_echoes_coefficients_readably_and_warns_about_missing_keys(tmp_path, good):
    from _cli_fixtures import coef_file

    d, _, _ = good
    f = coef_file(tmp_path, cpu_expert=1.33)
    doc = json.loads(f.read_text())
    del doc["coefficients"]["disk"]
    f.write_text(json.dumps(doc))
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                "--coefficients", f)
    assert r.exit_code == 0, r.output
    assert "cpu_expert 1.33" in r.stderr and "{" not in r.stderr
    assert "lacks disk: it takes its default value" in r.stderr
