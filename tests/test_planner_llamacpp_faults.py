"""planner/llamacpp_faults: llama.cpp's page faults beyond the page cache, on toy numbers checkable by hand.

The toy model (as tests/test_planner_llamacpp_cost.py): 2 MoE layers of 4 experts (top-2), each expert
3 MB (1 MB per projection slice), 1 MB of dense tensors per layer, a 1 MB head, no KV or compute
buffers. The toy fault probe: an isolated 1 MB run costs 10 ms and reads 4 MB (the window W), an 8 MB
run 20 ms; so W/2 = 2 MB reaches one whole slice past the faulting one (c = 2 - 1 = 1).
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan.planner import llamacpp_compare
from colibri_plan.planner.llamacpp_cost import (
    LlamaCoefficients,
    LlamaGeometry,
    LlamaMachine,
    LlamaPlacement,
    raw_terms,
)
from colibri_plan.planner.llamacpp_faults import FaultCurve, cover_slices, pass_cost, runs_of, scan_seconds
from colibri_plan.planner.llamacpp_inputs import fault_runs, no_mmap_outcome
from colibri_plan.profiler.fault import fit_runs, measure_runs

MB = 1_000_000
CURVE = FaultCurve(((1 * MB, 0.010, 4 * MB), (8 * MB, 0.020, 8 * MB)))
G = LlamaGeometry(n_layers=2, moe=(True, True), n_experts=4, top_k=2, expert_bytes=3 * MB,
                  layer_dense_bytes=1 * MB, head_bytes=1 * MB, kv_bytes_per_token_layer=0, hidden_size=0,
                  vocab_size=0)
#: both layers select experts 0 and 1 every token
P = np.array([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def test_curve_is_flat_below_the_shortest_run_linear_between_and_extended_beyond():
    assert CURVE.window_bytes == 4 * MB
    assert CURVE.seconds(0.5 * MB) == pytest.approx(0.010)      # a whole window is read anyway
    assert CURVE.seconds(4.5 * MB) == pytest.approx(0.015)      # halfway from 1 to 8 MB
    assert CURVE.seconds(15 * MB) == pytest.approx(0.030)       # 7 MB more at the last slope, 10 ms / 7 MB
    assert cover_slices(4 * MB, 1 * MB) == 1


def test_a_fault_window_covers_the_next_slice():
    # slices 0 and 3 missed: two faults (3 is 3 slices past 0), spans 0, 1 (read by 0's window) and 3
    assert runs_of([1, 0, 0, 1], 1) == pytest.approx((2.0, 3.0))
    # slices 0 and 1: slice 1 is inside slice 0's window, one fault spanning slices 0, 1, 2
    assert runs_of([1, 1, 0, 0], 1) == pytest.approx((1.0, 3.0))
    # half chances, no cover: sum m = 2 faults, 2 slices spanned
    assert runs_of([0.5] * 4, 0) == pytest.approx((2.0, 2.0))


def test_cold_pass_by_hand():
    t = scan_seconds(P, 3 * MB, np.array([1 * MB, 2 * MB]), CURVE, np.ones(2))
    # per expert tensor: 1 fault spanning 3 MB, s(3 MB) = 10 + 2/7 x 10 ms, under s(4 MB whole tensor);
    # 3 tensors x 2 layers; dense: 2 runs a layer, s(0.5 MB) = s(1 MB) = 10 ms each
    assert t["seconds"] == pytest.approx(6 * (0.010 + 2 / 7 * 0.010) + 4 * 0.010)
    assert t["faults"] == pytest.approx(6 + 4)
    # 6 tensors read whole (4 MB each: the window), dense: 2 runs x W = 8 MB a layer
    assert t["read_bytes"] == pytest.approx(6 * 4 * MB + 2 * 8 * MB)
    assert t["missed_bytes"] == pytest.approx(2 * 2 * 3 * MB + 3 * MB)


def test_a_token_inserting_more_than_the_cache_is_the_cyclic_worst_case():
    cold = scan_seconds(P, 3 * MB, np.array([1 * MB, 2 * MB]), CURVE, np.ones(2))
    out = pass_cost(P, 3 * MB, np.array([1 * MB, 2 * MB]), CURVE, cache_bytes=39 * MB)   # 40 MB inserted
    assert out["regime"] == "cyclic" and out["dense_hit"] == 0.0
    assert out["seconds"] == pytest.approx(cold["seconds"])


def test_a_cache_holding_the_token_hits_everything_it_touches():
    # 40 MB inserted < 100 MB: Che over items of 3 W = 12 MB, 8 slots, 4 live experts + 1 dense item
    out = pass_cost(P, 3 * MB, np.array([1 * MB, 2 * MB]), CURVE, cache_bytes=100 * MB)
    assert out["regime"] == "che" and out["dense_hit"] == pytest.approx(1.0)
    assert out["seconds"] == pytest.approx(0.0) and out["missed_bytes"] == pytest.approx(0.0)


def test_raw_terms_use_the_probe_when_the_mapped_model_exceeds_the_cache():
    m = LlamaMachine(cpu_gbps=1.0, cpu_batch_gbps=10.0, fault_gbps=0.5, ram_limit_bytes=10 * MB,
                     fault_runs=CURVE.runs)
    t = raw_terms(G, m, LlamaPlacement(ngl=0, context=1, ubatch=1), P)
    assert t["fault_regime"] == "cyclic"                        # 27 MB mapped, 10 MB of cache
    assert t["fault_s"] == pytest.approx(6 * (0.010 + 2 / 7 * 0.010) + 4 * 0.010)
    assert t["fault_bytes"] == pytest.approx(15 * MB)
    # a micro-batch of one token is the decode pass
    assert t["pp_fault_s"] == pytest.approx(t["fault_s"])
    # without the probe: the GB/s term, dense assumed cached, Che over the 7 MB left (2 expert slots for
    # 4 experts requested every token: half hit): 6 MB missed at 0.5 GB/s = 12 ms
    old = raw_terms(G, LlamaMachine(cpu_gbps=1.0, cpu_batch_gbps=10.0, fault_gbps=0.5,
                                    ram_limit_bytes=10 * MB), LlamaPlacement(ngl=0, context=1, ubatch=1), P)
    assert "fault_regime" not in old and old["fault_s"] == pytest.approx(6 * MB / 0.5e9)


def test_no_mmap_over_the_limit_is_an_outcome_not_a_speed():
    base = LlamaPlacement(ngl=0, context=1, ubatch=1)
    small = LlamaMachine(cpu_gbps=1.0, cpu_batch_gbps=10.0, fault_gbps=0.5, ram_limit_bytes=10 * MB)
    out = no_mmap_outcome(G, small, base, LlamaCoefficients(), P)
    assert out["outcome"] == "does not fit (OOM)" and out["decode_tok_s"] is None
    assert "--no-mmap" in out["args"] and "exceed the RAM limit" in out["why"]
    big = LlamaMachine(cpu_gbps=1.0, cpu_batch_gbps=10.0, fault_gbps=0.5, ram_limit_bytes=100 * MB)
    ok = no_mmap_outcome(G, big, base, LlamaCoefficients(), P)
    # 2 MB dense + 1 MB head + 4 selections x 3 MB = 15 MB at 1 GB/s
    assert ok["outcome"] == "runs" and ok["decode_tok_s"] == pytest.approx(1 / 0.015)


def test_compare_shows_the_no_mmap_oom_row():
    pick = {"args": [], "decode_tok_s": 2.0, "prefill_tok_s": 4.0, "memory": {"anon_host": 0},
            "gpu_expert_layers": [], "fault_bytes_per_token": 0.0}
    llama = {"verdict": "use", "chosen": pick, "fit": None, "calibrated_on": "uncalibrated",
             "budgets": {"ram_limit_bytes": 10 * MB},
             "no_mmap": {"args": ["--no-mmap"], "outcome": "does not fit (OOM)", "why": "over", "memory": {}}}
    rows = [{"placement": llamacpp_compare.FIT_ROW, "knobs": {}}]
    assert llamacpp_compare.apply(rows, llama, G) == 1
    assert rows[0]["tok_s"] == 2.0
    assert rows[1]["placement"] == "llama.cpp --no-mmap" and rows[1]["outcome"] == "does not fit (OOM)"
    assert rows[1]["tok_s"] == 0.0 and rows[1]["not_comparable"]


def test_fit_line_and_profile_rows():
    line = fit_runs([{"run_bytes": 1e6, "seconds_per_run": 0.011},
                     {"run_bytes": 2e6, "seconds_per_run": 0.012}])
    assert line["run_s"] == pytest.approx(0.010) and line["stream_gbps"] == pytest.approx(1.0)
    row = {"run_bytes": 1, "seconds_per_run": 0.5, "read_bytes_per_run": 8}
    doc = {"disk": {"mmap_fault": {"rows": [row]}}}
    assert fault_runs(doc) == ((1, 0.5, 8.0),)
    assert fault_runs({"disk": {}}) == ()


def test_probe_reads_what_it_touches(tmp_path):
    f = tmp_path / "t.bin"
    f.write_bytes(np.arange(2 << 20, dtype=np.uint8).tobytes())
    r = measure_runs(f, 256 << 10, 256 << 10, repetitions=1)
    assert r["runs"] == 1 and r["run_bytes"] == 256 << 10
    assert r["seconds_per_run"] > 0 and r["read_gbps"] > 0
