"""LRU hit rates of the streamed experts: with memory (a routing trace) or without (Che).

Two models of one MoE layer's LRU cache of ``S`` slots, shared by the experts that stream (the disk
tier; pinned and VRAM experts never enter it):

* **Trace (temporal locality).** From a token-level routing trace (``heat.trace``, written by `run
  --stats-out`), the LRU *stack distance* of every request (Mattson, Gecsei, Slutz, Traiger, "Evaluation
  techniques for storage hierarchies", IBM Systems Journal 9(2), 1970): the number of distinct streamed
  experts used since the last use of the requested one. An LRU of S slots hits exactly the requests at
  distance < S, so one pass gives the hit rate for every S (the hit curve h(S), concave in practice).
  Distances count streamed experts only, so they are recomputed when the disk set changes. The engine
  (engine/residency.py) serves one forward call per layer at a time: it looks up the call's distinct
  experts first, then admits the misses in id order; the distance of a request counts the distinct
  experts of the calls in between, plus those of the last call that used it which were admitted after it
  (taken in id order: exact when that call's experts all hit or all missed, and :func:`replay_lru`
  checks the rest). Only decode calls (one token row) are counted when the trace has any; earlier calls
  (the prefill) warm the cache, as in a run.
* **Independent requests (Che).** Without a trace each token picks expert e with probability ``p_e``
  independently, and the per-token form of the characteristic-time approximation (Che, Tung, Wang,
  IEEE JSAC 20(7), 2002) gives h_e = 1 − (1 − p_e)^T with Σ_e (1 − (1 − p_e)^T) = S. Under this model
  pins of the hottest experts always beat LRU slots; with locality they need not.

Units: slots are experts; hit rates are shares of requests in [0, 1]. Pure functions on plain arrays.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

#: distance of a first use (never a hit)
COLD = np.inf


def che_hit_rates(p: np.ndarray, slots: int) -> np.ndarray:
    """LRU hit probability of each item under the characteristic-time (Che) approximation.

    Item e is requested by a token with probability ``p_e`` (``[n]``, independent across tokens); an LRU of
    ``slots`` entries keeps what was requested within the last T tokens, where T solves
    Σ (1 − (1 − p_e)^T) = slots; the hit rate of item e is 1 − (1 − p_e)^T. This is the per-token
    (Bernoulli) form of Che, Tung, Wang, IEEE JSAC 20(7), 2002, whose Poisson form uses exp(−p_e T).

    Returns:
        float64 ``[n]`` in [0, 1]; all ones when ``slots`` >= the items with p > 0, zeros when slots <= 0.
    """
    p = np.asarray(p, dtype=np.float64)
    live = p > 0
    if slots <= 0 or not live.any():
        return np.zeros_like(p)
    if slots >= int(live.sum()):
        return live.astype(np.float64)
    # per-token Bernoulli form: an item is requested at most once per token, so after T tokens it was
    # seen with probability 1 - (1 - p)^T (the Poisson form 1 - exp(-pT) overestimates hot items).
    logq = np.log1p(-np.minimum(p[live], 1.0 - 1e-12))

    def occupancy(t: float) -> float:
        return float(np.sum(-np.expm1(logq * t)))

    lo, hi = 0.0, 1.0
    while occupancy(hi) < slots:
        hi *= 2.0
    for _ in range(100):  # bisection on the monotone occupancy
        mid = 0.5 * (lo + hi)
        if occupancy(mid) < slots:
            lo = mid
        else:
            hi = mid
    out = np.zeros_like(p)
    out[live] = -np.expm1(logq * 0.5 * (lo + hi))
    return out


def call_unions(rows: np.ndarray, steps) -> list[np.ndarray]:
    """The distinct expert ids (ascending) of each forward call: ``rows`` int ``[tokens, K]`` split into
    calls of ``steps`` token rows each (the engine reads each distinct expert of a call once)."""
    rows = np.asarray(rows)
    out, t = [], 0
    for s in steps:
        out.append(np.unique(rows[t:t + int(s)]))
        t += int(s)
    return out


def counted_calls(steps) -> np.ndarray:
    """bool ``[calls]``: the calls whose requests a decode hit rate counts: one-row calls (decode tokens)
    when the trace has any, else every call."""
    one = np.array([int(s) == 1 for s in steps], dtype=bool)
    return one if one.any() else np.ones(len(one), dtype=bool)


def stack_distances(unions: list[np.ndarray], members: np.ndarray | None = None):
    """LRU stack distance of every request of a member expert (module docstring; Mattson et al. 1970).

    Args:
        unions: distinct expert ids of each call, ascending (:func:`call_unions`).
        members: bool ``[E]``: the experts that use the LRU (None: all).

    Returns:
        (call int [R], expert int [R], distance float [R]): requests in engine order (call by call, ids
        ascending); distance is the number of distinct member experts more recent than the requested one
        before this call (``COLD`` = inf for a first use). A request hits an LRU of S slots iff its
        distance < S (up to the admission order inside one call, see :func:`replay_lru`).
    """
    n = len(unions)
    tree = [0] * (n + 1)                      # Fenwick tree: members whose last use is at call c

    def add(i: int, v: int) -> None:
        i += 1
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(i: int) -> int:                # sum over calls [0, i)
        s = 0
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s

    last: dict[int, int] = {}
    seen: list[list[int]] = []
    calls, exps, dists = [], [], []
    for c, u in enumerate(unions):
        u = np.asarray(u)
        if members is not None:
            u = u[members[u]]
        ul = [int(e) for e in u]
        seen.append(ul)
        before = prefix(c)
        for e in ul:
            c0 = last.get(e)
            if c0 is None:
                d = COLD
            else:   # distinct members used after call c0, plus those admitted after e within call c0
                d = before - prefix(c0 + 1) + sum(1 for x in seen[c0] if x > e and last[x] == c0)
            calls.append(c)
            exps.append(e)
            dists.append(d)
        for e in ul:
            c0 = last.get(e)
            if c0 is not None:
                add(c0, -1)
            last[e] = c
            add(c, 1)
    return (np.array(calls, dtype=np.int64), np.array(exps, dtype=np.int64),
            np.array(dists, dtype=np.float64))


def replay_lru(unions: list[np.ndarray], members: np.ndarray | None, slots: int,
               counted: np.ndarray | None = None) -> tuple[int, int]:
    """Replay calls through one layer's LRU exactly as the engine does (engine/residency.py: look up the
    call's distinct experts in id order, hits become most recent, then admit the misses in id order,
    evicting the least recently used). Returns (hits, requests) over the ``counted`` calls (default all)."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for c, u in enumerate(unions):
        u = np.asarray(u)
        if members is not None:
            u = u[members[u]]
        missed = []
        for e in (int(x) for x in u):
            if e in cache:
                cache.move_to_end(e)
                hits += int(counted is None or counted[c])
            else:
                missed.append(e)
        total += len(u) if counted is None or counted[c] else 0
        for e in missed if slots > 0 else ():
            cache[e] = None
            if len(cache) > slots:
                cache.popitem(last=False)
    return hits, total


