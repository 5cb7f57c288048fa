"""The zero-copy pinned tier on a discrete GPU (planner.compute): the trunk's GPU computes the pinned
experts from mapped host memory. Its cost on toy numbers, the processor choice, both solvers against the
brute-force optimum, and the plan check."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_solver import brute_force, random_problem

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM, _check_compute
from colibri_plan.planner.compute import (
    choose_compute,
    host_seconds,
    mapped_candidates,
    mapped_expert_seconds,
    pinned_alternative,
)
from colibri_plan.planner.costmodel import GpuResource, Resources, decode_cost, layer_terms
from colibri_plan.planner.path_rows import solver_rates
from colibri_plan.planner.solve import solve_placement

GB = 10**9


def _res(pinned_on: str = "cuda:0", mapped_gbps: float = 50.0, holds_trunk: bool = True) -> Resources:
    # CPU 10 GB/s; the trunk's GPU 1000 GB/s in VRAM, 50 GB/s from mapped host memory; hand-off 1 ms
    gpu = GpuResource("cuda:0", 1000.0, 50.0, 50.0, holds_trunk=holds_trunk, segmented=holds_trunk,
                      handoff_s=1e-3 if holds_trunk else 0.0, mapped_gbps=mapped_gbps)
    return Resources(cpu_matmul_gbps=10.0, ram_read_gbps=100.0, disk_read_gbps=2.0, gpus=(gpu,),
                     compute=(("disk", "cpu"), ("lru", "cpu"), ("ram_pinned", pinned_on)))


def test_two_pinned_experts_go_on_the_gpu_path_without_a_hand_off():
    p = np.array([0.5, 0.5, 1.0])
    tier = np.array([TIER_RAM, TIER_RAM, 0])
    t = layer_terms(p, tier, 0, GB, _res(), Coefficients(), 8192)
    # pinned: 2 x 0.5 x 1e9 B / 50 GB/s = 0.02 s; VRAM: 1.0 x 1e9 / 1000 GB/s = 0.001 s
    assert t["gpu_s"] == [pytest.approx(0.02 + 0.001)]
    assert t["cpu_s"] == 0.0 and t["cpu_path_s"] == 0.0
    assert t["handoff_s"] == 0.0 and t["time_s"] == pytest.approx(0.021)
    assert t["ram_pinned"] == 1.0 and t["vram"] == 1.0   # still served by the pinned tier
    # on the CPU the same pins cost 1.0 x 1e9 / 10 GB/s = 0.1 s, behind a 1 ms hand-off
    cpu = layer_terms(p, tier, 0, GB, _res("cpu"), Coefficients(), 8192)
    assert cpu["gpu_s"] == [pytest.approx(0.001)] and cpu["cpu_s"] == pytest.approx(0.1)
    assert cpu["handoff_s"] == 1e-3 and cpu["time_s"] == pytest.approx(0.101)


def test_a_streamed_expert_still_hands_off_while_the_pins_run_on_the_gpu():
    p = np.array([0.5, 0.5, 1.0])
    tier = np.array([TIER_RAM, TIER_RAM, TIER_DISK])
    t = layer_terms(p, tier, 0, GB, _res(), Coefficients(), 8192)
    assert t["gpu_s"] == [pytest.approx(0.02)]
    # the miss: read 1e9 / 2 GB/s = 0.5 s, compute 1e9 / 10 GB/s = 0.1 s on the CPU
    assert t["cpu_path_s"] == pytest.approx(0.6)
    assert t["handoff_s"] == 1e-3 and t["time_s"] == pytest.approx(0.601)


def test_decode_cost_books_the_pins_on_the_gpu():
    probs = np.array([[0.5, 0.5, 1.0]] * 2)
    tiers = np.array([[TIER_RAM, TIER_RAM, 0]] * 2)
    c = decode_cost(probs, tiers, np.zeros(2, int), GB, _res(), Coefficients())
    assert c["terms"]["expert_compute_s"] == {"cpu": 0.0, "cuda:0": pytest.approx(2 * 0.021)}
    assert c["terms"]["handoffs"] == 0 and c["decode_s_per_token"] == pytest.approx(0.042)


def test_per_expert_seconds_and_the_candidates():
    res = _res()
    assert mapped_expert_seconds(res.gpus[0], GB, Coefficients()) == pytest.approx(0.02)
    assert mapped_expert_seconds(res.gpus[0], GB, Coefficients(gpu_expert=2.0)) == pytest.approx(0.04)
    assert host_seconds(res, GB, Coefficients()) == pytest.approx((0.02, 0.1, 0.1))
    cpu_c, zc, map_s = solver_rates(res, GB, Coefficients())
    assert cpu_c[0] == 0.0 and zc == 0 and map_s == pytest.approx(0.02)
    assert mapped_candidates(res) == ["cuda:0"]
    assert mapped_candidates(_res(holds_trunk=False)) == []     # only the trunk's GPU
    assert mapped_candidates(_res(mapped_gbps=0.0)) == []       # only with a mapped figure
    chosen, explain = choose_compute(dataclasses.replace(res, compute=()), GB, Coefficients())
    assert dict(chosen.compute) == {"ram_pinned": "cuda:0", "lru": "cpu", "disk": "cpu"}
    assert explain["ram_pinned"] == {"cpu": pytest.approx(0.1), "cuda:0": pytest.approx(0.02)}
    assert "cuda:0" not in explain["lru"] and "cuda:0" not in explain["disk"]   # never the host copies
    alt = pinned_alternative(res, GB, Coefficients())
    assert dict(alt.compute)["ram_pinned"] == "cpu"
    assert pinned_alternative(_res("cpu"), GB, Coefficients()) is None
    with pytest.raises(InputError, match="mapped-memory"):
        host_seconds(_res(mapped_gbps=0.0), GB, Coefficients())


def test_a_slow_link_leaves_the_pins_on_the_cpu():
    res = dataclasses.replace(_res(mapped_gbps=5.0), compute=())   # 5 GB/s mapped < 10 GB/s CPU
    chosen, explain = choose_compute(res, GB, Coefficients())
    assert dict(chosen.compute)["ram_pinned"] == "cpu"
    assert explain["ram_pinned"]["cuda:0"] == pytest.approx(0.2)


@pytest.mark.parametrize("seed", range(8))
def test_both_solvers_price_zero_copy_pins_as_the_cost_model(seed):
    rng = np.random.default_rng(100 + seed)
    pr = random_problem(rng, int(rng.integers(1, 3)), int(rng.integers(3, 5)), 1, disk=seed % 3 != 0)
    g = dataclasses.replace(pr.res.gpus[0], holds_trunk=True, mapped_gbps=float(rng.uniform(2, 60)))
    pr.res = dataclasses.replace(pr.res, gpus=(g,), compute=(("ram_pinned", "cuda:0"),))
    best = brute_force(pr)
    if not np.isfinite(best):
        return
    sol = solve_placement(pr, method="exact")
    assert sol.cost["decode_s_per_token"] == pytest.approx(best, rel=1e-6)
    agg = solve_placement(pr, method="aggregate")
    got = agg.cost["decode_s_per_token"]
    assert got >= best * (1 - 1e-9)
    assert got * (1 - agg.gap) <= best * (1 + 1e-6)       # the count-and-mass bound holds too


def _doc(compute: dict, trunk: str | None) -> dict:
    doc = {"devices": [{"key": "cuda:0", "unified": False}], "compute": compute}
    if trunk is not None:
        doc["trunk"] = {"device": trunk}
    return doc


def test_the_plan_names_a_discrete_gpu_for_the_pins_only_when_it_holds_the_trunk():
    _check_compute(_doc({"ram_pinned": "cuda:0", "lru": "cpu", "disk": "cpu"}, "cuda:0"), "plan")
    with pytest.raises(FormatError, match="holds the trunk"):
        _check_compute(_doc({"ram_pinned": "cuda:0"}, "cpu"), "plan")
    with pytest.raises(FormatError, match="holds the trunk"):
        _check_compute(_doc({"ram_pinned": "cuda:0"}, None), "plan")
    with pytest.raises(FormatError, match="unified-memory"):   # streamed experts: never zero-copy
        _check_compute(_doc({"disk": "cuda:0"}, "cuda:0"), "plan")
    by_resources = {"devices": [{"key": "cuda:0"}], "compute": {"ram_pinned": "cuda:0"},
                    "resources": {"gpus": [{"key": "cuda:0", "holds_trunk": True}]}}
    _check_compute(by_resources, "plan")
