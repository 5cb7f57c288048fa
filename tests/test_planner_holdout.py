"""planner/holdout.py: the in-sample and two-fold held-out VRAM share of a heat's decode selections, on
toy traces a person can check, and in a solved plan (plan file, `plan show`, the solve answer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _cli_fixtures import _GOOD_GPU, invoke
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.formats.heat import Heat, save_heat
from colibri_plan.formats.heat_trace import RoutingTrace
from colibri_plan.formats.plan import load_plan, save_plan
from colibri_plan.formats.profile import save_profile
from colibri_plan.model import save_model_spec
from colibri_plan.planner.holdout import decode_rows, held_out_vram_share, plan_held_out
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions


def _trace(rows_by_layer: dict, steps) -> RoutingTrace:
    layers = tuple(rows_by_layer)
    ids = np.stack([np.asarray(rows_by_layer[l], np.int32) for l in layers])  # [layers, tokens, K]
    return RoutingTrace(layers=layers, top_k=ids.shape[2], steps=tuple(steps), ids=ids)


def test_decode_rows_are_the_one_token_calls():
    ids = np.array([[3, 2], [3, 1], [0, 1], [2, 3]])
    assert decode_rows(ids, [2, 1, 1]).tolist() == [[0, 1], [2, 3]]   # a 2-token prefill, then 2 steps


def test_shares_on_a_trace_whose_routing_moves_halfway():
    # 16 decode steps of top-2 over 4 experts: the first 8 route to {0, 1}, the last 8 to {0, 2}
    rows = [[0, 1]] * 8 + [[0, 2]] * 8
    tr = _trace({5: rows}, [1] * 16)
    got = held_out_vram_share(tr, {5: [0, 1]}, 4)
    assert got == {"in_sample": pytest.approx(24 / 32), "held_out": pytest.approx(0.5), "decode_steps": 16}
    # fold 1 places {0, 1} by the first half and covers half of the second; fold 2 {0, 2}, half of the first
    assert held_out_vram_share(tr, {5: [0, 1, 2, 3]}, 4)["held_out"] == 1.0       # everything in VRAM
    assert held_out_vram_share(_trace({5: rows[:8]}, [1] * 8), {5: [0]}, 4) is None  # too few steps
    assert held_out_vram_share(tr, {6: [0]}, 4) is None                             # no traced layer
    layers = [{"layer": 5, "vram": {"cuda:0": [0], "cuda:1": [1]}}]
    assert plan_held_out(tr, layers, 4)["in_sample"] == pytest.approx(24 / 32)      # every GPU's experts
    assert plan_held_out(None, layers, 4) is None
    assert plan_held_out(tr, [{"layer": 5, "vram": {}}], 4) is None                 # nothing in VRAM


def _shifting_heat(spec, steps: int = 64, seed: int = 0) -> Heat:
    """Decode steps whose hot experts change halfway (0-3, then 4-7), prefill of 8 first."""
    rng = np.random.default_rng(seed)
    K, E = spec.top_k, spec.n_experts
    rows = {}
    for layer in spec.moe_layers:
        pre = [rng.choice(E, K, replace=False) for _ in range(8)]
        hot = [np.arange(4) + (4 if t >= steps // 2 else 0) for t in range(steps)]
        dec = [rng.choice(h, K, replace=False) for h in hot]
        rows[layer] = np.array(pre + dec)
    tr = _trace(rows, [8] + [1] * steps)
    counts = np.stack([np.bincount(rows[l].ravel(), minlength=E) for l in spec.moe_layers]).astype(float)
    return Heat(n_experts=E, layers=tuple(spec.moe_layers), counts=counts, top_k=K, tokens=8 + steps,
                trace=tr)


def test_a_solved_plan_carries_the_held_out_share_and_says_it(tmp_path):
    prof = toy_profile(gpus=[_GOOD_GPU], ram_available_bytes=3 * 10**9)
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)
    heat = _shifting_heat(spec)
    plan, _, _ = make_plan(prof, spec, heat, SolveOptions(ram="0.58", context_tokens=100, trunk="cpu"))
    ho = plan.doc["predicted"]["hit_rate_held_out"]
    # the oracle, computed here from the plan's own VRAM sets
    want = held_out_vram_share(heat.trace, {e["layer"]: [i for v in e["vram"].values() for i in v]
                                            for e in plan.doc["layers"]}, spec.n_experts)
    assert ho == want and ho["decode_steps"] == 64 and 0 < ho["held_out"] < ho["in_sample"] <= 1
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").doc["predicted"]["hit_rate_held_out"] == ho   # schema accepts it
    bad = json.loads((tmp_path / "plan.json").read_text())
    bad["predicted"]["hit_rate_held_out"]["held_out"] = 1.5
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = invoke("plan", "show", tmp_path / "bad.json")
    assert r.exit_code != 0 and "hit_rate_held_out" in r.output
    r = invoke("plan", "show", tmp_path / "plan.json")
    assert r.exit_code == 0, r.output
    line = (f"VRAM holds {ho['in_sample'] * 100:.1f}% of the selections of the heat's 64 decode steps, "
            f"{ho['held_out'] * 100:.1f}% held out (two folds)")
    assert line in r.output
    # the solve answer warns when the two differ by more than 2 points
    save_profile(prof, tmp_path / "profile.json")
    save_model_spec(spec, tmp_path / "model.json")
    save_heat(heat, tmp_path / "heat.json")
    r = invoke("solve", "--profile", tmp_path / "profile.json", "--model", tmp_path / "model.json", "--heat",
               tmp_path / "heat.json", "--ram", "0.58", "--context", "100", "--trunk", "cpu")
    assert r.exit_code == 0, r.output
    assert "  # VRAM holds " in r.output and "held out (two folds)" in r.output

