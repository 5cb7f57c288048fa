"""Trunk layer probe: one whole decoder layer's op sequence, timed as the engine runs it (``trunk_layer``).

The GEMV and small-op figures of :mod:`colibri_plan.profiler.trunk_probe` miss what a decode layer pays
beyond bytes: the host work between the ops (Python dispatch, argument checks, one synchronising ``d_get``
per MoE layer, the routing in numpy). This probe runs the layer itself, at the model's shapes
(``profile --model``; a generic 4096-wide GQA layer otherwise), over a chain of ``layers`` distinct weight
sets (so weights are read from memory, not a cache), and divides by the layers run:

- ``path`` "device" (a GPU or any backend's device ops, what :mod:`engine.trunk` runs): d_rmsnorm;
  q/k/v in one ``d_matmul_many``; d_view; d_rope of q and k; K and V rows written (``d_write_rows``);
  ``d_attention`` over ``context_tokens`` keys; o-proj ``d_matmul``; ``d_add``; d_rmsnorm (the FFN norm).
  A MoE layer then hands x to the host: ``d_get`` of x [1, H] (it waits for the queued work), the
  router GEMV x · W_rᵀ [E, H] float32 in numpy, softmax, top-k, the per-expert grouping the engine does
  (argsort, unique, gather), a scatter into out [1, H], ``d_put`` of out and ``d_add`` into the residual.
- ``path`` "host" (the host CPU, what the engine's CPU trunk runs: ``engine/forward.py``,
  ``attention.py``, ``dense_quant.py``): numpy RMSNorm, each of q, k, v, o through the host backend's
  ``matmul`` (one call each), numpy RoPE, K/V rows written into [kv_heads, C, d] arrays, numpy GQA
  attention over ``context_tokens`` keys, residual add, FFN norm, and the same routing on the host.

Figures per entry (seconds per layer, stats over repetitions): ``block_seconds`` (the layer without the
MoE hand-off: norm .. FFN norm), ``moe_layer_seconds`` (with it), ``handoff_seconds`` (their difference,
floored at 0), ``attention_seconds`` (the KV write + attention call alone at ``context_tokens``),
``attention_long_seconds`` (the same at ``long_context_tokens``: their difference over the context
difference is the attention's growth per context token, on this path's own attention code), and
``weight_bytes`` (q, k, v, o stored bytes of one layer), so a planner can swap the bytes of another
shape in at the device's GEMV rate. On the host path, with an expert width, also the routed experts'
call in the engine's rhythm (each call after one layer of trunk work, as the residency manager calls
the CPU backend once per MoE layer): ``expert_one_seconds`` (``expert_ffn`` of 1 expert, 1 token) and
``expert_topk_seconds`` (of top-k distinct experts), at ``expert_width`` in ``expert_fmt``; the fixed
part of a call is t_1 − (t_k − t_1) / (k − 1). Routed and shared experts and dense FFN matrices are not
in the layer: they are priced by the expert cost model and the ``dense_gemv`` figures.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from colibri_plan.formats.profile import stat
from colibri_plan.profiler.trunk_shapes import tiled_weight

#: K/V rows the layer's attention reads (a short decode context)
LAYER_CONTEXT = 64
#: the longer context the attention call is also timed at (its growth per context token)
LONG_CONTEXT = 1024
#: layers that hold a cache of LONG_CONTEXT rows (the long attention runs over them in turn); the others
#: hold LAYER_CONTEXT rows, as a cache sized to the context does (some kernels' cost follows capacity)
LONG_LAYERS = 2
#: weight bytes the chain of distinct layers spans at least (beyond the caches it would otherwise sit in)
CHAIN_BYTES = 256 << 20
MAX_LAYERS = 16
#: most calls in one timed chain
MAX_CHAIN = 256


@dataclass(frozen=True)
class LayerGeometry:
    """The decoder layer the probe runs (elements; ``source`` names where the shape came from)."""

    hidden: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    n_experts: int = 64
    top_k: int = 8
    source: str = "generic"
    expert_width: int = 0
    expert_fmt: str = "int4"
    vocab: int = 0  # the model's vocabulary (the step probe's LM head; 0: a generic layer, no step probe)

    @classmethod
    def from_arch(cls, arch, name: str = "model", expert_fmt: str = "int4") -> LayerGeometry | None:
        """The GQA layer of an ArchConfig (None for MLA, whose attention stays on the host); its routed
        experts' width from the arch, their format ``expert_fmt``."""
        if getattr(arch, "attention", "gqa") == "mla":
            return None
        return cls(int(arch.hidden_size), int(arch.n_heads), int(arch.n_kv_heads), int(arch.head_dim),
                   max(1, int(arch.n_experts or 1)), max(1, int(arch.top_k or 1)), f"{name}",
                   int(getattr(arch, "moe_intermediate_size", 0) or 0), expert_fmt,
                   int(getattr(arch, "vocab_size", 0) or 0))

    def projection_shapes(self) -> tuple[tuple[int, int], ...]:
        """[out, in] of q, k, v, o (elements), in that order."""
        h, qd, kd = self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return (qd, h), (kd, h), (kd, h), (h, qd)

    def weight_bytes(self, fmt: str) -> int:
        """Stored bytes of q, k, v, o of one layer in ``fmt``."""
        from colibri_plan.quant import tensor_bytes

        return sum(tensor_bytes(fmt, o, i) for o, i in self.projection_shapes())