class TraceHits:
    """Per-expert LRU hit rates of the problem's rows from a routing trace (stack distances).

    Args:
        trace: a :class:`~colibri_plan.formats.heat_trace.RoutingTrace`.
        layer_ids: the MoE layer id of each problem row (rows without a trace fall back to Che).
        deadline_s: seconds from now after which :attr:`expired` turns true and :func:`lru_hit_rates`
            uses Che instead (``solve --time-limit``: a trace at the size bound took 25 s of stack
            distances with a 1 s limit); None: no limit.
    """

    def __init__(self, trace, layer_ids, deadline_s: float | None = None):
        import time

        self._deadline = None if deadline_s is None else time.monotonic() + float(deadline_s)
        self.time_limited = False   # set once the deadline passed: the rest was priced with Che
        self.trace = trace
        self.layer_ids = [int(x) for x in layer_ids]
        self.counted = counted_calls(trace.steps)
        self._unions: dict[int, list[np.ndarray]] = {}
        self._memo: dict[tuple, tuple] = {}

    @property
    def expired(self) -> bool:
        """The deadline passed (then stays so): callers price with Che from here on."""
        import time

        if not self.time_limited and self._deadline is not None and time.monotonic() > self._deadline:
            self.time_limited = True
        return self.time_limited

    def covers(self, row: int) -> bool:
        """The trace has this row's layer (and at least one counted call)."""
        return self.layer_ids[row] in self.trace.layers and bool(self.counted.any())

    def rows_covered(self) -> int:
        return sum(self.covers(r) for r in range(len(self.layer_ids)))

    def _requests(self, row: int, members: np.ndarray):
        key = (row, np.packbits(members).tobytes())
        if key not in self._memo:
            if row not in self._unions:
                self._unions[row] = call_unions(self.trace.rows(self.layer_ids[row]), self.trace.steps)
            c, e, d = stack_distances(self._unions[row], members)
            keep = self.counted[c] if c.size else np.zeros(0, dtype=bool)
            if len(self._memo) > 4096:
                self._memo.clear()
            self._memo[key] = (e[keep], d[keep])
        return self._memo[key]

    def hit_curve(self, row: int, members: np.ndarray, max_slots: int) -> np.ndarray:
        """float ``[max_slots + 1]``: the layer's LRU hit rate over counted member requests, for 0..max_slots
        slots (0.0 when no member is requested)."""
        _, d = self._requests(row, np.asarray(members, dtype=bool))
        if not d.size:
            return np.zeros(max_slots + 1)
        finite = np.sort(d[np.isfinite(d)])
        return np.searchsorted(finite, np.arange(max_slots + 1), side="left") / d.size

    def hit_rates(self, row: int, members: np.ndarray, slots: int) -> np.ndarray:
        """float ``[E]``: each member expert's share of counted requests at distance < ``slots``; a member
        the counted calls never request gets the layer's rate; non-members 0."""
        members = np.asarray(members, dtype=bool)
        e, d = self._requests(row, members)
        out = np.zeros(members.size)
        if not e.size or slots <= 0:
            return out
        req = np.bincount(e, minlength=members.size).astype(np.float64)
        hit = np.bincount(e, weights=(d < slots).astype(np.float64), minlength=members.size)
        layer = float(hit.sum() / req.sum())
        out = np.where(req > 0, hit / np.maximum(req, 1.0), layer)
        return np.where(members, out, 0.0)


