"""Decode steps replayed from captured graphs (issue 25, Builds 3 and 4): :class:`DecodeGraph`, used by
:class:`~colibri_plan.engine.trunk.Trunk` on a backend that declares ``d_capture_step`` (CUDA).

When every expert of every MoE layer lives in this GPU's VRAM and routing runs on the device, a decode
step needs nothing from the host between its first op and its logits. The trunk's own layer code then runs
once under capture (``Trunk.layers`` with each MoE layer's experts indexed on the device:
``d_expert_ffn_indexed``), and each later token is one replay: its embedding row and position go up, the
logits and every layer's routing come down, in one synchronisation. "Lives in this GPU's VRAM" includes
the pinned experts this GPU computes zero-copy from mapped host memory (a plan's ``compute.ram_pinned``
naming it: engine/unified.py): their rows of the layer's expert table hold host addresses, so such a
layer is not hybrid. The host then records the routing (``RoutingRecorder``), counts the "vram" (and
mapped "ram_pinned") uses and charges the local experts' seconds measured on the
trunk's last timed eager step, exactly as an eager step would.

Hybrid placement (Build 4: some experts of a layer live on the host, the 2.5 GB case): the step is
captured as segments (``d_capture_segments``), cut after the router of each *hybrid* layer (one with
experts off this GPU). A hybrid layer i is three pieces: the segment ending with the router copies the
routing and x down (one small copy); the next, launched at once, runs this GPU's experts of layer i with the
indexed kernel (the layer's expert table marks host experts absent: gate 0, nothing added); the host waits
only for the copy, runs its own chosen experts of the layer while the device computes (:meth:`DecodeGraph.
_host_part`: the eager step's calls, accounting and summation order) and the segment after starts by
copying that partial sum up (zeros when every choice was on this GPU) and adding it. Layers whose experts
all live here are not cut: they never sync. Same bits as the eager step: the device's sum over its
experts in ascending id gets +0 from the absent ones, then the host's sum is added as ``d_add`` did.

A graph reads the cache's arrays through address slots filled at each replay, so it serves every cache of
the model: it is kept per (RoPE table, attention key slices); a RoPE table that grows, or a context whose
attention splits its keys into another number of slices (every 64 tokens up to a few thousand), is
captured again. One step in :data:`EAGER_EVERY` (``COLIBRI_EAGER_EVERY``; and the first timed one) runs
eagerly, timed, so the report's attention and expert terms stay measured; so does the first decode step
(kernels compile outside any capture). Off with ``COLIBRI_CUDA_GRAPH=0``; ``Trunk.graph_off`` says why a
trunk does not capture.

Between replays a :class:`~colibri_plan.engine.promote.MappedPromoter` may exchange a layer's hot mapped
pinned experts with cold VRAM ones (bytes and table rows together: the graphs stay valid, the bits too);
``COLIBRI_PROMOTE=0`` keeps the plan's tiers.
"""

from __future__ import annotations

import os

import numpy as np

from colibri_plan.backends.handles import DArray
from colibri_plan.engine.moe import group_routes, scatter_sum
from colibri_plan.engine.promote import MappedPromoter
from colibri_plan.errors import InputError, UnsupportedError

#: environment switch: "0" decodes eagerly (the before/after of bench/h200_graph.sh)
ENV = "COLIBRI_CUDA_GRAPH"
#: one decode step in this many runs eagerly and timed (the report's measured terms). An eager step costs
#: several replays (its attention and experts bracketed by waits), so one in 64 slowed a 64-token decode
#: by several percent (bench/cuda_decode_gaps.py); ``COLIBRI_EAGER_EVERY`` sets another (a multiple of 8)
EAGER_EVERY = 256
EAGER_ENV = "COLIBRI_EAGER_EVERY"


def eager_every() -> int:
    """Decode steps per eager timed one: ``COLIBRI_EAGER_EVERY`` or :data:`EAGER_EVERY`.

    Raises:
        InputError: the variable is not a positive multiple of 8 (the attention sample's period, so
        that the eager step is a timed one).
    """
    raw = os.environ.get(EAGER_ENV, "").strip()
    if not raw:
        return EAGER_EVERY
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 8 or int(raw) % 8:
        raise InputError(f"{EAGER_ENV}={raw!r}: give a multiple of 8 (decode steps per eager timed step), "
                         f"or unset it for {EAGER_EVERY}")
    return int(raw)
_KEEP = 4  # graphs kept (RoPE tables, attention key slices), least recently used dropped


