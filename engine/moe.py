"""The MoE block: router, expert providers and the routing recorder.

Router semantics follow the transformers routers of each family (``MixtralTopKRouter``,
``Qwen2MoeTopKRouter``, ``OlmoeTopKRouter``, ``Glm4MoeTopkRouter``/``DeepseekV3TopkRouter``,
``DeepseekV2TopkRouter``):

- softmax scoring: p = softmax(x·Wᵀ) over all experts; top-k of p; optional renormalisation;
- sigmoid scoring: s = sigmoid(x·Wᵀ); experts are *chosen* on s + bias (e_score_correction_bias) but
  *weighted* by s; with group-limited top-k only experts inside the ``topk_group`` best of ``n_group``
  groups compete (group score: sum of its top-2 biased scores, or the max for DeepSeek-V2);
- weights are optionally renormalised (sum + 1e-20 for sigmoid) and multiplied by
  ``routed_scaling_factor``.

An :class:`ExpertProvider` computes routed experts. The model hands it, per MoE layer and forward
call, the distinct experts chosen, the tokens routed to each and their weights; the provider returns
each expert's weighted output. The default :class:`RamExperts` uploads every expert once to one backend
(host RAM); a residency manager supplies experts from VRAM / RAM / LRU / disk with the same call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from colibri_plan.backends.routing import RouteRule, route_ref
from colibri_plan.errors import BackendUnavailableError, InputError
from colibri_plan.formats.arch import ArchConfig


@runtime_checkable
class ExpertProvider(Protocol):
    """Computes routed experts for the model (the seam a residency manager plugs into)."""

    def run(self, layer: int, expert_ids: Sequence[int], xs: Sequence[np.ndarray],
            gates: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Weighted outputs of ``len(expert_ids)`` distinct experts of MoE layer ``layer``.

        Args:
            layer: decoder layer id (one of ``arch.moe_layers``).
            expert_ids: distinct expert ids [n], ascending.
            xs: xs[i] float32 [T_i, H]: the (post-norm) hidden states of the tokens routed to expert i.
            gates: gates[i] float32 [T_i]: those tokens' routing weights for expert i.

        Returns:
            list of n float32 arrays [T_i, H]: gates[i][:, None] · down_i(SiLU(gate_i x) · up_i x).
        """
        ...


