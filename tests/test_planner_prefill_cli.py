"""`solve --prompt-tokens`, `plan show` and verify's comparison with the plan's predicted prefill."""

import dataclasses
import json

import pytest
from _solver_fixtures import write_toy_files
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.formats.plan import load_plan, save_plan
from colibri_plan.formats.report import RunReport
from colibri_plan.planner.prefill import prefill_for_plan
from colibri_plan.verify import compare, make_verdict, predicted_prefill_at, report_table, verdict_line


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_toy_files(tmp_path_factory.mktemp("prefill"))


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def solve(files, *extra):
    return run("solve", "--profile", files / "profile.json", "--model", files / "model.json", "--ram", "0.58",
               *extra)


def test_solve_json_records_prefill(files):
    r = solve(files, "--prompt-tokens", 64, "--out", files / "plan.json", "--json")
    assert r.exit_code == 0, r.output
    pre = json.loads(r.stdout)["predicted"]["prefill"]
    assert pre["prompt_tokens"] == 64 and pre["ttft_s"] == pre["prefill_s"] > 0
    assert pre["prefill_tok_s"] == pytest.approx(64 / pre["prefill_s"])
    t = pre["terms"]
    assert pre["prefill_s"] == pytest.approx(t["experts_s"] + t["dense_s"] + t["lm_head_s"]
                                             + t["attention_s"] + t["handoff_s"])
    # the toy profile has no 16-token matmul figure: no batching gain, each expert row costs a full read
    assert pre["figures"]["cpu"]["r"] == 16.0
    doc = load_plan(files / "plan.json").doc
    again = prefill_for_plan(doc, 64)            # from the plan's own figures: the same prediction
    assert again["prefill_s"] == pytest.approx(pre["prefill_s"], rel=1e-4)
    curve = dict((n, s) for n, s in pre["curve"])
    assert curve[64] == pytest.approx(pre["prefill_s"], rel=1e-9)
    assert all(a[1] < b[1] for a, b in zip(pre["curve"], pre["curve"][1:]))   # longer prompts take longer


def test_solve_human_and_default_length(files):
    r = solve(files, "-v")
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if x.startswith("Time to first token"))
    assert line.startswith("Time to first token at 512 prompt tokens: ") and "distinct experts/layer" in line
    r = solve(files, "--prompt-tokens", 0)
    assert r.exit_code == 2 and "--prompt-tokens" in r.output


def test_plan_show_prints_prefill_and_old_plans_load(files, tmp_path):
    if not (files / "plan.json").exists():
        solve(files, "--prompt-tokens", 64, "--out", files / "plan.json")
    r = run("plan", "show", files / "plan.json")
    assert r.exit_code == 0 and "Time to first token at 64 prompt tokens:" in r.stdout
    shown = json.loads(run("plan", "show", files / "plan.json", "--json").stdout)
    assert shown["predicted"]["prefill"]["prompt_tokens"] == 64
    old = load_plan(files / "plan.json")
    del old.doc["predicted"]["prefill"]                         # a plan made before prefill predictions
    save_plan(old, tmp_path / "old.json")
    r = run("plan", "show", tmp_path / "old.json")
    assert r.exit_code == 0 and "Time to first token" not in r.stdout and "predicted" in r.stdout
    assert prefill_for_plan(load_plan(tmp_path / "old.json").doc, 64) is None


def test_prefill_at_interpolates_the_curve():
    pred = {"prefill": {"prompt_tokens": 8, "prefill_s": 0.5, "curve": [[1, 0.1], [2, 0.2], [4, 0.3]]}}
    assert predicted_prefill_at(pred, 8) == 0.5                    # the plan's own length
    assert predicted_prefill_at(pred, 3) == pytest.approx(0.25)     # between 2 and 4
    assert predicted_prefill_at(pred, 6) == pytest.approx(0.4)      # between 4 and the plan's 8
    assert predicted_prefill_at(pred, 10) == pytest.approx(0.6)     # past the last: its slope
    assert predicted_prefill_at({"prefill": {"prompt_tokens": 8, "prefill_s": 0.5}}, 4) == 0.25  # per token
    assert predicted_prefill_at({}, 4) is None and predicted_prefill_at(pred, None) is None


