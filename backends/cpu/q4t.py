"""int4-g32 / int4-g64 kernels of the ``cpu`` backend on the transposed layout: one loop shape for a
token or two, another for prefill batches (imported only when that backend is opened).

Layout. A 16- or 32-byte group is too short for a vectorised reduction (LLVM unrolls it and leaves it
scalar: 30x slower than per-row int4). So these formats are stored transposed at upload (cpu.py): row r
holds byte j of every group side by side, wt[r, c, j, k] (lane c·L + k, in chunks of L = 64 lanes so a
row is read front to back: a stride of a whole row per byte defeats the prefetcher, measured 3x slower
from RAM at 6144 columns). The loop over k (the groups) is the vectorised one; inside it the J bytes of
a group are a constant-length loop that LLVM unrolls, so each lane sums its own group in a register.
That loop needs >= 64 lanes to run vectorised, so a row of fewer groups is folded: each group split
into ``fold`` parts of J bytes side by side (k = g·fold + s); int4-g64 always folds by >= 2 (J <= 16).
Scales come one per lane (sl[r, k] = s[r, k // fold], repeated at upload: a k // fold index makes LLVM
gather them), and so do the activation sums that remove the zero code.

Arithmetic (the activations are those of ``qkernels.quant_x4t``: int16, one scale per token):
each lane's dot product is an exact int32 ``a_k = Σ code·xq − 8·Σ xq = Σ (code − 8)·xq`` (at most
32·2·15·32767 < 2³¹), then ``y = sx · Σ_k sl[k]·float32(a_k)``. The lane dots go to a small int32
scratch and one float32 sum per layout makes y from them for every loop shape, so a token gives the
same bits alone, in a batch, serially or in parallel (tests/test_backend_cpu_kernels.py).

Loop shapes (AVX-512 VNNI hosts, rows in chunks of 64 lanes; else the numba loop of ``_dots1``,
unpacking in registers, with ``_lane_sum``). Below ``PREFILL_TOKENS`` tokens per weight (decode), the
bytes are unpacked in registers into (low, high) nibble pairs, one int16 pair per 32-bit lane, and
multiplied with the activation pairs ``x2 = xe | xo << 16`` by ``vpdpwssd`` (32 products an
instruction; LLVM's own vectorisation of the numba loop gets 16, and does not form the pairs from numba
code): ``_packed_dots``. From ``PREFILL_TOKENS`` tokens, ``RB`` rows at a time are unpacked once into
an int32 scratch of signed pairs (code − 8) and every group of ``NT`` tokens runs over them with one
weight load per ``NT`` products (``_scratch_dots``): no unpacking per token. Each call covers a chunk
of 64 lanes (4 vectors of independent sums). The float32 sum is
``_vsum``: one fused multiply-add per 16 lanes in lane order, then halves added, written out so that no
loop shape can reassociate it differently. Measured on one core of a Zen 5 host (2048x2048, weight in
cache): 16 tokens 0.76 ms against 1.89 ms for the numba loop (88 against 35 GMAC/s); 2048x1024 (8 bytes
a lane) 0.51 ms; one token from L1 66 against 32 GMAC/s.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

# EXPERTS is a compile-time constant of these kernels, and vnni's intrinsics write part of their
# code: numba's cache keys a kernel by the contents of its own file only, so a change there must change
# this file too (VNNI_SOURCE below; a test checks it)
from colibri_plan.backends.cpu.qkernels import EXPERTS
from colibri_plan.backends.cpu.vnni import (
    VNNI,
    _pk4,
    _pk8,
    _pk16,
    _s4x1,
    _s4x2,
    _s4x4,
    _s8x1,
    _s8x2,
    _s8x4,
    _s16x1,
    _s16x2,
    _s16x4,
    _unpack16,
    _vsum,
    _vsum4,
)

#: sha256 (16 hex digits) of backends/cpu/vnni.py as these kernels were compiled against: updating it
#: with vnni makes numba recompile them (tests/test_backend_cpu_kernels.py compares)
VNNI_SOURCE = "545ddce21112fada"
#: tokens per weight from which rows are unpacked once into the scratch (2048x2048 on one core: 2 tokens
#: 0.21 ms either way, 4 tokens 0.28 against 0.45 ms unpacking in registers per token)
PREFILL_TOKENS = 2
#: rows per parallel step (qkernels' ROW_TILE is 32): longer runs of memory per step read RAM
#: faster, measured from RAM on a shared 2-core host (best of 15-30, interleaved): 8 int4-g32 experts'
#: decode 21 against 15 GB/s gate+up, 17-19 against 13 down; GEMV 2048x2048 17.6 against 13.4 GB/s,
#: 8192x2048 22.9 against 18.0. A prefill step unpacks RB rows at a time within its tile as before
TILE_ROWS = 128
#: the batched expert kernels' step (experts sizes their parallel chunks by it)
EXPERT_ROWS = TILE_ROWS
#: parts per group (fold) of the transposed layouts cpu.py makes, by group bytes: int4-g32 folds 1, 2
#: or 4 (J = 16, 8, 4 bytes per lane); int4-g64 folds 2 or 4 (J = 16, 8)
FOLDS = {16: (1, 2, 4), 32: (2, 4)}


@njit(fastmath=True, cache=True, inline="always")
def _lane_sum(sl, r, ai, o, n):
    # y/sx of one output: Σ_k sl[r, k]·float32(ai[o + k]) over n lanes (ai flat int32); the one float
    # sum of every loop shape
    acc = np.float32(0.0)
    for i in range(n):
        acc += sl[r, i] * np.float32(ai[o + i])
    return acc


def _dots1_fixed(J: int):
    """Lane dots of row r with token t, unpacking in registers, J bytes per lane (a closure constant:
    numba's cache keys closures by their cell contents)."""

    @njit(fastmath=True, cache=True, inline="always")
    def dots(wt, r, xe3, xo3, t, xsl, ai):
        # wt uint8 [out, C, J, L]; xe3/xo3 int16 [T, C, J, L]; xsl int32 [T, C·L]; ai int32 [C·L] out
        L = wt.shape[3]
        for c in range(wt.shape[1]):  # chunks of L lanes: J·L contiguous bytes, read front to back
            for k in range(L):  # vectorised over lanes (groups, or parts of groups)
                a = np.int32(0)
                for j in range(J):  # unrolled: a stays in a register lane
                    v = wt[r, c, j, k]
                    lo = np.uint8(v & np.uint8(15))
                    hi = np.uint8(v >> np.uint8(4))
                    a = np.int32(a + np.int32(lo) * np.int32(xe3[t, c, j, k])
                                 + np.int32(hi) * np.int32(xo3[t, c, j, k]))
                i = c * L + k  # int32 throughout: an int64 term would halve the lanes (2x slower)
                ai[i] = np.int32(a - np.int32(8) * np.int32(xsl[t, i]))

    return dots


_d1_16, _d1_8, _d1_4 = (_dots1_fixed(J) for J in (16, 8, 4))


@njit(fastmath=True, cache=True, inline="always")
def _dots1(wt, r, xe3, xo3, t, xsl, ai):
    J = wt.shape[2]
    if J == 16:
        _d1_16(wt, r, xe3, xo3, t, xsl, ai)
    elif J == 8:
        _d1_8(wt, r, xe3, xo3, t, xsl, ai)
    else:
        _d1_4(wt, r, xe3, xo3, t, xsl, ai)


# ---- AVX-512 VNNI (the intrinsics: vnni) -----------------------------------------------------
#: tokens per weight load of the prefill loop shape (a batch runs in groups of 4, then 2, then 1)
NT = 4
#: rows unpacked at a time: RB unpacked rows and NT tokens' activations stay in L1 (2048 columns:
#: 16 + 16 KiB) while every row meets every token group; one row at a time (all tokens' activations
#: from L2 for each row) was 0.67x as fast at 16 tokens (8 rows: 0.96x)
RB = 4


def _pick(a: int, b: int, fa, fb, fc):
    """A dispatch numba inlines: ``fa(...)`` when its key is ``a``, ``fb(...)`` when ``b``, else ``fc(...)``,
    over the nine arguments of the vnni intrinsics (the keys and functions are closure constants)."""

    @njit(fastmath=True, cache=True, inline="always")
    def run(key, p0, p1, p2, p3, p4, p5, p6, p7, p8):
        if key == a:
            fa(p0, p1, p2, p3, p4, p5, p6, p7, p8)
        elif key == b:
            fb(p0, p1, p2, p3, p4, p5, p6, p7, p8)
        else:
            fc(p0, p1, p2, p3, p4, p5, p6, p7, p8)

    return run


# _pk(J, ai, ao, w, wo, x2, xo, step, xsl, so): the one-token shape at J = 16, 8 or 4 bytes a lane;
# _sc(J, n, ai, ao, astep, ws, wo, x2, xo, xstep, step): the prefill shape of n = 4, 2 or 1 tokens
_pk = _pick(16, 8, _pk16, _pk8, _pk4)
_sc16, _sc8, _sc4 = (_pick(4, 2, f4, f2, f1) for f4, f2, f1 in (
    (_s16x4, _s16x2, _s16x1), (_s8x4, _s8x2, _s8x1), (_s4x4, _s4x2, _s4x1)))


@njit(fastmath=True, cache=True, inline="always")
def _sc(J, n, ai, ao, astep, ws, wo, x2, xo, xstep, step):
    if J == 16:
        _sc16(n, ai, ao, astep, ws, wo, x2, xo, xstep, step)
    elif J == 8:
        _sc8(n, ai, ao, astep, ws, wo, x2, xo, xstep, step)
    else:
        _sc4(n, ai, ao, astep, ws, wo, x2, xo, xstep, step)


@njit(fastmath=True, cache=True, inline="always")
def _pairs(xe3, xo3):
    # x2 int32 [T·C·J·L] (flat): the even and odd column of each byte as one int16 pair
    T, C, J, L = xe3.shape
    x2 = np.empty(T * C * J * L, np.int32)
    i = 0
    for t in range(T):
        for c in range(C):
            for j in range(J):
                for k in range(L):
                    lo = np.int32(xe3[t, c, j, k]) & np.int32(0xFFFF)
                    x2[i] = lo | (np.int32(xo3[t, c, j, k]) << np.int32(16))
                    i += 1
    return x2


@njit(fastmath=True, cache=True, inline="always")
def _unpack(wf, r, n, ws, o):
    # row r of the flat packed weight (n bytes a row) -> ws[o:o + n] int32: the pair (low − 8,
    # high − 8) of each byte
    for i in range(0, n, 16):
        _unpack16(ws, o + i, wf, r * n + i)


@njit(fastmath=True, cache=True, inline="always")
def _fast(wt):
    # the vpdpwssd path applies: compiled in, and chunks of 64 lanes (every row of >= 64 groups·fold
    # lanes; only small odd rows have fewer, and take the numba loop)
    return VNNI and wt.shape[3] == 64


@njit(fastmath=True, cache=True, inline="always")
def _x2_for(xe3, xo3, wt):
    if _fast(wt):
        return _pairs(xe3, xo3)
    return np.empty(1, np.int32)


@njit(fastmath=True, cache=True, inline="always")
def _rows(wt, sl, xe3, xo3, x2, sx, xsl, y, r0, r1, t0, t1, ws, ai):
    # y[t, r] = sx[t]·Σ_k sl[r, k]·a_k for rows r0:r1 and tokens t0:t1; ws int32 [C·J·L] and ai int32
    # [NT, C·L] scratch. Without VNNI: unpacking in registers (_dots1). With it: one token at a time in
    # registers below PREFILL_TOKENS tokens, else each row unpacked once and NT tokens per weight load
    C, J, L = wt.shape[1], wt.shape[2], wt.shape[3]
    n = C * L
    if not _fast(wt):
        af = ai.reshape(-1)
        for t in range(t0, t1):
            for r in range(r0, r1):
                _dots1(wt, r, xe3, xo3, t, xsl, af)
                y[t, r] = _lane_sum(sl, r, af, 0, n) * sx[t]
        return
    wf, af, xs, sf = wt.reshape(-1), ai.reshape(-1), xsl.reshape(-1), sl.reshape(-1)
    row = C * J * L
    f4 = np.empty(4, np.float32)
    if t1 - t0 < PREFILL_TOKENS:
        for t in range(t0, t1):
            for r in range(r0, r1):
                for c in range(C):  # a chunk of 64 lanes a call
                    _pk(J, af, c * L, wf, r * row + c * J * L, x2, t * row + c * J * L, L, xs, t * n + c * L)
                y[t, r] = _vsum(sf, r * n, af, 0, n, n) * sx[t]
        return
    for rb in range(r0, r1, RB):  # RB rows unpacked, then NT tokens at a time over them (L1)
        re = min(rb + RB, r1)
        for r in range(rb, re):
            _unpack(wf, r, row, ws, (r - rb) * row)
        t = t0
        while t < t1:
            m = 4 if t1 - t >= 4 else (2 if t1 - t >= 2 else 1)
            for r in range(rb, re):
                wo = (r - rb) * row
                for c in range(C):
                    _sc(J, m, af, c * L, n, ws, wo + c * J * L, x2, t * row + c * J * L, row, L)
                if m == 4:
                    _vsum4(sf, r * n, af, 0, n, n, f4)
                    for u in range(4):
                        y[t + u, r] = f4[u] * sx[t + u]
                else:
                    for u in range(m):
                        y[t + u, r] = _vsum(sf, r * n, af, u * n, n, n) * sx[t + u]
            t += m


@njit(fastmath=True, cache=True, inline="always")
def _rows_scratch(C, J, L, tokens):
    # ws int32: RB unpacked rows when a weight sees PREFILL_TOKENS tokens, else a placeholder (a decode
    # step allocates no 16 KiB it does not touch)
    return np.empty(RB * C * J * L if tokens >= PREFILL_TOKENS else 1, np.int32)


@njit(parallel=True, fastmath=True, cache=True)
def i4t_matmul(wt, scales2, xe3, xo3, sx, xsum, y):
    """int4-g32/g64 GEMM on the transposed layout: wt uint8 [out, C, J, L] (C·L = groups · fold lanes in
    chunks of L); scales2 float32 [out, C·L] (one per lane); xe3, xo3 int16 [T, C, J, L] (the
    activations in the same layout); sx float32 [T]; xsum int32 [T, C·L] (Σ xq per lane); y float32
    [T, out] written in place."""
    T = xe3.shape[0]
    x2 = _x2_for(xe3, xo3, wt)
    C, J, L = wt.shape[1], wt.shape[2], wt.shape[3]
    for b in prange((wt.shape[0] + TILE_ROWS - 1) // TILE_ROWS):
        ws = _rows_scratch(C, J, L, T)
        ai = np.empty((NT, C * L), np.int32)
        r0 = b * TILE_ROWS
        _rows(wt, scales2, xe3, xo3, x2, sx, xsum, y, r0, min(r0 + TILE_ROWS, wt.shape[0]), 0, T, ws, ai)


@njit(fastmath=True, cache=True)
def i4t_matmul_1(wt, scales2, xe3, xo3, sx, xsum, y):
    """:func:`i4t_matmul` on the calling thread (small weights), same result."""
    T = xe3.shape[0]
    x2 = _x2_for(xe3, xo3, wt)
    C, J, L = wt.shape[1], wt.shape[2], wt.shape[3]
    ws = _rows_scratch(C, J, L, T)
    ai = np.empty((NT, C * L), np.int32)
    for b in range((wt.shape[0] + TILE_ROWS - 1) // TILE_ROWS):
        r0 = b * TILE_ROWS
        _rows(wt, scales2, xe3, xo3, x2, sx, xsum, y, r0, min(r0 + TILE_ROWS, wt.shape[0]), 0, T, ws, ai)


@njit(fastmath=True, cache=True, inline="always")
def _silu_mul(g, u):
    return g / (np.float32(1.0) + np.exp(-g)) * u


@njit(fastmath=True, cache=True, inline="always")
def _tile(i, tiles, rows):
    # (expert e, its rows r0:r1) of parallel step i of a batched expert kernel: TILE_ROWS rows a step
    e = i // tiles
    r0 = (i - e * tiles) * TILE_ROWS
    return e, r0, min(r0 + TILE_ROWS, rows)


@njit(fastmath=True, cache=True, inline="always")
def _silu_rows(g, h, t0, t1, r0, r1):
    # the tile's h[t, r] = SiLU(g[t, r]) · h[t, r]: its gate results times its up rows, in place
    for t in range(t0, t1):
        for r in range(r0, r1):
            h[t, r] = _silu_mul(g[t, r], h[t, r])


# ---- routed experts, batched (see qkernels): every expert of a layer in one parallel call -------
# gate+up runs a tile of gate rows, then the tile of up rows (not a gate row and an up row in turn):
# 8 int4-g32 gate+up pairs of 1.3 MB from RAM, 1 token, 0.82x the time (4 tokens 0.90x). An expert with
# PREFILL_TOKENS or more tokens runs the unpacked-row loop shape; the gate tile's results wait in g
# [ΣT, I] (h's shape) until the up rows multiply them.


@njit(parallel=True, fastmath=True, cache=True)
def experts_gate_up_t(kind, gw, gs, uw, us, xa3, xb3, sx, xsum, offs, h):
    """h [ΣT, I] = SiLU(x·Gₑᵀ)·(x·Uₑᵀ) for the rows of each expert e (int4-g32/g64).

    gw, uw: tuples of EXPERTS weights uint8 [I, C, J, L]; gs, us: their lane scales float32 [I, C·L];
    xa3, xb3 int16 [ΣT, C, J, L] (even and odd columns), sx float32 [ΣT], xsum int32 [ΣT, C·L]; offs
    int64 [EXPERTS + 1] (expert e owns rows offs[e]:offs[e + 1]); h float32 [ΣT, I] written in place.
    ``kind`` is unused (the blocked kernels' argument, kept for one calling convention).
    """
    inter = gw[0].shape[0]
    tiles = (inter + TILE_ROWS - 1) // TILE_ROWS
    x2 = _x2_for(xa3, xb3, gw[0])
    g = np.empty_like(h)  # gate results of each tile
    C, J, L = gw[0].shape[1], gw[0].shape[2], gw[0].shape[3]
    for i in prange(EXPERTS * tiles):
        e, r0, r1 = _tile(i, tiles, inter)
        t0, t1 = offs[e], offs[e + 1]
        ws = _rows_scratch(C, J, L, t1 - t0)
        ai = np.empty((NT, C * L), np.int32)
        _rows(gw[e], gs[e], xa3, xb3, x2, sx, xsum, g, r0, r1, t0, t1, ws, ai)
        _rows(uw[e], us[e], xa3, xb3, x2, sx, xsum, h, r0, r1, t0, t1, ws, ai)
        _silu_rows(g, h, t0, t1, r0, r1)


@njit(parallel=True, fastmath=True, cache=True)
def experts_matmul_t(kind, ws_, ss, xa3, xb3, sx, xsum, offs, y):
    """y [ΣT, out] = x · Wₑᵀ for the rows of each expert e (the down projections, int4-g32/g64);
    arguments as :func:`experts_gate_up_t`, y float32 written in place."""
    out = ws_[0].shape[0]
    tiles = (out + TILE_ROWS - 1) // TILE_ROWS
    x2 = _x2_for(xa3, xb3, ws_[0])
    C, J, L = ws_[0].shape[1], ws_[0].shape[2], ws_[0].shape[3]
    for i in prange(EXPERTS * tiles):
        e, r0, r1 = _tile(i, tiles, out)
        ws = _rows_scratch(C, J, L, offs[e + 1] - offs[e])
        ai = np.empty((NT, C * L), np.int32)
        _rows(ws_[e], ss[e], xa3, xb3, x2, sx, xsum, y, r0, r1, offs[e], offs[e + 1], ws, ai)
