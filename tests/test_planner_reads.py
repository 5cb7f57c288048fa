"""planner/reads (issue 27, Build 6): our engine's reads priced O_DIRECT, buffered warm inside and beyond
the budget, and buffered cold, on the toy machine of tests/test_planner_knobs.py (CPU only)."""

from __future__ import annotations

import dataclasses

import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.formats.plan import TIER_RAM
from colibri_plan.planner.make import cost_of, make_plan
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.reads import reads_line, reads_section

SPEC = toy_spec(n_experts=16, hidden=2048, inter=1024)   # 3.15 MB experts


def _setup(ram: str):
    prof = toy_profile(ram_available_bytes=3 * 10**9)
    return make_plan(prof, SPEC, None, SolveOptions(ram=ram, context_tokens=100, trunk="cpu"))


def test_cold_buffered_reads_pay_a_copy_per_miss_on_top_of_o_direct():
    _, sol, setup = _setup("0.58")
    sec = reads_section(setup, sol.tiers, sol.lru_slots, cost_of)
    d, cold = sec["o_direct"], sec["buffered_cold"]
    assert d["tok_s"] == pytest.approx(cost_of(setup, sol.tiers, sol.lru_slots)["tok_s"])
    # the copy out of the page cache: disk bytes per token at the toy's 40 GB/s RAM read
    assert cold["decode_s_per_token"] == pytest.approx(d["decode_s_per_token"]
                                                       + d["disk_bytes_per_token"] / 40e9)
    assert cold["tok_s"] < d["tok_s"] and sec["chosen"] == "o_direct"


def test_warm_page_cache_inside_the_budget_is_what_the_pins_and_slots_leave_and_beyond_is_apart():
    _, sol, setup = _setup("0.58")
    sec = reads_section(setup, sol.tiers, sol.lru_slots, cost_of)
    warm, beyond = sec["buffered_warm"], sec["buffered_warm_beyond"]
    b = setup.problem.expert_bytes
    held = (int((sol.tiers == TIER_RAM).sum()) + 2 * int(sol.lru_slots.sum())) * b   # pins, slots x 2
    assert warm["page_cache_bytes"] <= max(0, setup.problem.ram_budget_bytes - held)
    assert beyond["page_cache_bytes"] > warm["page_cache_bytes"] and beyond["tok_s"] > warm["tok_s"]
    assert "beyond --ram" in sec["why"] and reads_line(sec).startswith("Reads: O_DIRECT")
    # without memory beyond the budget the two warm figures agree
    tight = dataclasses.replace(setup, knobs={**setup.knobs, "page_cache_pool_bytes": 0})
    sec2 = reads_section(tight, sol.tiers, sol.lru_slots, cost_of)
    assert sec2["buffered_warm_beyond"]["tok_s"] == pytest.approx(sec2["buffered_warm"]["tok_s"])
