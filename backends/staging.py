"""Staging shared by the GPU backends: the row-padded weight layout their kernels read, activations
zero-padded straight into pinned, mapped or shared memory, several inputs of one op packed into one
buffer, and uploads through a bounded staging chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_plan.quant import QuantTensor, bits, group_size

STAGE_BYTES = 64 << 20  # staging chunk of uploads through host memory: bounds the host memory held


@dataclass
class PaddedWeight:
    """A weight in the layout of :func:`padded_layout` on a device."""

    data: Any  # the rows, uint8 [out, row_bytes]: cl.Buffer, MTLBuffer or a CUDA device address
    scales: Any  # float32 scales (per row, per group, or a 1-element dummy), same kinds of handle
    in_pad: int  # padded columns: activations are zero-padded to this many floats
    mem: Any = None  # the allocation owning both when data/scales are addresses into it (CUDA)



def padded_layout(qt: QuantTensor, multiple: int = 128) -> tuple[np.ndarray, np.ndarray, int]:
    """The row-padded device layout the GPU kernels (OpenCL, CUDA, Metal) read.

    Columns are padded from ``in_features`` up to ``in_pad``, a multiple of ``multiple`` (128 divides
    by every group size and makes every row start 16-byte aligned for every format), with the zero
    code (0.0 for float formats, 8 for int4, 2 for int2, 0 for int8), so kernels need no tail loop and
    activations padded with zeros give exact sums. Group scales are padded to ``in_pad / G`` groups
    with 0.0.

    Returns:
        data: uint8 [out, row_bytes], the rows of ``qt.data`` as bytes plus padding.
        scales: float32, [out] (per-row), [out, in_pad / G] (groups) or [1] (float formats, unused).
        in_pad: padded column count.
    """
    in_f, out_f = qt.in_features, qt.out_features
    in_pad = -(-in_f // multiple) * multiple
    b = bits(qt.fmt)
    row_bytes = in_pad * b // 8
    pad_byte = 0xAA if qt.fmt == "int2" else 0x88 if b == 4 else 0  # zero codes 2 (x4) / 8 (x2)
    src = np.ascontiguousarray(qt.data).view(np.uint8).reshape(out_f, -1)
    if src.shape[1] == row_bytes:
        data = src
    else:  # quantize already filled the unused codes of the last stored byte with the zero code
        data = np.full((out_f, row_bytes), pad_byte, np.uint8)
        data[:, : src.shape[1]] = src
    g = group_size(qt.fmt)
    if qt.scales is None:
        scales = np.zeros(1, np.float32)
    elif g is None:
        scales = np.ascontiguousarray(qt.scales, np.float32)
    else:
        scales = np.zeros((out_f, in_pad // g), np.float32)
        scales[:, : qt.scales.shape[1]] = qt.scales
    return data, scales, in_pad


def pack(arrays: Sequence[np.ndarray], alloc: Callable[[int], np.ndarray] | None = None
         ) -> tuple[np.ndarray, list[int]]:
    """Several host inputs of one op in one float32 buffer (one copy to the device, one binding; kernels
    get the offsets): float32 ``arrays`` one after another, each at a 16-byte boundary. ``alloc(n)``
    gives the float32 view to fill, of n floats (mapped or shared memory); default a new array. Gaps are
    left as they are. Returns (the view, float offsets)."""
    offs, n = [], 0
    for a in arrays:
        n = -(-n // 4) * 4
        offs.append(n)
        n += a.size
    out = (alloc or (lambda k: np.empty(k, np.float32)))(n)
    for a, o in zip(arrays, offs):
        out[o:o + a.size] = a.reshape(-1)
    return out, offs


def stage_rows(xs: Sequence[np.ndarray], in_pad: int, out: np.ndarray) -> np.ndarray:
    """Write activations x_i [T_i, in] float32 one after another into ``out`` float32 [Σ T_i, in_pad] (a
    view of pinned, mapped or shared memory), with zeros in columns in .. in_pad-1: the weights' padding
    holds the zero code, so the padded sums are exact and kernels need no tail loop. Returns ``out``."""
    n_in = xs[0].shape[1]
    if n_in == in_pad:
        np.concatenate(xs, axis=0, out=out)
        return out
    out[:, n_in:] = 0.0
    t = 0
    for x in xs:
        out[t:t + x.shape[0], :n_in] = x
        t += x.shape[0]
    return out


def copy_in_chunks(src: np.ndarray, stage: np.ndarray, put: Callable[[int, int], None]) -> None:
    """Upload ``src`` through a staging buffer (pinned host memory, a mapped staging buffer): its bytes go
    into ``stage`` (uint8) one chunk at a time and ``put(offset, n)`` moves stage[:n] to byte ``offset``
    of the destination; ``put`` must have finished when it returns, as the next chunk overwrites it."""
    src = src.reshape(-1).view(np.uint8)
    for off in range(0, src.nbytes, stage.nbytes):
        n = min(stage.nbytes, src.nbytes - off)
        stage[:n] = src[off:off + n]
        put(off, n)
