"""Weight layouts of the ``cpu`` backend's integer kernels: what an upload makes of an int8 / int4 /
int4-gG weight (:class:`HostWeight`, :func:`int_layout`) and which kernels read it
(:func:`layout_kernels`): blocked views for ``qkernels``, transposed copies for ``q4t`` (int4-g32) and
``q4g`` (int4-g64, int4-g128 of 16·n groups, per-row int4 of 512·n bytes a row).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from colibri_plan.quant import GROUP_FORMATS, QuantTensor, group_size

#: formats of the integer kernels; int2 has a float kernel, the rest go through the numpy path
INT4_FORMATS = ("int4",) + GROUP_FORMATS
INT_FORMATS = ("int8",) + INT4_FORMATS


class HostWeight(NamedTuple):
    """Payload of an uploaded weight: the packed QuantTensor (its rows a zero-stride stand-in for the
    transposed layouts, :func:`without_rows`) plus the layout the integer kernels take
    (:func:`int_layout`) and those kernels (:func:`layout_kernels`)."""

    qt: QuantTensor
    data3: np.ndarray | None = None  # blocked int8 / int4 [out, blocks, bb]; transposed int4 [out, C, J, L]
    # float32 [out, groups] (int8 / per-row int4: 1; int4-g32 transposed: per lane, groups·fold, or on
    # the byte layout per group as stored: :func:`group_scales`)
    scales2: np.ndarray | None = None
    cols: int = 0  # padded input columns the activations are quantized to
    group: int = 0  # int4: columns per zero-code group (per-row: ``cols``)
    fold: int = 0  # transposed int4: lanes each group (per-row: row) is split in; 0: blocked layout
    kernel: object = None  # the parallel matmul kernel of this layout (chosen once, at upload)
    serial: object = None  # its single-thread twin (same bits) for small matmuls; None: always parallel
    key: tuple | None = None  # (format, data3 shape, fold): one key, one batched call; None: float/int2
    experts: tuple | None = None  # the batched experts' (gate+up, down) kernels of this layout


def without_rows(qt: QuantTensor) -> QuantTensor:
    """``qt`` with its data replaced by a read-only zero-stride view of its shape and dtype (no memory;
    ``nbytes`` unchanged): the payload of a weight whose kernels read a transposed copy, so that the
    packed rows are not held twice (an uploaded per-row int4 weight held its view of them, a
    transposed one would hold both)."""
    return QuantTensor(qt.fmt, qt.out_features, qt.in_features,
                       np.broadcast_to(np.zeros((), qt.data.dtype), qt.data.shape), qt.scales)


def layout_kernels(k, hw: HostWeight) -> tuple:
    """(parallel matmul, its serial twin or None, batched experts' gate+up, down) kernels of ``hw``'s
    layout in the kernel namespace ``k``: qkernels (int8, blocked int4), q4t (int4-g32
    transposed) or q4g (per-row int4, int4-g64, int4-g128 transposed: groups summed in int32)."""
    fmt = hw.qt.fmt
    if fmt == "int8":
        return k.i8_matmul, k.i8_matmul_1, k.experts_gate_up, k.experts_matmul
    if hw.fold:
        if group_size(fmt) == 32:  # int4-g32 and int4-g32h (its scales widened to float32 here)
            return k.i4t_matmul, k.i4t_matmul_1, k.experts_gate_up_t, k.experts_matmul_t
        return k.i4g_matmul, k.i4g_matmul_1, k.experts_gate_up_g, k.experts_matmul_g
    if hw.group == hw.cols:  # per-row int4 blocks
        return k.i4r_matmul, k.i4r_matmul_1, k.experts_gate_up, k.experts_matmul
    # int4-g128 blocks: reassociating parallel kernel only (qkernels.i4r_matmul)
    return k.i4_matmul, None, k.experts_gate_up, k.experts_matmul


def _block(nbytes: int, sizes: tuple[int, ...]) -> tuple[int, int]:
    """(block bytes, padded row bytes): the largest size dividing the row, else the smallest, padded."""
    for bb in sizes:
        if nbytes % bb == 0:
            return bb, nbytes
    return sizes[-1], -(-nbytes // sizes[-1]) * sizes[-1]


def _padded(data: np.ndarray, nbytes: int, fill: int) -> np.ndarray:
    if data.shape[1] == nbytes:
        return data
    p = np.full((data.shape[0], nbytes), fill, data.dtype)  # a copy, only for rows of odd length
    p[:, : data.shape[1]] = data
    return p


#: per-row int4 rows of a multiple of this many bytes take the transposed layout of q4g (16 bytes
#: a lane when the row is a multiple of 1024 bytes, else 8: whole chunks of 64 lanes)
ROW_BYTES_T = 512


def int_layout(qt: QuantTensor, k) -> HostWeight:
    """The kernel layout of an int8 / int4 / int4-gG weight for the kernels of ``k``: blocked views
    (qkernels' ``BLOCKS8``/``BLOCKS4``: int8, per-row int4 of other lengths, int4-g128 of other
    group counts; no copy unless a row does not end on a whole block, then padded with the zero code;
    group scales of padding groups are 0.0 already) or transposed copies (``fold`` > 0: int4-g32 for
    q4t with per-lane scales; int4-g64, int4-g128 of 16·n groups, per-row int4 of 512·n bytes for
    q4g with the scales as stored)."""
    out, nb = qt.data.shape
    if qt.fmt == "int8":
        bb, pb = _block(nb, k.BLOCKS8)
        return HostWeight(qt, _padded(qt.data, pb, 0).reshape(out, -1, bb), qt.scales.reshape(out, 1), pb, pb)
    g = group_size(qt.fmt)
    scales = np.ascontiguousarray(qt.scales, dtype=np.float32)
    if g is None:
        if nb % ROW_BYTES_T == 0:  # per-row int4 transposed (q4g): one group of nb / J lanes
            J = 16 if nb % (2 * ROW_BYTES_T) == 0 else 8
            return HostWeight(qt, _lanes(qt.data, 1, nb // J, J), scales.reshape(out, 1), 2 * nb, 2 * nb,
                              nb // J)
        bb, pb = _block(nb, k.BLOCKS4)  # other rows: blocks of any size, one scale (qkernels)
        return HostWeight(qt, _padded(qt.data, pb, 0x88).reshape(out, -1, bb), scales.reshape(out, 1),
                          2 * pb, 2 * pb)
    groups, bg = scales.shape[1], g // 2
    data = _padded(qt.data, groups * bg, 0x88)
    if g == 128:
        if groups % 16 == 0:  # transposed, fold 4 (q4g): chunks of 64 lanes are 16 whole groups
            return HostWeight(qt, _lanes(data, groups, 4, 16), scales, groups * g, g, 4)
        return HostWeight(qt, data.reshape(out, groups, bg), scales, groups * g, g)  # blocks (qkernels)
    # g32/g64 transposed: wt[r, j, g·fold + s] = byte s·(bg/fold) + j of group g
    # q4t's vpdpbusd kernels take any whole number of 16-lane quarters: an int4-g32 row of 24 groups (768
    # columns, a Qwen3-MoE expert's down) folds by 2 into 48 lanes for them, where it took the numba loop
    # at fold 4 (96 lanes: not whole chunks of 64) before: a 2048x768 GEMV in cache on 2 threads 23-31
    # against 58-69 µs; a decode step's routed experts, bench/results/cpu-int4-decode-h26-experts-768.json
    vnni = bool(getattr(k, "VNNI", False)) and g == 32
    fold = _fold(groups, k.FOLDS[bg], 16 if vnni else 64)
    if g == 64:  # q4g sums a group's lanes in int32: its own scales, [out, groups]
        return HostWeight(qt, _lanes(data, groups, fold, bg // fold), scales, groups * g, g, fold)
    wt = _lanes(data, groups, fold, bg // fold)
    if vnni and wt.shape[3] % 16 == 0:  # q4t's vpdpbusd kernels read the byte layout and the scales as
        # stored, one per group (int4-g32h: float16 bits, widened in the kernel; no copy): a decode GEMV
        # then reads the pack's bytes, where per-lane float32 copies added 25% (fold 1) to 50% (fold 2)
        return HostWeight(qt, bytes_layout(wt), group_scales(qt), groups * g, g, fold)
    lane_scales = np.repeat(scales, fold, axis=1) if fold > 1 else scales  # [out, groups·fold]
    return HostWeight(qt, wt, lane_scales, groups * g, g, fold)


def group_scales(qt: QuantTensor) -> np.ndarray:
    """The group scales of an int4-g32 / int4-g32h weight as q4t's byte kernels read them: float32
    [out, groups], or the float16 ones as their bits, uint16 [out, groups] (a view when contiguous)."""
    if qt.scales.dtype == np.float16:
        return np.ascontiguousarray(qt.scales).view(np.uint16)
    return np.ascontiguousarray(qt.scales, dtype=np.float32)


def lane_scales(hw: HostWeight) -> np.ndarray:
    """float32 [out, C·L] scales of ``hw`` one per lane (the numba loops' scales; tests), from the group
    scales of the byte layout (:func:`group_scales`) or as they are."""
    s = hw.scales2.view(np.float16).astype(np.float32) if hw.scales2.dtype == np.uint16 else hw.scales2
    lanes = hw.data3.shape[1] * hw.data3.shape[3]
    return np.repeat(s, lanes // s.shape[1], axis=1) if s.shape[1] != lanes else s


def bytes_layout(wt: np.ndarray) -> np.ndarray:
    """The transposed layout [N, C, J, L] (byte j of lane k at [c, j, k]; L a multiple of 16) -> the byte
    layout of ``vnni.byte_dots``, same shape: per chunk, quarter q (lanes 16q..16q + 15), dword d, the 4
    bytes 4d..4d + 3 of lane 16q + i at 4i of a 64-byte line (a copy)."""
    n, C, J, L = wt.shape
    t = wt.reshape(n, C, J // 4, 4, L // 16, 16).transpose(0, 1, 4, 2, 5, 3)  # [N, C, q, d, i, b]
    return np.ascontiguousarray(t).reshape(n, C, J, L)


def unbytes_layout(wt: np.ndarray) -> np.ndarray:
    """:func:`bytes_layout` undone (the transposed layout of the numba loops; tests)."""
    n, C, J, L = wt.shape
    t = wt.reshape(n, C, L // 16, J // 4, 16, 4).transpose(0, 1, 3, 5, 2, 4)  # [N, C, d, b, q, i]
    return np.ascontiguousarray(t).reshape(n, C, J, L)


def _fold(groups: int, folds: tuple[int, ...], quantum: int = 64) -> int:
    """Parts to split each group in: the fewest of ``folds`` making groups · parts a multiple of 64
    lanes (whole chunks), else the fewest making it a multiple of ``quantum`` lanes (16: q4t's byte
    kernels' quarters), else the most."""
    for q in (64, quantum):
        f = next((f for f in folds if (groups * f) % q == 0), None)
        if f is not None:
            return f
    return folds[-1]


def _lanes(a: np.ndarray, groups: int, fold: int, J: int) -> np.ndarray:
    """[N, groups·fold·J] (each group's bytes or activations in order) -> the transposed layout
    [N, C, J, L]: element j of part s of group g at lane g·fold + s, lanes in chunks of L = 64 (one
    chunk of every lane when their count is not a multiple of 64)."""
    n, K = a.shape[0], groups * fold
    L = 64 if K % 64 == 0 else K
    t = a.reshape(n, groups, fold, J).transpose(0, 3, 1, 2).reshape(n, J, K // L, L)  # [N, J, C, L]
    return np.ascontiguousarray(t.transpose(0, 2, 1, 3))


def int2_activations(x: np.ndarray, nbytes: int):
    """(x0, d1, d2, d3, xsum) for ``q2_matmul``: planes float32 [T, nbytes] and xsum float32 [T]."""
    T, n = x.shape
    xp = np.zeros((T, 4 * nbytes), np.float32)
    xp[:, :n] = x
    p = [xp[:, i::4] for i in range(4)]
    planes = [p[0]] + [p[i] - np.float32(4.0) * p[i - 1] for i in (1, 2, 3)]
    xsum = x.sum(axis=1, dtype=np.float64).astype(np.float32)
    return (*[np.ascontiguousarray(a) for a in planes], xsum)
