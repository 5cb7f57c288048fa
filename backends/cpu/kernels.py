"""Float numba kernels of the ``cpu`` backend: int2 GEMM, the RAM probe and the engine's bit-exact
float32 RMSNorm and routed sum (imported only when that backend is opened; int8/int4 are in
``qkernels``, attention in ``attention``).

The GEMM and the probe are ``parallel=True`` over output rows (one contiguous block of rows per core) and
``fastmath=True`` so LLVM vectorises the inner byte loop (AVX2/AVX-512 where the CPU has it). Compiled
code is cached on disk (``cache=True``) beside this file, or in numba's user cache when that is
read-only, so only the first run on a machine pays the compile time.

The unpacking trick of ``q2_matmul``, shown on int4 (where it started): a byte ``b`` holding two codes
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

# OpenMP threads spin a bounded while before they sleep between kernels, unless the user chose
# (OMP_WAIT_POLICY or GOMP_SPINCOUNT set): a decode step runs ~50 parallel kernels a few hundred µs
# apart, and waking sleeping workers (OMP_WAIT_POLICY=passive, the earlier default) cost ~45 µs a
# kernel (a cached 2048x2048 int4-g32h GEMV on 2 threads: 100 µs passive, 41 µs with
# GOMP_SPINCOUNT=200000, 66 µs active; shared 2-core host). Spinning without bound (active) made the
# int4 GEMV collapse whenever other processes were busy on the shared host; a bounded spin sleeps
# once a step is over. Read once, when numba starts its OpenMP pool (first parallel call), so set
# here, before any kernel runs (docs/backends.md).
OMP_SPINS = "200000"
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = OMP_SPINS

_F16 = np.float32(1.0 / 16.0)
_F4 = np.float32(0.25)
_F64 = np.float32(1.0 / 64.0)


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


@njit(cache=True)
def weighted_sum(y, gates, t, out):
    """out [t, H] = Σ_i gates[i] · y[i·t : (i + 1)·t] (y float32 [n·t, H], gates float32 [n]): zero, then
    each expert's product added in order, every operation rounded to float32 (no fast-math, so no fused
    multiply-add): the engine's ``out += y_i · g_i`` (engine/moe.py ``scatter_sum``), bit for bit."""
    for r in range(t):
        for j in range(out.shape[1]):
            out[r, j] = np.float32(0.0)
        for i in range(gates.shape[0]):
            g = gates[i]
            for j in range(out.shape[1]):
                out[r, j] = out[r, j] + y[i * t + r, j] * g