def _off_reason(trunk) -> str | None:
    """Why ``trunk`` cannot replay decode steps, or None."""
    be, a = trunk.be, trunk.arch
    if os.environ.get(ENV, "1").strip() == "0":
        return f"{ENV}=0"
    if not be.supports("d_capture_step"):
        return f"{getattr(be, 'name', 'the backend')} captures no decode step"
    if trunk._mla:
        return "MLA attention writes its cache rows in blocks (not captured)"
    if a.clip_qkv is not None:
        return "clip_qkv goes through the host"
    if a.moe_layers and a.shared_expert_gate:
        return "the shared expert's gate is computed on the host"
    if a.moe_layers and trunk._router is None:
        return f"routing on the host ({trunk.routing_off})"
    mgr = trunk.model.experts
    if a.moe_layers and getattr(mgr, "repinner", None) is not None:
        return "re-pinning may move experts between tiers"
    return None


def _cache_arrays(cache) -> list[int]:
    """Device addresses of a GQA cache's arrays: every layer's K, then every layer's V."""
    return [a.buf.data.ptr + 4 * a.offset for a in (*cache.k, *cache.v)]


class DecodeGraph:
    """Captured decode steps of one trunk (module docstring); made by :meth:`make`.

    Attributes:
        tables: MoE layer -> the backend's expert table of that layer. key: the residency manager's
        device key of this GPU (None for a dense model).
    """

    def __init__(self, trunk, key, tables: dict):
        self.trunk, self.key, self.tables = trunk, key, tables
        a = trunk.arch
        #: MoE layers with experts off this GPU: the step is cut after their routers (module docstring)
        self.hybrid = [i for i in a.moe_layers if i not in tables or tables[i].absent]
        self._graphs: dict = {}  # key -> CapturedStep / CapturedSegments
        self._steps, self._sampled = 0, 0  # decode steps asked about, eager timed steps taken
        self.captures = 0
        self.waits = 0  # host waits of replayed steps (one per hybrid layer per step)
        self.handoffs = 0  # of them, the ones where some chosen expert lived on the host
        self._cut = None  # while a segmented step is captured: d_capture_segments' cut
        self.promoter = None  # engine/promote.py MappedPromoter, or None: the plan's tiers hold still
        self.eager_every = eager_every()

    @classmethod
    def make(cls, trunk) -> tuple[DecodeGraph | None, str | None]:
        """(a DecodeGraph, None) when ``trunk`` can replay its decode steps, else (None, why not)."""
        why = _off_reason(trunk)
        if why is not None:
            return None, why
        be, a, mgr = trunk.be, trunk.arch, trunk.model.experts
        tables, keys = {}, set()
        try:
            for i in a.moe_layers:
                key, held = mgr.held_on(be, i)
                if held:  # a layer with no expert here hands all to the host: no table
                    keys.add(key)
                    tables[i] = be.d_expert_table([held.get(e) for e in range(a.n_experts)])
        except UnsupportedError as exc:
            return None, str(exc)
        if len(keys) > 1:
            return None, f"the trunk's GPU is known by {len(keys)} device keys"
        g = cls(trunk, keys.pop() if keys else None, tables)
        g.promoter = MappedPromoter.make(mgr, be, g.key, tables)  # hot mapped experts into VRAM (promote.py)
        return g, None

    def takes(self, calls: int) -> bool:
        """Whether the trunk's forward call number ``calls`` (a decode step) replays. Eager: the first
        decode step (it compiles and loads every one-token kernel outside any capture), the first timed
        one and then one in :attr:`eager_every` (timed: the report's measured terms)."""
        self._steps += 1
        if self._steps == 1:
            return False
        if calls % self.trunk.attention_every == 0 and (self._sampled == 0 or calls % self.eager_every == 0):
            self._sampled += 1
            return False
        return True

    def step(self, tok: int, cache) -> np.ndarray:
        """One decode step of token ``tok`` appended to ``cache``: logits float32 [1, V]; the cache
        advances by one and the routing is recorded.

        Raises:
            UnsupportedError: the step could not be captured (the trunk then decodes eagerly for good).
        """
        t, be, a = self.trunk, self.trunk.be, self.trunk.arch
        cache.reserve(cache.length + 1)  # whole pages, before the step writes
        if a.rotary_dim:
            t._grow_rope(cache.capacity)
        pos = cache.length
        window = a.sliding_window if a.sliding_window and a.sliding_layers else 0
        splits = (be.d_attention_splits(1, a.n_heads, a.n_kv_heads, pos + 1),
                  be.d_attention_splits(1, a.n_heads, a.n_kv_heads, min(pos + 1, window)) if window else 0)
        rope = (t._rope.buf.data.ptr, t._rope_rows) if t._rope is not None else None
        key = (rope, splits)
        slots = _cache_arrays(cache)
        g = self._graphs.pop(key, None) or self._capture(cache, pos, slots)
        self._graphs[key] = g  # most recent last
        while len(self._graphs) > _KEEP:
            del self._graphs[next(iter(self._graphs))]
        x = np.asarray(t.model.dense["embed"][tok], np.float32)  # [H] in
        if self.hybrid:
            outs = g.run(x, pos, slots, self._host_part)
            self.waits += g.waits
        else:
            outs = g.run(x, pos, slots)
        self._account(outs[1:])
        cache.advance(1)
        t._calls += 1
        if self.promoter is not None:  # between replays: the next one reads the new places
            self.promoter.step()
        return outs[0].reshape(1, -1)  # [1, V]

    def _capture(self, cache, pos: int, slots: list[int]):
        t, be, a = self.trunk, self.trunk.be, self.trunk.arch
        H, K = a.hidden_size, a.top_k

        def body(inp, cut=None):
            t._graph_routes, self._cut = [], cut
            try:
                h = t.layers(be.d_view(inp, (1, H)), cache)  # [1, H] final hidden states
                return [be.d_matmul(h, t.w["lm_head"]), *t._graph_routes]  # logits [1, V], routes [2K] each
            finally:
                t._graph_routes, self._cut = None, None

        n_full = len(a.moe_layers) - len(self.hybrid)
        n_out = a.vocab_size + 2 * K * n_full
        self.captures += 1
        if not self.hybrid:
            return be.d_capture_step(H, n_out, body, pos, slots)
        n_out += len(self.hybrid) * (2 * K + H)  # each hand-off's routing and x
        return be.d_capture_segments(H, n_out, len(self.hybrid) * H, body, pos, slots)

    def handoff(self, x, i: int, ids, weights, prep=None):
        """Inside a segmented capture, MoE layer ``i``'s routed experts on the device x [1, H] with the
        router's ids/weights [1, K] left on the device (``prep``: the experts' launch table the router
        wrote, or None): the segment ends with the routing and x copied down (the host then runs
        :meth:`_host_part`), the next one runs this GPU's experts of the layer (host experts at gate 0)
        and the one after adds the host's partial sum, copied up: [1, H]."""
        be, H, K = self.trunk.be, self.trunk.arch.hidden_size, self.trunk.arch.top_k
        route = DArray((2 * K,), ids.buf, ids.owner, ids.offset)  # [ids | weights]
        table = self.tables.get(i)
        if table is None:  # no expert of this layer here: the host's sum is the layer's
            return be.d_view(self._cut([route, be.d_view(x, (H,))], H), (1, H))
        self._cut([route, be.d_view(x, (H,))], 0)
        y = be.d_expert_ffn_indexed(x, ids, weights, table, prep)  # [1, H]: runs while the host computes
        return be.d_add(y, be.d_view(self._cut([], H), (1, H)))

    def _host_part(self, j: int, outs: list) -> np.ndarray:
        """The host's share of hybrid layer ``self.hybrid[j]`` from its routing [2K] and x [H] brought
        down: the experts off this GPU weighted and summed as the eager step does (float32 [H]; zeros when
        every choice is on this GPU). Records the routing, counts the tier uses and charges the local
        experts the trunk's measured seconds per expert."""
        t, a = self.trunk, self.trunk.arch
        m, K, i = t.model, a.top_k, self.hybrid[j]
        r, xh = outs[0], outs[1][None]  # [2K], [1, H]
        ids = r[:K].view(np.int32).astype(np.int64)[None]  # [1, K], descending choice order
        w = r[K:][None]
        if m.routing is not None:
            m.routing.record(i, ids, w)
        uniq, tok_of, gates = group_routes(ids, w, K)
        local, rest = m.experts.local_experts(i, uniq, tok_of, t.be)  # counts the "vram" uses
        if local and t._local_n:
            m.experts.add_local_seconds(self.key, t._local_s / t._local_n * len(local))
        if not rest:
            return np.zeros(a.hidden_size, np.float32)
        self.handoffs += 1
        ys = m.experts.run(i, [uniq[q] for q in rest], [xh] * len(rest), [gates[q] for q in rest],
                           observed=True)
        return scatter_sum(xh, [tok_of[q] for q in rest], ys)[0]

    def _account(self, routes: list) -> None:
        """Record each all-VRAM MoE layer's routing ([ids as int32 bits | weights], 2K floats) as an eager
        step would, count its "vram" uses and charge its experts the trunk's measured seconds per expert
        (hybrid layers: :meth:`_host_part`)."""
        t, a = self.trunk, self.trunk.arch
        m, K = t.model, a.top_k
        full = [i for i in a.moe_layers if i not in self.hybrid]
        p = self.promoter
        if full:  # every layer at once: a few numpy updates for the step, not a few per layer
            r = np.stack(routes[:len(full)])  # [layers, 2K]
            ids = r[:, :K].view(np.int32).astype(np.int64)  # [layers, K], descending choice order
            if m.routing is not None:
                m.routing.record_step(full, ids, r[:, K:])
            m.experts.count_local_step(full, ids)
            if p is not None:
                p.observe_step(full, ids)
        if full and t._local_n:
            m.experts.add_local_seconds(self.key, t._local_s / t._local_n * K * len(full))
