"""Cost model terms on numbers a person can check by hand; Che hit rates against an LRU simulation."""

import numpy as np
import pytest

from colibri_plan.errors import InputError
from colibri_plan.heatsynth import real_heat, sample_trace
from colibri_plan.planner.costmodel import (
    TIER_DISK,
    TIER_RAM,
    Coefficients,
    GpuResource,
    Resources,
    TokenBytes,
    che_hit_rates,
    decode_cost,
    layer_terms,
    simulate_lru,
)

# CPU 10 GB/s (RAM 20 caps nothing), disk 2 GB/s, one GPU at 100 GB/s behind a 10 GB/s link
RES = Resources(cpu_matmul_gbps=10, ram_read_gbps=20, disk_read_gbps=2,
                gpus=(GpuResource("cuda:0", matmul_gbps=100, h2d_gbps=10, d2h_gbps=10, link_latency_s=0.0),))
B = 100_000_000          # 100 MB experts
ACT = 1_000_000          # 1 MB of activations each way


def test_layer_terms_by_hand():
    p = np.array([0.5, 0.3, 0.2])
    t = layer_terms(p, np.array([0, TIER_RAM, TIER_DISK]), 0, B, RES, Coefficients(), ACT)
    assert t["cpu_s"] == pytest.approx(0.5 * 1e8 / 10e9)          # RAM + streamed experts on the CPU
    assert t["disk_s"] == pytest.approx(0.2 * 1e8 / 2e9)          # every selection of the disk expert misses
    assert t["gpu_s"] == [pytest.approx(0.5 * 1e8 / 100e9)]
    assert t["transfer_s"] == [pytest.approx(2 * 1e6 / 10e9)]
    # CPU path: the pinned expert's compute (0.003 s) runs while the miss is read (0.01 s), then the
    # streamed expert is computed (0.002 s): max(0.003, 0.01) + 0.002
    assert t["cpu_resident_s"] == pytest.approx(0.3 * 1e8 / 10e9)
    assert t["cpu_stream_s"] == pytest.approx(0.2 * 1e8 / 10e9)
    assert t["disk_wait_s"] == pytest.approx(0.01 - 0.003)        # the part of the read not hidden
    assert t["time_s"] == pytest.approx(0.01 + 0.002)             # CPU path is the slowest resource
    assert (t["vram"], t["ram_pinned"], t["lru"], t["disk"]) == pytest.approx((0.5, 0.3, 0.0, 0.2))
    # one LRU slot holds the only streamed expert: it always hits
    t1 = layer_terms(p, np.array([0, TIER_RAM, TIER_DISK]), 1, B, RES, Coefficients(), ACT)
    assert t1["disk_s"] == 0 and t1["lru"] == pytest.approx(0.2) and t1["time_s"] == pytest.approx(0.005)
    # everything on the GPU: the GPU is the slowest; coefficients scale their term only
    t2 = layer_terms(p, np.zeros(3, int), 0, B, RES, Coefficients(gpu_expert=2.0, transfer=0.5), ACT)
    assert t2["time_s"] == pytest.approx(2 * 1e8 / 100e9 + 0.5 * 2e-4)


def test_gpu_call_overhead_is_paid_per_layer_the_gpu_holds_experts_of():
    p = np.array([0.5, 0.3, 0.2])
    coef = Coefficients(gpu_call_s=0.004)
    # all on the GPU: compute 1e8/100e9 = 0.001 s, transfers 2e-4 s, the call 0.004 s
    t = layer_terms(p, np.zeros(3, int), 0, B, RES, coef, ACT)
    assert t["transfer_s"] == [pytest.approx(2e-4 + 0.004)] and t["gpu_calls"] == 1
    assert t["time_s"] == pytest.approx(0.001 + 2e-4 + 0.004)
    # nothing on the GPU: no call, no transfer; the CPU computes all (1e8 / 10e9 = 0.01 s)
    t0 = layer_terms(p, np.full(3, TIER_RAM), 0, B, RES, coef, ACT)
    assert t0["transfer_s"] == [0.0] and t0["gpu_calls"] == 0 and t0["time_s"] == pytest.approx(0.01)
    # two layers, one with GPU experts: one call per token
    d = decode_cost(np.stack([p, p]), np.array([[0, 0, TIER_RAM], [TIER_RAM] * 3]), np.zeros(2, int), B, RES,
                    coef, token=TokenBytes(activation_bytes=ACT))
    assert d["terms"]["gpu_calls"] == pytest.approx(1.0)
    assert d["terms"]["transfer_s"] == pytest.approx(2e-4 + 0.004)


