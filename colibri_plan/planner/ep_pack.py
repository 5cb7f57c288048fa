"""Replicas onto GPUs for one MoE layer and one pool of GPUs: the search that beats greedy packing.

A *pool* is the GPUs one layer's experts may use (all GPUs, or one node's). A placement of a pool is a
list of *items*, one per physical slot: ``item_e[i]`` the logical expert it holds and ``gpu[i]`` the
pool GPU it sits on. An expert's load (expected selections per token) is split evenly over its replicas,
as SGLang's and vLLM's dispatchers spread tokens over replicas, so a GPU's load is the sum of
``w[e] / count[e]`` over its items. Every GPU holds exactly its number of slots (the weights' memory),
so the search only swaps items and moves replicas between experts; it never empties a slot.

Moves, each accepted only when it lowers the pool's highest GPU load (so a search started from any
placement, eplb's included, never ends worse than it started):

* **swap** two items on different GPUs (best-improvement over every pair with the hottest GPU);
* **re-replicate**: take one replica from an expert with several and give the slot to an expert on the
  hottest GPU (its other replicas then carry less).

No GPU holds two replicas of one expert unless the expert has more replicas than the pool has GPUs
(a second copy on the same GPU adds memory and no balance).
"""

from __future__ import annotations

import numpy as np

#: a move must lower the hottest GPU by more than this fraction of the mean GPU load
_TOL = 1e-9


