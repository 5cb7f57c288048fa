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

Loop shapes (AVX-512 VNNI hosts, rows of whole quarters of 16 lanes: chunks of 64, or one chunk of
16·n lanes, e.g. 48 for the 24 groups of 768 columns at fold 2; else the numba loop of ``_dots1``,
unpacking in registers, with ``_lane_sum``). The weights are stored in the byte layout of
``vnni.byte_dots`` (``layout.bytes_layout``: each 32-bit lane holds 4 bytes of one lane) and the int16
activations split in bytes (``_xbytes``, xq = 256·xh + xl): ``vpdpbusd`` multiplies the nibbles with
the bytes, 64 products an instruction from 2 instructions of unpacking per 128 (the vpdpwssd pairs
before it: 32 from 5), the same integers a_k. One token (decode) runs two rows a call sharing the
activation loads (``vnni.byte_dots2``: two rows of a weight, or an expert's gate row and its up row);
a batch runs NT = 4, 2, 1 tokens per weight load over RB rows at a time. The float32 sum is
``_vsum``: one fused multiply-add per 16 lanes in lane order, then halves added, written out so that no
loop shape can reassociate it differently. Measured on one core of the shared 2-core EPYC host
(2048x2048 int4-g32h, one token, weight in cache): 76 µs against 131 µs for the vpdpwssd pairs
(31 against 18 GB/s of weight).
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
    _b4r2,
    _b4x1,
    _b4x2,
    _b4x4,
    _b8r2,
    _b8x1,
    _b8x2,
    _b8x4,
    _b16r2,
    _b16x1,
    _b16x2,
    _b16x4,
    _vsum,
    _vsum4,
    _vsum4_2,
    _vsum4_4,
    _vsum_2,
    _vsum_4,
)

#: sha256 (16 hex digits) of backends/cpu/vnni.py as these kernels were compiled against: updating it
#: with vnni makes numba recompile them (tests/test_backend_cpu_kernels.py compares)
VNNI_SOURCE = "1726ee0eb375cde7"
#: rows per parallel step (qkernels' ROW_TILE is 32): longer runs of memory per step read RAM
#: faster, measured from RAM on a shared 2-core host (best of 15-30, interleaved): 8 int4-g32 experts'
#: decode 21 against 15 GB/s gate+up, 17-19 against 13 down; GEMV 2048x2048 17.6 against 13.4 GB/s,
#: 8192x2048 22.9 against 18.0. A prefill step unpacks RB rows at a time within its tile as before
TILE_ROWS = 128
#: a GEMM of these kernels reading at most this many weight bytes × tokens runs ``i4t_matmul_1`` on the
#: calling thread (qkernels.SERIAL_BYTES, 2 MiB, for the others): one int4-g32h token from RAM on a shared
#: 2-core Xeon (workers spinning between calls), serial against parallel, per-lane scales before:
#: 0.59 MB 59-61 vs 40-44 µs, 1.18 MB 103-126 vs 63-74 (bench/results/cpu-gemv-h26q4.json, runs
#: "before": gemv_s, gemv_s_parallel); 0.29 MB 33 vs 26 µs (a scratch run)
SERIAL_BYTES_T = 256 << 10
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
#: rows at a time of a batch: RB rows (4 KiB at 2048 columns) and NT tokens' activation bytes (32 KiB)
#: stay in L1 while every row meets every token group (measured with the earlier unpacked rows: one row
#: at a time was 0.67x as fast at 16 tokens, 8 rows 0.96x)
RB = 4


def _by_tokens(f4, f2, f1):
    """A dispatch numba inlines over the token count m (4, 2 or 1) of one vnni.byte_dots(J, m) family,
    the intrinsics' twelve arguments passed on (the functions are closure constants)."""

    @njit(fastmath=True, cache=True, inline="always")
    def run(m, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11):
        if m == 4:
            f4(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11)
        elif m == 2:
            f2(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11)
        else:
            f1(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11)

    return run


_bd16, _bd8, _bd4 = (_by_tokens(*f) for f in (
    (_b16x4, _b16x2, _b16x1), (_b8x4, _b8x2, _b8x1), (_b4x4, _b4x2, _b4x1)))


