"""Per-row int4, int4-g64 and int4-g128 kernels of the ``cpu`` backend on the transposed layout of
``q4t`` (imported only when that backend is opened).

Layout (cpu.py ``int_layout``): wt uint8 [out, C, J, L], lane k of a row holding bytes k·J .. k·J + J − 1
(columns 2·k·J ..), chunks of L = 64 lanes; the activations are ``quant_x4t``'s xe/xo int16 [T, C, J, L]
and Σ xq per lane xsl int32 [T, C·L], as for int4-g32. A group spans R = 2 or 4 adjacent lanes
(int4-g64: fold 2 at J = 16 or 4 at J = 8; int4-g128: 4 at J = 16); a per-row weight is one group of
every lane and is summed in "entries" of R = 4 lanes (128 columns at J = 16), its scale applied once.

Arithmetic: each entry e (a group, or 4 lanes of a row) is the exact int32 ``a_e = Σ (code − 8)·xq``
(|a_e| ≤ 128·8·32767 < 2³¹); then ``y = sx · Σ_e s_e·float32(a_e)`` for groups (scales float32
[out, groups], as stored: no per-lane copies to read), ``y = sx · (s · Σ_e float32(a_e))`` per row.
The float sum is ``vnni._vsum`` (fixed order), so a token gives the same bits alone, in a batch,
serially or in parallel (tests/test_backend_cpu_q4g.py).

Loop shapes (AVX-512 VNNI, chunks of 64 lanes; else the numba loop of ``q4t._dots1`` with the
lanes summed into entries): ``vnni.group_dots`` unpacks 32 bytes into 32 int16 codes whose low
and high nibbles meet xe and xo as they lie, and ``vpdpwssd`` sums the lane pairs. One token per weight
load for decode; 4, 2, 1 tokens per weight load for a batch, RB rows at a time so the rows and the
token group's activations stay in L1.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# numba's cache keys a kernel by the contents of its own file: vnni's intrinsics and the q4t
# functions inlined here are compiled into these kernels, so a change of either file must change this
# one too (KERNEL_SOURCES below; tests/test_backend_cpu_q4g.py checks it)
from colibri_plan.backends.cpu.q4t import EXPERTS, NT, RB, TILE_ROWS, _dots1, _lane_sum, _silu_rows, _tile
from colibri_plan.backends.cpu.vnni import (
    VNNI,
    _g8r4x1,
    _g8r4x2,
    _g8r4x4,
    _g16r2x1,
    _g16r2x2,
    _g16r2x4,
    _g16r4x1,
    _g16r4x2,
    _g16r4x4,
    _vsum,
    _vsum4,
)

#: sha256 (16 hex digits each) of backends/cpu/vnni.py and backends/cpu/q4t.py as these kernels were
#: compiled against: updating it with them makes numba recompile this file's kernels
KERNEL_SOURCES = ("1726ee0eb375cde7", "965dc4de4e6e2bad")
#: lanes per per-row entry (the int32 sums of a per-row weight before the float sum)
ROW_ENTRY_LANES = 4


def _by_tokens(f4, f2, f1):
    """A dispatch numba inlines over the token count m (4, 2 or 1) of one vnni.group_dots(J, R, m)
    family, the intrinsics' twelve arguments passed on (the functions are closure constants)."""

    @njit(fastmath=True, cache=True, inline="always")
    def run(m, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11):
        if m == 4:
            f4(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11)
        elif m == 2:
            f2(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11)
        else:
            f1(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11)

    return run


_gd16r2, _gd16r4, _gd8r4 = (_by_tokens(*f) for f in (
    (_g16r2x4, _g16r2x2, _g16r2x1), (_g16r4x4, _g16r4x2, _g16r4x1), (_g8r4x4, _g8r4x2, _g8r4x1)))


@njit(fastmath=True, cache=True, inline="always")
def _gd(J, R, m, ai, ao, astep, w, wo, xe, xo, xoff, xstep, xg, go, gstep):
    # m tokens (4, 2 or 1) of one chunk: vnni.group_dots(J, R, m)
    if R == 2:  # J == 16: int4-g64 at fold 2
        _gd16r2(m, ai, ao, astep, w, wo, xe, xo, xoff, xstep, xg, go, gstep)
    elif J == 16:
        _gd16r4(m, ai, ao, astep, w, wo, xe, xo, xoff, xstep, xg, go, gstep)
    else:
        _gd8r4(m, ai, ao, astep, w, wo, xe, xo, xoff, xstep, xg, go, gstep)


