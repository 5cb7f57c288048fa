"""The decoder stack, written once against the backend's device ops: the host is a device like any other.

:class:`Trunk` runs :meth:`Model.hidden_states` / :meth:`Model.forward` of every supported family on the
device ops of one backend (the contract: :mod:`colibri_plan.backends.contract`): a GPU (CUDA, Vulkan,
OpenCL, Metal) or a host backend ("cpu", "numpy"), whose "device" arrays are numpy arrays in RAM.
`run --trunk cpu` and `run --trunk device` are this same code on two devices. What it uploads is
:mod:`colibri_plan.engine.trunk_weights`.

Each decoder layer is pre-norm, ``h += attn(rmsnorm(h)); h += ffn(rmsnorm(h))``, then a final RMSNorm and
the LM head, as in the transformers modeling code of every supported family:

- GQA attention: q/k/v (+ bias; q/k RMSNorm per head or over the projection; clip_qkv through a host
  round trip, a rare option); RoPE of the first ``rotary_dim`` channels (rotate_half or interleaved
  pairs, YaRN's attention factor in the table); K/V appended to the
  :class:`~colibri_plan.engine.kv_device.DeviceKVCache`; causal ``d_attention`` (sliding-window layers
  too); o-proj (+ bias). Where the backend declares ``d_attention_prologue`` (CUDA), the per-head norms,
  RoPE and the cache append are that one op (one launch, the same bits).
- MLA attention (DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-5), weight-absorbed at every length: q (through the
  normed q_a when ``q_lora_rank``); the latent (kv_a's latent rows, RMSNorm) and the rope key (kv_a's rope
  rows, RoPE) written as one cache row [k_rope | latent] of the
  :class:`~colibri_plan.engine.kv_device.DeviceLatentCache`; the query [q_rope | W_ukᵀ q_nope] from one
  ``d_head_matmul``; ``d_attention`` over the cache rows as keys and values of one kv head (the absorbed
  core: q_abs·latent + q_rope·k_rope, Σ p · latent); W_uv per head (``d_head_matmul``); o-proj. Same
  numbers as transformers' expanded ``DeepseekV3Attention`` up to float32 summation order.
- MoE layers: the normed x comes down once (``d_get``; on a host backend, no copy) for the router and top-k
  (:func:`~colibri_plan.engine.moe.route_tokens`, exactly the transformers routing of each family) — or,
  on a GPU that declares ``d_router_topk`` with the manager's experts on it, the router and top-k run on
  the device and only ids and weights come down (:mod:`~colibri_plan.engine.device_route`; x follows only
  for experts off this device; ``routing_off`` says why not). On a
  host backend the routed experts run through the provider (:func:`~colibri_plan.engine.moe.routed_experts`:
  one fused call per decode step on the cpu backend). On a GPU, with a residency manager as provider, the
  chosen experts it holds in VRAM on this very backend run on the device x (``d_expert_ffn``; at prefill
  ``d_expert_ffn_rows`` where the backend has it), queued before the host's work; the others run through
  the manager and their sum goes up once (``d_put``) — but for a prefill of at least
  ``PREFILL_OFFLOAD_TOKENS`` rows on such a backend, the host tiers' experts are copied up and computed in
  the same call (:mod:`~colibri_plan.engine.offload`). Shared experts (Qwen2-MoE's sigmoid gate from the
  host's x, applied with ``d_scale_rows``) and dense FFN layers run on the device.

Local experts are accounted as the manager's own: a "vram" use each, and their seconds charged to that
device's expert compute and to the experts' layer wall time — measured (bracketed by synchronizations) on
one decode step in :data:`GPU_ATTENTION_SAMPLE`, the other steps charged the measured seconds per expert.
"""

from __future__ import annotations

import time

import numpy as np

