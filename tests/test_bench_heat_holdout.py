"""bench/heat_holdout.py on a toy trace a person can check: which rows are decode steps, the in-sample and the
two-fold held-out VRAM share of a plan's experts."""

from __future__ import annotations

import pytest
from test_bench_bad_args import bench


def _heat(ids_rows, steps, k=2, e=4):
    return {"n_experts": e, "trace": {"layers": [0], "top_k": k, "steps": steps,
                                       "ids": [[i for row in ids_rows for i in row]]}}


def test_only_one_token_steps_are_decode_rows():
    h = bench("heat_holdout")
    heat = _heat([[3, 2], [3, 1], [0, 1], [2, 3]], steps=[2, 1, 1])  # a 2-token prefill, then 2 decode steps
    rows = h.decode_rows(heat["trace"])
    assert rows[0].tolist() == [[0, 1], [2, 3]]


def test_in_sample_and_held_out_shares():
    h = bench("heat_holdout")
    # 4 decode steps of top-2 over 4 experts: the first half routes to {0, 1}, the second to {0, 2}
    heat = _heat([[0, 1], [0, 1], [0, 2], [0, 2]], steps=[1, 1, 1, 1])
    plan = {"layers": [{"layer": 0, "vram": {"cuda:0": [0, 1]}}]}
    got = h.holdout(plan, heat)
    assert got["decode_steps"] == 4
    assert got["in_sample"] == pytest.approx(6 / 8)  # expert 0 in all 4 steps, expert 1 in 2
    # fold 1: top-2 of {0, 1, 0, 1} = {0, 1}, on {0, 2, 0, 2}: 2 of 4; fold 2: top-2 of the second half =
    # {0, 2}, on the first: 2 of 4 -> 0.5 held out
    assert got["held_out"] == pytest.approx(0.5)
    assert got["per_layer"][0]["vram_experts"] == 2
    other = {"layers": [{"layer": 0, "vram": {"cuda:1": [3]}}]}
    assert h.holdout(other, heat, device="cuda:0")["in_sample"] == 0.0  # another GPU's experts do not count