def test_verify_shows_prefill_row_outside_the_verdict(files):
    if not (files / "plan.json").exists():
        solve(files, "--prompt-tokens", 64, "--out", files / "plan.json")
    predicted = load_plan(files / "plan.json").doc["predicted"]
    want = predicted_prefill_at(predicted, 40)
    m = RunReport(tok_s=predicted["tok_s"], decode_s_per_token=predicted["decode_s_per_token"],
                  hit_rate=dict(predicted["hit_rate"]), prompt_tokens=40, prefill_s=2 * want)
    rows = compare(predicted, m)
    speed, ttft = [r for r in rows if r["term"].startswith("prefill")]
    # one prefill ratio everywhere: measured / predicted tok/s (40 tokens in twice the time: 0.5) ...
    assert speed["term"] == "prefill tok/s (40 prompt tokens)" and speed["unit"] == "tok/s"
    assert speed["predicted"] == pytest.approx(40 / want) and speed["measured"] == pytest.approx(20 / want)
    assert speed["ratio"] == pytest.approx(0.5)
    # ... and the time to first token beside it, in seconds, with no (inverse) ratio of its own
    assert ttft["term"] == "prefill time to first token" and ttft["unit"] == "s"
    assert (ttft["predicted"], ttft["measured"], ttft["ratio"]) == (pytest.approx(want), 2 * want, None)
    table = {r[0]: r[3] for r in report_table({"comparison": rows})}
    assert table["prefill tok/s (40 prompt tokens)"] == "x0.50"
    assert table["prefill time to first token"] == "-"
    v = make_verdict(predicted, m, True)
    assert v["ok"]                                                 # a 2x prefill miss does not fail it ...
    assert v["prefill_ratio"] == speed["ratio"] and v["prefill_ok"] is False   # ... but has its verdict
    assert v["tolerances"]["prefill_tok_s"] == 0.25
    line = verdict_line(v)
    assert line.startswith("verdict: PASS") and line.endswith(
        "prefill tok/s measured/predicted 0.50 (outside +-25%, not part of PASS/FAIL)")
    near = dataclasses.replace(m, prefill_s=want / 1.2)               # 1.2x faster: within
    assert make_verdict(predicted, near, True)["prefill_ratio"] == pytest.approx(1.2)
    assert make_verdict(predicted, near, True)["prefill_ok"] is True
    no_run = dataclasses.replace(m, prefill_s=None)
    assert make_verdict(predicted, no_run, True)["prefill_ok"] is None
    assert "prefill" not in verdict_line(make_verdict(predicted, no_run, True))
    no_prefill = {k: v for k, v in predicted.items() if k != "prefill"}
    assert not any(r["term"].startswith("prefill") for r in compare(no_prefill, m))
    assert make_verdict(no_prefill, m, True)["prefill_ratio"] is None


def test_prefill_ratio_is_measured_over_predicted_tok_s():
    from colibri_plan.verify import prefill_tok_s_ratio

    # 100 tokens predicted in 2.0 s (50 tok/s), measured in 2.5 s (40 tok/s): 40 / 50 = 0.8
    assert prefill_tok_s_ratio(2.0, 2.5) == pytest.approx(0.8)
    assert prefill_tok_s_ratio(2.0, 1.0) == pytest.approx(2.0)       # twice as fast as predicted
    assert prefill_tok_s_ratio(None, 1.0) is None and prefill_tok_s_ratio(1.0, None) is None
    assert prefill_tok_s_ratio(0.0, 1.0) is None and prefill_tok_s_ratio(1.0, 0.0) is None


def test_prefill_verdict_of_a_curve_clamped_to_zero_is_none():
    from colibri_plan.verify import prefill_verdict

    # a falling last segment extrapolates below 0 s: clamped to 0.0, no ratio (as the comparison's row)
    pred = {"prefill": {"prompt_tokens": 8, "prefill_s": 0.1, "curve": [[4, 0.5]]}}
    assert predicted_prefill_at(pred, 20) == 0.0
    m = RunReport(tok_s=1.0, decode_s_per_token=1.0, prompt_tokens=20, prefill_s=1.0)
    assert prefill_verdict(pred, m) == (None, None)
    assert prefill_verdict(pred, dataclasses.replace(m, prompt_tokens=8)) == (pytest.approx(0.1), False)


def test_run_prints_the_plans_prefill_beside_the_measured_one():
    from colibri_plan.cli.run import _human

    rep = RunReport(tokens=[1, 2], tok_s=10.0, decode_s_per_token=0.1, decode_steps=1, load_s=0.5,
                    prefill_s=0.25, dense_s_per_token=0.01, expert_layers_s_per_token=0.05,
                    expert_compute_s_per_token={"cpu": 0.04}, hit_rate={"vram": 0.0, "ram_pinned": 1.0,
                                                                     "lru": 0.0, "disk": 0.0})
    line = _human(rep, 16, "cpu", {"tok_s": 9.0, "prefill_s_at_prompt": 0.2}, {}).splitlines()[1]
    assert "; prefill 16 tokens in 0.250 s (plan predicted 0.200 s); load 0.50 s on cpu" in line
    assert "plan predicted 0.2" not in _human(rep, 16, "cpu", {"tok_s": 9.0}, {}).splitlines()[1].split(
        "prefill")[1]                                                   # an older plan: no prefill figure