from colibri_plan.backends import HOST_BACKENDS, DArray, rope_table
from colibri_plan.engine.decode_graph import DecodeGraph
from colibri_plan.engine.dense_quant import QuantLinear
from colibri_plan.engine.device_route import DeviceRouter, device_routing_off_reason
from colibri_plan.engine.kv_device import DeviceKVCache, DeviceLatentCache
from colibri_plan.engine.mla import LATENT_NORM_EPS, check_dsa_context
from colibri_plan.engine.moe import group_routes, route_tokens, routed_experts, scatter_sum
from colibri_plan.engine.offload import PREFILL_OFFLOAD_TOKENS, offload_enabled
from colibri_plan.engine.trunk_weights import (
    absorbed_weights,
    rope_positions,
    trunk_dense_bytes,
    trunk_kv_bytes,
    trunk_tensors,
)
from colibri_plan.errors import ColibriError, InputError, UnsupportedError
from colibri_plan.families.rope import attention_factor, mla_softmax_scale
from colibri_plan.quant import quantize

__all__ = ["Trunk", "trunk_dense_bytes", "trunk_kv_bytes", "HOST_BACKENDS"]

#: on a GPU backend, attention is timed (two synchronizations per layer) on one decode step of this many
GPU_ATTENTION_SAMPLE = 8
_NOT_TRIED = "no decode step yet"


