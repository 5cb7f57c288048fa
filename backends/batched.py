"""Batched routed experts, shared by the backends: which experts of a call run in one fused kernel call,
the token offsets of a batch, and the split of the result per expert (:class:`BatchedExperts`, the
``_expert_ffn`` hook a GPU backend binds over its own ``_ffn_batch``).

A batch whose experts differ in format or shape runs one fused call per expert; an expert the fused
kernels cannot take (gate and up of two formats, or what a backend's ``fusable`` refuses) runs as three
matmuls, the contract's default.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from colibri_plan.backends.handles import ExpertWeights
from colibri_plan.backends.reference import silu_mul_ref


def token_offsets(counts: Sequence[int]) -> list[int]:
    """[0, T_0, T_0 + T_1, ...]: expert i owns rows tok[i] .. tok[i+1]-1 of a batch's x, h and y."""
    tok = [0]
    for T in counts:
        tok.append(tok[-1] + int(T))
    return tok


class FFNBatch(NamedTuple):
    """Experts of one kind (formats and shapes) in one fused call: gate/up [I, H], down [H, I]."""

    counts: list[int]  # T_i, tokens of expert i
    tok: list[int]  # token_offsets(counts): expert i owns rows tok[i] .. tok[i+1]-1 of x, h and y
    H: int  # hidden size (columns of x, rows of y)
    I: int  # expert width (rows of gate/up)
    Hp: int  # H padded: x is staged [Σ T_i, Hp]
    Ip: int  # I padded: h is [Σ T_i, Ip], zero in its padding (down reads it)


def ffn_kind(e: ExpertWeights) -> tuple:
    """What must match for experts to share one fused call: formats and shape."""
    return e.gate.fmt, e.up.fmt, e.down.fmt, e.gate.out_features, e.gate.in_features


def ffn_fusable(e: ExpertWeights) -> bool:
    """Whether the fused kernels take this expert: their gate/up pass reads one format."""
    return e.gate.fmt == e.up.fmt


def three_matmuls(matmul: Callable, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]
                  ) -> list[np.ndarray]:
    """down(SiLU(gate x) · up x) per expert through ``matmul(x, w)`` (a backend's host ``_matmul``)."""
    out = []
    for x, e in zip(xs, experts):
        h = silu_mul_ref(matmul(x, e.gate), matmul(x, e.up))
        out.append(matmul(np.ascontiguousarray(h, dtype=np.float32), e.down))
    return out


class BatchedExperts:
    """The ``_expert_ffn`` hook over a backend's fused ``ffn_batch(xs, experts, batch) -> y [Σ T_i, H]``
    (gate/up with SiLU·mul, then down, over experts of one kind; weights in ``staging.padded_layout``).

    Args:
        backend: the backend (its host ``_matmul`` runs experts the fused kernels cannot take).
        ffn_batch: the backend's fused call.
        fusable: which experts it takes (default :func:`ffn_fusable`).
    """

    HOOKS = ("_expert_ffn",)

    def __init__(self, backend, ffn_batch: Callable, fusable: Callable[[ExpertWeights], bool] = ffn_fusable):
        self._matmul, self._ffn_batch, self._fusable = backend._matmul, ffn_batch, fusable

    def _expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        if len({ffn_kind(e) for e in experts}) > 1:
            return [y for x, e in zip(xs, experts) for y in self._expert_ffn([x], [e])]
        e0 = experts[0]
        if not self._fusable(e0):
            return three_matmuls(self._matmul, xs, experts)
        counts = [x.shape[0] for x in xs]
        batch = FFNBatch(counts, token_offsets(counts), e0.gate.in_features, e0.gate.out_features,
                         e0.gate.payload.in_pad, e0.down.payload.in_pad)
        y = self._ffn_batch(xs, experts, batch)  # [Σ T_i, H] float32, owned (not a view of device memory)
        return [y[a:b] for a, b in zip(batch.tok, batch.tok[1:])]
