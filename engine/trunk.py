"""The dense trunk on a device: the residual stream stays on one backend's device across layers.

:class:`DeviceTrunk` runs :meth:`Model.hidden_states` / :meth:`Model.forward` of a GQA model (mixtral,
qwen2_moe, qwen3_moe, olmoe, glm4_moe) on the device ops of one backend
(:mod:`colibri_plan.backends.device_ops`). At open it uploads, once: the trunk matrices (attention q/k/v/o,
shared experts, dense FFN layers, the LM head) with ``backend.upload`` (a pack's quantized
:class:`~colibri_plan.engine.dense_quant.QuantLinear` as its QuantTensor, a float array as an f32
QuantTensor); norms and biases with ``d_put``; a RoPE table for the planned context. The embedding,
routers, router biases and Qwen2-MoE's shared-expert gate stay on the host (gathered, or used by the
host's routing).

Per decoder layer (same order and semantics as :mod:`colibri_plan.engine.forward`, ``attention`` and
``moe``): RMSNorm; q/k/v (+ bias; q/k RMSNorm per head or over the projection; clip_qkv through a host
round trip, a rare option); RoPE; K/V appended to the :class:`~colibri_plan.engine.kv_device.DeviceKVCache`;
``d_attention`` (sliding-window layers too); o-proj (+ bias); residual add. A MoE layer brings the normed x
down once (``d_get``) for the router and top-k, which run on the host with exactly the CPU path's routing
code (:func:`~colibri_plan.engine.moe.route_tokens`), so routing decisions match. At decode (T = 1), when
the provider is a residency manager, the chosen experts it holds in VRAM on this very backend run on the
device x (``d_expert_ffn``, queued before the host work, so the device computes them while the host runs
the rest); the others (pinned RAM, LRU, disk, another device) run through the manager as on the CPU path
and their sum goes up once (``d_put``) to be added on the device. When every chosen expert is local,
nothing but x crosses. At prefill (T > 1) on a backend with ``d_expert_ffn_rows`` (CUDA), the local
experts run the same way, each on its own tokens' rows of the device x (timed as a whole, bracketed by
synchronizations). Otherwise (other providers, a prefill on other backends) all routed experts run
through the provider and their sum goes up. Shared experts (Qwen2-MoE's sigmoid gate from the
downloaded x, applied with ``d_scale_rows``) and dense FFN layers run on the device. Final norm and LM
head run on the device; only the logits come down (at decode, one row).

Local experts are accounted as the manager's own: a "vram" use each, and their seconds charged to that
device's expert compute and to the experts' layer wall time — measured (bracketed by synchronizations)
every step on a host backend and on one decode step in :data:`GPU_ATTENTION_SAMPLE` on a GPU, where the
other steps are charged the measured seconds per local expert.

MLA families (DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-5) keep attention on the host through
:mod:`colibri_plan.engine.mla` with the host :class:`~colibri_plan.engine.mla.LatentCache` (x down,
attention on the host, the result up), so a plan with a device trunk still runs them; their norms, shared
experts, dense FFN layers and LM head run on the device.
"""

from __future__ import annotations

import time

import numpy as np

from colibri_plan.backends import HOST_BACKENDS
from colibri_plan.backends.device_ops import DArray, rope_table
from colibri_plan.engine.dense_quant import QuantLinear
from colibri_plan.engine.kv_device import DeviceKVCache, device_kv_bytes
from colibri_plan.engine.mla import LatentCache, check_dsa_context, mla_attention
from colibri_plan.engine.moe import route_tokens, routed_experts, scatter_sum
from colibri_plan.errors import ColibriError, InputError
from colibri_plan.families.rope import attention_factor
from colibri_plan.formats.plan_trunk import PAGE_TOKENS
from colibri_plan.quant import quantize

__all__ = ["DeviceTrunk", "trunk_dense_bytes", "trunk_kv_bytes", "HOST_BACKENDS"]

#: on a GPU backend, attention is timed (two synchronizations per layer) on one decode step of this many
GPU_ATTENTION_SAMPLE = 8


def _trunk_tensors(arch, dense: dict) -> list[tuple[str, str, bool]]:
    """(key on the device, name in ``dense``, is a matrix) of every tensor the device trunk holds."""
    out = []
    for i in range(arch.n_layers):
        p = f"layers.{i}."
        names = [p + "attn_norm", p + "ffn_norm"]
        if arch.attention != "mla":
            names += [p + f"attn.{n}" for n in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias",
                                                 "q_norm", "k_norm")]
        names += [p + f"{g}.{n}" for g in ("shared", "ffn") for n in ("gate", "up", "down")]
        out += [(n, n, dense[n].ndim == 2) for n in names if n in dense]
    out.append(("final_norm", "final_norm", False))
    out.append(("lm_head", "embed" if arch.tie_word_embeddings else "lm_head", True))
    return out


