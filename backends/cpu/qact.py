"""Activation quantizers of the ``cpu`` backend's integer kernels (imported only when that backend is
opened): float32 activations [T, n] to int16 with one scale per token, in the layout each kernel reads
(``quant_x8``: qkernels' int8 blocks; ``quant_x4``: its int4 blocks, even and odd columns apart;
``quant_x4t``: the transposed int4 layouts of q4t / q4g). The arithmetic and its error bound are in
:mod:`~colibri_plan.backends.cpu.qkernels`' docstring: ``xq[t] = round(x[t] / sx[t])`` with ``sx[t] =
max|x[t]| / 32767`` (1 for a zero row).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_QMAX = np.float32(32767.0)


@njit(fastmath=True, cache=True, inline="always")
def _absmax(x, t):
    # max |x[t, j]| over j (float32, exact in any order): 8 independent running maxima, where one running
    # ``max(m, abs(x))`` stayed a scalar loop: 2.0 against 0.34 µs for 2048 columns (quant_x8 of one token
    # 2.4 -> 0.7 µs a call, beside an int8 1024x2048 GEMV's ~80 µs from RAM)
    n = x.shape[1]
    n8 = n // 8 * 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for j in range(0, n8, 8):
        a0 = max(a0, abs(x[t, j]))
        a1 = max(a1, abs(x[t, j + 1]))
        a2 = max(a2, abs(x[t, j + 2]))
        a3 = max(a3, abs(x[t, j + 3]))
        a4 = max(a4, abs(x[t, j + 4]))
        a5 = max(a5, abs(x[t, j + 5]))
        a6 = max(a6, abs(x[t, j + 6]))
        a7 = max(a7, abs(x[t, j + 7]))
    m = max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))
    for j in range(n8, n):
        m = max(m, abs(x[t, j]))
    return m


@njit(fastmath=True, cache=True, inline="always")
def _quant_row(x, t, cols, xq):
    # xq[:] = round(x[t] / s) (zeros past the row), returns s = max|x[t]| / 32767 (1 for a zero row)
    n = x.shape[1]
    m = _absmax(x, t)
    s = m / _QMAX if m > 0 else np.float32(1.0)
    inv = np.float32(1.0) / s
    for j in range(n):
        xq[j] = np.int16(np.rint(x[t, j] * inv))
    for j in range(n, cols):
        xq[j] = 0
    return s


@njit(fastmath=True, cache=True, inline="always")
def quant_x8(x, xq, sx):
    """Activations for the int8 kernels: x float32 [T, n] -> xq int16 [T, cols] (cols ≥ n, zeros past n)
    and sx float32 [T], x ≈ xq · sx (module docstring)."""
    for t in range(x.shape[0]):
        sx[t] = _quant_row(x, t, xq.shape[1], xq[t])


@njit(fastmath=True, cache=True, inline="always")
def quant_x4(x, group, xe, xo, sx, xsum):
    """Activations for the int4 kernels: x float32 [T, n] -> xe, xo int16 [T, cols/2] (the even and odd
    columns, zeros past n), sx float32 [T], xsum int32 [T, cols/group] (Σ xq per group of ``group``
    columns)."""
    half = xe.shape[1]
    row = np.empty(2 * half, np.int16)
    for t in range(x.shape[0]):
        sx[t] = _quant_row(x, t, 2 * half, row)
        for j in range(half):
            xe[t, j] = row[2 * j]
            xo[t, j] = row[2 * j + 1]
        for g in range(xsum.shape[1]):
            acc = np.int32(0)
            for j in range(g * group, (g + 1) * group):
                acc += np.int32(row[j])
            xsum[t, g] = acc


@njit(fastmath=True, cache=True)
def quant_x4t(x, groups, fold, xe4, xo4, sx, xsl):
    """Activations for the transposed int4-g32/g64 kernels, in one pass: x float32 [T, n] -> xe4, xo4
    int16 [T, C, J, L] (column pair b = g·fold·J + s·J + j of lane k = g·fold + s at [c, j, k − c·L]
    with c = k // L), sx float32 [T], xsl int32 [T, C·L] (Σ xq per lane)."""
    C, J, L = xe4.shape[1], xe4.shape[2], xe4.shape[3]
    row = np.empty(2 * groups * fold * J, np.int16)
    for t in range(x.shape[0]):
        sx[t] = _quant_row(x, t, row.shape[0], row)
        for k in range(C * L):
            c = k // L
            kk = k - c * L
            b0 = k * J  # lanes are in the groups' byte order: lane g·fold + s starts at byte (g·fold + s)·J
            acc = np.int32(0)
            for j in range(J):
                e = row[2 * (b0 + j)]
                o = row[2 * (b0 + j) + 1]
                xe4[t, c, j, kk] = e
                xo4[t, c, j, kk] = o
                acc += np.int32(e) + np.int32(o)
            xsl[t, k] = acc
