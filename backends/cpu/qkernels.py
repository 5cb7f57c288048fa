"""Integer GEMM kernels of the ``cpu`` backend: int8, per-row int4 and int4-g128 weights times
activations quantized to int16, accumulated in int32, and the batched routed-expert kernels of these
layouts (imported only when that backend is opened). The activation quantizers of every integer format
are in :mod:`~colibri_plan.backends.cpu.qact` (``quant_x4t``: the transposed int4-g32/g64 kernels').

Why integers: written as ``acc = int32(acc + int32(w[j]) * int32(x[j]))`` over int8/uint8 weights and
int16 activations, LLVM turns the reduction into ``vpmaddwd`` / ``vpdpwssd`` (AVX-512 VNNI): 32
multiply-adds per instruction, about three times the float32 convert-and-FMA path per byte. That is
what lets a GEMV keep up with RAM (``bench/results/cpu-gemv.json``: int8 at 0.97-1.05 of the RAM probe
at trunk/expert shapes) and a prefill batch of 16 tokens cost 9.9-14.5 GEMVs at those shapes. (Without
the explicit ``int32(...)`` truncation numba types the sum as int64 and the lanes fall to 64 bits.)

Activations (``quant_x8`` / ``quant_x4``, in :mod:`~.qact`): each token row t is scaled once per call,
``xq[t] = round(x[t] / sx[t])`` with ``sx[t] = max|x[t]| / 32767``, so the only numeric change against
float32 is that rounding:
|Σ w·x − sx·Σ w·xq| ≤ 0.5 · sx · Σ|w| per output (float64 bound; the oracle's ``matmul`` bound covers it).
int4 rows use the deinterleaved halves ``xe = xq[0::2]``, ``xo = xq[1::2]`` (byte j holds columns 2j in
its low and 2j+1 in its high nibble) and the per-group sums ``Σ xq`` remove the zero code 8 once per
group. int32 stays exact: a block of ``K8`` int8 columns sums at most 256·127·32767 < 2³¹, an int4
block of ``K4`` bytes at most 1024·2·15·32767 < 2³¹; blocks are summed in float32.

Weights are cut in blocks of fixed size (``data3`` [out, blocks, bb]), with constant trip counts so the
inner loop vectorises without a tail; a row whose length is not a whole number of blocks is padded with
zeros (int8) or the zero code (int4) at upload, by ``cpu.py``. The kernels here run tiles of
``ROW_TILE`` rows in parallel (``prange``; q4t steps 128) and, inside a tile, every token of the
batch: the tile stays in L2 while it is reused, so a prefill batch reads each weight from RAM once. The
``_1`` kernels are single-thread twins (same bits) for matmuls of at most ``SERIAL_BYTES``
(int8: ``SERIAL_BYTES_8``). On AVX-512 VNNI the int8 tiles run ``vnni8``'s 2-row dots (prefetching; the
float sums of ``_row8`` bit for bit), the one-row ``_d8`` elsewhere.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from colibri_plan.backends.cpu import kernels as _kernels  # noqa: F401 (OpenMP's spin, first)
from colibri_plan.backends.cpu.vnni import VNNI, _dot8_vnni
from colibri_plan.backends.cpu.vnni8 import _rows8x1, _rows8x2

#: sha256 (16 hex digits) of backends/cpu/vnni.py these kernels were compiled against (its int8 block dot
#: is compiled into them): as q4t.VNNI_SOURCE, a change of vnni.py comes with this one (a test compares)
VNNI_SOURCE = "1726ee0eb375cde7"
#: the same for backends/cpu/vnni8.py (the multi-row int8 dots of the one-token tiles)
VNNI8_SOURCE = "d4467a432beb6247"

#: a matmul reading at most this many weight bytes × tokens runs the ``_1`` kernels on the calling
#: thread: waking the sleeping workers of a parallel region costs ~45 µs, and one core streams ~25 GB/s
#: from RAM, so below ~2 MB the serial kernel is faster (measured 1 MB int4 GEMV from RAM: 49 µs serial,
#: 73 µs on 2 cores; 4 MB int8: 156 vs 178 µs on a shared 2-core host)
SERIAL_BYTES = 2 << 20
#: the same bound for int8 (lower: its parallel GEMV from RAM is faster from 128 KiB on, measured with the
#: 4-row vnni8 dots on 2 threads, workers spinning between calls, shared 2-core Xeon: 64x1024 6.9 µs serial,
#: 8.0 parallel; 128x1024 12.7 / 11.0; 256x1024 24.1 / 16.7; 1024x2048 188 / 98; in L2 serial is faster
#: up to ~0.5 MB, but a decode step's weights come from RAM; scratch runs, not kept)
SERIAL_BYTES_8 = 128 << 10
#: rows per parallel work item (a tile of a 6144-column int8 weight is 192 KiB: it stays in L2)
ROW_TILE = 32
#: int8 columns per int32 block (256·127·32767 < 2³¹)
K8 = 256
#: bytes per int32 block of per-row int4 (1024 bytes = 2048 columns: 2048·15·32767 < 2³¹)
K4 = 1024
#: fast-math without reassociation for the int8 and per-row int4 matmul kernels: their serial and
#: parallel kernels (compiled apart) then round alike, bit for bit (with ``reassoc`` LLVM regrouped the
#: scale products differently in each; decode speed the same, the dot products are integer). The
#: transposed int4 kernels (q4t) keep it and write their float sum out explicitly instead
#: (tests/test_backend_cpu_kernels.py checks serial/parallel bit-equality for every format)
_FM = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}


def _dot8(n: int):
    """Σ int32(w[j])·int32(x[j]) over ``n`` int8 weights and int16 activations; ``n`` a closure constant
    (numba's cache keys closures by cell contents)."""

    @njit(fastmath=True, cache=True, inline="always")
    def dot(w3, r, b, x3, t):
        acc = np.int32(0)
        for j in range(n):
            acc = np.int32(acc + np.int32(w3[r, b, j]) * np.int32(x3[t, b, j]))
        return acc

    return dot


def _dot4(n: int):
    """Σ code·x over ``n`` int4 bytes: low nibble times xe[j], high nibble times xo[j] (int32)."""

    @njit(fastmath=True, cache=True, inline="always")
    def dot(w3, r, b, xe3, xo3, t):
        acc = np.int32(0)
        for j in range(n):
            v = w3[r, b, j]  # nibbles split as uint8: 16-bit lanes (an int32 shift costs 20%)
            lo = np.uint8(v & np.uint8(15))
            hi = np.uint8(v >> np.uint8(4))
            acc = np.int32(acc + np.int32(lo) * np.int32(xe3[t, b, j])
                           + np.int32(hi) * np.int32(xo3[t, b, j]))
        return acc

    return dot


#: block sizes (bytes) the kernels have a fixed-size dot for, largest first: ``cpu.py`` cuts a row in
#: the largest that divides it (padding to the smallest otherwise); int4 groups are 16/32/64 bytes
BLOCKS8 = (K8, 64, 16)
BLOCKS4 = (K4, 256, 64, 32, 16)
_d8_256, _d8_64, _d8_16 = (_dot8(n) for n in BLOCKS8)
_d4_1024, _d4_256, _d4_64, _d4_32, _d4_16 = (_dot4(n) for n in BLOCKS4)


@njit(fastmath=True, cache=True, inline="always")
def _d8(w3, r, b, x3, t):
    # fixed-size dot of block b of row r with token t; whole-array indexing, no slices: a slice is a
    # new array whose reference counting costs more than a 16-byte block's arithmetic
    n = w3.shape[2]
    if VNNI and n % 32 == 0:  # vpmovsxbw + vpdpwssd (vnni.py): the same int32, 32 products a pair
        return _dot8_vnni(w3, (r * w3.shape[1] + b) * n, x3, (t * x3.shape[1] + b) * n, n)
    if n == K8:
        return _d8_256(w3, r, b, x3, t)
    if n == 64:
        return _d8_64(w3, r, b, x3, t)
    return _d8_16(w3, r, b, x3, t)


@njit(fastmath=True, cache=True, inline="always")
def _d4(w3, r, b, xe3, xo3, t):
    n = w3.shape[2]
    if n == 16:
        return _d4_16(w3, r, b, xe3, xo3, t)
    if n == 32:
        return _d4_32(w3, r, b, xe3, xo3, t)
    if n == 64:
        return _d4_64(w3, r, b, xe3, xo3, t)
    if n == 256:
        return _d4_256(w3, r, b, xe3, xo3, t)
    return _d4_1024(w3, r, b, xe3, xo3, t)


@njit(fastmath=True, cache=True, inline="always")
def _row8(d3, r, x3, t):
    # row r of an int8 weight cut in blocks (d3 int8 [out, blocks, bb]) times token t (x3 int16 [T, blocks,
    # bb]): int32 per block, float32 over blocks
    acc = np.float32(0.0)
    for b in range(d3.shape[1]):
        acc += np.float32(_d8(d3, r, b, x3, t))
    return acc


@njit(fastmath=True, cache=True, inline="always")
def _rows8(d3, r, x3, t):
    # rows r, r+1 of d3 int8 [out, blocks, bb] (bb a multiple of 64) times token t of x3 int16 [T, blocks,
    # bb]: vnni8's 2-row dot, float32 each (_row8's sums, bit for bit)
    n = d3.shape[1] * d3.shape[2]
    return _rows8x2(d3, r * n, n, x3, t * n, d3.shape[1], d3.shape[2])


@njit(fastmath=True, cache=True, inline="always")
def _row8v(d3, r, x3, t):
    # _row8 by vnni8's one-row dot (prefetching) where the 2-row one runs (a tile's odd last row)
    n = d3.shape[1] * d3.shape[2]
    return _rows8x1(d3, r * n, n, x3, t * n, d3.shape[1], d3.shape[2])[0]


@njit(fastmath=True, cache=True, inline="always")
def _multi8(d3):
    # the multi-row VNNI dots read this layout (blocks of 64 or 256 bytes)
    return VNNI and d3.shape[2] % 64 == 0


@njit(fastmath=True, cache=True, inline="always")
def _tile8(data3, scales, xq3, sx, y, b):
    # row tile b of i8_matmul, every token (the serial and parallel kernels share it: same numbers)
    r0, r1 = b * ROW_TILE, min(b * ROW_TILE + ROW_TILE, data3.shape[0])
    for t in range(xq3.shape[0]):  # prefill: the tile stays in L2 across tokens
        if _multi8(data3):
            r2 = r0 + (r1 - r0) // 2 * 2
            for r in range(r0, r2, 2):
                a0, a1 = _rows8(data3, r, xq3, t)
                y[t, r] = a0 * scales[r, 0] * sx[t]
                y[t, r + 1] = a1 * scales[r + 1, 0] * sx[t]
            for r in range(r2, r1):
                y[t, r] = _row8v(data3, r, xq3, t) * scales[r, 0] * sx[t]
        else:
            for r in range(r0, r1):
                y[t, r] = _row8(data3, r, xq3, t) * scales[r, 0] * sx[t]


@njit(parallel=True, fastmath=_FM, cache=True)
def i8_matmul(data3, scales, xq3, sx, y):
    """int8 GEMM: y [T, out] = x · Wᵀ with data3 int8 [out, blocks, bb], scales float32 [out, 1],
    xq3 int16 [T, blocks, K8], sx float32 [T]; y float32 [T, out] written in place."""
    for b in prange((data3.shape[0] + ROW_TILE - 1) // ROW_TILE):
        _tile8(data3, scales, xq3, sx, y, b)


@njit(fastmath=_FM, cache=True)
def i8_matmul_1(data3, scales, xq3, sx, y):
    """:func:`i8_matmul` on the calling thread (small weights: see ``SERIAL_BYTES``), same result."""
    for b in range((data3.shape[0] + ROW_TILE - 1) // ROW_TILE):
        _tile8(data3, scales, xq3, sx, y, b)


@njit(fastmath=True, cache=True, inline="always")
def _row4(d3, r, s2, xe3, xo3, t, xsum):
    # row r of an int4 weight d3 uint8 [out, blocks, bb] (a block = one int4-g128 group of 64 bytes, or a
    # block of a per-row weight) times token t; s2 float32 [out, groups], xe3/xo3 int16 [T, blocks, bb],
    # xsum int32 [T, groups]; per-row weights have one scale and one group sum for all blocks
    acc = np.float32(0.0)
    if s2.shape[1] == 1:
        for g in range(d3.shape[1]):
            acc += np.float32(_d4(d3, r, g, xe3, xo3, t))
        return s2[r, 0] * (acc - np.float32(8.0) * np.float32(xsum[t, 0]))
    for g in range(d3.shape[1]):
        acc += s2[r, g] * np.float32(_d4(d3, r, g, xe3, xo3, t) - 8 * xsum[t, g])
    return acc


@njit(fastmath=True, cache=True, inline="always")
def _tile4(data3, scales2, xe3, xo3, sx, xsum, y, b):
    r1 = min(b * ROW_TILE + ROW_TILE, data3.shape[0])
    for t in range(xe3.shape[0]):
        for r in range(b * ROW_TILE, r1):
            y[t, r] = _row4(data3, r, scales2, xe3, xo3, t, xsum) * sx[t]


@njit(parallel=True, fastmath=True, cache=True)
def i4_matmul(data3, scales2, xe3, xo3, sx, xsum, y):
    """int4 / int4-gG GEMM: y [T, out] = x · Wᵀ.

    data3 uint8 [out, blocks, bb]; scales2 float32 [out, groups] (1 group per-row); xe3, xo3 int16
    [T, blocks, bb]; sx float32 [T]; xsum int32 [T, groups]; y float32 [T, out] written in place.
    """
    for b in prange((data3.shape[0] + ROW_TILE - 1) // ROW_TILE):
        _tile4(data3, scales2, xe3, xo3, sx, xsum, y, b)


@njit(parallel=True, fastmath=_FM, cache=True)
def i4r_matmul(data3, scales2, xe3, xo3, sx, xsum, y):
    """:func:`i4_matmul` of a per-row int4 weight (one scale per row) compiled without reassociation,
    so that :func:`i4r_matmul_1` gives the same bits (int4-g128 keeps ``i4_matmul``: its sum over
    group scales was 1.1x slower at 16 tokens without reassociation, and it has no serial kernel)."""
    for b in prange((data3.shape[0] + ROW_TILE - 1) // ROW_TILE):
        _tile4(data3, scales2, xe3, xo3, sx, xsum, y, b)


@njit(fastmath=_FM, cache=True)
def i4r_matmul_1(data3, scales2, xe3, xo3, sx, xsum, y):
    """:func:`i4r_matmul` on the calling thread (small weights), same result."""
    for b in range((data3.shape[0] + ROW_TILE - 1) // ROW_TILE):
        _tile4(data3, scales2, xe3, xo3, sx, xsum, y, b)


@njit(fastmath=True, cache=True, inline="always")
def _silu_mul(g, u):
    return g / (np.float32(1.0) + np.exp(-g)) * u


# ---- routed experts, batched: every expert of a layer in one parallel call --------------------------
# (beside the row functions they inline: numba's disk cache keys a kernel by its own file only, so a
# kernel inlining row functions of another file would keep stale code after they change; the
# int4-g32/g64 kernels of the transposed layout, decode and prefill loop shapes, are in q4t.)
# Decode routes one token to k experts: 2k GEMVs of a few MB, and one parallel region each costs a
# thread wake-up (tens of µs with sleeping workers) and a load-imbalanced tail. Here the gate+up pass
# of all experts is one ``prange`` over (expert, row tile), and the down pass another. Experts come as
# tuples of ``EXPERTS`` arrays (one compiled specialisation; shorter batches are padded with experts
# given no tokens); expert e owns rows offs[e]:offs[e + 1] of the concatenated activations and results.
# The blocked kernel runs a gate row and an up row in turn (int8 was 1.05x slower split in tiles as
# q4t does, int4 0.98x). ``kind``: 0 int8, 1 int4 blocks (per-row, int4-g128). int8 ignores
# ``xb3``/``xsum`` (pass any int16 3-D / int32 2-D array).

#: experts per batched call (tuples of this length)
EXPERTS = 8


@njit(fastmath=True, cache=True, inline="always")
def _row_any(kind, w3, r, s2, xa3, xb3, t, xsum):
    # blocked layouts [out, blocks, bb] (kind 0, 1)
    if kind == 0:
        return _row8(w3, r, xa3, t) * s2[r, 0]
    return _row4(w3, r, s2, xa3, xb3, t, xsum)


@njit(fastmath=True, cache=True, inline="always")
def _expert_tile(i, tiles, rows):
    # (expert e, its rows r0:r1) of parallel step i: ROW_TILE rows of one expert a step
    r0 = (i % tiles) * ROW_TILE
    return i // tiles, r0, min(r0 + ROW_TILE, rows)


@njit(parallel=True, fastmath=True, cache=True)
def experts_gate_up(kind, gw, gs, uw, us, xa3, xb3, sx, xsum, offs, h):
    """h [ΣT, I] = SiLU(x·Gₑᵀ)·(x·Uₑᵀ) for the rows of each expert e.

    gw, uw: tuples of EXPERTS weight arrays [I, blocks, bb] (the upload's layout, same for all);
    gs, us: tuples of their float32 scales [I, groups]; xa3, xb3 [ΣT, blocks, bb] int16 activations
    (int8: xq; int4: the even and odd halves), sx float32 [ΣT], xsum int32 [ΣT, groups]; offs int64
    [EXPERTS + 1]; h float32 [ΣT, I] written in place.
    """
    inter = gw[0].shape[0]
    tiles = -(-inter // ROW_TILE)  # row tiles of each expert
    for i in prange(EXPERTS * tiles):
        e, r0, r1 = _expert_tile(i, tiles, inter)
        g3, u3, g2, u2 = gw[e], uw[e], gs[e], us[e]
        for t in range(offs[e], offs[e + 1]):  # this expert's tokens: its tile stays in L2
            r2 = r0
            if kind == 0 and _multi8(g3):  # int8: 2 gate rows, then the 2 up rows (vnni8)
                r2 = r0 + (r1 - r0) // 2 * 2
                for r in range(r0, r2, 2):
                    ga, gb = _rows8(g3, r, xa3, t)
                    ua, ub = _rows8(u3, r, xa3, t)
                    h[t, r] = _silu_mul(ga * g2[r, 0] * sx[t], ua * u2[r, 0] * sx[t])
                    h[t, r + 1] = _silu_mul(gb * g2[r + 1, 0] * sx[t], ub * u2[r + 1, 0] * sx[t])
            for r in range(r2, r1):
                g = _row_any(kind, g3, r, g2, xa3, xb3, t, xsum) * sx[t]
                u = _row_any(kind, u3, r, u2, xa3, xb3, t, xsum) * sx[t]
                h[t, r] = _silu_mul(g, u)


@njit(parallel=True, fastmath=True, cache=True)
def experts_matmul(kind, ws, ss, xa3, xb3, sx, xsum, offs, y):
    """y [ΣT, out] = x · Wₑᵀ for the rows of each expert e (the down projections); arguments as
    :func:`experts_gate_up`, y float32 written in place."""
    out = ws[0].shape[0]
    tiles = -(-out // ROW_TILE)  # row tiles of each expert
    for i in prange(EXPERTS * tiles):
        e, r0, r1 = _expert_tile(i, tiles, out)
        w3, s2 = ws[e], ss[e]
        for t in range(offs[e], offs[e + 1]):
            r2 = r0
            if kind == 0 and _multi8(w3):  # int8: 2 rows at a time (vnni8)
                r2 = r0 + (r1 - r0) // 2 * 2
                for r in range(r0, r2, 2):
                    a0, a1 = _rows8(w3, r, xa3, t)
                    y[t, r] = a0 * s2[r, 0] * sx[t]
                    y[t, r + 1] = a1 * s2[r + 1, 0] * sx[t]
            for r in range(r2, r1):
                y[t, r] = _row_any(kind, w3, r, s2, xa3, xb3, t, xsum) * sx[t]