@njit(fastmath=True, cache=True, inline="always")
def _lanes_per_entry(wt, sg):
    # R: adjacent lanes summed in int32 per entry (a group; per-row weights, sg [out, 1]: 4 lanes)
    lanes = wt.shape[1] * wt.shape[3]
    return ROW_ENTRY_LANES if sg.shape[1] == 1 else lanes // sg.shape[1]


@njit(fastmath=True, cache=True, inline="always")
def _fast(wt, R):
    # the vpdpwssd path: compiled in, chunks of 64 lanes, 16 or 8 bytes per lane, R = 4 or (J = 16) 2
    J = wt.shape[2]
    return VNNI and wt.shape[3] == 64 and (R == 4 and (J == 16 or J == 8) or R == 2 and J == 16)


@njit(fastmath=True, cache=True, inline="always")
def _entry_sums(xsl, R):
    # xg int32 [T, lanes / R]: Σ xq of each entry's R lanes
    T, n = xsl.shape[0], xsl.shape[1] // R
    xg = np.empty((T, n), np.int32)
    for t in range(T):
        for e in range(n):
            acc = np.int32(0)
            for q in range(R):
                acc += xsl[t, e * R + q]
            xg[t, e] = acc
    return xg


@njit(fastmath=True, cache=True, inline="always")
def _rows(wt, sg, ones, xe3, xo3, sx, xsl, xg, y, r0, r1, t0, t1, ai):
    # y[t, r] for rows r0:r1 and tokens t0:t1; ai int32 [NT, C·L] scratch; ones float32 [1, entries]
    C, J, L = wt.shape[1], wt.shape[2], wt.shape[3]
    R = _lanes_per_entry(wt, sg)
    ne = C * L // R
    row_scale = sg.shape[1] == 1
    if not _fast(wt, R):  # per-lane dots (numba loop), their entries summed in int32, then as below
        af = ai.reshape(-1)
        for t in range(t0, t1):
            for r in range(r0, r1):
                _dots1(wt, r, xe3, xo3, t, xsl, af)
                for e in range(ne):
                    acc = np.int32(0)
                    for q in range(R):
                        acc += af[e * R + q]
                    af[e] = acc
                if row_scale:
                    y[t, r] = _lane_sum(ones, 0, af, 0, ne) * sg[r, 0] * sx[t]
                else:
                    y[t, r] = _lane_sum(sg, r, af, 0, ne) * sx[t]
        return
    wf, ef, of, af, gf = wt.reshape(-1), xe3.reshape(-1), xo3.reshape(-1), ai.reshape(-1), xg.reshape(-1)
    sf = ones.reshape(-1) if row_scale else sg.reshape(-1)
    row, E = C * J * L, L // R
    f4 = np.empty(4, np.float32)
    for rb in range(r0, r1, RB):  # RB rows meet each group of NT tokens while both are in L1
        re = min(rb + RB, r1)
        t = t0
        while t < t1:
            m = 4 if t1 - t >= 4 else (2 if t1 - t >= 2 else 1)
            for r in range(rb, re):
                for c in range(C):
                    _gd(J, R, m, af, c * E, ne, wf, r * row + c * J * L, ef, of, t * row + c * J * L, row,
                        gf, t * ne + c * E, ne)
                so = 0 if row_scale else r * ne
                if m == 4:
                    _vsum4(sf, so, af, 0, ne, ne, f4)
                    for u in range(4):
                        s = f4[u] * sg[r, 0] if row_scale else f4[u]
                        y[t + u, r] = s * sx[t + u]
                else:
                    for u in range(m):
                        s = _vsum(sf, so, af, u * ne, ne, ne)
                        s = s * sg[r, 0] if row_scale else s
                        y[t + u, r] = s * sx[t + u]
            t += m


@njit(fastmath=True, cache=True, inline="always")
def _prep(wt, sg, xsl):
    # (ones float32 [1, entries], xg int32 [T, entries]) of one call, made in each parallel step (a few
    # hundred integer adds a step): the steps then share no array made by the call, only its inputs
    R = _lanes_per_entry(wt, sg)
    ne = wt.shape[1] * wt.shape[3] // R
    return np.ones((1, ne), np.float32), _entry_sums(xsl, R)