def test_checksums_of_streamed_experts_take_cpu_time_from_the_resident_compute():
    import dataclasses

    res = dataclasses.replace(RES, checksum_gbps=1.0)          # 1e8 B / 1 GB/s = 0.1 s per streamed expert
    p = np.array([0.5, 0.3, 0.2])
    t = layer_terms(p, np.array([0, TIER_RAM, TIER_DISK]), 0, B, res, Coefficients(), ACT)
    assert t["verify_s"] == pytest.approx(0.2 * 0.1)
    # max(resident 0.003 + checks 0.02, disk 0.01) + stream 0.002: the checks now set the CPU path
    assert t["cpu_path_s"] == pytest.approx(0.003 + 0.02 + 0.002)
    assert t["disk_wait_s"] == 0.0
    d = decode_cost(p[None], np.array([[0, TIER_RAM, TIER_DISK]]), np.zeros(1, int), B, res)
    assert d["cpu_path_layers"]["verify_s"] == [pytest.approx(0.02)]
    # without a checksum figure (older profiles) the term is absent
    assert layer_terms(p, np.array([0, TIER_RAM, TIER_DISK]), 0, B, RES, Coefficients(), ACT)["verify_s"] == 0


def test_cpu_path_overlaps_reads_with_resident_compute():
    """Toy numbers: 10 experts of 100 MB, CPU 10 GB/s (0.01 s each), disk 2 GB/s (0.05 s each)."""
    res = Resources(cpu_matmul_gbps=10, ram_read_gbps=20, disk_read_gbps=2)
    p = np.full(10, 0.8)                                           # top-k 8 over 10 experts
    # 9 pinned, 1 streamed: resident 7.2 x 0.01 = 0.072 s hides the read 0.8 x 0.05 = 0.04 s
    t = layer_terms(p, np.array([TIER_RAM] * 9 + [TIER_DISK]), 0, B, res, Coefficients(), 0)
    assert t["cpu_path_s"] == pytest.approx(0.072 + 0.008) and t["disk_wait_s"] == 0.0
    # 2 pinned, 8 streamed: the read 6.4 x 0.05 = 0.32 s hides the resident 0.016 s; + 0.064 s stream
    t = layer_terms(p, np.array([TIER_RAM] * 2 + [TIER_DISK] * 8), 0, B, res, Coefficients(), 0)
    assert t["cpu_path_s"] == pytest.approx(0.32 + 0.064)
    assert t["disk_wait_s"] == pytest.approx(0.32 - 0.016)
    # coefficients scale their own parts: c_disk 0.5 halves the read; c_cpu 2 doubles both computes
    t = layer_terms(p, np.array([TIER_RAM] * 2 + [TIER_DISK] * 8), 0, B, res,
                    Coefficients(cpu_expert=2.0, disk=0.5), 0)
    assert t["cpu_path_s"] == pytest.approx(max(0.032, 0.16) + 0.128)