def route(logits: np.ndarray, arch: ArchConfig, bias: np.ndarray | None = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """Choose top-k experts per token.

    Args:
        logits: router logits float32 [T, E] (x · W_routerᵀ).
        arch: supplies scoring, top_k, grouping, norm_topk_prob, routed_scaling_factor.
        bias: e_score_correction_bias float32 [E] (sigmoid routers), used for the choice only.

    Returns:
        (ids int64 [T, K] ordered by descending choice score, weights float32 [T, K]).
    """
    return route_ref(logits, bias, RouteRule.from_arch(arch))  # the one rule (backends.routing)


class RoutingRecorder:
    """Records routing decisions: per (MoE layer, expert) selection counts and top-k ids per token.

    Attributes:
        layers: MoE layer ids, one row of ``counts`` each.
        counts: int64 [len(layers), n_experts]: how many tokens chose each expert.
        tokens: int64 [len(layers)]: tokens routed per MoE layer row.
        keep_ids: when True (default) the top-k ids of every token are kept (see :meth:`topk_ids`).
        hooks: callables ``fn(layer, ids [T, K], weights [T, K])`` called after each routing
            (e.g. a prefetcher).
    """

    def __init__(self, arch: ArchConfig, keep_ids: bool = True):
        self.arch = arch
        self.layers = tuple(arch.moe_layers)
        self._row = {layer: r for r, layer in enumerate(self.layers)}
        self.keep_ids = keep_ids
        self.hooks: list[Callable] = []
        self.reset()

    def reset(self) -> None:
        """Zero the counts and drop the kept ids."""
        self.counts = np.zeros((len(self.layers), self.arch.n_experts), dtype=np.int64)
        self.tokens = np.zeros(len(self.layers), dtype=np.int64)
        self._ids: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}

    def _r(self, layer: int) -> int:
        if layer not in self._row:
            raise InputError(f"layer {layer} is not a MoE layer (MoE layers: {list(self.layers)})")
        return self._row[layer]

    def record(self, layer: int, ids: np.ndarray, weights: np.ndarray) -> None:
        """Add one routing result (ids int [T, K], weights float32 [T, K]) of MoE layer ``layer``."""
        r = self._r(layer)
        self.counts[r] += np.bincount(ids.ravel(), minlength=self.arch.n_experts)
        self.tokens[r] += ids.shape[0]
        if self.keep_ids:
            self._ids[layer].append(np.array(ids, dtype=np.int64))
        for fn in self.hooks:
            fn(layer, ids, weights)

    def record_step(self, layers: Sequence[int], ids: np.ndarray, weights: np.ndarray) -> None:
        """One token's routing of several MoE layers at once (a replayed decode step): ids int [n, K],
        weights float32 [n, K], row j that of ``layers[j]``; the counts, tokens and kept ids of
        :meth:`record` per layer, in one update (hooks, when any, are called per layer)."""
        rows = np.array([self._r(layer) for layer in layers], np.int64)
        ids = np.asarray(ids, np.int64)
        np.add.at(self.counts, (np.repeat(rows, ids.shape[1]), ids.ravel()), 1)
        self.tokens[rows] += 1
        if self.keep_ids:
            for layer, row in zip(layers, ids):
                self._ids[layer].append(row[None].copy())
        for fn in self.hooks:
            for layer, row, w in zip(layers, ids, weights):
                fn(layer, row[None], w[None])

    def topk_ids(self, layer: int) -> np.ndarray:
        """All top-k ids recorded for ``layer``, int64 [tokens, K], in token order (empty if none).

        Raises:
            InputError: ``layer`` is not a MoE layer, or ids were not kept.
        """
        self._r(layer)
        if not self.keep_ids:
            raise InputError("top-k ids were not kept (RoutingRecorder(keep_ids=False))")
        parts = self._ids[layer]
        return np.concatenate(parts) if parts else np.zeros((0, self.arch.top_k), dtype=np.int64)

    def trace(self):
        """The kept top-k ids as a size-bounded :class:`colibri_plan.formats.heat_trace.RoutingTrace`
        (forward calls in order; None when ids were not kept)."""
        from colibri_plan.formats.heat_trace import RoutingTrace

        if not self.keep_ids:
            return None
        return RoutingTrace.from_calls(self.layers, self.arch.top_k, self._ids)

    def to_heat(self, source: str = "engine run", model_fingerprint: str | None = None):
        """The counts as a :class:`colibri_plan.formats.heat.Heat` (rows = ``layers``)."""
        from colibri_plan.formats.heat import Heat

        tokens = int(self.tokens.max()) if len(self.tokens) else 0
        return Heat(n_experts=self.arch.n_experts, layers=self.layers, counts=self.counts.astype(np.float64),
                    top_k=self.arch.top_k, tokens=tokens, source=source,
                    model_fingerprint=model_fingerprint, n_model_layers=self.arch.n_layers)


def open_backend(name: str = "numpy", device_index: int = 0):
    """Open backend ``name`` (a :mod:`colibri_plan.backends` name) on device ``device_index``.

    Raises:
        BackendUnavailableError: unknown to this install or unusable here (the reason is given).
    """
    from colibri_plan.backends import get_backend

    try:
        cls = get_backend(name)
    except ImportError as e:
        raise BackendUnavailableError(f"backend {name!r} is not installed in this build ({e})") from None
    return cls.open(device_index)


