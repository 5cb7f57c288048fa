"""Quant formats: the living definition every kernel is tested against.

Semantics follow colibrì's container formats (its ``docs/FORMATS.md`` and ``qt_bytes``): symmetric
integers stored with an offset, float32 scales; ``int4-gGh`` stores its group scales as float16 (ggml's
Q4_0 bytes at G = 32: 16 bytes of codes + a 2-byte scale per 32 weights, 4.5 bits a weight).

| format      | data (dtype, shape)              | value                          | scales (float32)       |
|-------------|----------------------------------|--------------------------------|------------------------|
| f32         | float32 [out, in]                | as stored                      | none                   |
| f16         | float16 [out, in]                | as stored                      | none                   |
| bf16        | uint16 [out, in] (bf16 bits)     | bits << 16 as float32          | none                   |
| int8        | int8 [out, in]                   | q · s[row]                     | [out]                  |
| int4        | uint8 [out, ceil(in/2)]          | (nibble − 8) · s[row]          | [out]                  |
| int2        | uint8 [out, ceil(in/4)]          | (crumb − 2) · s[row]           | [out]                  |
| int4-gG     | uint8 [out, ceil(in/2)]          | (nibble − 8) · s[row, col//G]  | [out, ceil(in/G)]      |
| int4-gGh    | uint8 [out, ceil(in/2)]          | (nibble − 8) · s[row, col//G]  | float16, as int4-gG    |

Stored bits per weight (codes + scales): int8 8 + 32/in, int4 4 + 32/in, int4-g32 5.0, int4-g64 4.5,
int4-g128 4.25, int4-g32h 4.5 (Q4_0), int2 2 + 32/in. Readers widen a float16 scale to float32
exactly, so a kernel computes the same ``(code − 8) · s`` products for int4-g32h as for int4-g32.

Packing is little-end first: input column ``2j`` is the low nibble of byte ``j`` (int4), column ``4j+i``
is bits ``2i..2i+1`` of byte ``j`` (int2). Padding columns hold the zero code (8 or 2).

int4 scales are signed and every code 0..15 is used (:func:`quantize`): a block's scale is ``m / −k``
with ``m`` its value of largest magnitude, so ``m`` lands on code 0 (value −8·s = m at k = 8, ggml's
Q4_0 rule); ``k`` is the one of :data:`INT4_DIVISORS` with the least squared error. Readers only ever
compute ``(code − 8) · s``.

This module is a leaf: it imports only numpy and :mod:`colibri_plan.errors`, so the model spec, the
engine and every backend can share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_plan.errors import FormatError, UnsupportedError

FLOAT_FORMATS = ("f32", "f16", "bf16")
ROW_FORMATS = ("int8", "int4", "int2")
GROUP_SIZES = (32, 64, 128)
#: grouped int4 with float16 group scales: ``int4-gGh`` (G = 32 holds Q4_0's 18 bytes per 32 weights)
HALF_GROUP_FORMATS = ("int4-g32h",)
GROUP_FORMATS = tuple(f"int4-g{g}" for g in GROUP_SIZES) + HALF_GROUP_FORMATS
FORMATS = FLOAT_FORMATS + ROW_FORMATS + GROUP_FORMATS
#: the largest float16 (a group whose scale max|w|/8 passes it cannot be stored as int4-gGh)
F16_MAX = 65504.0

_BITS = {"f32": 32, "f16": 16, "bf16": 16, "int8": 8, "int4": 4, "int2": 2}
_ZERO_CODE = {"int4": 8, "int2": 2}
#: int4 scale candidates ``s = m / −k`` per block (``m`` its value of largest magnitude), for groups
#: of 32..128 and for whole rows. k = 8 puts m on code 0 exactly (ggml's Q4_0 rule); a larger k clips m
#: to −8·s for a finer step on the rest: a group of 32 Gaussian weights wants k = 8..9, a row of a few
#: thousand k ≈ 10..11. The first of least squared error wins, so a block that k = 8 stores exactly
#: keeps it. Random N(0, 1) [2048, 2048], RMS error / RMS weight against the old 15-code rule
#: s = max|w| / 7: g32 0.0970 -> 0.0831, row 0.1506 -> 0.1085. More candidates (7.5 .. 13 by 0.5)
#: gain under 1% more for as much again of the packing time.
INT4_DIVISORS = {"group": (8.0, 8.5, 9.0), "row": (8.0, 9.0, 10.0, 11.0, 12.0)}
#: values per block of rows :func:`_int4_codes` works on (each candidate's temporaries stay in L2)
_CHUNK_VALUES = 1 << 16


def check_format(fmt: str) -> str:
    """Return ``fmt`` if it is a known format name.

    Raises:
        UnsupportedError: unknown name; the message lists the known ones.
    """
    if fmt not in FORMATS:
        raise UnsupportedError(f"unknown quant format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def group_size(fmt: str) -> int | None:
    """Group size G of an ``int4-gG`` format, else None (per-row or float)."""
    check_format(fmt)
    return int(fmt.split("-g")[1].rstrip("h")) if fmt in GROUP_FORMATS else None


def scale_dtype(fmt: str) -> np.dtype | None:
    """dtype of the stored scales: float16 for ``int4-gGh``, float32 for the other integer formats,
    None for float formats (no scales)."""
    check_format(fmt)
    if fmt in FLOAT_FORMATS:
        return None
    return np.dtype(np.float16 if fmt in HALF_GROUP_FORMATS else np.float32)


def widen_scales(qt: QuantTensor) -> QuantTensor:
    """``qt`` with float32 scales: an ``int4-gGh`` tensor becomes the ``int4-gG`` tensor of the same
    values (float16 -> float32 is exact; data shared, not copied); any other tensor is returned as is.
    Kernels that read float32 group scales run int4-gGh through this."""
    if qt.fmt not in HALF_GROUP_FORMATS:
        return qt
    return QuantTensor(qt.fmt[:-1], qt.out_features, qt.in_features, qt.data, qt.scales.astype(np.float32))


def bits(fmt: str) -> int:
    """Bits per stored weight, without scales (4 for ``int4-g64``)."""
    check_format(fmt)
    return 4 if fmt in GROUP_FORMATS else _BITS[fmt]


def data_shape(fmt: str, out_features: int, in_features: int) -> tuple[int, int]:
    """Shape of the stored data array (see the module table)."""
    b = bits(fmt)
    if b >= 8:
        return (out_features, in_features)
    per_byte = 8 // b
    return (out_features, -(-in_features // per_byte))


def scales_shape(fmt: str, out_features: int, in_features: int) -> tuple[int, ...] | None:
    """Shape of the scales array (dtype :func:`scale_dtype`), or None for float formats."""
    if fmt in FLOAT_FORMATS:
        return None
    g = group_size(fmt)
    return (out_features,) if g is None else (out_features, -(-in_features // g))


def tensor_bytes(fmt: str, out_features: int, in_features: int) -> int:
    """Bytes one [out, in] weight takes in ``fmt``: data plus scales (float32; float16 for int4-gGh).

    Example: GLM-5.2 expert gate [2048, 6144] at int4 = 2048·3072 + 2048·4 = 6,299,648 B; at
    int4-g32h 2048·3072 + 2048·192·2 = 7,077,888 B (4.5 bits a weight).
    """
    o, c = data_shape(fmt, out_features, in_features)
    itemsize = 4 if fmt == "f32" else 2 if fmt in ("f16", "bf16") else 1
    n = o * c * itemsize
    s = scales_shape(fmt, out_features, in_features)
    if s is not None:
        n += scale_dtype(fmt).itemsize * int(np.prod(s))
    return n


@dataclass(frozen=True)
class QuantTensor:
    """A weight matrix W [out_features, in_features] in one quant format.

    Attributes:
        fmt: format name (see :data:`FORMATS`).
        out_features, in_features: logical shape of W.
        data: stored values, dtype and shape as in the module table.
        scales: scales ([out] or [out, groups]; float32, float16 for int4-gGh) or None for float formats.
    """

    fmt: str
    out_features: int
    in_features: int
    data: np.ndarray
    scales: np.ndarray | None

    def __post_init__(self):
        check_format(self.fmt)
        want = data_shape(self.fmt, self.out_features, self.in_features)
        if tuple(self.data.shape) != want:
            raise FormatError(f"{self.fmt} data for [{self.out_features}, {self.in_features}] must have "
                              f"shape {want}, got {tuple(self.data.shape)}")
        want_s = scales_shape(self.fmt, self.out_features, self.in_features)
        got_s = None if self.scales is None else tuple(self.scales.shape)
        if got_s != want_s:
            raise FormatError(f"{self.fmt} scales must have shape {want_s}, got {got_s}")
        if self.fmt in HALF_GROUP_FORMATS and self.scales.dtype != np.float16:  # a float32 one is int4-gG
            raise FormatError(f"{self.fmt} holds float16 scales, got {self.scales.dtype}; use "
                              f"{self.fmt[:-1]} for float32 scales")

    @property
    def nbytes(self) -> int:
        """Stored bytes (data + scales), equal to :func:`tensor_bytes`."""
        return int(self.data.nbytes + (0 if self.scales is None else self.scales.nbytes))


def _pack(codes: np.ndarray, per_byte: int) -> np.ndarray:
    # codes uint8 [out, in] in 0..2**bits-1 -> packed uint8 [out, ceil(in/per_byte)], low bits first
    out_f, in_f = codes.shape
    width = -(-in_f // per_byte) * per_byte
    pad_code = 8 if per_byte == 2 else 2
    padded = np.full((out_f, width), pad_code, dtype=np.uint8)
    padded[:, :in_f] = codes
    shift = 8 // per_byte
    packed = np.zeros((out_f, width // per_byte), dtype=np.uint8)
    for i in range(per_byte):
        packed |= (padded[:, i::per_byte] << (shift * i)).astype(np.uint8)
    return packed


def unpack_codes(fmt: str, data: np.ndarray, in_features: int) -> np.ndarray:
    """Unpack int4/int2 bytes [out, nb] to codes uint8 [out, in_features] (0..15 or 0..3)."""
    per_byte = 8 // bits(fmt)
    shift, mask = 8 // per_byte, (1 << (8 // per_byte)) - 1
    parts = [(data >> (shift * i)) & mask for i in range(per_byte)]
    codes = np.stack(parts, axis=-1).reshape(data.shape[0], -1)  # [out, nb*per_byte]
    return codes[:, :in_features]


def quantize(w: np.ndarray, fmt: str) -> QuantTensor:
    """Quantize a float matrix W [out, in] to ``fmt``: round to nearest; int8/int2 scale absmax per row
    symmetrically, int4 and int4-gG pick per block the signed scale of least squared error (module notes).

    int4-gGh rounds each candidate scale to float16 before it picks codes, so the codes fit the stored
    scale.

    Raises:
        FormatError: ``w`` is not 2-D or holds NaN/Inf; for int4-gGh, a group scale past float16's range.
        UnsupportedError: unknown format.
    """
    check_format(fmt)
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise FormatError(f"quantize expects a 2-D weight [out, in], got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise FormatError("quantize: weight holds NaN or Inf")
    out_f, in_f = w.shape
    if fmt == "f32":
        return QuantTensor(fmt, out_f, in_f, np.ascontiguousarray(w), None)
    if fmt == "f16":
        return QuantTensor(fmt, out_f, in_f, w.astype(np.float16), None)
    if fmt == "bf16":  # round to nearest even on the upper 16 bits
        u = w.view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return QuantTensor(fmt, out_f, in_f, r, None)
    if fmt not in ("int8", "int2"):  # int4, int4-gG and int4-gGh
        half = fmt in HALF_GROUP_FORMATS
        if half and w.size and float(np.abs(w).max()) / INT4_DIVISORS["group"][0] > F16_MAX:
            raise FormatError(f"{fmt}: a weight of magnitude {float(np.abs(w).max()):.3g} needs a group "
                              f"scale past float16's {F16_MAX:g}; use {fmt[:-1]} (float32 scales)")
        codes, scales = _int4_codes(w, group_size(fmt), half)
        return QuantTensor(fmt, out_f, in_f, _pack(codes, 2), scales.astype(scale_dtype(fmt)))
    qmax, qmin = (127, -127) if fmt == "int8" else (1, -2)
    # the symmetric step: absmax maps to qmax (int2 uses 2 so that -absmax is representable)
    denom = 2.0 if fmt == "int2" else float(qmax)
    scales = (np.abs(w).max(axis=1) / denom).astype(np.float32)  # [out]
    safe = np.where(scales == 0, 1.0, scales)[:, None]
    q = np.clip(np.rint(w / safe), qmin, qmax).astype(np.int32)
    if fmt == "int8":
        return QuantTensor(fmt, out_f, in_f, q.astype(np.int8), scales)
    codes = (q + _ZERO_CODE["int2"]).astype(np.uint8)
    return QuantTensor(fmt, out_f, in_f, _pack(codes, 4), scales)


def _int4_codes(w: np.ndarray, g: int | None, half: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """int4 codes uint8 [out, in] (0..15) and signed float32 scales ([out] if ``g`` is None, else
    [out, ceil(in/g)]) of a finite float32 W [out, in]: per block, the scale of :data:`INT4_DIVISORS`
    with the least squared error of ``(code − 8) · s`` against W (see the module notes). ``half``:
    candidates are rounded to float16 first (the scales returned are then float16 values)."""
    out_f, in_f = w.shape
    width = in_f if g is None else g
    ngroups = -(-in_f // width)
    codes = np.empty((out_f, in_f), np.uint8)
    scales = np.empty((out_f, ngroups), np.float32)
    step = max(1, _CHUNK_VALUES // (ngroups * width))
    for r0 in range(0, out_f, step):
        r1 = min(out_f, r0 + step)
        b = np.zeros((r1 - r0, ngroups * width), np.float32)  # padding zeros: code 8 at any scale
        b[:, :in_f] = w[r0:r1]
        b = b.reshape(r1 - r0, ngroups, width)  # [rows, groups, width]
        m = np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)  # [rows, groups, 1]
        q, r = np.empty_like(b), np.empty_like(b)  # scratch [rows, groups, width], reused per candidate
        best_err = best_s = None
        for k in INT4_DIVISORS["row" if g is None else "group"]:
            s = m / np.float32(-k)  # [rows, groups, 1]
            if half:  # the stored scale, so the codes are chosen for it
                s = s.astype(np.float16).astype(np.float32)
            _int4_round(b, s, q)
            np.multiply(q, s, out=r)
            r -= b
            err = np.einsum("rgw,rgw->rg", r, r)[..., None]  # [rows, groups, 1] squared error (one pass)
            if best_err is None:
                best_err, best_s = err, s
            else:  # strictly better only: ties keep the earlier candidate
                better = err < best_err
                best_err, best_s = np.where(better, err, best_err), np.where(better, s, best_s)
        _int4_round(b, best_s, q)
        q += 8
        codes[r0:r1] = q.astype(np.uint8).reshape(r1 - r0, -1)[:, :in_f]
        scales[r0:r1] = best_s[..., 0] + np.float32(0)  # an all-zero block: -0.0 + 0 = +0.0
    return codes, scales[:, 0] if g is None else scales


def _int4_round(b: np.ndarray, s: np.ndarray, out: np.ndarray) -> None:
    # out [rows, groups, width] = clip(rint(b / s), -8, 7) as float32, 0 where s = 0 (a division, not
    # a reciprocal: 1/s overflows for a block of subnormals, and 0·inf is NaN)
    out.fill(0)
    np.divide(b, s, out=out, where=s != 0)
    np.rint(out, out=out)
    np.clip(out, -8, 7, out=out)


def dequantize(qt: QuantTensor) -> np.ndarray:
    """W as float32 [out, in]: the reference every kernel must match."""
    fmt = qt.fmt
    if fmt == "f32":
        return qt.data.astype(np.float32, copy=True)
    if fmt == "f16":
        return qt.data.astype(np.float32)
    if fmt == "bf16":
        return (qt.data.astype(np.uint32) << 16).view(np.float32)
    if fmt == "int8":
        return qt.data.astype(np.float32) * qt.scales[:, None]
    zero = _ZERO_CODE["int2" if fmt == "int2" else "int4"]
    q = unpack_codes(fmt, qt.data, qt.in_features).astype(np.float32) - zero  # [out, in]
    g = group_size(fmt)
    if g is None:
        return q * qt.scales[:, None]
    s = qt.scales.astype(np.float32, copy=False)  # float16 (int4-gGh) widens exactly
    return q * np.repeat(s, g, axis=1)[:, : qt.in_features]


def matmul_ref(x: np.ndarray, qt: QuantTensor) -> np.ndarray:
    """Reference y [T, out] = x [T, in] · Wᵀ, accumulated in float64, returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != qt.in_features:
        raise FormatError(f"matmul: x must be [T, {qt.in_features}], got {x.shape}")
    return (x.astype(np.float64) @ dequantize(qt).astype(np.float64).T).astype(np.float32)
