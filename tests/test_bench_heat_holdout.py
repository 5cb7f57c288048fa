"""bench/heat_holdout.py: the two shares of a solved plan over its heat file (planner/holdout.py's figures),
and bad input refused in one line: a heat without a trace, missing or malformed files, a heat of another
model, an --out that is a folder."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import _GOOD_GPU
from _solver_fixtures import toy_profile, toy_spec
from test_bench_bad_args import bench
from test_planner_holdout import _shifting_heat

from colibri_plan.formats.heat import Heat, save_heat
from colibri_plan.formats.plan import save_plan
from colibri_plan.planner.holdout import plan_held_out
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("holdout")
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)
    heat = _shifting_heat(spec)
    plan, _, _ = make_plan(toy_profile(gpus=[_GOOD_GPU], ram_available_bytes=3 * 10**9), spec, heat,
                           SolveOptions(ram="0.58", context_tokens=100, trunk="cpu"))
    save_plan(plan, d / "plan.json")
    save_heat(heat, d / "heat.json")
    return d, plan, heat


def test_shares_of_a_plan_file_over_its_heat_file(files, tmp_path, capsys):
    d, plan, heat = files
    doc = bench("heat_holdout").main(["--plan", str(d / "plan.json"), "--heat", str(d / "heat.json"),
                                      "--out", str(tmp_path / "out.json")])
    want = plan_held_out(heat.trace, plan.doc["layers"], heat.n_experts)
    assert {k: doc[k] for k in want} == want and doc["decode_steps"] == 64
    assert json.loads((tmp_path / "out.json").read_text())["held_out"] == want["held_out"]
    assert f"in sample {want['in_sample'] * 100:.1f}%" in capsys.readouterr().out


def test_bad_input_is_one_line(files, tmp_path):
    d, plan, heat = files
    h = bench("heat_holdout")
    save_heat(Heat(n_experts=heat.n_experts, layers=heat.layers, counts=heat.counts, top_k=heat.top_k,
                   tokens=heat.tokens), tmp_path / "plain.json")
    (tmp_path / "nj.json").write_text("{not json")
    other = Heat(n_experts=heat.n_experts, layers=heat.layers, counts=heat.counts, top_k=heat.top_k,
                 tokens=heat.tokens, trace=heat.trace, model_fingerprint="0123456789abcdef")
    save_heat(other, tmp_path / "other.json")
    cases = [(["--heat", str(tmp_path / "plain.json")], "no routing trace"),
             (["--heat", str(tmp_path / "missing.json")], "missing.json"),
             (["--heat", str(tmp_path / "nj.json")], "nj.json"),
             (["--heat", str(tmp_path / "other.json")], "give the heat the plan was solved on")]
    for extra, match in cases:
        with pytest.raises(SystemExit, match=match):
            h.main(["--plan", str(d / "plan.json"), *extra])
    with pytest.raises(SystemExit, match="nj.json"):
        h.main(["--plan", str(tmp_path / "nj.json"), "--heat", str(d / "heat.json")])
    with pytest.raises(SystemExit) as e:   # an --out that is a folder: refused before any work
        h.main(["--plan", str(d / "plan.json"), "--heat", str(d / "heat.json"), "--out", str(tmp_path)])
    assert e.value.code == 2 and not list(tmp_path.parent.glob(tmp_path.name + ".tmp"))
