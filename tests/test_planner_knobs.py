"""planner/knobs (issue 16): the engine knobs a plan is solved for — target engine, queue depth, host
copies, colibrì's VRAM overhead, --ram at all available memory — in the solve, the plan and --compare."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import BudgetError, FormatError, InputError
from colibri_plan.formats.plan import TIER_RAM, Plan, load_plan, save_plan, validate_plan
from colibri_plan.planner.costmodel import Resources
from colibri_plan.planner.knobs import (
    COLIBRI_VRAM_OVERHEAD_BYTES,
    choose_queue_depth,
    lru_slot_candidates,
)
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}   # 60 MB of experts after the 2 GB reserve
SPEC = toy_spec(n_experts=16, hidden=2048, inter=1024)   # 3.15 MB experts


def _plan(**kw):
    prof = toy_profile(gpus=[GPU], ram_available_bytes=3 * 10**9)
    return make_plan(prof, SPEC, None, SolveOptions(ram=kw.pop("ram", "0.58"), context_tokens=100,
                                                    trunk="cpu", **kw))


def test_queue_depth_is_the_engines():
    res = Resources(cpu_matmul_gbps=1.0, ram_read_gbps=1.0, disk_read_gbps=3.0, disk_queue_depth=8,
                    disk_depth_gbps=((1, 0.5), (2, 0.9), (4, 1.8), (8, 3.0)))
    assert res.at_queue_depth(2).disk_read_gbps == 0.9 and res.at_queue_depth(3).disk_queue_depth == 2
    assert res.at_queue_depth(64).disk_queue_depth == 8
    got, why = choose_queue_depth(res, 8, "auto", "colibri")       # colibrì reads at depth 1-2
    assert (got.disk_queue_depth, got.disk_read_gbps) == (2, 0.9) and "colibr" in why
    got, why = choose_queue_depth(res, 8, "auto")                  # ours: as resolved (top-k buffers)
    assert got is res and "working buffers" in why
    assert choose_queue_depth(res, 8, "1")[0].disk_read_gbps == 0.5
    with pytest.raises(InputError, match="queue-depth"):
        choose_queue_depth(res, 8, "0")
    assert lru_slot_candidates(2, 8, 64, 20) == [2, 4, 8, 16]


def test_plan_records_every_knob_and_reloads(tmp_path):
    plan, _, _ = _plan()
    save_plan(plan, tmp_path / "p.json")
    k = load_plan(tmp_path / "p.json").doc["knobs"]
    assert k["target"] == "colibri-plan" and k["o_direct"] is True and k["queue_depth"] == 1
    assert k["vram_overhead_bytes_per_expert"] == 0 and k["keep_host_copies"] is False
    assert k["cache_model"]["kind"] == "che" and k["cache_model"]["lru_slots_mode"] == "auto"
    assert k["page_cache"]["pool_bytes"] > 0 and k["page_cache"]["used"] is False
    assert plan.doc["resources"]["disk_depth_gbps"] == [[1, 1.0], [4, 2.0]]
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["knobs"]["queue_depth"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="knobs.queue_depth"):
        load_plan(tmp_path / "bad.json")


def test_colibri_target_counts_the_vram_overhead_in_the_budget(tmp_path):
    ours, _, _ = _plan()
    plan, _, setup = _plan(target="colibri")
    b = plan.expert_bytes
    budget = plan.doc["budgets"]["vram_budget_bytes"]["cuda:0"]
    n = plan.counts()["cuda:0"]
    assert n == budget // (b + COLIBRI_VRAM_OVERHEAD_BYTES) < ours.counts()["cuda:0"]
    assert plan.doc["knobs"]["vram_overhead_bytes_per_expert"] == COLIBRI_VRAM_OVERHEAD_BYTES
    validate_plan(plan)
    doc = json.loads(json.dumps(plan.doc))
    doc["knobs"]["vram_overhead_bytes_per_expert"] = 10 * b      # the plan's own figure is re-checked
    with pytest.raises(FormatError, match="over its VRAM budget"):
        validate_plan(Plan(doc))


def test_keeping_host_copies_charges_ram_and_shows_its_cost():
    from colibri_plan.planner.compare import compare_placements

    released, sol_r, setup_r = _plan()
    kept, _, _ = _plan(keep_host_copies=True)
    c = kept.counts()
    b = kept.expert_bytes
    assert (c["ram_pinned"] + c["lru_slots"] + c["cuda:0"]) * b <= kept.doc["budgets"]["ram_budget_bytes"]
    assert kept.doc["knobs"]["host_copy_bytes"] == c["cuda:0"] * b > 0
    assert kept.doc["predicted"]["tok_s"] < released.doc["predicted"]["tok_s"]
    rows = {r["placement"]: r for r in compare_placements(setup_r, sol_r)}
    alt = rows["colibri-plan (host copies kept)"]
    assert alt["knobs"]["keep_host_copies"] and alt["tok_s"] == pytest.approx(kept.doc["predicted"]["tok_s"])
    doc = json.loads(json.dumps(kept.doc))
    doc["budgets"]["ram_budget_bytes"] = (c["ram_pinned"] + c["lru_slots"]) * b   # no room for the copies
    with pytest.raises(FormatError, match="RAM tiers"):
        validate_plan(Plan(doc))


def test_compare_rows_carry_the_knobs_each_engine_runs_with():
    from colibri_plan.planner.compare import compare_placements

    _, sol, setup = _plan()
    rows = compare_placements(setup, sol, host_copy_toggle=False)
    names = [r["placement"] for r in rows]
    assert names == ["colibri-plan (optimised)", "colibri hot-first", "colibri hot-first (DIRECT=0)",
                     "llama.cpp --fit layers", "uniform"]
    by = dict(zip(names, rows))
    assert by["colibri hot-first"]["knobs"]["vram_overhead_bytes_per_expert"] == COLIBRI_VRAM_OVERHEAD_BYTES
    assert by["colibri hot-first"]["knobs"]["o_direct"] and not by["colibri hot-first (DIRECT=0)"]["knobs"][
        "o_direct"]
    llama = by["llama.cpp --fit layers"]["knobs"]
    assert llama["pinned_experts"] == 0 and llama["lru_slots_max"] == 0 and llama["queue_depth"] == 1
    for r in rows:
        assert {"tok_s", "tok_s_our_engine", "vs_best_baseline", "vs_best_baseline_our_engine"} <= set(r)
        assert set(r["knobs"]) >= {"queue_depth", "disk_read_gbps", "o_direct", "page_cache_hit_rate",
                                   "pinned_experts", "lru_slots_max", "keep_host_copies", "cache_model"}
    assert np.isclose(rows[0]["tok_s"], sol.cost["tok_s"])


def test_ram_equal_to_all_available_memory_keeps_headroom_and_warns():
    prof = toy_profile(gpus=[GPU], ram_available_bytes=4 * 10**9)
    plan, _, setup = make_plan(prof, SPEC, None, SolveOptions(ram="4", context_tokens=100, trunk="cpu"))
    assert any("all of the 4.00 GB available" in w and "give at most 1.50 GB" in w for w in setup.warnings)
    assert plan.doc["knobs"]["ram_warnings"] and any("page-cache headroom kept" in e["what"]
                                                     for e in plan.doc["budgets"]["explain"])
    assert plan.doc["budgets"]["headroom_bytes"] == int(2.5e9)
    prof = toy_profile(ram_available_bytes=0)
    with pytest.raises(BudgetError, match="no memory is available"):
        make_plan(prof, SPEC, None, SolveOptions(ram="auto", context_tokens=100, trunk="cpu"))


def test_pins_keep_their_meaning_with_knobs():
    plan, _, _ = _plan(target="colibri", keep_host_copies=True)
    t = plan.tiers()
    assert (t == TIER_RAM).sum() == plan.counts()["ram_pinned"]
    validate_plan(plan)