def host_route(xh: np.ndarray, router: np.ndarray, top_k: int) -> np.ndarray:
    """The engine's routing on the host (engine/moe.py routed_experts, less the experts): x [1, H] ->
    out [1, H] (each chosen expert's stand-in output is its gathered x, weighted)."""
    logits = xh @ router.T  # [1, H] · [E, H]ᵀ -> [1, E]
    z = np.exp(logits - logits.max(axis=1, keepdims=True))
    scores = z / z.sum(axis=1, keepdims=True)
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]  # [1, K]
    w = np.take_along_axis(scores, ids, axis=1).astype(np.float32)
    w = w / w.sum(axis=1, keepdims=True)
    flat = ids.ravel()
    order = np.argsort(flat, kind="stable")
    uniq, starts = np.unique(flat[order], return_index=True)
    bounds = list(starts[1:]) + [len(order)]
    tok_of = [order[a:b] // top_k for a, b in zip(starts, bounds)]
    gates = [w.ravel()[order[a:b]] for a, b in zip(starts, bounds)]
    xs = [np.ascontiguousarray(xh[t]) for t in tok_of]  # [T_i, H]
    out = np.zeros_like(xh)
    for t, y, g in zip(tok_of, xs, gates):
        out[t] += y * g[:, None]
    return out


def time_chain(step: Callable[[], object], finish: Callable[[object], object], repetitions: int,
               budget_s: float, chain_s: float) -> tuple[list[float], int]:
    """Seconds per call of ``step`` (which returns a DArray), synchronised by ``finish`` (a ``d_get``) at
    the end of each chain of calls.

    Returns:
        (seconds per call of every repetition, calls per chain). At least one repetition; more while
        they fit ``budget_s``.
    """
    finish(step())  # warm-up: compiles, first touch, allocator growth
    t0 = time.perf_counter()
    finish(step())
    one = time.perf_counter() - t0
    n = max(1, min(MAX_CHAIN, int(chain_s / max(one, 1e-7))))
    reps = max(1, min(repetitions, int(budget_s / max(one * n, 1e-9))))
    out = [one] if n == 1 else []  # a chain of one is what was just timed
    while len(out) < reps:
        t0 = time.perf_counter()
        last = None
        for _ in range(n):
            last = step()
        finish(last)
        out.append((time.perf_counter() - t0) / n)
    return out, n


def chain_layers(geom: LayerGeometry, fmt: str, limit_bytes: int | None) -> int:
    """Distinct layers in the chain: weights enough to span :data:`CHAIN_BYTES`, 2..16, within
    ``limit_bytes`` (weights + KV cache)."""
    per = max(1, geom.weight_bytes(fmt))
    n = min(MAX_LAYERS, max(2, math.ceil(CHAIN_BYTES / per)))
    if limit_bytes is not None:  # a layer holds its weights and its K and V cache, f32
        kv = 8 * geom.n_kv_heads * geom.head_dim
        n = min(n, max(1, (limit_bytes - LONG_LAYERS * kv * LONG_CONTEXT) // (per + kv * LAYER_CONTEXT)))
    return max(1, n)


def _weights(geom: LayerGeometry, fmt: str, layer: int) -> list:
    return [tiled_weight(fmt, o, i, seed=layer * 4 + j) for j, (o, i) in enumerate(geom.projection_shapes())]


def _rope_np(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2  # rotate_half over the whole head: [heads, 1, d]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32)
    return (x / np.sqrt(var + np.float32(1e-6))) * w


class _HostLayers:
    """The CPU trunk's layer through the host backend's ``matmul`` (module docstring, path "host")."""

    def __init__(self, be, geom: LayerGeometry, fmt: str, n: int, ctx: int):
        g, rng = geom, np.random.default_rng(3)
        self.be, self.g, self.ctx = be, geom, ctx
        self.w = [[be.upload(t) for t in _weights(g, fmt, i)] for i in range(n)]
        self.norm = np.ones(g.hidden, np.float32)
        self.router = rng.standard_normal((g.n_experts, g.hidden), np.float32) * 0.02  # [E, H]
        self.n_keys = ctx
        self.k = [rng.standard_normal((g.n_kv_heads, c, g.head_dim), np.float32) * 0.1
                  for c in [ctx] * n + [LONG_CONTEXT] * LONG_LAYERS]  # short caches, then the long ones
        self.v = [a.copy() for a in self.k]
        freqs = (ctx - 1) * 10000.0 ** (-np.arange(g.head_dim // 2, dtype=np.float32) / (g.head_dim // 2))
        self.cos, self.sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
        self.h = rng.standard_normal((1, g.hidden), np.float32)

    def attention(self, i: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        g, p = self.g, self.n_keys - 1
        i = i if self.n_keys <= self.ctx else len(self.k) - 1 - i % LONG_LAYERS
        self.k[i][:, p:p + 1], self.v[i][:, p:p + 1] = k, v  # [nkv, 1, d] at the last position
        keys, values = self.k[i][:, :self.n_keys], self.v[i][:, :self.n_keys]  # [nkv, C, d]
        qg = q.reshape(g.n_kv_heads, g.n_heads // g.n_kv_heads, 1, g.head_dim)
        s = np.matmul(qg, keys[:, None].transpose(0, 1, 3, 2)) * np.float32(g.head_dim ** -0.5)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        probs = s / s.sum(axis=-1, keepdims=True)  # [nkv, g, 1, C]
        return np.matmul(probs, values[:, None]).reshape(1, g.n_heads * g.head_dim)

    def layer(self, i: int, moe: bool) -> None:
        be, g, (wq, wk, wv, wo) = self.be, self.g, self.w[i]
        xa = _rms(self.h, self.norm)  # [1, H]
        q, k, v = be.matmul(xa, wq), be.matmul(xa, wk), be.matmul(xa, wv)  # one call each, as QuantLinear
        q = _rope_np(q.reshape(1, g.n_heads, g.head_dim).transpose(1, 0, 2), self.cos, self.sin)
        k = _rope_np(k.reshape(1, g.n_kv_heads, g.head_dim).transpose(1, 0, 2), self.cos, self.sin)
        o = self.attention(i, q, k, v.reshape(1, g.n_kv_heads, g.head_dim).transpose(1, 0, 2))
        self.h = self.h + be.matmul(np.ascontiguousarray(o), wo)
        x = _rms(self.h, self.norm)
        if moe:
            self.h = self.h + host_route(x, self.router, g.top_k)

    def attention_only(self, i: int) -> None:
        g = self.g
        q = np.ones((g.n_heads, 1, g.head_dim), np.float32)
        kv = np.ones((g.n_kv_heads, 1, g.head_dim), np.float32)
        self.attention(i, q, kv, kv)

    def close(self) -> None:
        for ws in self.w:
            for w in ws:
                self.be.free(w)


class _DeviceLayers:
    """The device trunk's layer through the ``d_*`` ops (module docstring, path "device")."""

    def __init__(self, be, geom: LayerGeometry, fmt: str, n: int, ctx: int):
        from colibri_plan.backends import rope_table

        g, rng = geom, np.random.default_rng(3)
        self.be, self.g, self.ctx = be, geom, ctx
        self.w = [[be.upload(t) for t in _weights(g, fmt, i)] for i in range(n)]
        self.norm = be.d_put(np.ones((g.hidden,), np.float32))
        self.router = rng.standard_normal((g.n_experts, g.hidden), np.float32) * 0.02  # [E, H] on the host
        inv = 10000.0 ** (-np.arange(g.head_dim // 2, dtype=np.float32) / (g.head_dim // 2))
        self.n_keys = ctx
        self.table = be.d_put(rope_table(inv, LONG_CONTEXT))  # [C, d/2, 2]
        block = rng.standard_normal((LONG_CONTEXT, g.n_kv_heads, g.head_dim), np.float32) * 0.1
        self.k, self.v = [], []
        for c in [ctx] * n + [LONG_CONTEXT] * LONG_LAYERS:  # short caches, then the long ones
            shape = (c, g.n_kv_heads, g.head_dim)
            k, v = be.d_zeros(shape), be.d_zeros(shape)
            rows = be.d_put(block[:c])
            be.d_write_rows(k, 0, rows)
            be.d_write_rows(v, 0, rows)
            self.k.append(k)
            self.v.append(v)
        self.h = be.d_put(rng.standard_normal((1, g.hidden), np.float32))
        self.q1 = be.d_put(np.ones((1, g.n_heads, g.head_dim), np.float32))
        self.kv1 = be.d_put(np.ones((1, g.n_kv_heads, g.head_dim), np.float32))

    def layer(self, i: int, moe: bool) -> None:
        be, g, (wq, wk, wv, wo), p = self.be, self.g, self.w[i], self.ctx - 1
        xa = be.d_rmsnorm(self.h, self.norm, 1e-6)  # [1, H]
        q, k, v = be.d_matmul_many(xa, [wq, wk, wv])
        q = be.d_view(q, (1, g.n_heads, g.head_dim))
        k, v = be.d_view(k, (1, g.n_kv_heads, g.head_dim)), be.d_view(v, (1, g.n_kv_heads, g.head_dim))
        q = be.d_rope(q, self.table, p, g.head_dim, False)
        k = be.d_rope(k, self.table, p, g.head_dim, False)
        be.d_write_rows(self.k[i], p, k)
        be.d_write_rows(self.v[i], p, v)
        o = be.d_attention(q, self.k[i], self.v[i], self.ctx, p, g.head_dim ** -0.5)  # [1, nh·d]
        self.h = be.d_add(self.h, be.d_matmul(o, wo))
        x = be.d_rmsnorm(self.h, self.norm, 1e-6)
        if moe:  # the hand-off: x down (waits for the queue), routing on the host, the sum back up
            out = be.d_put(host_route(be.d_get(x), self.router, g.top_k))
            self.h = be.d_add(self.h, out)

    def attention_only(self, i: int) -> None:
        be, p = self.be, self.n_keys - 1
        i = i if self.n_keys <= self.ctx else len(self.k) - 1 - i % LONG_LAYERS
        be.d_write_rows(self.k[i], p, self.kv1)
        be.d_write_rows(self.v[i], p, self.kv1)
        self.h_att = be.d_attention(self.q1, self.k[i], self.v[i], self.n_keys, p, self.g.head_dim ** -0.5)

    def close(self) -> None:
        for ws in self.w:
            for w in ws:
                self.be.free(w)


def paired_chains(steps: list[Callable[[], object]], finish: Callable[[object], object], repetitions: int,
                  budget_s: float) -> list[list[float]]:
    """Seconds of each step (a chain of layers, synchronised by ``finish``), the steps timed in turn within
    each repetition, so a difference between two steps is taken under the same load. One warm-up call
    each first; at least one repetition, more while they fit ``budget_s``.

    Returns:
        one list of seconds per step, ``repetitions`` long at most, all of the same length.
    """
    for step in steps:
        finish(step())  # compiles, first touch
    out: list[list[float]] = [[] for _ in steps]
    end = time.perf_counter() + budget_s
    while len(out[0]) < max(1, repetitions) and (not out[0] or time.perf_counter() < end):
        for step, secs in zip(steps, out):
            t0 = time.perf_counter()
            finish(step())
            secs.append(time.perf_counter() - t0)
    return out


def _expert_calls(be, run, geom: LayerGeometry, n: int, repetitions: int) -> dict:
    """``expert_ffn`` of 1 and of top-k distinct experts, each call after one layer of trunk work (the
    engine's rhythm: between two MoE layers' expert calls the host runs a layer), timed alone."""
    h, w, k = geom.hidden, geom.expert_width, max(2, geom.top_k)
    fmt = geom.expert_fmt
    ex = [be.upload_expert(tiled_weight(fmt, w, h, 3 * e), tiled_weight(fmt, w, h, 3 * e + 1),
                           tiled_weight(fmt, h, w, 3 * e + 2)) for e in range(k + 1)]
    x = np.random.default_rng(9).standard_normal((1, h), np.float32)  # [1, H]
    one, many = [], []
    try:
        for r in range(max(1, repetitions) + 1):  # the first pair warms up (compiles)
            for sel, out in (([ex[r % (k + 1)]], one), (ex[:k], many)):
                run.layer(r % n, True)
                t0 = time.perf_counter()
                be.expert_ffn([x] * len(sel), sel)
                if r:
                    out.append(time.perf_counter() - t0)
    finally:
        for e in ex:
            for wt in e:
                be.free(wt)
    return {"expert_width": int(w), "expert_fmt": fmt, "expert_topk": int(k), "expert_one_seconds": stat(one),
            "expert_topk_seconds": stat(many)}


def probe_layer(be, base: dict, geom: LayerGeometry, fmt: str, path: str, limit_bytes: int | None,
                repetitions: int, budget_s: float) -> dict:
    """The ``trunk_layer`` entry of one opened backend on ``path`` ("device" or "host") in ``fmt``.

    Each step runs every layer of the chain once (a decode token's worth of layers, synchronised by one
    ``d_get`` on the device path); seconds are per layer. The layer without and with the MoE hand-off
    are timed in turn, and so are the attention call at the two contexts, so the hand-off (their
    difference per repetition) and the attention's growth are taken under the same load.

    Raises:
        whatever the backend raises (the caller records the device as skipped).
    """
    n = chain_layers(geom, fmt, limit_bytes)
    ctx = LAYER_CONTEXT
    run = (_HostLayers if path == "host" else _DeviceLayers)(be, geom, fmt, n, ctx)
    try:
        finish = (lambda _r: None) if path == "host" else be.d_get

        def layers(moe: bool) -> Callable[[], object]:
            def step():
                for i in range(n):
                    run.layer(i, moe)
                return run.h
            return step

        def attention(keys: int) -> Callable[[], object]:
            def step():
                run.n_keys = keys
                for i in range(n):
                    run.attention_only(i)
                return getattr(run, "h_att", run.h)
            return step

        block, moe = paired_chains([layers(False), layers(True)], finish, repetitions, 0.7 * budget_s)
        att, att_long = paired_chains([attention(ctx), attention(LONG_CONTEXT)], finish, repetitions,
                                      0.3 * budget_s)
        calls = _expert_calls(be, run, geom, n, repetitions) if path == "host" and geom.expert_width else {}
    finally:
        run.close()

    def per_layer(secs: list[float]) -> dict:
        return stat(s / n for s in secs)

    return {**base, "path": path, "fmt": fmt, "hidden": geom.hidden, "n_heads": geom.n_heads,
            "n_kv_heads": geom.n_kv_heads, "head_dim": geom.head_dim, "n_experts": geom.n_experts,
            "top_k": geom.top_k, "context_tokens": ctx, "layers": int(n), "shape_source": geom.source,
            "weight_bytes": int(geom.weight_bytes(fmt)), "block_seconds": per_layer(block),
            "moe_layer_seconds": per_layer(moe),
            "handoff_seconds": per_layer([max(m - b, 1e-9 * n) for b, m in zip(block, moe)]),
            "attention_seconds": per_layer(att), "long_context_tokens": LONG_CONTEXT,
            "attention_long_seconds": per_layer(att_long), **calls,
            "method": f"{n} distinct layers run in turn, per layer; the layer without and with the MoE "
                      "hand-off timed in turn (hand-off = their difference per repetition)"}