def _rope_positions(tokens: int) -> int:
    return max(1, -(-int(tokens) // PAGE_TOKENS)) * PAGE_TOKENS


def trunk_dense_bytes(arch, dense: dict, context_tokens: int = 0) -> int:
    """Device bytes a :class:`DeviceTrunk` uploads for ``dense`` (matrices in their stored format — a
    float array at f32 —, norms and biases at f32, and the RoPE table of ``context_tokens`` positions in
    whole 64-token pages); the embedding, routers and the shared-expert gate stay on the host."""
    total = 0
    for _, name, _ in _trunk_tensors(arch, dense):
        v = dense[name]
        total += v.nbytes if isinstance(v, QuantLinear) else 4 * int(np.prod(v.shape))
    if arch.attention != "mla" and arch.rotary_dim:
        total += _rope_positions(context_tokens) * arch.rotary_dim * 4  # [P, rd/2, 2] float32
    return total


def trunk_kv_bytes(arch, context_tokens: int) -> int:
    """Device bytes of the KV cache a :class:`DeviceTrunk` reserves for ``context_tokens`` (0 for MLA,
    whose latent cache stays on the host)."""
    if arch.attention == "mla":
        return 0
    return device_kv_bytes(arch.n_layers, arch.n_kv_heads, arch.head_dim, context_tokens)


class DeviceTrunk:
    """A model's trunk on one backend's device (see the module docstring).

    Args:
        model: the :class:`~colibri_plan.engine.forward.Model` (arch, dense tensors, expert provider,
            routing recorder, RoPE frequencies, MLA absorb core).
        backend: an open backend; its ``d_*`` ops and ``upload`` hold the trunk.
        context_tokens: tokens the KV cache and RoPE table reserve at open (the plan's
            ``trunk.kv.context_tokens``); a longer run grows both by whole pages.

    Attributes:
        dense_bytes: device bytes uploaded (matrices, vectors, RoPE table). attention_s,
        attention_steps: attention seconds (KV append + ``d_attention``, all layers) summed over the timed
        forward calls, and how many were timed (every call on a host backend, one in
        :data:`GPU_ATTENTION_SAMPLE` on a GPU backend, bracketed by synchronizations).

    Raises:
        InputError: a dense tensor the trunk needs is missing. DeviceOutOfMemoryError /
        BackendUnavailableError: from the uploads (nothing stays uploaded).
    """

    def __init__(self, model, backend, context_tokens: int = 0):
        self.model, self.be, self.arch = model, backend, model.arch
        self.context_tokens = max(0, int(context_tokens))
        self._mla = self.arch.attention == "mla"
        self.time_attention = True
        self.attention_every = 1 if getattr(backend, "name", "") in HOST_BACKENDS else GPU_ATTENTION_SAMPLE
        self.reset_stats()
        self._weights: list = []
        self.w: dict[str, object] = {}
        self.dense_bytes = 0
        self._rope, self._rope_rows = None, 0
        try:
            for key, name, matrix in _trunk_tensors(self.arch, model.dense):
                v = model.dense[name]
                if matrix:
                    qt = v.qt if isinstance(v, QuantLinear) else quantize(np.asarray(v, np.float32), "f32")
                    w = backend.upload(qt)
                    self._weights.append(w)
                    self.dense_bytes += qt.nbytes
                else:
                    w = backend.d_put(np.asarray(v, np.float32))
                    self.dense_bytes += w.nbytes
                self.w[key] = w
            if not self._mla and self.arch.rotary_dim:
                self._grow_rope(self.context_tokens)
        except BaseException:
            self.close()
            raise

    # ---- state -----------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        """Zero the attention timing (the session calls it after the prefill)."""
        self.attention_s, self.attention_steps, self._calls = 0.0, 0, 0
        self._local_s, self._local_n = 0.0, 0  # measured seconds of local experts, and how many

    def _grow_rope(self, tokens: int) -> None:
        rows = _rope_positions(tokens)
        if rows <= self._rope_rows:
            return
        a = self.arch
        table = rope_table(self.model._inv_freq, rows, attention_factor(a), a.rope_scaling_factor)
        old = self._rope
        self._rope, self._rope_rows = self.be.d_put(table), rows  # [P, rd/2, 2]
        if old is None:
            self.dense_bytes += self._rope.nbytes
        else:
            self.dense_bytes += self._rope.nbytes - old.nbytes

    def new_cache(self, capacity: int = 256) -> DeviceKVCache | LatentCache:
        """An empty cache: a :class:`DeviceKVCache` reserving max(context_tokens, capacity) tokens in whole
        pages (GQA), or a host LatentCache (MLA)."""
        a = self.arch
        if self._mla:
            return LatentCache(a.n_layers, a.kv_lora_rank, a.qk_rope_head_dim)
        return DeviceKVCache(self.be, a.n_layers, a.n_kv_heads, a.head_dim,
                             max(self.context_tokens, int(capacity)))

    def _check_cache(self, cache):
        want = LatentCache if self._mla else DeviceKVCache
        if not isinstance(cache, want) or (not self._mla and cache.backend is not self.be):
            raise InputError(f"the device trunk needs a cache from Model.new_cache() ({want.__name__} on "
                             f"{getattr(self.be, 'name', 'its backend')}), got {type(cache).__name__}")

    # ---- the forward pass ------------------------------------------------------------------------
    def _swiglu(self, x: DArray, prefix: str) -> DArray:
        be, w = self.be, self.w
        g, u = be.d_matmul_many(x, [w[prefix + "gate"], w[prefix + "up"]])  # [T, I] each, one launch on GPUs
        return be.d_matmul(be.d_silu_mul(g, u), w[prefix + "down"])  # [T, H]

    def _attention(self, x: DArray, i: int, cache: DeviceKVCache, timed: bool) -> DArray:
        """GQA self-attention of the normed x [T, H] on the device -> [T, H] (engine/attention.py)."""
        be, a, w = self.be, self.arch, self.w
        p = f"layers.{i}.attn."
        t, nh, nkv, d, eps = x.shape[0], a.n_heads, a.n_kv_heads, a.head_dim, a.rms_norm_eps
        q, k, v = be.d_matmul_many(x, [w[p + n] for n in "qkv"])  # [T, nh·d], [T, nkv·d], [T, nkv·d]
        q, k, v = (be.d_add(m, w[p + n + "_bias"]) if p + n + "_bias" in w else m
                   for m, n in zip((q, k, v), "qkv"))
        if a.qk_norm == "full":  # OLMoE: one RMSNorm over the whole projection
            q, k = be.d_rmsnorm(q, w[p + "q_norm"], eps), be.d_rmsnorm(k, w[p + "k_norm"], eps)
        if a.clip_qkv is not None:  # rare option: a host round trip keeps the device ops few
            c = np.float32(a.clip_qkv)
            q, k, v = (be.d_put(np.clip(be.d_get(m), -c, c)) for m in (q, k, v))
        if a.qk_norm == "head":  # per head: rows of [T·heads, d]
            q = be.d_rmsnorm(be.d_view(q, (t * nh, d)), w[p + "q_norm"], eps)
            k = be.d_rmsnorm(be.d_view(k, (t * nkv, d)), w[p + "k_norm"], eps)
        q, k, v = be.d_view(q, (t, nh, d)), be.d_view(k, (t, nkv, d)), be.d_view(v, (t, nkv, d))
        pos0 = cache.length
        if a.rotary_dim:
            q = be.d_rope(q, self._rope, pos0, a.rotary_dim, a.rope_interleave)
            k = be.d_rope(k, self._rope, pos0, a.rotary_dim, a.rope_interleave)
        window = a.sliding_window if a.sliding_window and i in a.sliding_layers else 0
        if timed:
            be.synchronize()
            t0 = time.perf_counter()
        keys, values = cache.append(i, k, v)  # [C, nkv, d] each, rows < pos0 + T valid
        o = be.d_attention(q, keys, values, pos0 + t, pos0, d ** -0.5, window)  # [T, nh·d]
        if timed:
            be.synchronize()
            self.attention_s += time.perf_counter() - t0
        y = be.d_matmul(o, w[p + "o"])  # [T, H]
        return be.d_add(y, w[p + "o_bias"]) if p + "o_bias" in w else y

    def _routed(self, x: DArray, xh: np.ndarray, i: int, sampled: bool) -> DArray:
        """The routed experts' weighted sum of MoE layer ``i`` on the device [T, H] (module docstring): x
        [T, H] the normed hidden state on the device, xh its host copy."""
        be, a, m = self.be, self.arch, self.model
        split = getattr(m.experts, "local_experts", None)
        T = x.shape[0]
        rows_op = getattr(be, "d_expert_ffn_rows", None)  # prefill's routed rows on the device (CUDA)
        if split is None or (T != 1 and rows_op is None):  # all on the host
            return be.d_put(routed_experts(xh, i, a, m.dense, m.experts, m.routing))
        uniq, tok_of, gates = route_tokens(xh, i, a, m.dense, m.routing)  # decode: tok_of[j] == [0]
        xs = [xh] * len(uniq) if T == 1 else [np.ascontiguousarray(xh[t]) for t in tok_of]  # [T_j, H] each
        local, rest = split(i, uniq, xs, be)
        y = None
        if local:
            timed = sampled or T != 1  # a prefill's local experts are timed on their own (not per token)
            if timed:
                be.synchronize()  # the queued trunk work is not the experts'
            t0 = time.perf_counter()
            ws = [w for _, _, w in local]
            if T == 1:
                y = be.d_expert_ffn(x, ws, np.array([gates[j][0] for j, _, _ in local], np.float32))  # [1, H]
            else:  # each expert on its own tokens' rows of the device x, [T, H]
                y = rows_op(x, ws, [tok_of[j] for j, _, _ in local], [gates[j] for j, _, _ in local])
            if timed:
                be.synchronize()
                seconds = time.perf_counter() - t0
                if T == 1:
                    self._local_s, self._local_n = self._local_s + seconds, self._local_n + len(local)
            per_expert = seconds / len(local) if T != 1 else self._local_s / max(1, self._local_n)
            keys = [k for _, k, _ in local]
            for k in sorted(set(keys)):  # one device key but for aliases of one backend
                m.experts.add_local_seconds(k, per_expert * keys.count(k))
        if rest:
            ys = m.experts.run(i, [uniq[j] for j in rest], [xs[j] for j in rest], [gates[j] for j in rest],
                               observed=True)
            host = be.d_put(scatter_sum(xh, [tok_of[j] for j in rest], ys))  # [T, H] up once
            y = host if y is None else be.d_add(y, host)
        return y

    def _run(self, ids: np.ndarray, cache) -> DArray:
        """The decoder layers and the final norm on the device: final hidden states DArray [T, H]."""
        be, a, m, w = self.be, self.arch, self.model, self.w
        self._check_cache(cache)
        t, eps = len(ids), a.rms_norm_eps
        check_dsa_context(a, cache.length, t)  # DSA beyond index_topk: refused before any work
        if not self._mla:
            cache.reserve(cache.length + t)  # whole pages, before layer 0 writes
            if a.rotary_dim:
                self._grow_rope(cache.capacity)
        sampled = self._calls % self.attention_every == 0  # this call's device work is timed
        timed = self.time_attention and not self._mla and sampled
        h = be.d_put(m.dense["embed"][ids])  # [T, H]: the embedding is gathered on the host
        for i in range(a.n_layers):
            p = f"layers.{i}."
            xa = be.d_rmsnorm(h, w[p + "attn_norm"], eps)  # [T, H]
            if self._mla:  # attention on the host (module docstring)
                y = be.d_put(mla_attention(be.d_get(xa), i, a, m.dense, cache, m._inv_freq, m._absorb))
            else:
                y = self._attention(xa, i, cache, timed)
            h = be.d_add(h, y)
            x = be.d_rmsnorm(h, w[p + "ffn_norm"], eps)  # [T, H]
            if a.is_moe_layer(i):
                xh = be.d_get(x)  # [T, H] down once: router and top-k on the host
                # the shared expert is queued first: the device runs it while the host runs the routed ones
                shared = self._swiglu(x, p + "shared.") if a.shared_intermediate_size else None
                if shared is not None and a.shared_expert_gate:  # Qwen2-MoE: sigmoid(x · w) per token
                    z = (xh @ m.dense[p + "shared_gate"].T)[:, 0]  # [T], from the host's x
                    shared = be.d_scale_rows(shared, 1.0 / (1.0 + np.exp(-z)))
                out = self._routed(x, xh, i, sampled)  # [T, H]
                if shared is not None:
                    out = be.d_add(out, shared)
                h = be.d_add(h, out)
            else:
                h = be.d_add(h, self._swiglu(x, p + "ffn."))
        cache.advance(t)
        if timed:
            self.attention_steps += 1
        self._calls += 1
        return be.d_rmsnorm(h, w["final_norm"], eps)

    def hidden_states(self, ids: np.ndarray, cache) -> np.ndarray:
        """Final-norm hidden states float32 [T, H] on the host (ids checked by the Model)."""
        return self.be.d_get(self._run(ids, cache))

    def forward(self, ids: np.ndarray, cache) -> np.ndarray:
        """Logits float32 [T, V] on the host."""
        return self.be.d_get(self.be.d_matmul(self._run(ids, cache), self.w["lm_head"]))

    def last_logits(self, ids: np.ndarray, cache) -> np.ndarray:
        """Logits float32 [1, V] of the last position (what greedy decoding reads); with T > 1 the last
        hidden row comes down and goes up alone, so the LM head reads one row."""
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
