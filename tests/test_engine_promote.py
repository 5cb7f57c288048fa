"""engine/promote.py's rule on toy numbers a person can check: decayed counts and which experts move."""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np

from colibri_plan.engine.promote import ENV, MappedPromoter, PromotePolicy


class FakeRM:
    """One MoE layer (id 3) of 4 experts, top-2: 0 and 1 in VRAM, 2 and 3 mapped; records swap_tiers."""

    def __init__(self):
        self.pack = NS(arch=NS(moe_layers=[3], n_experts=4, top_k=2))
        self.vram, self.mapped, self.observers, self.swapped = [0, 1], [2, 3], [], []

    def tiers_on(self, be, layer):
        return list(self.vram), list(self.mapped)

    def held_weights(self, layer, e):
        return (NS(nbytes=10), NS(nbytes=20), NS(nbytes=30))

    def swap_tiers(self, layer, hot, cold):
        self.swapped.append((layer, hot, cold))
        self.vram[self.vram.index(cold)], self.mapped[self.mapped.index(hot)] = hot, cold


class FakeBE:
    def __init__(self):
        self.exchanged = []

    def d_expert_exchange(self, table, a, b, ew_a, ew_b):
        self.exchanged.append((a, b))


def _promoter(policy=None):
    rm, be = FakeRM(), FakeBE()
    policy = policy or PromotePolicy(window_tokens=32)
    return MappedPromoter(rm, be, "cuda:0", {3: NS(absent=0)}, policy), rm, be


def test_counts_decay_by_one_minus_one_over_the_window_per_token():
    p, _, _ = _promoter()
    p.observe(3, [2, 0])  # one token: 1 each
    p.observe(3, [2, 1])  # the next token: the old counts * 31/32, then +1
    np.testing.assert_allclose(p.q[0], [31 / 32, 1, 1 + 31 / 32, 0])
    p.observe(3, [0, 2], [4, 2])  # a prefill of 3 tokens (6 selections / top-2): decayed (31/32)^3
    d3 = (31 / 32) ** 3
    np.testing.assert_allclose(p.q[0], [31 / 32 * d3 + 4, d3, (1 + 31 / 32) * d3 + 2, 0])
    p.observe(7, [0, 1])  # not a layer it moves: ignored
    assert p.q.shape == (1, 4)
    p.observe(3, [1, 3], [96, 32])  # a 64-token prefill, twice the window: the old counts ~0, half its own
    np.testing.assert_allclose(p.q[0], np.array([31 / 32 * d3 + 4, d3, (1 + 31 / 32) * d3 + 2, 0])
                               * (31 / 32) ** 64 + [0, 48, 0, 16])


def test_the_rule_leads_by_two_plus_two_standard_deviations():
    pol = PromotePolicy()
    assert pol.pays(9, 0) and not pol.pays(7, 0)  # 9 > 2 + 2*3; 7 < 2 + 2*sqrt(7) = 7.29
    assert not pol.pays(20, 10) and pol.pays(30, 4)  # 10 < 2 + 2*sqrt(30); 26 > 2 + 2*sqrt(34) = 13.7


def test_a_mapped_expert_moves_in_once_it_leads_a_vram_one_clearly():
    p, rm, be = _promoter()
    p.q[0] = [0.0, 1.0, 9.0, 7.0]  # mapped 2 (9) for VRAM 0 (0): moves; mapped 3 (7) for VRAM 1 (1): kept
    assert p.rebalance() == 1
    assert be.exchanged == [(2, 0)] and rm.swapped == [(3, 2, 0)]
    assert rm.vram == [2, 1] and rm.mapped == [0, 3]
    assert p.swaps == 1 and p.swap_bytes == 2 * 60
    assert p.rebalance() == 0  # 3 (7) against 1 (1): 6 < 2 + 2*sqrt(8)


def test_the_round_cap_keeps_the_rest_for_the_next_round():
    p, rm, _ = _promoter(PromotePolicy(window_tokens=32, max_swaps=1))
    p.q[0] = [0.0, 0.5, 30.0, 28.0]  # both would move; the cap allows one: the hottest for the coldest
    assert p.rebalance() == 1 and rm.swapped == [(3, 2, 0)]
    assert p.rebalance() == 1 and rm.swapped[-1] == (3, 3, 1)


