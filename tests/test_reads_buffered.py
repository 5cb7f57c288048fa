"""Buffered reads as a plan's choice (issue 27, Build 6): the solver prices and picks them, the plan carries
the page cache's bytes, and the engine reads buffered while keeping the page cache within them."""

from __future__ import annotations

import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.backends import get_backend
from colibri_plan.engine import streaming
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import Placement
from colibri_plan.engine.residency import ResidencyManager
from colibri_plan.errors import InputError
from colibri_plan.planner import reads as reads_mod
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N_TOKENS = 10
SPEC = toy_spec(n_experts=16, hidden=2048, inter=1024)   # 3.15 MB experts


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("reads") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=32, top_k=4))
    return out


def _solve(reads: str, ram: str = "0.58", target: str = "colibri-plan"):
    prof = toy_profile(ram_available_bytes=3 * 10**9)
    return make_plan(prof, SPEC, None, SolveOptions(ram=ram, context_tokens=100, trunk="cpu", reads=reads,
                                                    target=target))


def test_forced_buffered_reads_predict_the_warm_page_cache_inside_the_budget():
    direct, _, _ = _solve("o_direct")
    plan, sol, _ = _solve("buffered")
    sec = plan.doc["reads"]
    assert sec["chosen"] == "buffered_warm" and plan.doc["knobs"]["o_direct"] is False
    assert plan.doc["predicted"]["tok_s"] == pytest.approx(sec["buffered_warm"]["tok_s"])
    assert direct.doc["predicted"]["tok_s"] == pytest.approx(sec["o_direct"]["tok_s"])
    assert direct.doc["knobs"]["o_direct"] is True and direct.doc["reads"]["chosen"] == "o_direct"
    # the bytes the engine may keep: what the pins and (twice) the LRU slots leave of the budget
    pc = plan.doc["knobs"]["page_cache"]
    assert pc["used"] and pc["capacity_bytes"] == sec["buffered_warm"]["page_cache_bytes"]
    eb = plan.expert_bytes
    pl = Placement.from_plan(plan)
    assert pl.page_cache_experts == pc["capacity_bytes"] // eb + int(sum(plan.lru_slots()))
    assert Placement.from_plan(direct).page_cache_experts is None


def test_auto_takes_buffered_reads_only_beyond_the_noise(monkeypatch):
    plan, _, _ = _solve("auto")
    assert plan.doc["reads"]["chosen"] == "o_direct"   # the toy's pins fill the budget: nothing to gain
    real = reads_mod.reads_section

    def better(setup, tiers, slots, cost_of):   # the same section, buffered warm 10% faster than O_DIRECT
        sec = real(setup, tiers, slots, cost_of)
        return {**sec, "buffered_warm": {**sec["buffered_warm"], "tok_s": sec["o_direct"]["tok_s"] * 1.10}}

    monkeypatch.setattr(reads_mod, "reads_section", better)
    plan, _, _ = _solve("auto")
    assert plan.doc["reads"]["chosen"] == "buffered_warm" and plan.doc["knobs"]["o_direct"] is False
    assert "+10%" in plan.doc["reads"]["why"]


def test_bad_reads_options_are_refused():
    with pytest.raises(InputError, match="--reads 'mmap'"):
        _solve("mmap")
    with pytest.raises(InputError, match="--target colibri"):
        _solve("buffered", target="colibri")


def test_the_engine_keeps_the_page_cache_to_the_plans_experts(fixture_dir, monkeypatch):
    """Every expert streamed (no LRU slots), a page cache of 40 of the 64 experts: token-exact, the
    page-cache hits are those of one LRU of 40 over the reads in order, and every evicted expert's pages
    are dropped."""
    cap = 40
    dropped: list[tuple[int, int]] = []
    monkeypatch.setattr(streaming, "drop_cache", lambda fd, off=0, n=0: dropped.append((off, n)))
    with open_pack(fixture_dir) as pack:
        arch = pack.arch
        ref = Model(pack, backend_name="numpy")
        want = ref.generate(PROMPT, N_TOKENS)
        calls = []   # (layer, sorted unique experts) in the order the engine reads them
        ids = {layer: ref.routing.topk_ids(layer) for layer in arch.moe_layers}
        n_prompt = len(PROMPT)
        for t in range(-1, N_TOKENS - 1):
            for layer in arch.moe_layers:
                rows = ids[layer][:n_prompt] if t < 0 else ids[layer][n_prompt + t: n_prompt + t + 1]
                calls.append((layer, sorted({int(e) for e in rows.ravel()})))
        ref.close()
        placement = Placement.all_disk(arch.moe_layers, 0)
        placement.page_cache_experts = cap
        cpu = get_backend("numpy").open(0)
        rm = ResidencyManager(pack, placement, cpu, read_threads=1)
        try:
            got = Model(pack, experts=rm).generate(PROMPT, N_TOKENS)
        finally:
            rm.close()
    assert got == want
    assert rm.o_direct is False and rm.page_cache_method in ("buffered+bounded_lru", "buffered")
    lru: list[tuple[int, int]] = []
    hits = evicted = 0
    for layer, experts in calls:
        for e in experts:
            key = (layer, e)
            hits += key in lru
            if key in lru:
                lru.remove(key)
            lru.append(key)
            if len(lru) > cap:
                lru.pop(0)
                evicted += 1
    assert rm.stats.page_cache_hits == hits and 0 < hits < rm.stats.misses
    assert len(dropped) == evicted and len(rm._page_cache) == cap


def test_a_plan_named_like_its_usage_file_is_refused_before_solving(tmp_path):
    from _cli_fixtures import invoke

    out = tmp_path / "plan.coli_usage"
    r = invoke("solve", "--model", "olmoe-1b-7b", "--machine", "gpu=24G ram=64G nvme=gen4 cpu=16", "--out",
               str(out))
    assert r.exit_code != 0 and "give the plan a .json name" in r.output and not out.exists()


def test_a_null_o_direct_knob_reads_and_shows_as_o_direct():
    from colibri_plan.cli.common import knob_lines
    from colibri_plan.engine.placement import _page_cache_experts

    doc = {"knobs": {"o_direct": None}, "model": {"expert_bytes": 100}}
    assert _page_cache_experts(doc, 3) is None
    assert "O_DIRECT reads" in knob_lines(doc["knobs"])[0]
    doc["knobs"]["o_direct"] = False
    assert _page_cache_experts(doc, 3) == 3 and "buffered reads" in knob_lines(doc["knobs"])[0]