def lru_hit_rates(p: np.ndarray, on_disk: np.ndarray, slots: int, row: int | None = None,
                  trace_hits: TraceHits | None = None) -> np.ndarray:
    """Per-expert LRU hit rates ``[E]`` of one row's disk-tier experts: the trace model when
    ``trace_hits`` covers ``row``, else Che on the disk experts' probabilities."""
    on_disk = np.asarray(on_disk, dtype=bool)
    if trace_hits is not None and row is not None and trace_hits.covers(row) and not trace_hits.expired:
        return trace_hits.hit_rates(row, on_disk, slots)
    return che_hit_rates(np.where(on_disk, p, 0.0), slots)


def simulate_lru(trace: np.ndarray, slots: int, members: np.ndarray | None = None) -> float:
    """Replay a routing trace ``[T, K]`` of expert ids through an LRU of ``slots`` entries.

    Only ids with ``members[id]`` True (the non-pinned experts) use the cache; each token's selected
    experts are looked up, then the misses are inserted (evicting the least recently used), as the
    engine does per token. Returns the hit rate over member requests (0.0 when there are none).
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in np.asarray(trace):
        missed = []
        for e in row:  # look up every expert of the token first ...
            e = int(e)
            if members is not None and not members[e]:
                continue
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                missed.append(e)
        for e in missed[-slots:] if slots > 0 else ():  # ... then promote the misses, evicting the LRU
            cache[e] = None
            if len(cache) > slots:
                cache.popitem(last=False)
    return hits / total if total else 0.0