def test_a_round_every_few_tokens_and_the_switch(monkeypatch):
    p, _, be = _promoter(PromotePolicy(window_tokens=32, every_tokens=4))
    p.q[0] = [0.0, 0.0, 12.0, 0.0]
    assert [p.step() for _ in range(4)] == [0, 0, 0, 1]
    rm = FakeRM()
    monkeypatch.setenv(ENV, "0")
    assert MappedPromoter.make(rm, FakeBE(), "cuda:0", {3: NS(absent=0)}) is None
    monkeypatch.setenv(ENV, "1")
    got = MappedPromoter.make(rm, FakeBE(), "cuda:0", {3: NS(absent=0)})
    assert got is not None and rm.observers == [got.observe]
    assert MappedPromoter.make(FakeRM(), object(), "cuda:0", {3: NS(absent=0)}) is None  # no exchange op
    rm.mapped = []
    assert MappedPromoter.make(rm, FakeBE(), "cuda:0", {3: NS(absent=0)}) is None  # nothing mapped


def test_a_hybrid_layer_is_left_alone():
    """A layer with experts on the host (absent from the GPU's table) is not one the promoter moves."""
    p, _, _ = _promoter()
    p2 = MappedPromoter(FakeRM(), FakeBE(), "cuda:0", {3: NS(absent=1)})
    assert p.layers == [3] and p2.layers == []


def test_a_replayed_step_counted_at_once_equals_one_count_per_layer():
    """observe_step (all layers of a replayed step in one update) gives the counts of observe per layer."""
    rm = FakeRM()
    rm.pack.arch.moe_layers = [3, 5]
    tables = {3: NS(absent=0), 5: NS(absent=0)}
    a, b = (MappedPromoter(rm, FakeBE(), "cuda:0", tables) for _ in range(2))
    steps = [np.array([[0, 2], [1, 3]]), np.array([[2, 3], [2, 0]]), np.array([[1, 0], [3, 1]])]
    for ids in steps:
        a.observe_step([3, 5], ids)
        for layer, row in zip((3, 5), ids):
            b.observe(layer, row)
    np.testing.assert_allclose(a.q, b.q)
    a.observe_step([9], np.array([[0, 1]]))  # a layer it does not move: ignored
    np.testing.assert_allclose(a.q, b.q)


def test_a_step_recorded_at_once_equals_one_record_per_layer():
    """RoutingRecorder.record_step (a replayed step's layers in one update) keeps what record keeps per
    layer: counts, tokens, the ids in order and the hooks' calls."""
    from colibri_plan.engine.moe import RoutingRecorder

    arch = NS(moe_layers=[1, 2, 4], n_experts=6, top_k=2, n_layers=5)
    a, b = RoutingRecorder(arch), RoutingRecorder(arch)
    seen_a, seen_b = [], []
    a.hooks.append(lambda layer, ids, w: seen_a.append((layer, ids.tolist(), w.tolist())))
    b.hooks.append(lambda layer, ids, w: seen_b.append((layer, ids.tolist(), w.tolist())))
    steps = [np.array([[0, 5], [1, 2], [5, 4]]), np.array([[3, 0], [2, 1], [4, 0]])]
    w = np.array([[0.75, 0.25]] * 3, np.float32)
    for ids in steps:
        a.record_step([1, 2, 4], ids, w)
        for layer, row, wr in zip([1, 2, 4], ids, w):
            b.record(layer, row[None], wr[None])
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.counts[0].tolist() == [2, 0, 0, 1, 0, 1] and a.tokens.tolist() == [2, 2, 2]  # 0,5 then 3,0
    for layer in (1, 2, 4):
        np.testing.assert_array_equal(a.topk_ids(layer), b.topk_ids(layer))
    assert seen_a == seen_b and len(seen_a) == 6


def test_the_prompt_served_before_the_promoter_is_counted_first(monkeypatch):
    """The prefill runs before the first decode step makes the promoter: the residency manager keeps those
    routings (early_routing) and make() counts them, 6 selections of 2 experts as 3 tokens."""
    monkeypatch.setenv(ENV, "1")
    rm = FakeRM()
    rm.early_routing = [(3, [0, 2], [4, 2])]
    p = MappedPromoter.make(rm, FakeBE(), "cuda:0", {3: NS(absent=0)})
    np.testing.assert_allclose(p.q[0], [4.0, 0.0, 2.0, 0.0])
