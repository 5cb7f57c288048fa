"""numba kernels of the ``cpu`` backend (imported only when that backend is opened).

Every kernel is ``parallel=True`` over output rows (one contiguous block of rows per core) and
``fastmath=True`` so LLVM vectorises the inner byte loop (AVX2/AVX-512 where the CPU has it). Compiled
code is cached on disk (``cache=True``) beside this file, or in numba's user cache when that is
read-only, so only the first run on a machine pays the compile time.

The unpacking trick (why these kernels keep up with RAM): a byte ``b`` holding two int4 codes
``lo = b & 15`` and ``hi = b >> 4`` contributes ``lo·x0 + hi·x1``. With ``f = float(b)`` and
``hi = floor(f / 16)`` (exact for 0 ≤ b < 256), ``lo = f − 16·hi``, so

    lo·x0 + hi·x1 = f·x0 + hi·(x1 − 16·x0) = f·xe + hi·xd

with ``xe = x[0::2]`` and ``xd = x[1::2] − 16·x[0::2]`` prepared once per call. The inner loop is then
one byte→float conversion, one multiply-round and two FMAs per byte, all on 16 float lanes; integer
nibble masking would be promoted to 64-bit lanes by numba's integer typing and run at half the speed.
The zero code is removed once per group: Σ (code − 8)·x = Σ code·x − 8·Σ x. int2 uses the same
idea with four planes (``floor(f/4)``, ``floor(f/16)``, ``floor(f/64)``).
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_F16 = np.float32(1.0 / 16.0)
_F4 = np.float32(0.25)
_F64 = np.float32(1.0 / 64.0)


@njit(fastmath=True, cache=True)
def _q4_dot(row, j0, j1, xe, xd):
    # Σ over bytes j0..j1 of one int4 row of code·x (zero code not removed), float32
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    for j in range(j0, j1):
        f = np.float32(row[j])
        a1 += f * xe[j]
        a2 += np.floor(f * _F16) * xd[j]
    return a1 + a2


@njit(fastmath=True, cache=True)
def _q4_row(row, srow, xe, xd, xsum, gb):
    # one output value: Σ_g s[g] · (Σ code·x − 8 Σ x) over the groups of gb bytes
    nbytes = row.shape[0]
    acc = np.float32(0.0)
    for g in range(srow.shape[0]):
        j0 = g * gb
        j1 = min(j0 + gb, nbytes)
        acc += srow[g] * (_q4_dot(row, j0, j1, xe, xd) - np.float32(8.0) * xsum[g])
    return acc


@njit(parallel=True, fastmath=True, cache=True)
def q4_matmul(data, scales, xe, xd, xsum, gb, y):
    """int4 / int4-gG GEMM: y [T, out] = x · Wᵀ.

    data uint8 [out, nb]; scales float32 [out, ng] (ng = 1 for per-row int4); xe, xd float32 [T, nb]
    (see the module docstring); xsum float32 [T, ng] (Σ x per group); gb: bytes per group (G/2);
    y float32 [T, out], written in place.
    """
    out = data.shape[0]
    T = xe.shape[0]
    for r in prange(out):  # rows are independent: each core takes one contiguous block
        row = data[r]
        srow = scales[r]
        for t in range(T):
            y[t, r] = _q4_row(row, srow, xe[t], xd[t], xsum[t], gb)


@njit(parallel=True, fastmath=True, cache=True)
def q4_gate_up(gdata, gscales, udata, uscales, xe, xd, xsum, gb, h):
    """Fused SwiGLU first half: h [T, I] = SiLU(x·Gᵀ) · (x·Uᵀ) for int4 / int4-gG gate and up [I, H].

    Arguments as :func:`q4_matmul` (same activations for both matrices); h written in place.
    """
    inter = gdata.shape[0]
    T = xe.shape[0]
    for r in prange(inter):
        grow = gdata[r]
        urow = udata[r]
        gs = gscales[r]
        us = uscales[r]
        for t in range(T):
            g = _q4_row(grow, gs, xe[t], xd[t], xsum[t], gb)
            u = _q4_row(urow, us, xe[t], xd[t], xsum[t], gb)
            h[t, r] = g / (np.float32(1.0) + np.exp(-g)) * u


@njit(parallel=True, fastmath=True, cache=True)
def q2_matmul(data, scales, x0, d1, d2, d3, xsum, y):
    """int2 GEMM with per-row scales: y [T, out] = x · Wᵀ.

    data uint8 [out, nb] (four 2-bit codes per byte, low bits first); scales float32 [out];
    x0 = x[0::4], d1 = x[1::4] − 4·x[0::4], d2 = x[2::4] − 4·x[1::4], d3 = x[3::4] − 4·x[2::4], each
    float32 [T, nb]; xsum float32 [T]; y float32 [T, out] written in place.
    """
    out, nbytes = data.shape
    T = x0.shape[0]
    for r in prange(out):
        row = data[r]
        for t in range(T):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for j in range(nbytes):
                f = np.float32(row[j])
                a0 += f * x0[t, j]
                a1 += np.floor(f * _F4) * d1[t, j]
                a2 += np.floor(f * _F16) * d2[t, j]
                a3 += np.floor(f * _F64) * d3[t, j]
            y[t, r] = (a0 + a1 + a2 + a3 - np.float32(2.0) * xsum[t]) * scales[r]


@njit(parallel=True, fastmath=True, cache=True)
def q8_matmul(data, scales, x, y):
    """int8 GEMM with per-row scales: data int8 [out, in], scales float32 [out], x float32 [T, in],
    y float32 [T, out] written in place."""
    out, n = data.shape
    T = x.shape[0]
    for r in prange(out):
        row = data[r]
        for t in range(T):
            acc = np.float32(0.0)
            for j in range(n):
                acc += np.float32(row[j]) * x[t, j]
            y[t, r] = acc * scales[r]


@njit(parallel=True, fastmath=True, cache=True)
def read_sum(a):
    """Σ of a float32 [chunks, n] array, one chunk per prange step: RAM read bandwidth with all cores
    (the benchmark's yardstick for what bounds CPU GEMV)."""
    parts = np.zeros(a.shape[0], np.float32)
    for c in prange(a.shape[0]):
        s = np.float32(0.0)
        for i in range(a.shape[1]):
            s += a[c, i]
        parts[c] = s
    return parts.sum()
