"""The baseline: DeepSeek's open expert-parallel load balancer (``eplb``), re-implemented in numpy.

Written from the algorithm's public description (github deepseek-ai/EPLB, README "The Algorithm" and the
signature ``rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)``); no code of it is
used. Two policies:

* **hierarchical** (when the node count divides the group count): the expert groups of group-limited
  routing are packed onto nodes so node loads are balanced (each node gets the same number of groups),
  the redundant slots of each node go to that node's experts, and the node's replicas are packed onto its
  GPUs;
* **global** (otherwise): the same with one group and one node.

Replication is greedy: each redundant slot goes to the expert whose load per replica is highest now.
Packing is greedy too: heaviest item first, into the lightest pack that still has room; every pack gets
exactly its number of items. An expert's load is split evenly over its replicas.

One extension, marked where it is used: upstream requires the physical slot count to be a multiple of the
GPU count; here ``gpu_slots`` may give every GPU its own slot count (DeepSeek-V3's 256 + 32 = 288 slots
on 64 GPUs is 4.5 per GPU), which the same greedy fills pack by pack. With equal counts it is the
upstream algorithm.
"""

from __future__ import annotations

import numpy as np

from colibri_plan.errors import InputError


def greedy_pack(weight: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pack the items of every row onto packs: heaviest first into the lightest pack with room.

    Args:
        weight: float ``[rows, n]`` item weights.
        caps: int ``[m]`` items each pack takes (sum == n).

    Returns:
        (pack, rank): int64 ``[rows, n]`` pack of each item and its position inside the pack. With every
        cap 1 item i goes to pack i (any one-to-one assignment balances equally; this is eplb's).
    """
    rows, n = weight.shape
    caps = np.asarray(caps, dtype=np.int64)
    if int(caps.sum()) != n:
        raise InputError(f"packing {n} items into packs holding {int(caps.sum())}")
    if np.all(caps == 1):
        return np.tile(np.arange(n), (rows, 1)), np.zeros((rows, n), dtype=np.int64)
    pack = np.empty((rows, n), dtype=np.int64)
    rank = np.empty((rows, n), dtype=np.int64)
    for r in range(rows):
        load = np.zeros(caps.size)
        used = np.zeros(caps.size, dtype=np.int64)
        for item in np.argsort(-weight[r], kind="stable"):
            room = np.flatnonzero(used < caps)
            p = int(room[np.argmin(load[room])])   # first of the lightest on ties
            pack[r, item], rank[r, item] = p, used[p]
            load[p] += weight[r, item]
            used[p] += 1
    return pack, rank


def greedy_replicate(weight: np.ndarray, n_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate ``n`` logical experts into ``n_physical`` slots, one redundant slot at a time to the
    expert with the highest load per replica (the first such expert on ties).

    Args:
        weight: float ``[rows, n]`` expert loads.
        n_physical: slots per row (>= n).

    Returns:
        (phy2log, rank, count): int64 ``[rows, n_physical]`` logical expert of each slot (slot i < n holds
        expert i), ``[rows, n_physical]`` the replica's number among its expert's replicas, and
        ``[rows, n]`` replicas per expert.
    """
    rows, n = weight.shape
    phy2log = np.tile(np.arange(n_physical), (rows, 1))
    rank = np.zeros((rows, n_physical), dtype=np.int64)
    count = np.ones((rows, n), dtype=np.int64)
    every = np.arange(rows)
    for slot in range(n, n_physical):
        best = np.argmax(weight / count, axis=1)
        phy2log[:, slot] = best
        rank[:, slot] = count[every, best]
        count[every, best] += 1
    return phy2log, rank, count


def eplb_rebalance(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
                   gpu_slots: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek eplb's placement of ``num_replicas`` physical slots per MoE layer (module docstring).

    Args:
        weight: float ``[layers, E]`` load of each logical expert (selections, any unit).
        num_replicas: physical slots per layer P (E plus the redundant ones).
        num_groups: expert groups of group-limited routing (1 without).
        num_nodes: nodes N (GPUs inside a node share a fast link).
        num_gpus: GPUs G, a multiple of N.
        gpu_slots: optional int ``[G]`` slots of each GPU (the extension; default P / G each).

    Returns:
        (phy2log, log2phy, count): int64 ``[layers, P]`` logical expert of every physical slot (GPU g's
        slots follow GPU g-1's), ``[layers, E, X]`` the slots of each expert by replica number, -1 padded,
        and ``[layers, E]`` replicas per expert.

    Raises:
        InputError: the counts do not divide as the algorithm needs.
    """
    weight = np.asarray(weight, dtype=np.float64)
    layers, n_log = weight.shape
    caps = (np.full(num_gpus, num_replicas // num_gpus, dtype=np.int64) if gpu_slots is None
            else np.asarray(gpu_slots, dtype=np.int64))
    if caps.size != num_gpus or int(caps.sum()) != num_replicas or num_gpus % num_nodes:
        raise InputError(f"eplb: {num_replicas} slots on {num_gpus} GPUs in {num_nodes} nodes do not divide; "
                         "give slots per GPU that add up and a node count that divides the GPUs")
    if num_groups % num_nodes or n_log % num_groups:
        num_groups, num_nodes = 1, 1   # the global policy
    group_size, per_node_groups = n_log // num_groups, num_groups // num_nodes
    gpn = num_gpus // num_nodes
    node_caps = caps.reshape(num_nodes, gpn)
    if np.any(node_caps.sum(axis=1) < n_log // num_nodes):
        raise InputError("eplb: a node has fewer slots than the experts it must hold")

    # 1. groups onto nodes; experts renumbered node-major ("mlog"), each node a contiguous range
    group_load = weight.reshape(layers, num_groups, group_size).sum(axis=2)
    g_node, g_rank = greedy_pack(group_load, np.full(num_nodes, per_node_groups))
    first = (g_node * per_node_groups + g_rank) * group_size                       # [L, groups]
    log2mlog = (first[:, :, None] + np.arange(group_size)).reshape(layers, n_log)   # [L, E]
    mlog2log = np.argsort(log2mlog, axis=1)

    # 2. and 3. per node: replicate into its slots, pack its replicas onto its GPUs
    per_node = n_log // num_nodes
    slot_base = np.concatenate([[0], np.cumsum(caps)])
    phy2log = np.empty((layers, num_replicas), dtype=np.int64)
    phyrank = np.empty((layers, num_replicas), dtype=np.int64)
    count = np.empty((layers, n_log), dtype=np.int64)
    mweight = np.take_along_axis(weight, mlog2log, axis=1)
    for node in range(num_nodes):
        lo = node * per_node
        w = mweight[:, lo:lo + per_node]
        n_phy = int(node_caps[node].sum())
        p2m, prank, cnt = greedy_replicate(w, n_phy)
        share = np.take_along_axis(w / cnt, p2m, axis=1)                             # [L, n_phy]
        gpu, pos = greedy_pack(share, node_caps[node])
        slot = slot_base[node * gpn + gpu] + pos                                      # global slot ids
        rows = np.arange(layers)[:, None]
        phy2log[rows, slot] = np.take_along_axis(mlog2log[:, lo:lo + per_node], p2m, axis=1)
        phyrank[rows, slot] = prank
        np.put_along_axis(count, mlog2log[:, lo:lo + per_node], cnt, axis=1)
    log2phy = np.full((layers, n_log, int(count.max())), -1, dtype=np.int64)
    rows = np.arange(layers)[:, None]
    log2phy[rows, phy2log, phyrank] = np.arange(num_replicas)[None, :]
    return phy2log, log2phy, count