@njit(cache=True)
def _pairwise_block(a, lo, n):
    """Σ a[lo : lo + n], n ≤ 128, as numpy's ``pairwise_sum`` sums a block: under 8 terms in order, else
    8 interleaved partial sums combined as ((0+1)+(2+3))+((4+5)+(6+7)), then the tail in order."""
    if n < 8:
        res = np.float32(0.0)
        for i in range(n):
            res = res + a[lo + i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    i = 8
    while i < n - n % 8:
        r0, r1, r2, r3 = r0 + a[lo + i], r1 + a[lo + i + 1], r2 + a[lo + i + 2], r3 + a[lo + i + 3]
        r4, r5, r6, r7 = r4 + a[lo + i + 4], r5 + a[lo + i + 5], r6 + a[lo + i + 6], r7 + a[lo + i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res = res + a[lo + i]
        i += 1
    return res


@njit(cache=True)
def _pairwise(a, n):
    """Σ a[:n] (float32, 1-D) as numpy sums a contiguous float32 row: blocks of ≤ 128 terms
    (:func:`_pairwise_block`), a longer span split at n/2 rounded down to a multiple of 8, left + right.
    Walked with an explicit stack (a recursive function loaded from numba's disk cache crashes)."""
    if n <= 128:
        return _pairwise_block(a, 0, n)
    los = np.empty(64, np.int64)  # span start, length and state (0: new, 1: left done, 2: both done)
    lens = np.empty(64, np.int64)
    state = np.zeros(64, np.int64)
    vals = np.empty(64, np.float32)  # finished spans' sums, left before right
    los[0], lens[0], sp, vp = 0, n, 1, 0
    while sp > 0:
        top = sp - 1
        lo, m = los[top], lens[top]
        if m <= 128:
            vals[vp] = _pairwise_block(a, lo, m)
            vp += 1
            sp -= 1
            continue
        half = m // 2 - (m // 2) % 8
        if state[top] == 0:  # the left half first
            state[top] = 1
            los[sp], lens[sp], state[sp] = lo, half, 0
            sp += 1
        elif state[top] == 1:  # then the right half
            state[top] = 2
            los[sp], lens[sp], state[sp] = lo + half, m - half, 0
            sp += 1
        else:  # both done: left + right
            vals[vp - 2] = vals[vp - 2] + vals[vp - 1]
            vp -= 1
            sp -= 1
    return vals[0]


@njit(cache=True)
def rms_norm(x, w, eps, out):
    """out [R, H] = x / sqrt(Σx² / H + eps) · w per row: x float32 [R, H], w float32 [R, H] or [1, H]
    (broadcast), eps float32. Every step rounded to float32 as the engine's numpy ``rmsnorm``
    (engine/attention.py) rounds it, Σx² summed in numpy's pairwise order (no fast-math): the same
    bits in one call instead of seven numpy calls."""
    h = x.shape[1]
    sq = np.empty(h, np.float32)
    for r in range(x.shape[0]):
        for j in range(h):
            sq[j] = x[r, j] * x[r, j]
        s = np.sqrt(_pairwise(sq, h) / np.float32(h) + eps)
        wr = r if w.shape[0] > 1 else 0
        for j in range(h):
            out[r, j] = (x[r, j] / s) * w[wr, j]


@njit(cache=True)
def add_rms_norm(a, b, w, eps, h, out):
    """h [R, H] = a + b, then out = :func:`rms_norm` of h (w float32 [1, H], eps float32): the bits of
    the residual add then the norm (each step float32, no fast-math), in one call."""
    for r in range(a.shape[0]):
        for j in range(a.shape[1]):
            h[r, j] = a[r, j] + b[r, j]
    rms_norm(h, w, eps, out)


@njit(cache=True)
def rope(x, table, pos0, rd, interleave, out):
    """out [T, heads, d] = x rotated by the (cos, sin) rows ``table[pos0 + t]`` (float32 [P, rd/2, 2])
    on its first ``rd`` channels (rotate_half pairs (i, i + rd/2), or interleaved pairs (2i, 2i + 1)),
    the other channels copied: ``reference.rope_ref``'s float32 products and sums, the same bits (no
    fast-math: nothing is fused into an FMA)."""
    half = rd // 2
    for t in range(x.shape[0]):
        for hd in range(x.shape[1]):
            for j in range(rd, x.shape[2]):
                out[t, hd, j] = x[t, hd, j]
            for i in range(half):
                c, s = table[pos0 + t, i, 0], table[pos0 + t, i, 1]
                ia, ib = (2 * i, 2 * i + 1) if interleave else (i, i + half)
                a, b = x[t, hd, ia], x[t, hd, ib]
                out[t, hd, ia] = a * c - b * s
                out[t, hd, ib] = b * c + a * s


@njit(cache=True)
def qkv_prologue(q, k, v, qw, kw, normed, eps, table, rd, interleave, pos0, kc, vc, qo, tmp_q, tmp_k):
    """A GQA layer's per-head q/k :func:`rms_norm` (``normed``; weights qw, kw float32 [1, d]), :func:`rope`
    (``rd`` > 0; table float32 [P, rd/2, 2]) at positions pos0.. and the cache append, in one call: q
    [T, Hq, d] -> qo [T, Hq, d]; k roped into kc[pos0: pos0 + T], v copied into vc[pos0: pos0 + T] (caches
    [C, Hkv, d]). The same functions in the order the unfused ops call them: the same bits. tmp_q, tmp_k:
    scratch of q's and k's shapes."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    qn, kn = q, k
    if normed:
        rms_norm(q.reshape(T * hq, d), qw, eps, tmp_q.reshape(T * hq, d))
        rms_norm(k.reshape(T * hkv, d), kw, eps, tmp_k.reshape(T * hkv, d))
        qn, kn = tmp_q, tmp_k
    kdst = kc[pos0: pos0 + T]
    if rd > 0:
        rope(qn, table, pos0, rd, interleave, qo)
        rope(kn, table, pos0, rd, interleave, kdst)
    else:
        qo[:] = qn
        kdst[:] = kn
    vc[pos0: pos0 + T] = v
