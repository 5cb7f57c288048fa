"""bench/heat_holdout.py: the two shares of a plan file over a heat file (planner/holdout.py's figures),
and a heat without a trace refused with what to do."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_bench_bad_args import bench

from colibri_plan.formats.heat import Heat, save_heat
from colibri_plan.formats.heat_trace import RoutingTrace


def test_shares_of_a_plan_file_over_a_heat_file(tmp_path, capsys):
    rows = np.array([[0, 1]] * 8 + [[0, 2]] * 8, np.int32)[None]  # one layer, 16 decode steps
    tr = RoutingTrace(layers=(3,), top_k=2, steps=(1,) * 16, ids=rows)
    counts = np.array([[16.0, 8, 8, 0]])
    save_heat(Heat(n_experts=4, layers=(3,), counts=counts, top_k=2, tokens=16, trace=tr),
              tmp_path / "heat.json")
    (tmp_path / "plan.json").write_text(json.dumps({"layers": [{"layer": 3, "vram": {"cuda:0": [0, 1]}}]}))
    h = bench("heat_holdout")
    doc = h.main(["--plan", str(tmp_path / "plan.json"), "--heat", str(tmp_path / "heat.json"),
                  "--out", str(tmp_path / "out.json")])
    assert doc["in_sample"] == pytest.approx(0.75) and doc["held_out"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "out.json").read_text())["decode_steps"] == 16
    assert "in sample 75.0%, held out (2 folds) 50.0%" in capsys.readouterr().out
    save_heat(Heat(n_experts=4, layers=(3,), counts=np.array([[16.0, 8, 8, 0]]), top_k=2, tokens=16),
              tmp_path / "plain.json")
    with pytest.raises(SystemExit, match="no routing trace"):
        h.main(["--plan", str(tmp_path / "plan.json"), "--heat", str(tmp_path / "plain.json")])