def test_decode_cost_by_hand():
    probs = np.array([[0.5, 0.3, 0.2], [0.6, 0.2, 0.2]])
    tiers = np.array([[0, TIER_RAM, TIER_DISK], [TIER_RAM, TIER_RAM, TIER_RAM]])
    token = TokenBytes(dense_read_bytes=2_000_000_000, context_tokens=1000, kv_bytes_per_token=10_000,
                       activation_bytes=ACT)
    c = decode_cost(probs, tiers, np.zeros(2, int), B, RES, token=token, layer_weights=np.array([1.0, 0.0]))
    t = c["terms"]
    assert t["dense_s"] == pytest.approx(0.2)                     # 2 GB / 10 GB/s
    assert t["attention_s"] == pytest.approx(1e7 / 20e9)
    assert t["expert_layers_s"] == pytest.approx(0.012)           # the weight-0 row (an MTP head) is free
    assert t["disk_read_s"] == pytest.approx(0.01) and t["disk_wait_s"] == pytest.approx(0.007)
    assert c["decode_s_per_token"] == pytest.approx(0.2 + 0.0005 + 0.012)
    assert c["tok_s"] == pytest.approx(1 / 0.2125)
    assert c["cpu_path_layers"]["disk_s"] == pytest.approx([0.01, 0.0])
    assert c["disk_bytes_per_token"] == pytest.approx(0.2 * B)
    assert c["hit_rate"]["disk"] == pytest.approx(0.2)


def test_disk_needed_and_validation():
    no_disk = Resources(cpu_matmul_gbps=10, ram_read_gbps=20)
    with pytest.raises(InputError, match="no disk figure"):
        layer_terms(np.array([1.0]), np.array([TIER_DISK]), 0, B, no_disk, Coefficients(), ACT)
    with pytest.raises(InputError):
        Resources(cpu_matmul_gbps=-1, ram_read_gbps=20)
    with pytest.raises(InputError, match="unknown"):
        Coefficients.from_dict({"dsik": 1.0})
    assert Coefficients.from_dict({"disk": 2}).disk == 2.0


def test_che_by_hand():
    assert che_hit_rates(np.full(10, 0.3), 4) == pytest.approx(np.full(10, 0.4))   # symmetric: slots / n
    assert che_hit_rates(np.array([0.5, 0.0, 0.2]), 5).tolist() == [1.0, 0.0, 1.0]
    assert che_hit_rates(np.array([0.5, 0.2]), 0).tolist() == [0.0, 0.0]
    p = np.array([0.9, 0.1, 0.1, 0.1])
    h = che_hit_rates(p, 1)
    assert h[0] > h[1]
    t = np.log(1 - h[0]) / np.log(1 - 0.9)                 # the characteristic time T of the fit
    assert np.sum(1 - (1 - p) ** t) == pytest.approx(1.0)  # ... fills exactly one slot


def test_simulate_lru_by_hand():
    trace = np.array([[0, 1], [0, 2], [1, 2]])
    # token 1 misses 0,1; token 2 hits 0, 2 evicts 1; token 3 misses 1, hits 2 -> 2 hits of 6
    assert simulate_lru(trace, 2) == pytest.approx(2 / 6)
    # expert 0 pinned: 1 and 2 miss once each, then both hit in token 3 -> 2 hits of 4
    assert simulate_lru(trace, 2, members=np.array([False, True, True])) == pytest.approx(2 / 4)
    assert simulate_lru(trace, 0) == 0.0


@pytest.mark.parametrize("domain", ["c4", "github"])
def test_che_within_3_points_of_trace_simulation(domain):
    probs = real_heat("olmoe", domain).probabilities()
    worst = 0.0
    for layer in range(3):
        trace = sample_trace(probs[layer], 6000, 8, seed=layer)
        freq = np.bincount(trace.ravel(), minlength=64) / len(trace)     # the heat such a run records
        for pinned in (0, 8):
            members = np.ones(64, bool)
            members[np.argsort(-freq)[:pinned]] = False
            q = freq * members
            for slots in (8, 16, 32):
                predicted = float((q * che_hit_rates(q, slots)).sum() / q.sum())
                simulated = simulate_lru(trace, slots, members)
                worst = max(worst, abs(predicted - simulated))
    assert worst < 0.03
