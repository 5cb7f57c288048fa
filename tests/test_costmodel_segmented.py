"""The segmented decode step's price (issue 25, Build 4; planner.costmodel.segmented_layer_seconds): on a
toy layer the trunk's GPU adds a hand-off only where some experts live off it, and the host's experts
overlap the device's own."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan import TIER_RAM
from colibri_plan.planner.costmodel import GpuResource, Resources, decode_cost, layer_terms

MB = 10**6


def _res(segmented: bool, handoff_s: float = 50e-6) -> Resources:
    # CPU 10 GB/s, GPU 1000 GB/s (an expert of 10 MB: 1 ms on the CPU, 10 us on the GPU)
    gpu = GpuResource("cuda:0", 1000.0, 50.0, 50.0, holds_trunk=True,
                      expert_call_s=0.0 if segmented else 20e-6, segmented=segmented, handoff_s=handoff_s)
    return Resources(cpu_matmul_gbps=10.0, ram_read_gbps=100.0, gpus=(gpu,))


def test_a_hybrid_layer_costs_the_hand_off_plus_the_host_or_the_device_whichever_is_longer():
    p = np.array([1.0, 1.0, 0.5, 0.5])  # top-3 of 4
    tier = np.array([0, 0, 0, TIER_RAM])  # expert 3 on the host
    t = layer_terms(p, tier, 0, 10 * MB, _res(True), Coefficients(), 8192)
    assert t["gpu_s"] == [pytest.approx(2.5 * 10e-6)]  # no host launch per expert: captured
    assert t["cpu_path_s"] == pytest.approx(0.5e-3)
    assert t["handoff_s"] == 50e-6 and t["time_s"] == pytest.approx(50e-6 + 0.5e-3)
    fast = layer_terms(p, tier, 0, 10 * MB, _res(True, handoff_s=0.0), Coefficients(), 8192)
    assert fast["time_s"] == pytest.approx(0.5e-3)  # the device's experts hide behind the host's
    eager = layer_terms(p, tier, 0, 10 * MB, _res(False), Coefficients(), 8192)
    # op by op: the round trip is the trunk's term, each expert a host launch
    assert eager["handoff_s"] == 0.0 and eager["time_s"] == pytest.approx(0.5e-3)


def test_a_layer_all_on_the_trunk_gpu_never_hands_off():
    p = np.array([1.0, 1.0, 0.5, 0.5])
    t = layer_terms(p, np.zeros(4, int), 0, 10 * MB, _res(True), Coefficients(), 8192)
    assert t["handoff_s"] == 0.0 and t["time_s"] == pytest.approx(3.0 * 10e-6)


def test_decode_cost_counts_the_hand_offs_of_hybrid_layers_only():
    probs = np.array([[1.0, 1.0, 0.5, 0.5]] * 3)
    tiers = np.array([[0, 0, 0, 0], [0, 0, 0, TIER_RAM], [0, 0, TIER_RAM, TIER_RAM]])
    c = decode_cost(probs, tiers, np.zeros(3, int), 10 * MB, _res(True), Coefficients())
    assert c["terms"]["handoffs"] == 2 and c["terms"]["handoff_s"] == pytest.approx(100e-6)
    want = 3 * 10e-6 + (50e-6 + 0.5e-3) + (50e-6 + 1e-3)
    assert c["decode_s_per_token"] == pytest.approx(want)
