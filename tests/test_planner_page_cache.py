"""planner/page_cache: the OS page cache as a tier for engines that read through it (memory pressure),
checked on hand numbers; "more --ram is slower" for colibrì with buffered reads; the llama.cpp export."""

from __future__ import annotations

import numpy as np
import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.formats.plan import TIER_DISK, TIER_RAM
from colibri_plan.planner.cache_model import che_hit_rates
from colibri_plan.planner.costmodel import Resources, decode_cost
from colibri_plan.planner.page_cache import page_cache_experts, page_cache_hit_rates, page_cache_pool

GB = 10**9


def test_capacity_by_hand():
    # 64 GB available - 10 dense - 4 KV - 1 buffers - 5% OS (3.2) = 45.8 GB
    assert page_cache_pool(64 * GB, 10 * GB, 4 * GB, 1 * GB) == int(45.8 * GB)
    assert page_cache_pool(8 * GB, 10 * GB, 0, 0) == 0                  # never negative
    # 45.8 GB pool, 1 GB experts: 20 pinned and 5 LRU slots (counted twice) leave 45.8 - 30 -> 15 experts
    assert page_cache_experts(int(45.8 * GB), GB, 20, 5) == 15
    assert page_cache_experts(0, GB, 0, 0) == 0 and page_cache_experts(GB, GB, 5, 0) == 0


def test_hit_rates_are_che_over_all_layers_together():
    q = np.array([[0.5, 0.25, 0.0], [0.25, 0.0, 0.0]])
    g = page_cache_hit_rates(q, 2)
    assert g.shape == q.shape and g[0, 2] == 0.0
    assert g.ravel().tolist() == pytest.approx(che_hit_rates(q.ravel(), 2).tolist())
    assert page_cache_hit_rates(q, 3).tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]   # all fit
    assert not page_cache_hit_rates(q, 0).any()


def test_a_page_cache_hit_costs_a_copy_not_a_read():
    """One layer, 2 disk experts p = 1 each, no LRU, 1 GB experts, disk 2 GB/s, RAM 20 GB/s: with room for
    both in the page cache every read is a 0.05 s copy instead of a 0.5 s read."""
    res = Resources(cpu_matmul_gbps=10.0, ram_read_gbps=20.0, disk_read_gbps=2.0)
    p, t = np.array([[1.0, 1.0]]), np.array([[TIER_DISK, TIER_DISK]])
    direct = decode_cost(p, t, np.zeros(1, int), GB, res)
    assert direct["terms"]["disk_read_s"] == pytest.approx(1.0) and direct["page_cache"]["hit_rate"] == 0
    import dataclasses

    cached = decode_cost(p, t, np.zeros(1, int), GB, dataclasses.replace(res, page_cache_pool_bytes=2 * GB))
    assert cached["page_cache"] == {"capacity_experts": 2, "hit_rate": 1.0}
    assert cached["terms"]["disk_read_s"] == pytest.approx(0.1) and cached["disk_bytes_per_token"] == 0
    # a pinned expert takes its bytes from the pool: one left, half the reads hit it (Che, p = 1 each)
    t2 = np.array([[TIER_RAM, TIER_DISK]])
    one = decode_cost(p, t2, np.zeros(1, int), GB, dataclasses.replace(res, page_cache_pool_bytes=2 * GB))
    assert one["page_cache"]["capacity_experts"] == 1 and one["page_cache"]["hit_rate"] == pytest.approx(0.5)


def test_more_ram_is_slower_for_colibri_with_buffered_reads():
    """Issue 16: with PIN_GB fixed, more RAM_GB goes to LRU slots (cap auto-raise) that duplicate what
    the page cache held, so predicted tok/s falls as --ram grows (until the page cache is gone)."""
    from colibri_plan.planner.compare import colibri_ram_sweep
    from colibri_plan.planner.make import build_setup
    from colibri_plan.planner.options import SolveOptions

    spec = toy_spec(n_experts=64, hidden=4096, inter=2048, n_layers=7, moe_layers=(1, 2, 3, 4, 5, 6), top_k=4)
    prof = toy_profile(ram_available_bytes=int(3.4e9), disk_gbps=1.0)
    setup = build_setup(prof, spec, None, SolveOptions(ram="3.3", context_tokens=100))
    rows = colibri_ram_sweep(setup, [int(x * GB) for x in (0.4, 0.8, 1.2, 1.6)], pin_bytes=int(0.4 * GB))
    tok = [r["tok_s"] for r in rows]
    assert tok == sorted(tok, reverse=True) and tok[0] > 1.3 * tok[-1]
    assert [r["lru_slots"] for r in rows] == sorted(r["lru_slots"] for r in rows)
    assert rows[0]["page_cache_bytes"] > rows[-1]["page_cache_bytes"]


def test_llama_export_says_what_mmap_implies():
    from colibri_plan.planner.exports import export_llama_cpp
    from colibri_plan.planner.make import make_plan
    from colibri_plan.planner.options import SolveOptions

    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)
    plan, _, _ = make_plan(toy_profile(ram_available_bytes=3 * GB), spec, None,
                           SolveOptions(ram="0.58", context_tokens=100, trunk="cpu"))
    note = [n for n in export_llama_cpp(plan)["notes"] if "mmap" in n][0]
    assert "page cache can hold about" in note and "of the CPU layers' selections" in note
