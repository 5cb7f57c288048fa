"""The prefill cost model (planner/prefill.py) on hand-checkable toy numbers."""

import numpy as np
import pytest
from _solver_fixtures import st, toy_profile

from colibri_plan.errors import InputError
from colibri_plan.planner.prefill import (
    batch_factor,
    batch_ratio,
    distinct_experts,
    layer_seconds,
    predict_prefill,
    trunk_prefill_seconds,
)

GB = 1e9


def figures(**change) -> dict:
    """Toy figures: 1 GB experts, CPU 10 GB/s without a batched figure (r 16), disk 2 GB/s, one GPU at
    100 GB/s with r 2, a trunk on the CPU with nothing to read."""
    fig = {"expert_bytes": int(GB), "hidden_size": 1000, "disk_gbps": 2.0,
           "cpu": {"gbps": 10.0, "r": 16.0},
           "gpus": [{"key": "cuda:0", "gbps": 100.0, "r": 2.0, "unified": False, "h2d_gbps": 10.0,
                     "d2h_gbps": 10.0, "latency_s": 1e-5}],
           "trunk": {"device": "cpu", "gbps": 100.0, "lm_gbps": 50.0, "r": 16.0, "dense_bytes": 0,
                     "lm_head_bytes": 0, "kv_bytes_per_token": 0, "kv_gbps": [[0, 100.0]], "fixed_s": 0.0,
                     "roundtrip_s": 0.0, "n_moe_layers": 1, "link": None}}
    fig.update(change)
    return fig


def test_batch_factor_interpolates_between_1_and_16_rows_then_counts_passes():
    assert batch_factor(1, 4.0) == 1.0
    assert batch_factor(16, 4.0) == pytest.approx(4.0)
    assert batch_factor(8.5, 4.0) == pytest.approx(1 + 7.5 * 3 / 15)      # 2.5
    assert batch_factor(32, 4.0) == pytest.approx(8.0)                     # two passes of 16 rows
    assert batch_factor(5, 16.0) == pytest.approx(5.0)                     # no batched figure: f(T) = T
    assert batch_factor(16, 0.5) == pytest.approx(1.0)                     # clamped: never below 1 row


def test_distinct_experts_formula():
    assert distinct_experts(np.array([0.5]), 2)[0] == pytest.approx(0.75)
    p = np.array([1.0, 0.5, 0.25, 0.25])                                    # top-2: Σ p = 2
    assert distinct_experts(p, 1).sum() == pytest.approx(2.0)
    assert distinct_experts(p, 3).sum() == pytest.approx(1 + 0.875 + 2 * (1 - 0.75 ** 3))   # 3.03125
    assert distinct_experts(p, 10_000).sum() == pytest.approx(4.0)           # a long prompt touches all


def test_disk_tier_read_once_per_batch():
    # two disk experts with p = 0.5, P = 2: q = 0.75, n = 4/3 rows each
    lay = layer_seconds(np.array([0.5, 0.5]), np.array([-2, -2]), 2, figures())
    assert lay["disk_read_s"] == pytest.approx(1.5 * 0.5)                  # 1.5 expected reads of 0.5 s
    # 0.2 s of compute in all, each as its read lands: the reads, then the last one's 0.2 / 1.5 s
    assert lay["cpu_s"] == pytest.approx(0.75 + 0.2 / 1.5)
    assert lay["distinct_experts"] == pytest.approx(1.5)
    # one of them pinned: its compute (0.1 s) hides behind the other's read (0.375 s), whose own 0.1 s of
    # compute follows it
    lay = layer_seconds(np.array([0.5, 0.5]), np.array([-1, -2]), 2, figures())
    assert lay["cpu_s"] == pytest.approx(0.375 + 0.1) and lay["layer_s"] == pytest.approx(0.475)


def test_disk_experts_without_disk_figure_refused():
    with pytest.raises(InputError, match="disk"):
        layer_seconds(np.array([0.5]), np.array([-2]), 4, figures(disk_gbps=None))


def test_gpu_tier_batched_rate_and_transfer():
    # p = 1 on the GPU, P = 16: q = 1, 16 rows, f(16, 2) = 2 -> 1 GB / 100 GB/s · 2 = 0.02 s;
    # transfer: 16 rows · 1000 · 4 B each way at 10 GB/s + 2 latencies
    lay = layer_seconds(np.array([1.0, 0.0]), np.array([0, -1]), 16, figures())
    assert lay["gpu_s"]["cuda:0"] == pytest.approx(0.02 + 2 * 64_000 / 10e9 + 2e-5)
    assert lay["cpu_s"] == 0.0 and lay["layer_s"] == pytest.approx(lay["gpu_s"]["cuda:0"])