def replicate(w: np.ndarray, n_slots: int, max_count: int | None = None) -> np.ndarray:
    """Replica counts ``[n]`` (int64, each >= 1, sum ``n_slots``) minimising the highest load per
    replica: the redundant slots go to the largest values of ``w[e] / c`` over c = 1, 2, ... (the same
    counts as adding one replica at a time to the expert with the highest load per replica).

    Args:
        w: float ``[n]`` expert loads (>= 0).
        n_slots: physical slots (>= n).
        max_count: replicas one expert may get (None: no limit).
    """
    n = w.size
    extra = int(n_slots) - n
    if extra <= 0:
        return np.ones(n, dtype=np.int64)
    top = extra if max_count is None else min(extra, int(max_count) - 1)
    c = np.arange(1, top + 1, dtype=np.float64)
    value = (w[:, None] / c[None, :]).ravel()                      # [n * top]: w_e / c
    order = np.lexsort((np.arange(value.size), -value))[:extra]      # largest first, first id on ties
    return 1 + np.bincount(order // top, minlength=n).astype(np.int64)


def items_of(count: np.ndarray) -> np.ndarray:
    """Expert of every slot ``[sum(count)]`` for replica counts ``[n]`` (expert e repeated count[e])."""
    return np.repeat(np.arange(count.size), count)


def copies_cap(count: np.ndarray, n_gpus: int) -> np.ndarray:
    """Replicas of each expert one GPU may hold ``[n]``: 1, or ceil(count / GPUs) when count > GPUs."""
    return np.maximum(1, -(-count // n_gpus))


def lpt(item_w: np.ndarray, item_e: np.ndarray, caps: np.ndarray, cap_e: np.ndarray) -> np.ndarray:
    """Heaviest item first onto the lightest GPU that has a free slot and room for its expert.

    Args:
        item_w, item_e: float / int ``[M]`` load and expert of each item.
        caps: int ``[G]`` slots per GPU (sum M).
        cap_e: int ``[n]`` copies of an expert one GPU may hold.

    Returns:
        int64 ``[M]`` GPU of each item.
    """
    g_count = caps.size
    load = np.zeros(g_count)
    used = np.zeros(g_count, dtype=np.int64)
    held = np.zeros((g_count, cap_e.size), dtype=np.int64)
    gpu = np.empty(item_w.size, dtype=np.int64)
    for i in np.argsort(-item_w, kind="stable"):
        e = item_e[i]
        ok = (used < caps) & (held[:, e] < cap_e[e])
        if not ok.any():   # only when caps leave no legal GPU; relax the copy cap rather than fail
            ok = used < caps
        g = int(np.flatnonzero(ok)[np.argmin(load[ok])])
        gpu[i] = g
        load[g] += item_w[i]
        used[g] += 1
        held[g, e] += 1
    return gpu


def _loads(item_w, gpu, g_count):
    return np.bincount(gpu, weights=item_w, minlength=g_count)


def swap_search(item_w: np.ndarray, item_e: np.ndarray, gpu: np.ndarray, g_count: int,
                cap_e: np.ndarray, max_rounds: int = 4000) -> np.ndarray:
    """Swap items between the hottest GPU and any other while that lowers the pair's higher load below
    the hottest load (best pair first). Returns the improved ``gpu`` (a copy)."""
    gpu = gpu.copy()
    held = np.zeros((g_count, cap_e.size), dtype=np.int64)
    np.add.at(held, (gpu, item_e), 1)
    load = _loads(item_w, gpu, g_count)
    tol = _TOL * max(load.mean(), 1e-300)
    for _ in range(max_rounds):
        g = int(np.argmax(load))
        top = load[g]
        on, off = np.flatnonzero(gpu == g), np.flatnonzero(gpu != g)
        if not on.size or not off.size:
            break
        d = item_w[off][None, :] - item_w[on][:, None]          # [a, b] change of g's load
        other = load[gpu[off]][None, :]
        pair_max = np.maximum(top + d, other - d)
        ok = (d < 0) & (pair_max < top - tol)
        e_on, e_off = item_e[on][:, None], item_e[off][None, :]
        ok &= held[gpu[off][None, :], e_on] < cap_e[e_on]      # room for e_on on the other GPU
        ok &= held[g, e_off] < cap_e[e_off]                     # room for e_off on g
        if not ok.any():
            break
        a, b = np.unravel_index(np.argmin(np.where(ok, pair_max, np.inf)), ok.shape)
        i, j = on[a], off[b]
        h = gpu[j]
        held[g, item_e[i]] -= 1
        held[h, item_e[j]] -= 1
        held[h, item_e[i]] += 1
        held[g, item_e[j]] += 1
        gpu[i], gpu[j] = h, g
        load[g] += item_w[j] - item_w[i]
        load[h] += item_w[i] - item_w[j]
    return gpu


def rereplicate(w: np.ndarray, item_e: np.ndarray, gpu: np.ndarray, g_count: int,
                max_moves: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """Move replicas between experts while that lowers the hottest GPU, re-running the swaps after each
    move. Returns ``(item_e, gpu)`` (copies); the slot layout (items per GPU) never changes."""
    item_e, gpu = item_e.copy(), gpu.copy()
    n = w.size
    for _ in range(max_moves):
        count = np.bincount(item_e, minlength=n)
        share = w / count
        load = _loads(share[item_e], gpu, g_count)
        top = load.max()
        tol = _TOL * max(load.mean(), 1e-300)
        held = np.zeros((g_count, n), dtype=np.int64)
        np.add.at(held, (gpu, item_e), 1)
        best = (top - tol, None)
        hot = int(np.argmax(load))
        donor = count[item_e] >= 2                                     # slots whose expert can give one
        if not donor.any():
            break
        k_of = np.full(n, -1)
        donors = np.flatnonzero(count >= 2)
        k_of[donors] = np.arange(donors.size)
        # a donor f loses a replica: its other replicas then carry w_f/(c_f-1)
        gain_f = w[donors] / (count[donors] - 1) - share[donors]
        donor_delta = held[:, donors].T * gain_f[:, None]              # [nf, G]
        slots = np.flatnonzero(donor)
        f_s, h_s = item_e[slots], gpu[slots]
        for e in np.unique(item_e[gpu == hot]):
            new_share_e = w[e] / (count[e] + 1)
            base = load - held[:, e] * (share[e] - new_share_e)        # [G] e's replicas lighter
            after = base[None, :] + donor_delta                         # [nf, G] before the slot changes
            cap_new = max(1, -(-(count[e] + 1) // g_count))
            ok = (f_s != e) & (held[h_s, e] < cap_new)
            if not ok.any():
                continue
            if g_count > 1:
                two = np.argsort(after, axis=1)[:, -2:]                 # [nf, 2] second, first
                first, second = two[:, 1], two[:, 0]
            else:
                first = second = np.zeros(donors.size, dtype=np.int64)
            k = k_of[f_s]
            rows = np.arange(donors.size)
            rest = np.where(h_s == first[k], after[rows, second][k], after[rows, first][k])
            cand = after[k, h_s] - w[f_s] / (count[f_s] - 1) + new_share_e
            new_top = np.where(ok, np.maximum(cand, rest), np.inf)
            j = int(np.argmin(new_top))
            if new_top[j] < best[0]:
                best = (new_top[j], (e, int(f_s[j]), int(h_s[j])))
        if best[1] is None:
            break
        e, f, h = best[1]
        slot = np.flatnonzero((item_e == f) & (gpu == h))[0]
        item_e[slot] = e
        count = np.bincount(item_e, minlength=n)
        gpu = swap_search(w[item_e] / count[item_e], item_e, gpu, g_count, copies_cap(count, g_count))
    return item_e, gpu


def solve_pool(w: np.ndarray, caps: np.ndarray, start: tuple[np.ndarray, np.ndarray] | None = None,
               rereplicate_moves: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """The best placement found for one pool: greedy replicas and heaviest-first packing (or ``start``),
    then swaps and re-replication.

    Args:
        w: float ``[n]`` loads of the pool's experts.
        caps: int ``[G]`` slots per pool GPU (sum >= n).
        start: optional ``(item_e, gpu)`` placement to improve instead (e.g. eplb's).
        rereplicate_moves: most replica moves tried (0: keep the replica counts).

    Returns:
        (item_e, gpu): int64 ``[sum(caps)]`` expert and pool GPU of every slot.
    """
    caps = np.asarray(caps, dtype=np.int64)
    g_count = caps.size
    if start is None:
        count = replicate(w, int(caps.sum()))
        item_e = items_of(count)
        gpu = lpt(w[item_e] / count[item_e], item_e, caps, copies_cap(count, g_count))
    else:
        item_e, gpu = (np.asarray(a, dtype=np.int64) for a in start)
        count = np.bincount(item_e, minlength=w.size)
    gpu = swap_search(w[item_e] / count[item_e], item_e, gpu, g_count, copies_cap(count, g_count))
    if rereplicate_moves:
        item_e, gpu = rereplicate(w, item_e, gpu, g_count, rereplicate_moves)
    return item_e, gpu
