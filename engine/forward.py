"""The forward pass: embeddings, GQA or MLA attention with RoPE and a KV cache, MoE/dense FFN, LM head.

Reference CPU path: dense matmuls are plain numpy float32 (x · Wᵀ); routed experts go through an
:class:`~colibri_plan.engine.moe.ExpertProvider` (default :class:`~colibri_plan.engine.moe.RamExperts`
on a backend of :mod:`colibri_plan.backends`); MLA models (DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-5) use
:mod:`colibri_plan.engine.mla` with a paged latent cache, their decode attention on the host backend's
``attention_absorb`` kernel when it has one. Each decoder layer is pre-norm:
``h += attn(rmsnorm(h)); h += ffn(rmsnorm(h))``, then a final RMSNorm and the LM head, as in the
transformers modeling code of every supported family. With ``trunk_backend`` the same pass runs on that
backend's device, the residual stream staying there across layers (:mod:`colibri_plan.engine.trunk`).

Usage::

    w = load_checkpoint("ckpt/", expert_format="int4")
    model = Model(w)                             # experts uploaded once to the "numpy" backend
    cache = model.new_cache()
    logits = model.forward([1, 2, 3], cache)     # prefill: float32 [3, V]
    logits = model.forward([7], cache)           # decode one token: [1, V]
    ids = model.generate([1, 2, 3], 32)          # greedy: 32 new token ids
    model.routing.counts                         # int64 [n_moe_layers, E]
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from colibri_plan.backends import HOST_BACKENDS
from colibri_plan.engine.attention import (
    KVCache,
    attention,
    rmsnorm,
    rope_cos_sin,
    rope_inv_freq,
    stacked_qk_norm,
)
from colibri_plan.engine.blas_threads import BlasLimit
from colibri_plan.engine.dense_quant import bind_dense
from colibri_plan.engine.mla import LatentCache, check_dsa_context, mla_attention, select_absorb
from colibri_plan.engine.moe import ExpertProvider, RamExperts, RoutingRecorder, moe_block, swiglu
from colibri_plan.engine.weights import ModelWeights, check_dense
from colibri_plan.errors import InputError

__all__ = ["KVCache", "LatentCache", "Model", "ExpertProvider", "RamExperts", "RoutingRecorder"]


class Model:
    """A MoE decoder ready to run.

    Args:
        weights: a :class:`~colibri_plan.engine.weights.ModelWeights` (checkpoint or pack).
        backend_name: backend for the default expert provider ("numpy", "cpu", "opencl", ...).
        experts: an ExpertProvider (``run(layer, expert_ids, xs, gates) -> [y_i]``); None =
            :class:`RamExperts`, every expert uploaded once to ``backend_name``.
        recorder: a RoutingRecorder; None = a new one (``model.routing``).
        device_index: device of ``backend_name`` for the default provider.
        trunk_backend: an open backend to run the dense trunk, attention and the KV cache on
            (:class:`~colibri_plan.engine.trunk.DeviceTrunk`); None = the host path below. The caller
            owns and closes it.
        context_tokens: tokens the device trunk's KV cache reserves at open (the plan's context).

    Attributes:
        arch, weights, experts, routing (the RoutingRecorder), trunk (the DeviceTrunk or None).

    Raises:
        UnsupportedError: the architecture cannot run (non-SiLU activation, MLA without its widths).
        FormatError: a dense tensor is missing or has the wrong shape (names and shapes in the message).
        BackendUnavailableError / DeviceOutOfMemoryError: from the default provider.
    """

    def __init__(self, weights: ModelWeights, backend_name: str = "numpy",
                 experts: ExpertProvider | None = None, recorder: RoutingRecorder | None = None,
                 device_index: int = 0, trunk_backend=None, context_tokens: int = 0):
        self.arch = weights.arch
        self.arch.check_supported()
        check_dense(self.arch, weights.dense, weights.source)
        self.weights = weights
        self.dense = weights.dense
        self._owns_experts = experts is None
        self.experts = RamExperts(weights, backend_name, device_index) if experts is None else experts
        self.routing = recorder if recorder is not None else RoutingRecorder(self.arch)
        self._inv_freq = rope_inv_freq(self.arch)
        # per layer: (attn_norm, ffn_norm, dense FFN names or None for a MoE layer), looked up once here
        self._layer_names = [(f"layers.{i}.attn_norm", f"layers.{i}.ffn_norm",
                              None if self.arch.is_moe_layer(i) else
                              tuple(f"layers.{i}.ffn.{n}" for n in ("gate", "up", "down")))
                             for i in range(self.arch.n_layers)]
        self._qk_norm_w = [None if self.arch.attention == "mla" else stacked_qk_norm(self.arch, self.dense, i)
                           for i in range(self.arch.n_layers)]  # q/k head norms stacked once
        self._lm_head = self.dense["embed"] if self.arch.tie_word_embeddings else self.dense["lm_head"]
        self._mla = self.arch.attention == "mla"
        self._absorb = select_absorb(self._host_backend()) if self._mla else None
        host = self._host_backend()
        n_quant = bind_dense(self.dense, host)  # quantized trunk matmuls: the host backend
        # RMSNorm of [T, H] rows: the cpu backend's one-call kernel (same bits), else numpy
        self._norm = getattr(host, "rmsnorm_rows", None) or rmsnorm
        # numba runs the experts and the quantized trunk on the cpu backend: numpy BLAS, left the tiny
        # float ops (router, attention scores), gets one thread so that it does not fight numba's for the
        # cores (engine/blas_threads.py). A float trunk's matmuls are BLAS's: it keeps its threads.
        on_numba = getattr(host, "name", None) == "cpu" and n_quant > 0
        self._blas_limit = BlasLimit() if on_numba else None
        self.trunk = None
        if trunk_backend is not None:
            from colibri_plan.engine.trunk import DeviceTrunk

            try:
                self.trunk = DeviceTrunk(self, trunk_backend, context_tokens)
            except BaseException:
                self.close()
                raise

    def _host_backend(self):
        """The expert provider's host backend ("cpu"/"numpy"; RamExperts.backend or the residency
        manager's cpu), whose ``attention_absorb`` runs MLA decode; None if it has none."""
        be = getattr(self.experts, "backend", None) or getattr(self.experts, "cpu", None)
        return be if getattr(be, "name", None) in HOST_BACKENDS else None

    def new_cache(self, capacity: int = 256) -> KVCache | LatentCache:
        """An empty cache for this model: a KVCache (GQA; grows beyond ``capacity`` as needed) or a paged
        LatentCache (MLA; grows by 64-token pages, ``capacity`` unused); with a device trunk, its
        :class:`~colibri_plan.engine.kv_device.DeviceKVCache` (whole 64-token pages on the device)."""
        if self.trunk is not None:
            return self.trunk.new_cache(capacity)
        a = self.arch
        if self._mla:
            return LatentCache(a.n_layers, a.kv_lora_rank, a.qk_rope_head_dim)
        return KVCache(a.n_layers, a.n_kv_heads, a.head_dim, capacity)

    def _ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0:
            raise InputError(f"token ids must be a non-empty 1-D sequence, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"token ids must be integers, got dtype {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= self.arch.vocab_size)]
        if bad.size:
            raise InputError(f"token id {int(bad[0])} is outside the vocabulary "
                             f"0..{self.arch.vocab_size - 1}")
        return ids.astype(np.int64)

    def hidden_states(self, token_ids: Sequence[int] | np.ndarray,
                      cache: KVCache | LatentCache | None = None) -> np.ndarray:
        """Final-norm hidden states float32 [T, H] (what the LM head reads); see :meth:`forward`."""
        ids = self._ids(token_ids)
        cache = self.new_cache(len(ids)) if cache is None else cache
        if self.trunk is not None:
            return self.trunk.hidden_states(ids, cache)
        a, d, eps = self.arch, self.dense, self.arch.rms_norm_eps
        check_dsa_context(a, cache.length, len(ids))  # DSA beyond index_topk: refused before any work
        h = d["embed"][ids]  # [T, H], a gathered copy: the residual adds below go into it
        cs = None  # RoPE cos/sin of this call's positions, the same for every GQA layer
        if not self._mla and a.rotary_dim:
            cs = rope_cos_sin(np.arange(cache.length, cache.length + len(ids)), self._inv_freq, a)
        for i, (attn_norm, ffn_norm, ffn) in enumerate(self._layer_names):
            xa = self._norm(h, d[attn_norm], eps)  # [T, H]
            if self._mla:
                h = h + mla_attention(xa, i, a, d, cache, self._inv_freq, self._absorb)
            else:
                h += attention(xa, i, a, d, cache, self._inv_freq, cs, self._qk_norm_w[i], self._norm)
            x = self._norm(h, d[ffn_norm], eps)
            if ffn is None:
                h += moe_block(x, i, a, d, self.experts, self.routing)  # float32 [T, H]
            else:
                h = h + swiglu(x, d[ffn[0]], d[ffn[1]], d[ffn[2]])
        cache.advance(len(ids))
        return self._norm(h, d["final_norm"], a.rms_norm_eps)

    def forward(self, token_ids: Sequence[int] | np.ndarray,
                cache: KVCache | LatentCache | None = None) -> np.ndarray:
        """Logits float32 [T, V] of ``token_ids`` [T] appended after the tokens in ``cache``.

        The cache (None = a fresh one, discarded) grows by T. Routing is recorded in ``self.routing``.

        Raises:
            InputError: empty input, or an id outside 0..V-1.
            UnsupportedError: a DSA model's context would pass index_topk tokens (before any work).
        """
        if self.trunk is not None:
            ids = self._ids(token_ids)
            return self.trunk.forward(ids, self.new_cache(len(ids)) if cache is None else cache)
        h = self.hidden_states(token_ids, cache)
        return (h @ self._lm_head.T).astype(np.float32, copy=False)  # [T, H] · [V, H]ᵀ -> [T, V]

    def _last_logits(self, ids, cache) -> np.ndarray:
        """Logits [1, V] of the last position (greedy decoding reads only these)."""
        if self.trunk is not None:
            return self.trunk.last_logits(self._ids(ids), cache)
        return self.hidden_states(ids, cache)[-1:] @ self._lm_head.T  # [1, H] · [V, H]ᵀ

    def generate(self, prompt_ids: Sequence[int], n_tokens: int, cache: KVCache | LatentCache | None = None,
                 on_token: Callable[[int, int, float], None] | None = None) -> list[int]:
        """Greedy decoding: prefill ``prompt_ids``, then ``n_tokens`` steps of argmax.

        Args:
            cache: continue from this cache (None = a fresh one).
            on_token: optional ``fn(step, token_id, seconds)`` after each new token; step 0's seconds
                include the prefill.

        Returns:
            the ``n_tokens`` new ids (the prompt excluded).

        Raises:
            InputError: bad prompt ids or a negative ``n_tokens``.
            UnsupportedError: a DSA model's context would pass index_topk tokens: at the step that would
                feed the (index_topk + 1)-th token (before any work when the prompt alone does).
        """
        if int(n_tokens) < 0:
            raise InputError(f"n_tokens must be >= 0, got {n_tokens}")
        ids = self._ids(prompt_ids)
        cache = self.new_cache(min(len(ids) + int(n_tokens), 4096)) if cache is None else cache  # grows
        out: list[int] = []
        t0 = time.perf_counter()
        if n_tokens == 0:
            return out
        logits = self._last_logits(ids, cache)  # only the last position's logits are needed
        for step in range(int(n_tokens)):
            tok = int(np.argmax(logits))
            out.append(tok)
            if on_token is not None:
                now = time.perf_counter()
                on_token(step, tok, now - t0)
                t0 = now
            if step + 1 < n_tokens:
                logits = self._last_logits([tok], cache)
        return out

    def close(self) -> None:
        """Release the device trunk's uploads and the default expert provider's device memory (a caller's
        provider and trunk backend stay open)."""
        if getattr(self, "trunk", None) is not None:
            self.trunk.close()
            self.trunk = None
        if self._owns_experts and self.experts is not None:
            self.experts.close()
            self.experts = None
        if getattr(self, "_blas_limit", None) is not None:
            self._blas_limit.restore()
            self._blas_limit = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