@njit(fastmath=True, cache=True, inline="always")
def _xbytes(xe3, xo3):
    # xb uint8 [T·4·C·J·L] (flat): the activations' bytes in the byte layout of vnni.byte_dots: per token,
    # chunk c, quarter q (L / 16 a chunk), dword d: 4 x 64 bytes (xl even, xh even, xl odd, xh odd),
    # lane 16q + i's bytes 4d..4d + 3 at 4i
    T, C, J, L = xe3.shape
    D, Q = J // 4, L // 16
    xb = np.empty(T * 4 * C * J * L, np.uint8)
    for t in range(T):
        for c in range(C):
            for q in range(Q):
                for d in range(D):
                    o = (((t * C + c) * Q + q) * D + d) * 256
                    for i in range(16):
                        k = 16 * q + i
                        for b in range(4):
                            e = np.int32(xe3[t, c, 4 * d + b, k])
                            v = np.int32(xo3[t, c, 4 * d + b, k])
                            p = o + 4 * i + b
                            xb[p] = np.uint8(e & 255)
                            xb[p + 64] = np.uint8((e >> 8) & 255)
                            xb[p + 128] = np.uint8(v & 255)
                            xb[p + 192] = np.uint8((v >> 8) & 255)
    return xb


@njit(fastmath=True, cache=True, inline="always")
def _fast(wt):
    # the vpdpbusd path applies: compiled in, and chunks of whole quarters of 16 lanes (layout.int_layout
    # folds the groups of a row to a multiple of 16 lanes where it can; small odd rows take the numba loop)
    return VNNI and wt.shape[3] % 16 == 0


def takes_one_row(wt) -> bool:
    """Whether :func:`experts_gate_up_t` takes one token's activations for a decode batch on the layout
    of ``wt`` (the byte kernels': :func:`_fast`), where other layouts need the token repeated per expert."""
    return bool(VNNI) and wt.shape[3] % 16 == 0


@njit(fastmath=True, cache=True, inline="always")
def _xb_for(xe3, xo3, wt):
    if _fast(wt):
        return _xbytes(xe3, xo3)
    return np.empty(1, np.uint8)


@njit(fastmath=True, cache=True, inline="always")
def _bd(J, m, ai, ao, astep, w, wo, xb, xo, xstep, xs, so, sstep, nq):
    # m tokens (4, 2 or 1) of one chunk of nq quarters of 16 lanes: vnni.byte_dots(J, m)
    if J == 16:
        _bd16(m, ai, ao, astep, w, wo, xb, xo, xstep, xs, so, sstep, nq)
    elif J == 8:
        _bd8(m, ai, ao, astep, w, wo, xb, xo, xstep, xs, so, sstep, nq)
    else:
        _bd4(m, ai, ao, astep, w, wo, xb, xo, xstep, xs, so, sstep, nq)


@njit(fastmath=True, cache=True, inline="always")
def _bd2(J, ai, ao, bo, w, wo, v, vo, xb, xo, xs, so, nq):
    # one token, two rows (w at wo, v at vo) of one chunk of nq quarters: vnni.byte_dots2(J)
    if J == 16:
        _b16r2(ai, ao, bo, w, wo, v, vo, xb, xo, xs, so, nq)
    elif J == 8:
        _b8r2(ai, ao, bo, w, wo, v, vo, xb, xo, xs, so, nq)
    else:
        _b4r2(ai, ao, bo, w, wo, v, vo, xb, xo, xs, so, nq)


@njit(fastmath=True, cache=True, inline="always")
def _ssum(fold, sf, so, af, ao, n):
    # vnni.vsum(fold): Σ_k sf[so + k // fold]·float32(af[ao + k]) over n lanes (sf flat: lane scales at
    # fold 1, else group scales, float32 or float16 bits as uint16); the same bits for equal lane scales
    if fold == 1:
        return _vsum(sf, so, af, ao, n, n)
    if fold == 2:
        return _vsum_2(sf, so, af, ao, n, n)
    return _vsum_4(sf, so, af, ao, n, n)


@njit(fastmath=True, cache=True, inline="always")
def _ssum4(fold, sf, so, af, ao, astep, n, f4):
    # vnni.vsum4(fold) into f4 float32 [4]: :func:`_ssum` of 4 tokens (af at ao + u·astep)
    if fold == 1:
        _vsum4(sf, so, af, ao, astep, n, f4)
    elif fold == 2:
        _vsum4_2(sf, so, af, ao, astep, n, f4)
    else:
        _vsum4_4(sf, so, af, ao, astep, n, f4)