class RamExperts:
    """Every routed expert uploaded once to one backend (default: host RAM through "numpy").

    Args:
        weights: a ModelWeights; ``weights.expert(layer, e)`` is read once per expert at construction.
        backend: an open backend instance, or a backend name for ``colibri_plan.backends.get_backend``.
        device_index: device to open when ``backend`` is a name.

    Raises:
        BackendUnavailableError: the backend cannot be opened here.
        DeviceOutOfMemoryError: the experts do not fit the device (nothing stays allocated).
    """

    def __init__(self, weights, backend="numpy", device_index: int = 0):
        self._owns = isinstance(backend, str)
        self.backend = open_backend(backend, device_index) if self._owns else backend
        self.uploaded: dict[tuple[int, int], object] = {}
        try:
            for key in weights.expert_keys():
                self.uploaded[key] = self.backend.upload_expert(*weights.expert(*key))
            self._rows: dict[int, dict[int, object]] = {}  # layer -> expert id -> ExpertWeights (run_sum)
            for (layer, e), ew in self.uploaded.items():
                self._rows.setdefault(layer, {})[e] = ew
        except BaseException:
            self.close()
            raise

    def run(self, layer: int, expert_ids: Sequence[int], xs: Sequence[np.ndarray],
            gates: Sequence[np.ndarray]) -> list[np.ndarray]:
        """See :meth:`ExpertProvider.run`."""
        ys = self.backend.expert_ffn(xs, [self.uploaded[(layer, int(e))] for e in expert_ids])
        return [y * g[:, None] for y, g in zip(ys, gates)]  # [T_i, H] · gates [T_i, 1]

    def run_sum(self, layer: int, expert_ids: Sequence[int], x: np.ndarray, gates: np.ndarray) -> np.ndarray:
        """Σ_i gates[i] · expert_i(x) of MoE layer ``layer``: every token of x float32 [T, H] routed to
        every expert (decode, T = 1), gates float32 [n]; float32 [T, H], the sum of :meth:`run`'s outputs
        in :func:`scatter_sum`'s order (one call where the backend has ``expert_ffn_sum``, the cpu
        backend's: same bits)."""
        fused = self.backend.expert_ffn_sum if self.backend.supports("expert_ffn_sum") else None
        if fused is None:
            n = len(expert_ids)
            ys = self.run(layer, expert_ids, [x] * n, [gates[i: i + 1] for i in range(n)])
            return scatter_sum(x, [np.arange(x.shape[0])] * n, ys)
        row = self._rows[layer]
        return fused(x, [row[e] for e in expert_ids], gates)

    def close(self) -> None:
        """Free the uploaded experts and close the backend if this object opened it."""
        if self.backend is None:
            return
        if self._owns:
            self.backend.close()
        else:
            for ew in self.uploaded.values():
                for w in ew:
                    self.backend.free(w)
        self.uploaded.clear()
        self._rows = {}
        self.backend = None


def route_tokens(x: np.ndarray, layer: int, arch: ArchConfig, dense: dict[str, np.ndarray],
                 recorder: RoutingRecorder | None = None
                 ) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
    """Router and top-k of one MoE layer, grouped by expert: x float32 [T, H] (post-norm) -> (distinct
    expert ids ascending [n], token ids per expert int64 [T_i], gates per expert float32 [T_i]). The
    routing is recorded in ``recorder``. The one routing path of the CPU trunk and the device trunk."""
    return group_routes(*_route_record(x, layer, arch, dense, recorder), arch.top_k)  # ids, weights [T, K]


def group_routes(ids: np.ndarray, weights: np.ndarray, top_k: int
                 ) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
    """A routing (ids int [T, K], weights float32 [T, K]) grouped by expert as :func:`route_tokens`
    returns it: (distinct expert ids ascending, token ids per expert int64 [T_i], gates float32 [T_i])."""
    if ids.shape[0] == 1:  # decode: K distinct experts of token 0, ascending (what the grouping below gives)
        uniq, w = _one_token(ids, weights)
        tok0 = np.zeros(1, np.int64)
        return uniq, [tok0] * len(uniq), [w[i: i + 1] for i in range(len(uniq))]
    flat = ids.ravel()  # token t's k-th choice sits at t·K + k
    order = np.argsort(flat, kind="stable")  # group (token, slot) pairs by expert, ascending
    by_expert = flat[order]  # [T·K] expert ids, ascending
    starts = [0, *(np.flatnonzero(by_expert[1:] != by_expert[:-1]) + 1).tolist()]  # each expert's first slot
    bounds = starts[1:] + [len(order)]
    tok = order // top_k  # [T·K] token of each slot, grouped by expert
    w = weights.ravel()[order]  # [T·K] gates, grouped alike
    tok_of = [tok[a:b] for a, b in zip(starts, bounds)]  # token ids per expert (views)
    gates = [w[a:b] for a, b in zip(starts, bounds)]  # [T_i] per expert (views)
    return by_expert[starts].tolist(), tok_of, gates