class Trunk:
    """A model's decoder stack on one backend's device (see the module docstring).

    Args:
        model: the :class:`~colibri_plan.engine.forward.Model` (arch, dense tensors, expert provider,
            routing recorder, RoPE frequencies).
        backend: an open backend; its ``d_*`` ops and ``upload`` hold the trunk.
        context_tokens: tokens the cache and RoPE table reserve at open (the plan's
            ``trunk.kv.context_tokens``); a longer run grows both by whole pages.
        measure: time attention and the local experts (a trunk placed on a device: the run report's
            terms); the CPU trunk of a run does not.

    Attributes:
        dense_bytes: bytes uploaded (matrices, vectors, MLA's absorbed weights, RoPE table).
        attention_s, attention_steps: with ``measure``, attention seconds (cache append + ``d_attention``,
            all layers) summed over the timed forward calls (every call on a host backend, one in
            :data:`GPU_ATTENTION_SAMPLE` on a GPU, bracketed by synchronizations), and how many were timed.

    Raises:
        InputError: a dense tensor the trunk needs is missing. DeviceOutOfMemoryError /
        BackendUnavailableError: from the uploads (nothing stays uploaded).
    """

    def __init__(self, model, backend, context_tokens: int = 0, measure: bool = True):
        self.model, self.be, self.arch = model, backend, model.arch
        self.context_tokens = max(0, int(context_tokens))
        self._mla = self.arch.attention == "mla"
        self.time_attention = bool(measure)
        self.attention_every = 1 if getattr(backend, "name", "") in HOST_BACKENDS else GPU_ATTENTION_SAMPLE
        # a residency manager's experts held on this very device run on its x (d_expert_ffn)
        held = any(d is backend for d in getattr(model.experts, "devices", {}).values())
        self._split = getattr(model.experts, "local_experts", None) if held else None
        # prefill's routed rows on the device x, where the backend declares the op (CUDA)
        self._rows_op = backend.d_expert_ffn_rows if backend.supports("d_expert_ffn_rows") else None
        # ... and a long prefill's host experts copied up and run there too (engine/offload.py)
        self._offload = (self._rows_op is not None and self._split is not None and offload_enabled()
                         and hasattr(model.experts, "offload_experts"))
        # routing on the device where the experts' split runs here (engine/device_route.py)
        self.routing_off = (device_routing_off_reason(backend, self.arch) if self._split is not None
                            else "no experts of a residency manager on this device")
        self._router = None
        # a GQA layer's q/k norms, RoPE and cache append in one launch, where the backend declares it
        fused = not self._mla and backend.supports("d_attention_prologue")
        self._prologue = backend.d_attention_prologue if fused else None
        self.prologue_off = None if self._prologue is not None else "no d_attention_prologue here"
        self._step_graph = None  # engine/decode_graph.py's DecodeGraph, made at the first decode step
        self._graph_routes = None  # while a decode step is captured: each MoE layer's device routing
        self.graph_off = _NOT_TRIED  # why decode steps run eagerly (None: they replay a graph)
        self.reset_stats()
        self._weights: list = []
        self.w: dict[str, object] = {}
        self.dense_bytes = 0
        self._rope, self._rope_rows = None, 0
        try:
            self._upload(model.dense)
            if self.routing_off is None and self.arch.moe_layers:
                self._router = DeviceRouter(backend, self.arch, model.dense)
        except BaseException:
            self.close()
            raise

    def _upload(self, dense: dict) -> None:
        be, a = self.be, self.arch
        for key, v, matrix in trunk_tensors(a, dense):
            if matrix:
                qt = v.qt if isinstance(v, QuantLinear) else quantize(np.asarray(v, np.float32), "f32")
                w = be.upload(qt)
                self._weights.append(w)
                self.dense_bytes += qt.nbytes
            else:
                w = be.d_put(np.asarray(v, np.float32))
                self.dense_bytes += w.nbytes
            self.w[key] = w
        if self._mla:
            for i in range(a.n_layers):
                p = f"layers.{i}.attn."
                for name, arr in zip(("absorb_q", "absorb_o"), absorbed_weights(a, dense[p + "kv_b"])):
                    self.w[p + name] = be.d_put(arr)  # [nh, dr + R, dn + dr], [nh, dv, dr + R]
                    self.dense_bytes += arr.nbytes
        if a.rotary_dim:
            self._grow_rope(self.context_tokens)

    # ---- state -----------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the attention timing (the session calls it after the prefill)."""
        self.attention_s, self.attention_steps, self._calls = 0.0, 0, 0
        self._local_s, self._local_n = 0.0, 0  # measured seconds of local experts, and how many
        self._prefill_expert_s = 0.0  # a prefill's device seconds per expert, last timed (sampled) call

    def _grow_rope(self, tokens: int) -> None:
        rows = rope_positions(tokens)
        if rows <= self._rope_rows:
            return
        a = self.arch
        table = rope_table(self.model.inv_freq, rows, attention_factor(a), a.rope_scaling_factor)
        old = self._rope
        self._rope, self._rope_rows = self.be.d_put(table), rows  # [P, rd/2, 2]
        self.dense_bytes += self._rope.nbytes - (0 if old is None else old.nbytes)

    def new_cache(self, capacity: int = 256) -> DeviceKVCache:
        """An empty cache reserving max(context_tokens, capacity) tokens in whole pages: a
        :class:`DeviceKVCache` (GQA) or a :class:`DeviceLatentCache` (MLA)."""
        a, n = self.arch, max(self.context_tokens, int(capacity))
        if self._mla:
            return DeviceLatentCache(self.be, a.n_layers, a.qk_rope_head_dim, a.kv_lora_rank, n)
        return DeviceKVCache(self.be, a.n_layers, a.n_kv_heads, a.head_dim, n)

    def _check_cache(self, cache) -> None:
        want = DeviceLatentCache if self._mla else DeviceKVCache
        if not isinstance(cache, want) or cache.backend is not self.be:
            raise InputError(f"the trunk needs a cache from Model.new_cache() ({want.__name__} on "
                             f"{getattr(self.be, 'name', 'its backend')}), got {type(cache).__name__}")

    # ---- layers ----------------------------------------------------------------------------------
    def _bias(self, y: DArray, key: str) -> DArray:
        b = self.w.get(key)
        return y if b is None else self.be.d_add(y, b)

    def _swiglu(self, x: DArray, prefix: str) -> DArray:
        be, w = self.be, self.w
        g, u = be.d_matmul_many(x, [w[prefix + "gate"], w[prefix + "up"]])  # [T, I] each, one launch on GPUs
        return be.d_matmul(be.d_silu_mul(g, u), w[prefix + "down"])  # [T, H]

    def _attend(self, q: DArray, cache, i: int, k: DArray, v: DArray, scale: float, window: int,
                timed: bool) -> DArray:
        """Append this call's cache rows, then causal attention of q [T, Hq, d] -> [T, Hq·d] (timed on a
        sampled GPU step)."""
        be, t, pos0 = self.be, q.shape[0], cache.length
        if timed:
            be.synchronize()
            t0 = time.perf_counter()
        # [C, Hkv, d] each, rows < pos0 + T valid (k None: the fused prologue wrote this call's rows)
        keys, values = cache.append(i, k, v) if k is not None else (cache.k[i], cache.v[i])
        o = be.d_attention(q, keys, values, pos0 + t, pos0, scale, window)  # [T, Hq·d]
        if timed:
            be.synchronize()
            self.attention_s += time.perf_counter() - t0
        return o

    def _gqa(self, x: DArray, i: int, cache: DeviceKVCache, timed: bool) -> DArray:
        """GQA self-attention of the normed x [T, H] -> [T, H]."""
        be, a, w = self.be, self.arch, self.w
        p = f"layers.{i}.attn."
        d, eps = a.head_dim, a.rms_norm_eps
        q, k, v = be.d_matmul_many(x, [w[p + n] for n in "qkv"])  # [T, nh·d], [T, nkv·d], [T, nkv·d]
        q, k, v = (self._bias(m, p + n + "_bias") for m, n in zip((q, k, v), "qkv"))
        if a.qk_norm == "full":  # OLMoE: one RMSNorm over the whole projection
            q, k = be.d_rmsnorm(q, w[p + "q_norm"], eps), be.d_rmsnorm(k, w[p + "k_norm"], eps)
        if a.clip_qkv is not None:  # rare option: a host round trip keeps the device ops few
            c = np.float32(a.clip_qkv)
            q, k, v = (be.d_put(np.clip(be.d_get(m), -c, c)) for m in (q, k, v))
        q, k, v = self._qk_prologue(q, k, v, i, cache)  # [T, heads, d]; k, v None: already in the cache
        window = a.sliding_window if a.sliding_window and i in a.sliding_layers else 0
        o = self._attend(q, cache, i, k, v, d ** -0.5, window, timed)  # [T, nh·d]
        return self._bias(be.d_matmul(o, w[p + "o"]), p + "o_bias")  # [T, H]

    def _qk_prologue(self, q: DArray, k: DArray, v: DArray, i: int, cache: DeviceKVCache) -> tuple:
        """Per-head q/k RMSNorm (``qk_norm == "head"``) and RoPE of q [T, nh·d], k and v [T, nkv·d] ->
        q, k, v [T, heads, d]; on a backend with ``d_attention_prologue`` one launch that also appends
        k and v to the cache: (q, None, None). Same bits either way."""
        be, a, w = self.be, self.arch, self.w
        p = f"layers.{i}.attn."
        t, nh, nkv, d, eps = q.shape[0], a.n_heads, a.n_kv_heads, a.head_dim, a.rms_norm_eps
        head = a.qk_norm == "head"
        q, k, v = be.d_view(q, (t, nh, d)), be.d_view(k, (t, nkv, d)), be.d_view(v, (t, nkv, d))
        if self._prologue is not None and (head or a.rotary_dim):
            norms = (w[p + "q_norm"], w[p + "k_norm"]) if head else None
            rope = (self._rope, a.rotary_dim, a.rope_interleave) if a.rotary_dim else None
            keys, values = cache.rows(i, t)
            try:
                return self._prologue(q, k, v, norms, eps, rope, keys, values, cache.length), None, None
            except UnsupportedError as exc:  # refused before any work (a head too wide): unfused from now on
                self._prologue, self.prologue_off = None, str(exc)
        if head:  # per head: rows of [T·heads, d]
            q = be.d_view(be.d_rmsnorm(be.d_view(q, (t * nh, d)), w[p + "q_norm"], eps), (t, nh, d))
            k = be.d_view(be.d_rmsnorm(be.d_view(k, (t * nkv, d)), w[p + "k_norm"], eps), (t, nkv, d))
        if a.rotary_dim:
            q = be.d_rope(q, self._rope, cache.length, a.rotary_dim, a.rope_interleave)
            k = be.d_rope(k, self._rope, cache.length, a.rotary_dim, a.rope_interleave)
        return q, k, v

    def _mla_attn(self, x: DArray, i: int, cache: DeviceLatentCache, timed: bool) -> DArray:
        """Weight-absorbed MLA self-attention of the normed x [T, H] -> [T, H] (module docstring)."""
        be, a, w = self.be, self.arch, self.w
        p = f"layers.{i}.attn."
        t, nh, dn, dr, dv, r = (x.shape[0], a.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
                                a.kv_lora_rank)
        if a.q_lora_rank:  # q_a, the latent and the rope key read the same x: one launch on GPUs
            qa, lat, kr = be.d_matmul_many(x, [w[p + "q_a"], w[p + "kv_a.latent"], w[p + "kv_a.rope"]])
            qa = be.d_rmsnorm(self._bias(qa, p + "q_a_bias"), w[p + "q_a_norm"], LATENT_NORM_EPS)  # [T, Rq]
            q = be.d_matmul(qa, w[p + "q_b"])  # [T, nh·(dn + dr)]
        else:
            q, lat, kr = be.d_matmul_many(x, [w[p + "q"], w[p + "kv_a.latent"], w[p + "kv_a.rope"]])
        lat = be.d_rmsnorm(self._bias(lat, p + "kv_a.latent_bias"), w[p + "kv_a_norm"], LATENT_NORM_EPS)
        kr = be.d_view(self._bias(kr, p + "kv_a.rope_bias"), (t, 1, dr))
        kr = be.d_rope(kr, self._rope, cache.length, dr, a.rope_interleave)  # [T, 1, dr]: one key, all heads
        query = be.d_head_matmul(be.d_view(q, (t, nh, dn + dr)), w[p + "absorb_q"])  # [T, nh, dr + R]
        query = be.d_rope(query, self._rope, cache.length, dr, a.rope_interleave)
        o = self._attend(query, cache, i, be.d_view(kr, (t, dr)), lat, mla_softmax_scale(a), 0, timed)
        o = be.d_head_matmul(be.d_view(o, (t, nh, dr + r)), w[p + "absorb_o"])  # [T, nh, dv]: W_uv o_lat
        return self._bias(be.d_matmul(be.d_view(o, (t, nh * dv)), w[p + "o"]), p + "o_bias")  # [T, H]

    def _moe(self, x: DArray, i: int, sampled: bool) -> DArray:
        """Routed + shared experts of MoE layer ``i`` on the normed x [T, H] -> [T, H]."""
        be, a, m = self.be, self.arch, self.model
        p = f"layers.{i}."
        on_device = self._router is not None and (x.shape[0] == 1 or self._rows_op is not None)
        # [T, H] down once (a view on a host backend) for the host's router, unless it runs on the device
        xh = None if on_device and not a.shared_expert_gate else be.d_get(x)
        # the shared expert is queued first: a GPU runs it while the host runs the routed ones
        shared = self._swiglu(x, p + "shared.") if a.shared_intermediate_size else None
        if shared is not None and a.shared_expert_gate:  # Qwen2-MoE: sigmoid(x · w) per token
            z = (xh @ m.dense[p + "shared_gate"].T)[:, 0]  # [T]
            shared = be.d_scale_rows(shared, 1.0 / (1.0 + np.exp(-z)))
        out = self._routed(x, xh, i, sampled)  # [T, H]
        return out if shared is None else be.d_add(out, shared)

    def _routed(self, x: DArray, xh: np.ndarray | None, i: int, sampled: bool) -> DArray:
        """The routed experts' weighted sum of MoE layer ``i`` on the device [T, H] (module docstring);
        ``xh`` the host copy of x, or None when the routing runs on the device."""
        be, a, m = self.be, self.arch, self.model
        split = self._split
        T = x.shape[0]
        rows_op = self._rows_op
        if split is None or (T != 1 and rows_op is None):  # all through the provider
            return be.d_put(routed_experts(xh, i, a, m.dense, m.experts, m.routing))
        if self._graph_routes is not None:  # a captured step: this GPU's experts indexed on the device
            graph = self._step_graph  # ids, weights [1, K] left on the device; prep: the experts' table
            ids, weights, prep = self._router.on_device_indexed(x, i, graph.tables.get(i))
            if weights.buf is not ids.buf or weights.offset != ids.offset + a.top_k:
                raise UnsupportedError(f"{be.name}: d_router_topk's ids and weights are not back to back")
            if i in graph.hybrid:  # some experts on the host: the step is cut here (decode_graph.py)
                return graph.handoff(x, i, ids, weights, prep)
            self._graph_routes.append(DArray((2 * a.top_k,), ids.buf, ids.owner, ids.offset))  # [ids | w]
            return be.d_expert_ffn_indexed(x, ids, weights, graph.tables[i], prep)
        if self._router is not None:  # ids and weights [T, K] come down, not x
            ids, weights = self._router.route(x, i)
            if m.routing is not None:
                m.routing.record(i, ids, weights)
            uniq, tok_of, gates = group_routes(ids, weights, a.top_k)
        else:
            uniq, tok_of, gates = route_tokens(xh, i, a, m.dense, m.routing)  # decode: tok_of[j] == [0]
        # the split reads only each expert's row count: rows are gathered for the host's experts alone (a
        # prefill's gather of every expert's rows cost more than the device's experts did)
        local, rest = split(i, uniq, tok_of, be)
        off = None
        if rest and T >= PREFILL_OFFLOAD_TOKENS and self._offload:  # host experts up, computed here
            off = m.experts.offload_experts(i, uniq, rest, be)  # engine/offload.py
            rest = off.left
        y = None
        try:
            if local or (off is not None and off.taken):
                y = self._device_experts(x, local, [] if off is None else off.taken,
                                         None if off is None else off.key, tok_of, gates, sampled)
        finally:
            if off is not None:
                off.release()
        if rest:  # x comes down when some chosen experts live off this device (once per layer)
            xh = be.d_get(x) if xh is None else xh
            xs = [xh if T == 1 else np.ascontiguousarray(xh[tok_of[j]]) for j in rest]  # [T_j, H] each
            ys = m.experts.run(i, [uniq[j] for j in rest], xs, [gates[j] for j in rest], observed=True)
            host = be.d_put(scatter_sum(xh, [tok_of[j] for j in rest], ys))  # [T, H] up once
            y = host if y is None else be.d_add(y, host)
        return y

    def _device_experts(self, x: DArray, local: list, taken: list, off_key: str | None, tok_of, gates,
                        sampled: bool) -> DArray:
        """The device's own experts ``local`` [(position, key, weights)] and a prefill's offloaded host
        experts ``taken`` [(position, weights on this device)] on the device x: their weighted sum [T, H]."""
        be, m, T = self.be, self.model, x.shape[0]
        # a sampled call's device experts are timed on their own; the others queue behind the trunk's work
        # and the next layer's is queued behind them (no wait: a prefill's GPU no longer idles per layer)
        timed = sampled
        if timed:
            be.synchronize()  # the queued trunk work is not the experts'
        t0 = time.perf_counter()
        if T == 1:
            y = be.d_expert_ffn(x, [w for _, _, w in local],
                                np.array([gates[j][0] for j, _, _ in local], np.float32))  # [1, H]
        else:  # each expert on its own tokens' rows of the device x, ascending positions, [T, H]
            jobs = sorted([(j, w) for j, _, w in local] + list(taken), key=lambda t: t[0])
            pos = [j for j, _ in jobs]
            y = self._rows_op(x, [w for _, w in jobs], [tok_of[j] for j in pos], [gates[j] for j in pos])
        if timed:
            be.synchronize()
            seconds = time.perf_counter() - t0
            if T == 1:
                self._local_s, self._local_n = self._local_s + seconds, self._local_n + len(local)
            elif local or taken:
                self._prefill_expert_s = seconds / (len(local) + len(taken))
        # untimed: charged at the last timed call's seconds per expert (decode: the mean of the timed ones)
        per_expert = self._local_s / max(1, self._local_n) if T == 1 else self._prefill_expert_s
        keys = [k for _, k, _ in local] + [off_key] * len(taken)
        for k in sorted(set(keys)):  # one device key but for aliases of one backend
            m.experts.add_local_seconds(k, per_expert * keys.count(k))
        return y

    # ---- the forward pass ------------------------------------------------------------------------
    def _run(self, ids: np.ndarray, cache) -> DArray:
        """The decoder layers and the final norm: final hidden states DArray [T, H]."""
        be, a, m = self.be, self.arch, self.model
        self._check_cache(cache)
        t = len(ids)
        check_dsa_context(a, cache.length, t)  # DSA beyond index_topk: refused before any work
        cache.reserve(cache.length + t)  # whole pages, before layer 0 writes
        if a.rotary_dim:
            self._grow_rope(cache.capacity)
        sampled = self._calls % self.attention_every == 0  # this call's device work is timed
        timed = self.time_attention and sampled
        h = self.layers(be.d_put(m.dense["embed"][ids]), cache, sampled, timed)  # embedded on the host
        cache.advance(t)
        if timed:
            self.attention_steps += 1
        self._calls += 1
        return h

    def layers(self, h: DArray, cache, sampled: bool = False, timed: bool = False) -> DArray:
        """The decoder layers and the final norm on the device h [T, H] (the embedded tokens), appending
        at ``cache.length`` (the caller advances it): final hidden states [T, H]."""
        be, a, w, eps = self.be, self.arch, self.w, self.arch.rms_norm_eps
        attn = self._mla_attn if self._mla else self._gqa
        # each residual add fused with the norm after it (d_add_rmsnorm: one launch on CUDA, the same bits)
        x = be.d_rmsnorm(h, w["layers.0.attn_norm"], eps) if a.n_layers else None
        for i in range(a.n_layers):
            p = f"layers.{i}."
            h, x = be.d_add_rmsnorm(h, attn(x, i, cache, timed), w[p + "ffn_norm"], eps)  # [T, H] each
            y = self._moe(x, i, sampled) if a.is_moe_layer(i) else self._swiglu(x, p + "ffn.")
            nxt = f"layers.{i + 1}.attn_norm" if i + 1 < a.n_layers else "final_norm"
            h, x = be.d_add_rmsnorm(h, y, w[nxt], eps)
        return x if a.n_layers else be.d_rmsnorm(h, w["final_norm"], eps)

    def hidden_states(self, ids: np.ndarray, cache) -> np.ndarray:
        """Final-norm hidden states float32 [T, H] on the host (ids checked by the Model)."""
        return self.be.d_get(self._run(ids, cache))

    def forward(self, ids: np.ndarray, cache) -> np.ndarray:
        """Logits float32 [T, V] on the host."""
        return self.be.d_get(self.be.d_matmul(self._run(ids, cache), self.w["lm_head"]))

    def last_logits(self, ids: np.ndarray, cache) -> np.ndarray:
        """Logits float32 [1, V] of the last position (what greedy decoding reads); with T > 1 the last
        hidden row comes down and goes up alone, so the LM head reads one row. A decode step (T = 1)
        replays a captured graph where the trunk can (engine/decode_graph.py; ``graph_off`` says why not)."""
        if len(ids) == 1 and self.graph_off == _NOT_TRIED:  # at the first decode step: the tiers are set
            self._step_graph, self.graph_off = DecodeGraph.make(self)
        if len(ids) == 1 and self._step_graph is not None and self._step_graph.takes(self._calls):
            self._check_cache(cache)
            try:
                return self._step_graph.step(int(ids[0]), cache)
            except UnsupportedError as exc:  # not capturable after all: eager from now on, and why
                self._step_graph, self.graph_off = None, str(exc)
        h = self._run(ids, cache)
        if h.shape[0] > 1:
            h = self.be.d_put(self.be.d_get(h)[-1:])  # [1, H]
        return self.be.d_get(self.be.d_matmul(h, self.w["lm_head"]))  # [1, V]

    def close(self) -> None:
        """Free the uploaded matrices and drop the device vectors (the backend stays open: its owner
        closes it)."""
        for wt in self._weights:
            try:
                if not getattr(self.be, "closed", False):
                    self.be.free(wt)
            except ColibriError:
                pass
        self._weights, self.w, self._rope = [], {}, None
        self._step_graph = None  # its graphs and expert tables (their memory returns to the pools)
        if self._router is not None:
            self._router.close()
            self._router = None
