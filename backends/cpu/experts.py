"""Routed experts of the ``cpu`` backend: every expert of a layer in one parallel call per projection.

:class:`CpuExperts` is a part of :class:`~colibri_plan.backends.cpu.backend.CpuBackend` (it uses the
backend's ``_k`` kernel namespace, ``_xq`` activation quantization, ``_par`` parallel call and the checks
of ``expert_ffn``), bound at open as the ``_expert_ffn`` hook and the optional op ``expert_ffn_sum``.
Experts whose weights share one layout (``HostWeight.key``: format, blocked shape, fold) run
``qkernels.experts_gate_up`` (SiLU·mul fused) then ``experts_matmul`` on tuples of ``EXPERTS`` arrays
(``HostWeight.experts``: int4-g32 ``q4t.experts_gate_up_t``, other transposed int4
``q4g.experts_gate_up_g``, and their down kernels); mixed layouts fall back to three matmuls per expert.
:meth:`CpuExperts.expert_ffn_sum` is a decode step's whole routed sum in one call: the batch, then
``kernels.weighted_sum`` (the engine's float32 order, bit for bit), with the checks of ``expert_ffn``
made in the same pass over the experts that collects their arrays (a decode step touches each chosen
expert's objects once: they are cold in the caches after the previous layer's weights streamed through).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from colibri_plan.backends.batched import three_matmuls
from colibri_plan.backends.handles import DeviceWeight, ExpertWeights
from colibri_plan.errors import InputError

#: dynamic chunks per batched expert call: numba hands the tuples of expert arrays to every chunk it
#: schedules (~1.5 µs a chunk on a dummy kernel of these arguments, ~0.3 without the tuples); 16 chunks
#: instead of 64 took an int8 8-expert decode step (peer model shapes, from RAM) from 1018 to 939 µs
#: gate+up and 575 to 541 µs down (medians of 9, interleaved, shared 2-core host), and a descheduled
#: core still stalls only 1/16 of a call
EXPERT_CHUNKS = 16


class CpuExperts:
    """Batched routed experts, a part of ``CpuBackend`` (see the module docstring).

    Args:
        backend: the open cpu backend (its kernels, activation quantization and parallel call).
    """

    def __init__(self, backend):
        self.be, self._k, self._xq, self._par = backend, backend._k, backend._xq, backend._par
        self._step_rows = backend._step_rows
        # offsets of n experts of one token each (decode), padded to EXPERTS (read-only use)
        e = self._k.EXPERTS
        self._offs1 = [np.minimum(np.arange(e + 1, dtype=np.int64), n) for n in range(e + 1)]

    def _expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        packs = _batch_arrays(experts)
        if packs is None:  # mixed formats or layouts: one expert at a time, three matmuls each
            return three_matmuls(self.be._matmul, xs, experts)
        n, g0, d0 = self._k.EXPERTS, experts[0].gate.payload, experts[0].down.payload
        out: list[np.ndarray] = []
        for c in range(0, len(xs), n):  # all experts of a layer in one call per projection (qkernels)
            y, bounds = self._experts_batch(xs[c:c + n], packs[c:c + n], g0, d0)
            out.extend(y[bounds[i]: bounds[i + 1]] for i in range(len(bounds) - 1))
        return out

    def expert_ffn_sum(self, x: np.ndarray, experts: Sequence[ExpertWeights], gates) -> np.ndarray:
        """Σ_i gates[i] · down_i(SiLU(gate_i x) · up_i x): x float32 [T, H] routed to every expert (a
        decode step: T = 1), ``gates`` float32 [n]; returns float32 [T, H], zero plus each weighted
        expert output in order, every step rounded to float32: the sum ``y_i · gates[i]`` of
        :meth:`expert_ffn`'s outputs makes (engine/moe.py ``scatter_sum``), bit for bit, in one call.

        Raises:
            InputError: as :meth:`expert_ffn`; ``gates`` not of length n.
        """
        n, be = len(experts), self.be
        g = np.ascontiguousarray(gates, dtype=np.float32).reshape(-1)  # [n]
        packs = None if be.closed or not 0 < n <= self._k.EXPERTS else _ready_packs(x, experts, id(be))
        if packs is None:  # not a ready decode batch: expert_ffn's checks (and errors) first
            xs = be._check_experts([x] * n, experts)
            x = xs[0] if xs else x
        if g.shape[0] != n:
            raise InputError(f"expert_ffn_sum: {g.shape[0]} gates for {n} experts")
        if n == 0:
            return np.zeros(np.shape(x), np.float32)
        out = np.empty(x.shape, np.float32)  # [T, H]
        if packs is not None:  # one batched call, one weighted sum
            y, _ = self._experts_batch([x] * n, packs, experts[0].gate.payload, experts[0].down.payload)
            self._k.weighted_sum(y, g, x.shape[0], out)  # y [n·T, H]
            return out
        ys = self._expert_ffn(xs, experts)
        self._k.weighted_sum(np.concatenate(ys), g, x.shape[0], out)
        return out

    def _experts_batch(self, xs: Sequence[np.ndarray], packs: list[tuple], g0, d0
                       ) -> tuple[np.ndarray, Sequence[int]]:
        """Up to EXPERTS experts of one layout (``packs``: their (gate data3, scales2, up ..., down ...)
        arrays, :func:`_batch_arrays`; g0/d0 the first expert's gate and down): gate+up (SiLU·mul fused)
        then down, one call each. Returns (y float32 [ΣT, H], bounds: expert i's rows are
        bounds[i]:bounds[i + 1])."""
        n, k = len(xs), self._k
        # a decode step's one token routed to every expert (expert_ffn_sum): quantized once, its rows
        # repeated (the numbers n quantizations of the n equal rows would make)
        one = n > 1 and xs[0].shape[0] == 1 and all(xi is xs[0] for xi in xs)
        x = xs[0] if n == 1 or one else np.concatenate(xs)  # [ΣT, H], or the shared [1, H]
        rows = n if one else x.shape[0]
        if rows == n:  # one token per expert (decode): offsets 0..n, padding experts own no tokens
            offs, bounds = self._offs1[n], range(n + 1)
        else:
            bounds = [0]
            for xi in xs:
                bounds.append(bounds[-1] + xi.shape[0])
            offs = np.array(bounds + [rows] * (k.EXPERTS - n), np.int64)
        pad = k.EXPERTS - n
        gw, gs, uw, us, dw, ds = (c + c[:1] * pad for c in zip(*packs))  # tuples of EXPERTS arrays
        h = np.empty((rows, g0.qt.out_features), np.float32)  # [ΣT, I]
        gate_up = g0.experts[0]
        # the byte kernels take the one token for every expert as it is (q4t.takes_one_row), others repeated
        single = one and gate_up is k.experts_gate_up_t and k.takes_one_row(g0.data3)
        self._par(self._expert_steps(h.shape[1], g0), gate_up, _kind(g0), gw, gs, uw, us,
                  *self._xq_any(x, g0, n if one and not single else 1), offs, h, chunks=EXPERT_CHUNKS)
        y = np.empty((rows, d0.qt.out_features), np.float32)  # [ΣT, H]
        down = d0.experts[1]
        self._par(self._expert_steps(y.shape[1], d0), down, _kind(d0), dw, ds, *self._xq_any(h, d0), offs, y,
                  chunks=EXPERT_CHUNKS)
        return y, bounds

    def _expert_steps(self, rows: int, hw) -> int:
        """prange steps of a batched expert kernel over ``rows`` output rows: EXPERTS × row blocks of
        ``_step_rows(hw)`` rows (the backend's)."""
        return self._k.EXPERTS * -(-rows // self._step_rows(hw))

    def _xq_any(self, x: np.ndarray, hw, repeat: int = 1):
        """(xa3, xb3, sx, xsum) for the batched kernels; int8 fills the unused slots. ``repeat`` > 1: x
        is one row [1, H], quantized once and each array's row repeated that many times."""
        a = self._xq(x, hw)
        if repeat > 1:
            a = tuple(np.repeat(v, repeat, axis=0) for v in a)
        return a if len(a) == 4 else (a[0], a[0], a[1], _NO_SUMS)


_NO_SUMS = np.zeros((1, 1), np.int32)


def _kind(hw) -> int:
    """Row kernel of a weight in the batched expert kernels: 0 int8, 1 int4 blocks, 2 transposed."""
    return 0 if hw.qt.fmt == "int8" else (2 if hw.fold else 1)


def _ready_packs(x, experts: Sequence[ExpertWeights], owner: int) -> list[tuple] | None:
    """:func:`_batch_arrays` of experts that pass ``expert_ffn``'s checks with x as given (live weights of
    backend ``owner`` whose shapes chain with x, a C-contiguous float32 ndarray [T ≥ 1, H]) in one pass;
    None when any check or the batching does not hold (the caller then runs the checks that raise)."""
    if not (type(x) is np.ndarray and x.dtype == _F32 and x.ndim == 2 and x.shape[0] > 0
            and x.flags.c_contiguous):
        return None
    hidden, dw, kg, kd, packs = x.shape[1], DeviceWeight, None, None, []
    for e in experts:
        g, u, d = e.gate, e.up, e.down
        if not (type(g) is dw and type(u) is dw and type(d) is dw and g.owner == owner and u.owner == owner
                and d.owner == owner and not (g.freed or u.freed or d.freed)
                and g.in_features == u.in_features == d.out_features == hidden
                and g.out_features == u.out_features == d.in_features):
            return None
        pg, pu, pd = g.payload, u.payload, d.payload
        if kg is None:
            kg, kd = pg.key, pd.key
            if kg is None or kd is None:
                return None
        if not (pg.key is kg or pg.key == kg) or not (pu.key is kg or pu.key == kg) \
                or not (pd.key is kd or pd.key == kd):  # interned keys (CpuBackend._upload): identity
            return None
        packs.append((pg.data3, pg.scales2, pu.data3, pu.scales2, pd.data3, pd.scales2))
    return packs


_F32 = np.dtype(np.float32)


def _batch_arrays(experts: Sequence[ExpertWeights]) -> list[tuple] | None:
    """(gate data3, gate scales2, up data3, up scales2, down data3, down scales2) of each expert when all
    run in one batched call: integer formats, the first expert's layout (``HostWeight.key``) for every
    gate and up, and its down's for every down; None otherwise."""
    kg, kd = experts[0].gate.payload.key, experts[0].down.payload.key
    if kg is None or kd is None:
        return None
    packs = []
    for e in experts:
        g, u, d = e.gate.payload, e.up.payload, e.down.payload
        if g.key != kg or u.key != kg or d.key != kd:
            return None
        packs.append((g.data3, g.scales2, u.data3, u.scales2, d.data3, d.scales2))
    return packs
