"""`calibrate --engine llama.cpp` on replay JSON, and `solve --target llama.cpp` / `export --to llama.cpp`.

The replays in tests/data are runs of bench/replay_llamacpp.py placements on a 2-core VM (AMD EPYC,
24 GB, cgroup v1 memory limit), trimmed to the fields the calibration reads, with the quick profiles the
replay took of the same machine; the model is the random 8-layer Qwen3-MoE of bench/peer_llamacpp.py:

* ``*-r3``: 3 interleaved llama-bench rounds per placement (pp512 / tg64): Q8_0 under a 4 GB limit and
  Q4_0 under 1.5 GB (both fit in RAM);
* the debug runs (one round, pp64 / tg16): Q4_0 under 4 GB and Q8_0 under 1.5 GB (1.84 GB of GGUF:
  llama.cpp's mmap faults).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli_fixtures import cli_run, refused
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.formats.profile import save_profile
from colibri_plan.model import save_model_spec
from colibri_plan.planner import llamacpp_calibrate as lc

DATA = Path(__file__).parent / "data"
Q4, Q8 = DATA / "replay-llamacpp-q4-4gb.json", DATA / "replay-llamacpp-q8-1.5gb.json"
R8, R4 = DATA / "replay-llamacpp-q8-4gb-r3.json", DATA / "replay-llamacpp-q4-1.5gb-r3.json"
PROFILES = ["--profile", DATA / "replay-profile-int4-g32.json", "--profile",
            DATA / "replay-profile-int8.json"]
MODEL = ["--model", DATA / "replay-qwen3-8l.spec.json"]


def _calibrate(tmp_path, *extra):
    return cli_run("calibrate", "--engine", "llama.cpp", Q4, Q8, *PROFILES, *MODEL, "--out",
                   tmp_path / "llc.json", *extra)


def test_calibrated_on_three_round_replays_every_placement_is_within_20_percent(tmp_path):
    r = cli_run("calibrate", "--engine", "llama.cpp", R8, R4, "--profile", PROFILES[3], "--profile",
                PROFILES[1], *MODEL, "--out", tmp_path / "r3.json", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = doc["detail"]["rows"]
    assert len(rows) == 16                                  # 8 placements x 2 replays
    for row in rows:
        for k in ("decode_tok_s", "prefill_tok_s"):
            assert abs(row[k]["predicted"] / row[k]["measured"] - 1) <= 0.2, (row["placement"], k, row[k])
    # --no-repack of Q4_0 (the CPU computes the file's layout, not the repacked one) is its own term
    # the file's own name, not its path: a checkout under /tmp/tmp.xxq4xx would match "q4" in both files
    def q4(x):
        return "q4" in Path(x["file"]).name

    slow = next(x for x in rows if x["placement"] == "no-repack" and q4(x))
    assert slow["decode_tok_s"]["measured"] < 0.7 * next(
        x for x in rows if x["placement"] == "default" and q4(x))["decode_tok_s"]["measured"]
    assert doc["coefficients"]["c_norepack"] > 0


def test_calibrate_fits_the_replays_and_predicts_the_rows_that_fit_in_ram_within_15_percent(tmp_path):
    r = _calibrate(tmp_path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    c = doc["coefficients"]
    # page faults under the cgroup cost more than the profile's O_DIRECT reads at depth 1 (readahead,
    # reclaim of the group's own pages): c_fault > 1; llama.cpp's Q4_0 CPU path beats our kernel's figure
    assert c["c_fault"] > 1.5 and 0.3 < c["c_cpu"] < 1.0
    assert len(c["fitted_on"]) == 2 and "2-core AMD EPYC" in c["fitted_on"][0]
    fits = [row for row in doc["detail"]["rows"] if "q4-4gb" in row["file"]]
    assert len(fits) == 7
    for row in fits:
        d = row["decode_tok_s"]
        assert abs(d["predicted"] / d["measured"] - 1) < 0.15, row
    coef = lc.load(tmp_path / "llc.json")                  # the document round-trips
    assert coef.c_fault == pytest.approx(c["c_fault"]) and coef.calibrated_on.startswith(str(Q4))


def test_calibrate_prints_measured_beside_predicted(tmp_path):
    r = _calibrate(tmp_path)
    assert r.exit_code == 0, r.output
    assert "decode tok/s measured / predicted" in r.stdout and "n-cpu-moe-4" in r.stdout
    assert "--llama-coefficients" in r.stdout


def test_calibrate_refuses_a_verify_report_and_a_wrong_count_of_profiles(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kind": "verify-report", "schema_version": 1}))
    refused(cli_run("calibrate", "--engine", "llama.cpp", bad, *MODEL, "--profile", PROFILES[1],
                    "--out", tmp_path / "o.json"), 1, "expected 'replay-llamacpp'")
    refused(cli_run("calibrate", "--engine", "llama.cpp", Q4, Q8, "--profile", PROFILES[1], "--profile",
                    PROFILES[1], "--profile", PROFILES[1], *MODEL, "--out", tmp_path / "o.json"),
            "once per replay")
    doc = json.loads(Q4.read_text())
    doc["placements"][0]["decode_tok_s"]["median"] = "fast"
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(doc))
    refused(cli_run("calibrate", "--engine", "llama.cpp", edited, "--profile", PROFILES[1], *MODEL,
                    "--out", tmp_path / "o.json"), 1, "decode_tok_s.median")
    assert not (tmp_path / "o.json").exists()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    save_profile(toy_profile(gpus=[{"gbps": 200.0, "free_bytes": 3 * 10**9}], ram_available_bytes=8 * 10**9),
                 d / "profile.json")
    save_model_spec(toy_spec(n_layers=8, moe_layers=range(8), n_experts=64, inter=512, hidden=512, vocab=4096,
                             dense_params=8_000_000), d / "model.json")
    return d


def _solve(toy, *extra):
    return cli_run("solve", "--profile", toy / "profile.json", "--model", toy / "model.json", "--ram", "1",
                   "--vram", "0.05", "--vram-reserve", "0", "--context", "256", "--trunk", "cpu",
                   "--heat", "synth", *extra)


def test_solve_target_llama_cpp_prints_its_pick_and_export_follows_it(toy, tmp_path):
    plan = tmp_path / "plan.json"
    r = _solve(toy, "--target", "llama.cpp", "--out", plan, "--json")
    assert r.exit_code == 0, r.output
    sec = json.loads(r.stdout)["llamacpp"]
    assert sec["verdict"] in ("use", "keep --fit") and sec["why"]
    assert sec["chosen"]["memory"]["gpu_total"] <= sec["budgets"]["vram_bytes"] == 50_000_000
    assert json.loads(plan.read_text())["llamacpp"] == sec
    ex = cli_run("export", plan, "--to", "llama.cpp", "--json")
    assert ex.exit_code == 0, ex.output
    out = json.loads(ex.stdout)
    assert out["verdict"] == sec["verdict"]
    if sec["verdict"] == "use":
        assert out["args"].startswith("-ngl ")
    else:
        assert out["args"] == "" and out["notes"][0].startswith("keep --fit")
    text = _solve(toy, "--target", "llama.cpp")
    assert f"llama.cpp (uncalibrated): {sec['verdict']}" in text.stdout
    # the per-engine table's llama.cpp row is that pick, at its predicted speed, with export's command
    row = json.loads(r.stdout)["engines"][2]
    assert row["engine"] == "llama.cpp" and row["tok_s"] == sec["chosen"]["decode_tok_s"]
    assert row["command"] == out["command"] and row["what"].startswith(f"{sec['verdict']}: its own placement")


def test_compare_rows_say_what_they_were_calibrated_on(toy, tmp_path):
    r = _calibrate(tmp_path)
    assert r.exit_code == 0, r.output
    res = _solve(toy, "--compare", "--llama-coefficients", tmp_path / "llc.json", "--json")
    assert res.exit_code == 0, res.output
    rows = {x["placement"]: x for x in json.loads(res.stdout)["compare"]}
    assert rows["colibri-plan (optimised)"]["calibrated_on"] == "uncalibrated"
    assert rows["llama.cpp --fit layers"]["calibrated_on"].startswith(str(Q4))
    text = _solve(toy, "--compare").stdout
    assert "Calibrated on: our cost model rows: uncalibrated; llama.cpp rows: uncalibrated" in text


def test_check_prices_a_replay_with_coefficients_fitted_on_another(tmp_path):
    """bench/replay_check.py's core: coefficients fitted on the Q8_0 replay, the Q4_0 replay priced with
    them and nothing refitted; in sample (the same file) it gives calibrate's own table."""
    from colibri_plan.model import load_model_spec

    coef, detail = lc.calibrate_replays([str(R8)], [str(PROFILES[3])], [str(MODEL[1])], load_model_spec)
    same = lc.check_replays([str(R8)], [str(PROFILES[3])], [str(MODEL[1])], load_model_spec, coef)
    assert same["rows"] == detail["rows"] and same["checked_with"] == list(coef.fitted_on)
    other = lc.check_replays([str(R4)], [str(PROFILES[1])], [str(MODEL[1])], load_model_spec, coef)
    assert len(other["rows"]) == 8 and other["rows"] != detail["rows"]
    assert all(r["file"] == str(R4) for r in other["rows"])
    refit, _ = lc.calibrate_replays([str(R4)], [str(PROFILES[1])], [str(MODEL[1])], load_model_spec)
    def numbers(c):
        return {k: v for k, v in c.to_dict().items() if k != "fitted_on"}
    assert numbers(refit) != numbers(coef)      # so the check above is not the Q4_0 replay's own fit