@njit(parallel=True, fastmath=True, cache=True)
def i4g_matmul(wt, sg, xe3, xo3, sx, xsl, y):
    """Grouped int4 GEMM on the transposed layout: wt uint8 [out, C, J, L]; sg float32 [out, groups]
    (int4-g64/g128) or [out, 1] (per-row); xe3, xo3 int16 [T, C, J, L]; sx float32 [T]; xsl int32
    [T, C·L] (Σ xq per lane); y float32 [T, out] written in place."""
    T = xe3.shape[0]
    for b in prange((wt.shape[0] + TILE_ROWS - 1) // TILE_ROWS):
        ones, xg = _prep(wt, sg, xsl)  # per step (see _prep)
        ai = np.empty((NT, wt.shape[1] * wt.shape[3]), np.int32)
        r0 = b * TILE_ROWS
        _rows(wt, sg, ones, xe3, xo3, sx, xsl, xg, y, r0, min(r0 + TILE_ROWS, wt.shape[0]), 0, T, ai)


@njit(fastmath=True, cache=True)
def i4g_matmul_1(wt, sg, xe3, xo3, sx, xsl, y):
    """:func:`i4g_matmul` on the calling thread (small weights), same result."""
    T = xe3.shape[0]
    ones, xg = _prep(wt, sg, xsl)
    ai = np.empty((NT, wt.shape[1] * wt.shape[3]), np.int32)
    for b in range((wt.shape[0] + TILE_ROWS - 1) // TILE_ROWS):
        r0 = b * TILE_ROWS
        _rows(wt, sg, ones, xe3, xo3, sx, xsl, xg, y, r0, min(r0 + TILE_ROWS, wt.shape[0]), 0, T, ai)


# ---- routed experts, batched (as q4t's: a tile of gate rows, then the same tile of up rows) ----


@njit(parallel=True, fastmath=True, cache=True)
def experts_gate_up_g(kind, gw, gs, uw, us, xa3, xb3, sx, xsum, offs, h):
    """h [ΣT, I] = SiLU(x·Gₑᵀ)·(x·Uₑᵀ) for the rows of each expert e (per-row int4, int4-g64/g128 on
    the transposed layout). gw, uw: tuples of EXPERTS weights uint8 [I, C, J, L]; gs, us: their
    scales float32 [I, groups or 1]; xa3, xb3 int16 [ΣT, C, J, L], sx float32 [ΣT], xsum int32
    [ΣT, C·L]; offs int64 [EXPERTS + 1]; h float32 [ΣT, I] written in place; ``kind`` unused."""
    inter = gw[0].shape[0]
    tiles = (inter + TILE_ROWS - 1) // TILE_ROWS
    g = np.empty_like(h)
    for i in prange(EXPERTS * tiles):
        ones, xg = _prep(gw[0], gs[0], xsum)  # per step (see _prep)
        e, r0, r1 = _tile(i, tiles, inter)
        t0, t1 = offs[e], offs[e + 1]
        ai = np.empty((NT, gw[0].shape[1] * gw[0].shape[3]), np.int32)
        _rows(gw[e], gs[e], ones, xa3, xb3, sx, xsum, xg, g, r0, r1, t0, t1, ai)
        _rows(uw[e], us[e], ones, xa3, xb3, sx, xsum, xg, h, r0, r1, t0, t1, ai)
        _silu_rows(g, h, t0, t1, r0, r1)


@njit(parallel=True, fastmath=True, cache=True)
def experts_matmul_g(kind, ws_, ss, xa3, xb3, sx, xsum, offs, y):
    """y [ΣT, out] = x · Wₑᵀ for the rows of each expert e (the down projections); arguments as
    :func:`experts_gate_up_g`, y float32 written in place."""
    out = ws_[0].shape[0]
    tiles = (out + TILE_ROWS - 1) // TILE_ROWS
    for i in prange(EXPERTS * tiles):
        ones, xg = _prep(ws_[0], ss[0], xsum)  # per step (see _prep)
        e, r0, r1 = _tile(i, tiles, out)
        ai = np.empty((NT, ws_[0].shape[1] * ws_[0].shape[3]), np.int32)
        _rows(ws_[e], ss[e], ones, xa3, xb3, sx, xsum, xg, y, r0, r1, offs[e], offs[e + 1], ai)
