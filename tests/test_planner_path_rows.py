"""The per-selection costs the cost model and the solvers share (planner/path_rows.py): the host's
launches of experts on the trunk's GPU and the CPU backend's per-call cost in the solvers' objective, on
numbers a person can check by hand."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM
from colibri_plan.planner.costmodel import GpuResource, Resources, layer_terms
from colibri_plan.planner.path_rows import gpu_expert_seconds, host_miss_seconds, solver_host_seconds
from colibri_plan.planner.solve import Problem, evaluate, solve_placement

GB = 10**9


def test_gpu_expert_seconds_adds_the_call_outside_the_coefficient():
    g = GpuResource("cuda:0", matmul_gbps=100.0, expert_call_s=1e-5)
    assert gpu_expert_seconds(g, GB, Coefficients()) == pytest.approx(0.01 + 1e-5)
    assert gpu_expert_seconds(g, GB, Coefficients(gpu_expert=2.0)) == pytest.approx(0.02 + 1e-5)
    assert gpu_expert_seconds(GpuResource("cuda:1", 100.0), GB, Coefficients()) == pytest.approx(0.01)


def test_h200_trunk_gpu_expert_term_by_hand():
    # 16 layers x top-8 experts all in the trunk's VRAM, 8.4 MB int8 experts at 762 GB/s: 2.82 ms of
    # matmul per token; the profile's CUDA device op takes 17.2 us: + 16 x 8 x 17.2 us = 2.20 ms -> 5.02 ms
    # (measured 4.66 ms on the H200 host; 2.82 ms predicted before the launches were priced)
    b = 16_785_408 // 2
    g = GpuResource("cuda:0", matmul_gbps=16 * 8 * b / 2.82e-3 / 1e9, h2d_gbps=50.0, d2h_gbps=50.0,
                    holds_trunk=True, expert_call_s=17.2e-6)
    per_layer = layer_terms(np.full(8, 1.0), np.zeros(8, int), 0, b, Resources(10.0, 10.0, gpus=(g,)),
                            Coefficients(), 4096 * 4)
    assert 16 * per_layer["gpu_s"][0] == pytest.approx(2.82e-3 + 16 * 8 * 17.2e-6)   # 5.02 ms
    assert per_layer["transfer_s"][0] == 0.0                                          # its own x


def test_host_miss_seconds_charges_the_call_to_misses_only():
    assert host_miss_seconds((1.0, 2.0, 3.0), 0.5) == (1.0, 2.0, 3.5)
    assert host_miss_seconds((1.0, 2.0, 3.0), 0.5, disk_on_cpu=False) == (1.0, 2.0, 3.0)
    res = Resources(10.0, 10.0, disk_read_gbps=1.0, cpu_call_s=1e-3)
    assert solver_host_seconds(res, GB, Coefficients()) == pytest.approx((0.1, 0.1, 0.101))


def _problem(call_s: float) -> Problem:
    """One layer of 2 experts, both selected every token (top-2, p = 1), 1 GB each. RAM holds one (CPU
    10 GB/s: 0.1 s), a GPU holds one (100 GB/s: 0.01 s, but 0.3 s fixed per layer call: gpu_call_s), the
    disk reads at 10 GB/s (0.1 s a miss). ``call_s``: the CPU backend's seconds per call."""
    res = Resources(cpu_matmul_gbps=10.0, ram_read_gbps=10.0, disk_read_gbps=10.0, cpu_call_s=call_s,
                    gpus=(GpuResource("cuda:0", 100.0, h2d_gbps=1e6, d2h_gbps=1e6, budget_bytes=GB,
                                      link_latency_s=0.0),))
    return Problem(probs=np.ones((1, 2)), weights=np.ones(1), expert_bytes=GB, res=res, ram_budget_bytes=GB,
                   lru_slots=np.zeros(1, int), coef=Coefficients(gpu_call_s=0.3), activation_bytes=4)


def test_solver_objective_carries_the_miss_call_and_its_choice_changes():
    # no call cost: RAM + disk = max(0.1, 0.1) + 0.1 stream = 0.2 s beats RAM + GPU = max(0.1, 0.01 + 0.3)
    ram_disk = np.array([[TIER_RAM, TIER_DISK]])
    ram_gpu = np.array([[0, TIER_RAM]])
    assert evaluate(_problem(0.0), ram_disk)["decode_s_per_token"] == pytest.approx(0.2)
    assert evaluate(_problem(0.0), ram_gpu)["decode_s_per_token"] == pytest.approx(0.31, abs=1e-6)
    assert sorted(solve_placement(_problem(0.0)).tiers[0].tolist()) == sorted(ram_disk[0].tolist())
    # 0.2 s a call: RAM + disk = 0.1 + 0.2 (its resident call) ... max with the read, + 0.1 + 0.2 (the miss's
    # call) = 0.6 s; RAM + GPU = max(0.1 + 0.2, 0.31) = 0.31 s. The objective now sees the miss's call
    # (linear) and picks the GPU
    assert evaluate(_problem(0.2), ram_disk)["decode_s_per_token"] == pytest.approx(0.6)
    assert evaluate(_problem(0.2), ram_gpu)["decode_s_per_token"] == pytest.approx(0.31, abs=1e-6)
    sol = solve_placement(_problem(0.2))
    assert sorted(sol.tiers[0].tolist()) == sorted(ram_gpu[0].tolist())
    assert sol.cost["decode_s_per_token"] == pytest.approx(0.31, abs=1e-6)
