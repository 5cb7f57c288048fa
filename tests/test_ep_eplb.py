"""The eplb baseline (planner/ep_eplb.py) is DeepSeek's algorithm: it reproduces the published example,
keeps groups whole on nodes in the hierarchical policy, and its greedy replication gives the counts of
the solver's vectorised one."""

import numpy as np
import pytest

from colibri_plan.errors import InputError
from colibri_plan.planner.ep_eplb import eplb_rebalance, greedy_pack, greedy_replicate
from colibri_plan.planner.ep_pack import replicate

# github deepseek-ai/EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs
README_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                 [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_reproduces_the_published_example():
    p2l, l2p, count = eplb_rebalance(np.array(README_WEIGHT), 16, 4, 2, 8)
    assert p2l.tolist() == README_PHY2LOG
    assert count.sum(axis=1).tolist() == [16, 16]
    for layer in range(2):          # every expert's slots list exactly its replicas
        for e in range(12):
            slots = l2p[layer, e][l2p[layer, e] >= 0]
            assert len(slots) == count[layer, e] and np.all(p2l[layer, slots] == e)


def test_hierarchical_keeps_every_group_on_one_node():
    rng = np.random.default_rng(3)
    w = rng.random((4, 64)) * 100
    p2l, _, _ = eplb_rebalance(w, 80, 8, 4, 16)           # 8 groups of 8 experts, 4 nodes of 4 GPUs
    node = np.arange(80) // 20
    for row in p2l:
        for g in range(8):
            assert len(set(node[np.isin(row, np.arange(g * 8, g * 8 + 8))])) == 1


def test_uneven_gpu_slots_fill_each_gpu_to_its_count():
    w = np.random.default_rng(0).random((3, 256))
    caps = np.array([5] * 32 + [4] * 32)                   # 288 slots on 64 GPUs (upstream refuses)
    p2l, _, count = eplb_rebalance(w, 288, 8, 8, 64, caps)
    assert p2l.shape == (3, 288) and np.all(count >= 1) and np.all(count.sum(axis=1) == 288)
    with pytest.raises(InputError, match="do not divide"):
        eplb_rebalance(w, 288, 8, 8, 64)


def test_greedy_pack_puts_heaviest_first_into_the_lightest_pack():
    pack, rank = greedy_pack(np.array([[5.0, 1.0, 4.0, 2.0]]), np.array([2, 2]))
    # 5 -> pack 0, 4 -> pack 1, 2 -> pack 1 (4 < 5, now full), 1 -> pack 0: loads 6 and 6
    assert pack.tolist() == [[0, 0, 1, 1]] and rank.tolist() == [[0, 1, 0, 1]]


def test_vectorised_replication_gives_the_greedy_counts():
    rng = np.random.default_rng(7)
    for _ in range(20):
        w = rng.random((1, 32)) ** 3 * 1000
        _, _, count = greedy_replicate(w, 32 + 24)
        assert replicate(w[0], 32 + 24).tolist() == count[0].tolist()