def test_trunk_at_p_rows():
    trunk = {"device": "cuda:0", "gbps": 100.0, "lm_gbps": 50.0, "r": 4.0, "dense_bytes": int(1.1 * GB),
             "lm_head_bytes": int(0.1 * GB), "kv_bytes_per_token": 1_000_000, "kv_gbps": [[0, 100.0]],
             "fixed_s": 0.001, "roundtrip_s": 1e-4, "n_moe_layers": 2,
             "link": {"h2d_gbps": 10.0, "d2h_gbps": 10.0}}
    t = trunk_prefill_seconds(32, figures(trunk=trunk))
    assert t["dense_s"] == pytest.approx(1 * GB / 100e9 * 8 + 0.001)      # f(32, 4) = 8 passes' worth
    assert t["lm_head_s"] == pytest.approx(0.1 / 50)                       # the last row only
    assert t["attention_s"] == pytest.approx(32 * 32 / 2 * 1e6 / 100e9)    # causal: P²/2 K+V rows
    assert t["handoff_s"] == pytest.approx(2 * (1e-4 + 2 * 31 * 4000 / 10e9))


def test_predict_prefill_sums_decode_layers_only():
    probs = np.array([[0.5, 0.5], [0.5, 0.5]])
    tiers = np.array([[-2, -2], [-2, -2]])
    out = predict_prefill(probs, tiers, np.array([True, False]), 2, figures())   # row 2: an MTP row
    want = 0.75 + 0.2 / 1.5                                                  # row 1 alone (as above)
    assert out["terms"]["experts_s"] == pytest.approx(want)
    assert out["prefill_s"] == pytest.approx(want) and out["ttft_s"] == out["prefill_s"]
    assert out["prefill_tok_s"] == pytest.approx(2 / want) and out["prompt_tokens"] == 2
    with pytest.raises(InputError, match="prompt-tokens"):
        predict_prefill(probs, tiers, np.array([True, True]), 0, figures())


def test_batch_ratio_from_profile_matmul_rows():
    prof = toy_profile(cpu_gbps=20.0)
    assert batch_ratio(prof, "numpy", 0, "int4", 32, 64) == 16.0           # no 16-token figure
    row = dict(prof.doc["matmul"][0], tokens=16, weight_gbps=st(5.0))      # 16 rows in 4x a row's time
    prof.doc["matmul"].append(row)
    assert batch_ratio(prof, "numpy", 0, "int4", 32, 64) == pytest.approx(4.0)


def test_streamed_experts_crc32_takes_the_cores_from_the_pinned_compute():
    # one pinned expert (p = 1, P = 2: 2 rows, f = 2 -> 0.2 s) and one disk expert (p = 1: read once, 0.5 s;
    # 2 rows of compute after it, 0.2 s); crc32 at 1 GB/s: 1 s of the cores beside the pinned compute
    p, tiers = np.array([1.0, 1.0]), np.array([-1, -2])
    plain = layer_seconds(p, tiers, 2, figures())
    assert plain["cpu_s"] == pytest.approx(max(0.2 + 0.2, 0.5 + 0.2)) and plain["verify_s"] == 0.0
    lay = layer_seconds(p, tiers, 2, figures(checksum_gbps=1.0))
    assert lay["verify_s"] == pytest.approx(1.0)
    assert lay["cpu_s"] == pytest.approx(max(0.2 + 1.0 + 0.2, 0.5 + 0.2))  # 1.4 s: the cores are the limit


def test_reads_and_compute_pipeline_over_many_misses():
    # P = 6: the pinned expert (p = 1) has 6 rows, 0.6 s of compute; two disk experts with p = 0.5 are each
    # touched with q = 1 - 0.5^6 = 0.984375 (M = 1.96875 expected misses, 0.984 s of reads at 2 GB/s),
    # 3.048 rows each, 0.6 s of compute in all as their reads land
    p, tiers = np.array([1.0, 0.5, 0.5]), np.array([-1, -2, -2])
    q = 1 - 0.5 ** 6
    disk_s, stream_s = 2 * q * 0.5, 2 * q * 0.1 * (3 / q)
    lay = layer_seconds(p, tiers, 6, figures())
    assert lay["cpu_s"] == pytest.approx(max(0.6 + stream_s, disk_s + stream_s / (2 * q)))   # 1.2 s: CPU
    # a slow disk (0.5 GB/s): the reads are the path, plus the last miss's compute
    slow = layer_seconds(p, tiers, 6, figures(disk_gbps=0.5))
    assert slow["cpu_s"] == pytest.approx(4 * disk_s + stream_s / (2 * q))


