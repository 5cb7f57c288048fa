"""A MoE decoder ready to run: weights, an expert provider, a routing recorder and the trunk on a device.

The forward pass itself is :class:`~colibri_plan.engine.trunk.Trunk`, written once against the backend's
device ops. Without ``trunk_backend`` the trunk runs on the host: on the expert provider's host backend
(:class:`~colibri_plan.engine.moe.RamExperts` on "cpu"/"numpy", or a residency manager's cpu backend), else
on a "numpy" backend of its own; with it, on that backend's device.
Routed experts go through an :class:`~colibri_plan.engine.moe.ExpertProvider` (default
:class:`~colibri_plan.engine.moe.RamExperts` on a backend of :mod:`colibri_plan.backends`).

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
from collections.abc import Callable, Collection, Sequence

import numpy as np

from colibri_plan.backends import HOST_BACKENDS
from colibri_plan.engine.blas_threads import BlasLimit
from colibri_plan.engine.dense_quant import QuantLinear
from colibri_plan.engine.kv_device import DeviceKVCache
from colibri_plan.engine.moe import ExpertProvider, RamExperts, RoutingRecorder, open_backend
from colibri_plan.engine.trunk import Trunk
from colibri_plan.engine.weights import ModelWeights, check_dense
from colibri_plan.errors import InputError
from colibri_plan.families.rope import inv_freq

__all__ = ["Model", "ExpertProvider", "RamExperts", "RoutingRecorder"]


class Model:
    """A MoE decoder ready to run.

    Args:
        weights: a :class:`~colibri_plan.engine.weights.ModelWeights` (checkpoint or pack).
        backend_name: backend for the default expert provider ("numpy", "cpu", "opencl", ...).
        experts: an ExpertProvider (``run(layer, expert_ids, xs, gates) -> [y_i]``); None =
            :class:`RamExperts`, every expert uploaded once to ``backend_name``.
        recorder: a RoutingRecorder; None = a new one (``model.routing``).
        device_index: device of ``backend_name`` for the default provider.
        trunk_backend: an open backend to run the trunk, attention and the KV cache on; None = the host
            (module docstring). The caller owns and closes it.
        context_tokens: tokens the trunk's cache reserves at open (the plan's context).

    Attributes:
        arch, weights, experts, routing (the RoutingRecorder), trunk (the
        :class:`~colibri_plan.engine.trunk.Trunk`), inv_freq (RoPE inverse frequencies float32 [rd/2]).

    Raises:
        UnsupportedError: the architecture cannot run (non-SiLU activation, MLA without its widths).
        FormatError: a dense tensor is missing or has the wrong shape (names and shapes in the message).
        BackendUnavailableError / DeviceOutOfMemoryError: from the default provider or the trunk.
    """

    def __init__(self, weights: ModelWeights, backend_name: str = "numpy",
                 experts: ExpertProvider | None = None, recorder: RoutingRecorder | None = None,
                 device_index: int = 0, trunk_backend=None, context_tokens: int = 0):
        self.arch = weights.arch
        self.arch.check_supported()
        check_dense(self.arch, weights.dense, weights.source)
        self.weights = weights
        self.dense = weights.dense
        self.inv_freq = inv_freq(self.arch)
        self.trunk = None
        self._owns_experts = experts is None
        self._own_host = None  # a host backend opened for the trunk, closed with the model
        self._blas_limit = None
        self.experts = RamExperts(weights, backend_name, device_index) if experts is None else experts
        self.routing = recorder if recorder is not None else RoutingRecorder(self.arch)
        try:
            be = trunk_backend if trunk_backend is not None else self._host_backend()
            # numba runs the experts and a quantized trunk on the cpu backend: numpy BLAS, left the tiny
            # float ops (router, attention scores), gets one thread so that it does not fight numba's for
            # the cores (engine/blas_threads.py). A float trunk's matmuls are BLAS's: it keeps its threads.
            provider = getattr(self.experts, "backend", None) or getattr(self.experts, "cpu", None)
            on_numba = "cpu" in (be.name, getattr(provider, "name", None))
            if on_numba and any(isinstance(v, QuantLinear) for v in self.dense.values()):
                self._blas_limit = BlasLimit()
            self.trunk = Trunk(self, be, context_tokens, measure=trunk_backend is not None)
        except BaseException:
            self.close()
            raise

    def _host_backend(self):
        """The expert provider's host backend ("cpu"/"numpy": RamExperts.backend or the residency
        manager's cpu), else a "numpy" backend opened here (the reference)."""
        be = getattr(self.experts, "backend", None) or getattr(self.experts, "cpu", None)
        if getattr(be, "name", None) in HOST_BACKENDS:
            return be
        self._own_host = open_backend("numpy")
        return self._own_host

    def new_cache(self, capacity: int = 256) -> DeviceKVCache:
        """An empty cache on the trunk's device reserving ``capacity`` tokens (at least the trunk's
        context) in whole 64-token pages, growing by pages past them: a
        :class:`~colibri_plan.engine.kv_device.DeviceKVCache` (GQA) or
        :class:`~colibri_plan.engine.kv_device.DeviceLatentCache` (MLA)."""
        return self.trunk.new_cache(capacity)

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

    def _cache(self, ids: np.ndarray, cache):
        return self.new_cache(len(ids)) if cache is None else cache

    def hidden_states(self, token_ids: Sequence[int] | np.ndarray, cache: DeviceKVCache | None = None
                      ) -> np.ndarray:
        """Final-norm hidden states float32 [T, H] (what the LM head reads); see :meth:`forward`."""
        ids = self._ids(token_ids)
        return self.trunk.hidden_states(ids, self._cache(ids, cache))

    def forward(self, token_ids: Sequence[int] | np.ndarray, cache: DeviceKVCache | None = None
                ) -> np.ndarray:
        """Logits float32 [T, V] of ``token_ids`` [T] appended after the tokens in ``cache``.

        The cache (None = a fresh one, discarded) grows by T. Routing is recorded in ``self.routing``.

        Raises:
            InputError: empty input, an id outside 0..V-1, or a cache of another model or device.
            UnsupportedError: a DSA model's context would pass index_topk tokens (before any work).
        """
        ids = self._ids(token_ids)
        return self.trunk.forward(ids, self._cache(ids, cache))

    def _last_logits(self, ids, cache) -> np.ndarray:
        """Logits [1, V] of the last position (greedy decoding reads only these)."""
        return self.trunk.last_logits(self._ids(ids), cache)

    def generate(self, prompt_ids: Sequence[int], n_tokens: int, cache: DeviceKVCache | None = None,
                 on_token: Callable[[int, int, float], None] | None = None,
                 sample: Callable[[np.ndarray], int] | None = None, stop_ids: Collection[int] = ()
                 ) -> list[int]:
        """Decoding: prefill ``prompt_ids``, then up to ``n_tokens`` steps (argmax unless ``sample``).

        Args:
            cache: continue from this cache (None = a fresh one).
            on_token: optional ``fn(step, token_id, seconds)`` after each new token; step 0's seconds
                include the prefill.
            sample: ``fn(logits float32 [V]) -> token id`` choosing each new token (None = argmax, greedy;
                colibri_plan/text/sampling.py). An exception it raises ends the generation (e.g. a
                cancelled request).
            stop_ids: ids that end the generation once emitted (EOS); the stop id is returned.

        Returns:
            the new ids (the prompt excluded): ``n_tokens``, fewer when a stop id came first.

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
        stop = frozenset(int(i) for i in stop_ids)
        for step in range(int(n_tokens)):
            tok = int(np.argmax(logits)) if sample is None else int(sample(logits.reshape(-1)))  # [V]
            out.append(tok)
            if on_token is not None:
                now = time.perf_counter()
                on_token(step, tok, now - t0)
                t0 = now
            if tok in stop:
                break
            if step + 1 < n_tokens:
                logits = self._last_logits([tok], cache)
        return out

    def close(self) -> None:
        """Release the trunk's uploads, a host backend opened for it and the default expert provider's
        device memory (a caller's provider and trunk backend stay open)."""
        if getattr(self, "trunk", None) is not None:
            self.trunk.close()
            self.trunk = None
        if getattr(self, "_own_host", None) is not None:
            self._own_host.close()
            self._own_host = None
        if getattr(self, "_owns_experts", False) and self.experts is not None:
            self.experts.close()
            self.experts = None
        if getattr(self, "_blas_limit", None) is not None:
            self._blas_limit.restore()
            self._blas_limit = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
