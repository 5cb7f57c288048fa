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

import os

import numpy as np
from numba import njit, prange

# OpenMP threads that sleep instead of spin between kernels, unless the user chose: on the shared
# 2-core host, spinning barriers made the int4 GEMV collapse (0.4-0.8 GB/s instead of 18) whenever
# other processes were busy; sleeping costs up to ~1.5x on an idle machine, where
# OMP_WAIT_POLICY=active gets it back (docs/backends.md). Read once, when numba starts its OpenMP
# pool (first parallel call), so set here, before any kernel runs.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

_F16 = np.float32(1.0 / 16.0)
_F4 = np.float32(0.25)
_F64 = np.float32(1.0 / 64.0)
#: rows per parallel work item: ~100 KiB of int4 weights at 6144 columns, so a tile stays in L2 while
#: it is reused for every token of a prefill batch
ROW_TILE = 32


@njit(fastmath=True, cache=True)
def _q4_dot(row, xe, xd):
    # Σ code·x over one int4 byte run (zero code not removed); row uint8 [n], xe/xd float32 [n]
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    for j in range(row.shape[0]):
        f = np.float32(row[j])
        a1 += f * xe[j]
        a2 += np.floor(f * _F16) * xd[j]
    return a1 + a2


def _q4_dot_fixed(nbytes: int):
    """Σ code·x over one int4 group of ``nbytes`` bytes (zero code not removed). ``nbytes`` is a closure
    constant, so numba compiles a constant trip count, which vectorises without a scalar tail; numba's
    disk cache keys closures by their cell contents, so each size has its own cached entry."""

    @njit(fastmath=True, cache=True)
    def dot(row, xe, xd):
        a = np.float32(0.0)  # one accumulator: one horizontal reduction per group instead of two
        for j in range(nbytes):
            f = np.float32(row[j])
            a += f * xe[j] + np.floor(f * _F16) * xd[j]
        return a

    return dot


_q4_dot32 = _q4_dot_fixed(32)  # one int4-g64 group (32 bytes)
_q4_dot64 = _q4_dot_fixed(64)  # one int4-g128 group (64 bytes)


@njit(fastmath=True, cache=True)
def _q4_dot16x2(row, xe, xd):
    # two int4-g32 groups (2 x 16 bytes) in one 32-byte loop: LLVM leaves a 16-trip loop scalar
    a = np.float32(0.0)
    b = np.float32(0.0)
    for j in range(32):
        f = np.float32(row[j])
        v = f * xe[j] + np.floor(f * _F16) * xd[j]
        if j < 16:
            a += v
        else:
            b += v
    return a, b


@njit(fastmath=True, cache=True)
def _q4_row(d2, srow, xe2, xd2, xsum, pairs):
    # one output value Σ_g s[g] · (Σ code·x − 8 Σ x). d2 uint8 [blocks, bb] is one weight row cut in
    # blocks (one per group, or two int4-g32 groups per block when ``pairs``); xe2/xd2 float32
    # [blocks, bb] likewise; srow, xsum float32 [groups]. Fixed-size 2-D indexing, not slicing at
    # runtime offsets: numba's wraparound checks on a runtime start keep the loop scalar.
    blocks, bb = d2.shape
    if blocks == 1 and not pairs:  # per-row int4 (or a single group)
        return srow[0] * (_q4_dot(d2[0], xe2[0], xd2[0]) - np.float32(8.0) * xsum[0])
    acc = np.float32(0.0)
    for g in range(blocks):
        if pairs:
            a, b = _q4_dot16x2(d2[g], xe2[g], xd2[g])
            acc += srow[2 * g] * (a - np.float32(8.0) * xsum[2 * g])
            acc += srow[2 * g + 1] * (b - np.float32(8.0) * xsum[2 * g + 1])
            continue
        if bb == 32:
            d = _q4_dot32(d2[g], xe2[g], xd2[g])
        elif bb == 64:
            d = _q4_dot64(d2[g], xe2[g], xd2[g])
        else:
            d = _q4_dot(d2[g], xe2[g], xd2[g])
        acc += srow[g] * (d - np.float32(8.0) * xsum[g])
    return acc


@njit(parallel=True, fastmath=True, cache=True)
def q4_matmul(data3, scales, xe3, xd3, xsum, pairs, y):
    """int4 / int4-gG GEMM: y [T, out] = x · Wᵀ.

    data3 uint8 [out, blocks, bb]: the packed rows cut in blocks of bb bytes (per-row int4: one block;
    int4-gG: one group of G/2 bytes per block, or two int4-g32 groups per 32-byte block when
    ``pairs``); scales float32 [out, groups]; xe3, xd3 float32 [T, blocks, bb] (module docstring);
    xsum float32 [T, groups] (Σ x per group); y float32 [T, out], written in place.
    """
    out = data3.shape[0]
    T = xe3.shape[0]
    nblk = (out + ROW_TILE - 1) // ROW_TILE
    for b in prange(nblk):  # tiles of rows are independent: the cores share them out
        r0 = b * ROW_TILE
        r1 = min(r0 + ROW_TILE, out)
        for t in range(T):  # prefill: the tile's rows stay in L2 across tokens, x[t] in L1
            for r in range(r0, r1):
                y[t, r] = _q4_row(data3[r], scales[r], xe3[t], xd3[t], xsum[t], pairs)


@njit(parallel=True, fastmath=True, cache=True)
def q4_gate_up(gdata3, gscales, udata3, uscales, xe3, xd3, xsum, pairs, h):
    """Fused SwiGLU first half: h [T, I] = SiLU(x·Gᵀ) · (x·Uᵀ) for int4 / int4-gG gate and up [I, H].

    Arguments as :func:`q4_matmul` (one activation set for both matrices); h written in place.
    """
    inter = gdata3.shape[0]
    T = xe3.shape[0]
    nblk = (inter + ROW_TILE - 1) // ROW_TILE
    for b in prange(nblk):
        r0 = b * ROW_TILE
        r1 = min(r0 + ROW_TILE, inter)
        for t in range(T):
            for r in range(r0, r1):
                g = _q4_row(gdata3[r], gscales[r], xe3[t], xd3[t], xsum[t], pairs)
                u = _q4_row(udata3[r], uscales[r], xe3[t], xd3[t], xsum[t], pairs)
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
    T = x.shape[0]
    out, n = data.shape
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


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def attention_absorb(q_abs, q_rope, latent, k_rope, scale, out):
    """Absorbed MLA decode attention, one head per prange step: q_abs [H, R], q_rope [H, Dr], latent
    [T, R], k_rope [T, Dr] float32; out float32 [H, R] written in place with
    Σ_t softmax_t(scale · (q_abs[h]·latent[t] + q_rope[h]·k_rope[t])) · latent[t]. Dot products and the
    weighted sum vectorise over R (reassociation only: infinities and NaNs keep their meaning)."""
    H, R = q_abs.shape
    T, Dr = k_rope.shape
    for h in prange(H):
        s = np.empty(T, np.float32)
        m = -np.inf
        for t in range(T):
            acc = np.float32(0.0)
            for r in range(R):
                acc += q_abs[h, r] * latent[t, r]
            for d in range(Dr):
                acc += q_rope[h, d] * k_rope[t, d]
            s[t] = acc * scale
            m = max(m, s[t])
        total = 0.0
        for t in range(T):
            s[t] = np.exp(s[t] - m)
            total += s[t]
        o = out[h]
        o[:] = 0.0
        for t in range(T):
            p = s[t]
            for r in range(R):
                o[r] += p * latent[t, r]
        inv = np.float32(1.0 / total)
        for r in range(R):
            o[r] *= inv