def test_expert_ratio_weighs_gate_up_and_down_shapes():
    from colibri_plan.planner.prefill import _ffn_ratio

    prof = toy_profile(cpu_gbps=20.0)
    base = prof.doc["matmul"][0]
    h, i = base["in_features"], base["out_features"]
    prof.doc["matmul"] += [dict(base, tokens=16, weight_gbps=st(2.0)),                      # gate: r 10
                           dict(base, out_features=h, in_features=i, tokens=1, weight_gbps=st(20.0)),
                           dict(base, out_features=h, in_features=i, tokens=16, weight_gbps=st(5.0))]  # r 4
    assert _ffn_ratio(prof, ("numpy", 0), "int4", i, h) == pytest.approx((2 * 10 + 4) / 3)   # 8


def test_the_trunks_cuda_gpu_runs_its_experts_on_the_device_rows_without_the_trip():
    # as test_gpu_tier_batched_rate_and_transfer, but the GPU holds a CUDA trunk: its VRAM experts read the
    # prefill's rows on the device (d_expert_ffn_rows), so no 16-row round trip
    gpus = [dict(figures()["gpus"][0], device_x=True)]
    lay = layer_seconds(np.array([1.0, 0.0]), np.array([0, -1]), 16, figures(gpus=gpus))
    assert lay["gpu_s"]["cuda:0"] == pytest.approx(0.02)


def test_figures_mark_only_the_cuda_trunk_gpu_as_device_x():
    from _solver_fixtures import toy_spec

    from colibri_plan.planner.make import make_plan
    from colibri_plan.planner.options import SolveOptions
    from colibri_plan.planner.prefill import figures_from_setup

    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": 2_300_000_000}], ram_available_bytes=3 * 10**9)
    for trunk, want in (("cuda:0", True), ("cpu", False)):
        _, _, setup = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk=trunk))
        assert figures_from_setup(prof, setup)["gpus"][0]["device_x"] is want


def test_a_cuda_trunks_long_prefill_offloads_the_host_experts_to_its_gpu():
    # one expert on the trunk's GPU (p 1), one pinned and one on disk (p 0.5 each: q ≈ 1 at P = 32, 16 rows)
    gpus = [dict(figures()["gpus"][0], device_x=True)]
    fig = figures(gpus=gpus, offload_tokens=32)
    p, tiers = np.array([1.0, 0.5, 0.5]), np.array([0, -1, -2])
    lay = layer_seconds(p, tiers, 32, fig)
    # uploads at 10 GB/s: 0.1 s each; the miss's read (0.5 s) then its upload (0.1 s) is the host path
    assert lay["offload_h2d_s"] == pytest.approx(0.2)
    assert lay["cpu_s"] == pytest.approx(max(0.1 + 0.1, 0.5 + 0.1))
    # the device: its own expert (32 rows, f = 4: 0.04 s), the host path, the two uploaded (f(16) = 2: 0.02 s)
    assert lay["gpu_s"]["cuda:0"] == pytest.approx(0.04 + 0.6 + 2 * 0.02)
    assert lay["layer_s"] == pytest.approx(0.68)
    # below the threshold, and a plan recorded without it: the CPU computes them (16 rows at r 16: 1.6 s)
    for n, f in ((31, fig), (32, figures(gpus=gpus))):
        lay = layer_seconds(p, tiers, n, f)
        assert lay["offload_h2d_s"] == 0.0 and lay["cpu_s"] > 1.5 and lay["layer_s"] == lay["cpu_s"]
    # not a CUDA trunk (no device_x): no offload either
    assert layer_seconds(p, tiers, 32, figures(offload_tokens=32))["offload_h2d_s"] == 0.0
    out = predict_prefill(p[None], tiers[None], np.array([True]), 32, fig)
    assert out["terms"]["offload_h2d_s"] == pytest.approx(0.2)
    assert out["terms"]["experts_s"] == pytest.approx(0.68)