def _route_record(x: np.ndarray, layer: int, arch: ArchConfig, dense: dict, recorder: RoutingRecorder | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Router logits, top-k (:func:`route`) and its recording, one MoE layer: (ids [T, K], weights [T, K])."""
    p = f"layers.{layer}."
    logits = x @ dense[p + "router"].T  # [T, H] · [E, H]ᵀ -> router logits [T, E]
    ids, weights = route(logits, arch, dense.get(p + "router_bias"))  # [T, K], [T, K]
    if recorder is not None:
        recorder.record(layer, ids, weights)
    return ids, weights


def _route_one(x: np.ndarray, layer: int, arch: ArchConfig, dense: dict, recorder: RoutingRecorder | None
               ) -> tuple[list[int], np.ndarray]:
    """One token's routing (x [1, H]), recorded: (expert ids ascending, their gates float32 [K]). A plain
    softmax router runs :func:`route`'s steps on the logits row (the same numpy calls on the same
    numbers: the same bits, without the [T, ·] indexing); other routers run :func:`route` itself."""
    p = f"layers.{layer}."
    logits = x @ dense[p + "router"].T  # [1, H] · [E, H]ᵀ -> [1, E]
    if (arch.scoring != "softmax" or p + "router_bias" in dense or logits.dtype != np.float32
            or (arch.n_group > 1 and arch.topk_group < arch.n_group)):
        return _one_token(*_route_record(x, layer, arch, dense, recorder))
    row = logits[0]
    z = np.exp(row - row.max())
    scores = z / z.sum()  # probabilities [E]
    ids = np.argsort(-scores, kind="stable")[: arch.top_k]  # top-k ids [K], descending
    w = scores[ids]
    if arch.norm_topk_prob:
        w = w / (w.sum() + 0.0)
    if arch.routed_scaling_factor != 1.0:
        w = w * np.float32(arch.routed_scaling_factor)
    ids = ids.astype(np.int64, copy=False)
    if recorder is not None:
        recorder.record(layer, ids[None], w[None])
    return _one_token(ids[None], w[None])


def _one_token(ids: np.ndarray, weights: np.ndarray) -> tuple[list[int], np.ndarray]:
    """A decode step's routing ids/weights [1, K] as (expert ids ascending [K], their gates float32 [K])."""
    order = np.argsort(ids[0], kind="stable")
    return ids[0][order].tolist(), weights[0][order]


def scatter_sum(x: np.ndarray, tok_of: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> np.ndarray:
    """Σ of the experts' weighted outputs ys[i] [T_i, H] into the rows tok_of[i] of a zero float32
    [T, H] shaped as x, in the order given (the engine's summation order).

    Raises:
        InputError: ys of the wrong number or shape.
    """
    if len(ys) != len(tok_of):
        raise InputError(f"expert provider returned {len(ys)} outputs for {len(tok_of)} experts")
    out = np.zeros_like(x)
    one = x.shape[0] == 1  # decode: every expert's one row is row 0, added in place without indexing
    for t, y in zip(tok_of, ys):
        if y.shape != (len(t), x.shape[1]):
            raise InputError(f"expert provider returned shape {y.shape}, want {(len(t), x.shape[1])}")
        if one:
            np.add(out, y, out=out)
        else:
            out[t] += y  # a token appears at most once per expert: a plain scatter-add
    return out


def routed_experts(x: np.ndarray, layer: int, arch: ArchConfig, dense: dict[str, np.ndarray],
                   experts: ExpertProvider, recorder: RoutingRecorder | None = None) -> np.ndarray:
    """The routed experts' weighted sum of one MoE layer (router, top-k, provider): x float32 [T, H]
    (post-norm) -> [T, H].

    Raises:
        InputError: the provider returned outputs of the wrong number or shape.
    """
    run_sum = getattr(experts, "run_sum", None)
    if x.shape[0] == 1 and run_sum is not None:  # decode: one provider call that sums as scatter_sum does
        uniq, w = _route_one(x, layer, arch, dense, recorder)
        return run_sum(layer, uniq, np.ascontiguousarray(x, dtype=np.float32), w)
    uniq, tok_of, gates = route_tokens(x, layer, arch, dense, recorder)
    if x.shape[0] == 1:  # decode: every expert sees the one token
        x1 = np.ascontiguousarray(x, dtype=np.float32)
        return scatter_sum(x, tok_of, experts.run(layer, uniq, [x1] * len(uniq), gates))
    xs = [np.ascontiguousarray(x[t]) for t in tok_of]  # [T_i, H] per expert
    return scatter_sum(x, tok_of, experts.run(layer, uniq, xs, gates))
