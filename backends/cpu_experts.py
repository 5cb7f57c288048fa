"""Batched routed-expert kernels of the ``cpu`` backend: every expert of a layer in one parallel call.

Decode routes one token to k experts: k·2 small GEMVs of a few MB each. One parallel region per GEMV
costs a thread wake-up (tens of µs with sleeping workers) and a load-imbalanced tail, which kept
them well below RAM bandwidth; here the gate+up pass of all experts is one ``prange`` over (expert,
row tile) work items, and the down pass another. Prefill is batched the same way (each expert with its
own tokens, which stay together in a tile's loop so its weights are read once).

Experts are passed as tuples of ``EXPERTS`` arrays (one compiled specialisation; shorter batches are
padded with an expert given no tokens). Tokens of all experts are concatenated: expert e owns rows
``offs[e]:offs[e + 1]`` of the activations and of the result. ``kind`` selects the row kernel of
:mod:`~colibri_plan.backends.cpu_qkernels`: 0 int8, 1 int4 in blocks (per-row, int4-g128), 2 int4-g32/g64
transposed; ``xb3`` and ``xsum`` are unused by int8 (pass any int16 3-D / int32 2-D array).
"""

from __future__ import annotations

import os

from numba import njit, prange

from colibri_plan.backends.cpu_qkernels import ROW_TILE, _row4, _row4t, _row8, _silu_mul

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # see cpu_kernels

#: experts per batched call (tuples of this length)
EXPERTS = 8


@njit(fastmath=True, cache=True, inline="always")
def _row_any(kind, w3, r, s2, xa3, xb3, t, xsum):
    # blocked layouts [out, blocks, bb] (kind 0, 1); the transposed one is 4-D: kernels of its own
    if kind == 0:
        return _row8(w3, r, xa3, t) * s2[r, 0]
    return _row4(w3, r, s2, xa3, xb3, t, xsum)


@njit(fastmath=True, cache=True, inline="always")
def _row_t(kind, w4, r, s2, xa4, xb4, t, xsum):
    return _row4t(w4, r, s2, xa4, xb4, t, xsum)


@njit(parallel=True, fastmath=True, cache=True)
def experts_gate_up(kind, gw, gs, uw, us, xa3, xb3, sx, xsum, offs, h):
    """h [ΣT, I] = SiLU(x·Gₑᵀ)·(x·Uₑᵀ) for the rows of each expert e.

    gw, uw: tuples of EXPERTS weight arrays [I, blocks, bb] (the upload's layout, same for all);
    gs, us: tuples of their float32 scales [I, groups]; xa3, xb3 [ΣT, blocks, bb] int16 activations
    (int8: xq; int4: the even and odd halves), sx float32 [ΣT], xsum int32 [ΣT, groups]; offs int64
    [EXPERTS + 1]; h float32 [ΣT, I] written in place.
    """
    inter = gw[0].shape[0]
    tiles = (inter + ROW_TILE - 1) // ROW_TILE
    for i in prange(EXPERTS * tiles):
        e = i // tiles
        r0 = (i - e * tiles) * ROW_TILE
        r1 = min(r0 + ROW_TILE, inter)
        g3, u3, g2, u2 = gw[e], uw[e], gs[e], us[e]
        for t in range(offs[e], offs[e + 1]):  # this expert's tokens: its tile stays in L2
            for r in range(r0, r1):
                g = _row_any(kind, g3, r, g2, xa3, xb3, t, xsum) * sx[t]
                u = _row_any(kind, u3, r, u2, xa3, xb3, t, xsum) * sx[t]
                h[t, r] = _silu_mul(g, u)


@njit(parallel=True, fastmath=True, cache=True)
def experts_matmul(kind, ws, ss, xa3, xb3, sx, xsum, offs, y):
    """y [ΣT, out] = x · Wₑᵀ for the rows of each expert e (the down projections); arguments as
    :func:`experts_gate_up`, y float32 written in place."""
    out = ws[0].shape[0]
    tiles = (out + ROW_TILE - 1) // ROW_TILE
    for i in prange(EXPERTS * tiles):
        e = i // tiles
        r0 = (i - e * tiles) * ROW_TILE
        r1 = min(r0 + ROW_TILE, out)
        w3, s2 = ws[e], ss[e]
        for t in range(offs[e], offs[e + 1]):
            for r in range(r0, r1):
                y[t, r] = _row_any(kind, w3, r, s2, xa3, xb3, t, xsum) * sx[t]


@njit(parallel=True, fastmath=True, cache=True)
def experts_gate_up_t(kind, gw, gs, uw, us, xa3, xb3, sx, xsum, offs, h):
    """:func:`experts_gate_up` for int4-g32/g64 (weights and activations [.., C, J, L])."""
    inter = gw[0].shape[0]
    tiles = (inter + ROW_TILE - 1) // ROW_TILE
    for i in prange(EXPERTS * tiles):
        e = i // tiles
        r0 = (i - e * tiles) * ROW_TILE
        r1 = min(r0 + ROW_TILE, inter)
        g3, u3, g2, u2 = gw[e], uw[e], gs[e], us[e]
        for t in range(offs[e], offs[e + 1]):  # this expert's tokens: its tile stays in L2
            for r in range(r0, r1):
                g = _row_t(kind, g3, r, g2, xa3, xb3, t, xsum) * sx[t]
                u = _row_t(kind, u3, r, u2, xa3, xb3, t, xsum) * sx[t]
                h[t, r] = _silu_mul(g, u)


@njit(parallel=True, fastmath=True, cache=True)
def experts_matmul_t(kind, ws, ss, xa3, xb3, sx, xsum, offs, y):
    """:func:`experts_matmul` for int4-g32/g64 (weights and activations [.., C, J, L])."""
    out = ws[0].shape[0]
    tiles = (out + ROW_TILE - 1) // ROW_TILE
    for i in prange(EXPERTS * tiles):
        e = i // tiles
        r0 = (i - e * tiles) * ROW_TILE
        r1 = min(r0 + ROW_TILE, out)
        w3, s2 = ws[e], ss[e]
        for t in range(offs[e], offs[e + 1]):
            for r in range(r0, r1):
                y[t, r] = _row_t(kind, w3, r, s2, xa3, xb3, t, xsum) * sx[t]