@njit(fastmath=True, cache=True, inline="always")
def _pair_rows(C, J, L, wf, vf, sf, vl, fold, xb, sx, xs, y, z, r, q, t, tx, af):
    # one token tx of the activations (xb, xs, sx), row r of the flat weight wf (into y[t, r]) and row q of
    # vf (into z[t, q]), scales sf /
    # vl flat (n / fold a row: _ssum), with the activation loads shared (vnni.byte_dots2); the integers
    # and the float sum of _rows, so the same bits (flat arguments: a reshape per row would cost more
    # than its row)
    n = C * L
    row = C * J * L
    for c in range(C):  # L / 16 quarters a chunk
        _bd2(J, af, c * L, n + c * L, wf, r * row + c * J * L, vf, q * row + c * J * L, xb,
             tx * 4 * row + c * 4 * J * L, xs, tx * n + c * L, L // 16)
    y[t, r] = _ssum(fold, sf, r * (n // fold), af, 0, n) * sx[tx]
    z[t, q] = _ssum(fold, vl, q * (n // fold), af, n, n) * sx[tx]


@njit(fastmath=True, cache=True, inline="always")
def _rows(wt, sl, xe3, xo3, xb, sx, xsl, y, r0, r1, t0, t1, ai):
    # y[t, r] = sx[t]·Σ_k sl[r, k]·a_k for rows r0:r1 and tokens t0:t1; ai int32 [NT, C·L] scratch.
    # Without VNNI: unpacking in registers (_dots1), sl float32 lane scales [out, C·L]. With it:
    # vnni.byte_dots on the byte layout, NT tokens per weight load, RB rows at a time (their bytes and a
    # token group's activations in L1), sl lane scales or the group scales as stored [out, C·L / fold]
    # (float32, or float16 bits as uint16: layout.int_layout), lane k's the scale of group k // fold
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
    fold = n // sl.shape[1]  # lanes per scale
    ns = n // fold  # scales a row
    row = C * J * L
    xrow = 4 * row  # activation bytes a token
    f4 = np.empty(4, np.float32)
    if t1 - t0 == 1:  # one token (decode): two rows a call, sharing the activation loads
        for r in range(r0, r1 - 1, 2):
            _pair_rows(C, J, L, wf, wf, sf, sf, fold, xb, sx, xs, y, y, r, r + 1, t0, t0, af)
        if (r1 - r0) % 2 == 0:
            return
        r0 = r1 - 1
    for rb in range(r0, r1, RB):
        re = min(rb + RB, r1)
        t = t0
        while t < t1:
            m = 4 if t1 - t >= 4 else (2 if t1 - t >= 2 else 1)
            for r in range(rb, re):
                for c in range(C):
                    _bd(J, m, af, c * L, n, wf, r * row + c * J * L, xb, t * xrow + c * 4 * J * L, xrow,
                        xs, t * n + c * L, n, L // 16)
                if m == 4:
                    _ssum4(fold, sf, r * ns, af, 0, n, n, f4)
                    for u in range(4):
                        y[t + u, r] = f4[u] * sx[t + u]
                else:
                    for u in range(m):
                        y[t + u, r] = _ssum(fold, sf, r * ns, af, u * n, n) * sx[t + u]
            t += m


@njit(parallel=True, fastmath=True, cache=True)
def i4t_matmul(wt, scales2, xe3, xo3, sx, xsum, y):
    """int4-g32/g64 GEMM on the transposed layout: wt uint8 [out, C, J, L] (C·L = groups · fold lanes in
    chunks of L); scales2 float32 [out, C·L] (one per lane) or, for the byte kernels, the group scales
    [out, C·L / fold] (float32, or float16 bits as uint16; see ``_rows``); xe3, xo3 int16 [T, C, J, L] (the
    activations in the same layout); sx float32 [T]; xsum int32 [T, C·L] (Σ xq per lane); y float32
    [T, out] written in place."""
    T = xe3.shape[0]
    xb = _xb_for(xe3, xo3, wt)
    C, L = wt.shape[1], wt.shape[3]
    for b in prange((wt.shape[0] + TILE_ROWS - 1) // TILE_ROWS):
        ai = np.empty((NT, C * L), np.int32)
        r0 = b * TILE_ROWS
        _rows(wt, scales2, xe3, xo3, xb, sx, xsum, y, r0, min(r0 + TILE_ROWS, wt.shape[0]), 0, T, ai)


@njit(fastmath=True, cache=True)
def i4t_matmul_1(wt, scales2, xe3, xo3, sx, xsum, y):
    """:func:`i4t_matmul` on the calling thread (small weights), same result."""
    T = xe3.shape[0]
    xb = _xb_for(xe3, xo3, wt)
    C, L = wt.shape[1], wt.shape[3]
    ai = np.empty((NT, C * L), np.int32)
    for b in range((wt.shape[0] + TILE_ROWS - 1) // TILE_ROWS):
        r0 = b * TILE_ROWS
        _rows(wt, scales2, xe3, xo3, xb, sx, xsum, y, r0, min(r0 + TILE_ROWS, wt.shape[0]), 0, T, ai)


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
# one token runs each gate row with its up row (vnni.byte_dots2); the gate tile's results wait in g
# [ΣT, I] (h's shape) until the up rows multiply them.


@njit(parallel=True, fastmath=True, cache=True)
def experts_gate_up_t(kind, gw, gs, uw, us, xa3, xb3, sx, xsum, offs, h):
    """h [ΣT, I] = SiLU(x·Gₑᵀ)·(x·Uₑᵀ) for the rows of each expert e (int4-g32/g64).

    gw, uw: tuples of EXPERTS weights uint8 [I, C, J, L]; gs, us: their scales (``i4t_matmul``'s scales2);
    xa3, xb3 int16 [ΣT, C, J, L] (even and odd columns), sx float32 [ΣT], xsum int32 [ΣT, C·L]; offs
    int64 [EXPERTS + 1] (expert e owns rows offs[e]:offs[e + 1]); h float32 [ΣT, I] written in place.
    ``kind`` is unused (the blocked kernels' argument, kept for one calling convention). A decode batch
    (one token an expert) on the byte kernels' layout (:func:`takes_one_row`) may pass the activations
    of one token, xa3, xb3 [1, C, J, L], sx [1], xsum [1, C·L], for every expert: h [n, I] as before.
    """
    inter = gw[0].shape[0]
    tiles = (inter + TILE_ROWS - 1) // TILE_ROWS
    xb = _xb_for(xa3, xb3, gw[0])
    g = np.empty_like(h)  # gate results of each tile
    C, J, L = gw[0].shape[1], gw[0].shape[2], gw[0].shape[3]
    one = xa3.shape[0] == 1 and h.shape[0] > 1  # one token's activations for every expert
    for i in prange(EXPERTS * tiles):
        e, r0, r1 = _tile(i, tiles, inter)
        t0, t1 = offs[e], offs[e + 1]
        ai = np.empty((NT, C * L), np.int32)
        if t1 - t0 == 1 and _fast(gw[0]):  # decode: a gate row and its up row share the activations
            gf, uf, gl, ul = gw[e].reshape(-1), uw[e].reshape(-1), gs[e].reshape(-1), us[e].reshape(-1)
            af, xs = ai.reshape(-1), xsum.reshape(-1)
            fold = C * L // gs[e].shape[1]  # lanes per scale (_rows)
            tx = 0 if one else t0
            for r in range(r0, r1):
                _pair_rows(C, J, L, gf, uf, gl, ul, fold, xb, sx, xs, g, h, r, r, t0, tx, af)
        else:
            _rows(gw[e], gs[e], xa3, xb3, xb, sx, xsum, g, r0, r1, t0, t1, ai)
            _rows(uw[e], us[e], xa3, xb3, xb, sx, xsum, h, r0, r1, t0, t1, ai)
        _silu_rows(g, h, t0, t1, r0, r1)


@njit(parallel=True, fastmath=True, cache=True)
def experts_matmul_t(kind, ws_, ss, xa3, xb3, sx, xsum, offs, y):
    """y [ΣT, out] = x · Wₑᵀ for the rows of each expert e (the down projections, int4-g32/g64);
    arguments as :func:`experts_gate_up_t`, y float32 written in place."""
    out = ws_[0].shape[0]
    tiles = (out + TILE_ROWS - 1) // TILE_ROWS
    xb = _xb_for(xa3, xb3, ws_[0])
    C, L = ws_[0].shape[1], ws_[0].shape[3]
    for i in prange(EXPERTS * tiles):
        e, r0, r1 = _tile(i, tiles, out)
        ai = np.empty((NT, C * L), np.int32)
        _rows(ws_[e], ss[e], xa3, xb3, xb, sx, xsum, y, r0, r1, offs[e], offs[e + 1], ai)
