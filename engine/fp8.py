"""FP8 block-scaled checkpoints (DeepSeek-V3/R1, Kimi-K2 releases): e4m3 weights dequantised per block.

Such a checkpoint stores a Linear weight W [N, K] as ``F8_E4M3`` bytes plus ``<name>_scale_inv``, float32
[ceil(N / bn), ceil(K / bk)] with (bn, bk) = ``quantization_config.weight_block_size`` of config.json
(default [128, 128]). The real weight is W[i, j] = e4m3(W8[i, j]) · scale_inv[i // bn, j // bk], as in
DeepSeek-V3's ``inference/kernel.py`` (``weight_dequant``) and transformers'
``integrations/finegrained_fp8.py``. The engine dequantises at load time (dense tensors) or when an
expert is read (then quantized to the pack's format), in numpy only: no torch at run time.

e4m3fn ("fn": finite, no infinities): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
is subnormal (m / 8 · 2^-6); 0x7F / 0xFF are NaN; the largest finite value is 448.
"""

from __future__ import annotations

import numpy as np

from colibri_plan.errors import FormatError, UnsupportedError

#: default (rows, columns) of one scale block
DEFAULT_BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"


def _e4m3fn_table() -> np.ndarray:
    """float32 [256]: the value of every e4m3fn byte."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    val = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    val[(exp == 15) & (man == 7)] = np.nan
    return (sign * val).astype(np.float32)


E4M3FN = _e4m3fn_table()


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """Decode e4m3fn bytes (uint8, any shape) to float32 of the same shape."""
    return E4M3FN[np.asarray(bits, dtype=np.uint8)]


def dequant_blocks(bits: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = DEFAULT_BLOCK,
                   name: str = "tensor") -> np.ndarray:
    """W = e4m3(bits) · scale_inv per (bn × bk) block; bits uint8 [..., N, K], scale_inv float32
    [..., ceil(N / bn), ceil(K / bk)] -> float32 [..., N, K] (partial edge blocks use their block's scale).

    Raises:
        FormatError: the scale's shape does not tile the weight with ``block``.
    """
    bn, bk = int(block[0]), int(block[1])
    *lead, n, k = bits.shape
    want = (*lead, -(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise FormatError(f"{name}: FP8 scale {name}{SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, want "
                          f"{want} for a weight {tuple(bits.shape)} in {bn}×{bk} blocks "
                          "(quantization_config.weight_block_size)")
    s = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bn, axis=-2)[..., :n, :], bk, axis=-1)[..., :k]
    return e4m3_to_f32(bits) * s  # [..., N, K] float32


def block_size(config: dict) -> tuple[int, int]:
    """``quantization_config.weight_block_size`` of a config.json dict (default 128 × 128).

    Raises:
        UnsupportedError: an FP8 format other than e4m3 or a scheme without blocks.
        FormatError: a malformed block size.
    """
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise FormatError(f"config field 'quantization_config' must be an object, got {qc!r}")
    fmt = qc.get("fmt", "e4m3")
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise UnsupportedError(f"config field 'quantization_config.fmt' = {fmt!r}: only e4m3 FP8 is "
                               "supported")
    blk = qc.get("weight_block_size", list(DEFAULT_BLOCK))
    if (not isinstance(blk, (list, tuple)) or len(blk) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in blk)):
        raise FormatError(f"config field 'quantization_config.weight_block_size' must be two positive "
                          f"integers, got {blk!r}")
    return int(blk[0]), int(blk[1])


def is_fp8_scale(meta: dict, name: str) -> bool:
    """``name`` is the ``_scale_inv`` of an FP8 tensor in ``meta`` (name -> (dtype, shape, offset))."""
    if not name.endswith(SCALE_SUFFIX):
        return False
    weight = meta.get(name[: -len(SCALE_SUFFIX)])
    return weight is not None and str(weight[0]).startswith("F8")


def read_fp8(tensors, name: str) -> np.ndarray:
    """FP8 tensor ``name`` of a safetensors reader (``meta``, ``where``, ``get``; engine/weights.py),
    dequantised with its ``_scale_inv`` in ``tensors.fp8_block`` blocks -> float32.

    Raises:
        UnsupportedError: an FP8 dtype other than F8_E4M3.
        FormatError: the scale tensor is missing or does not tile the weight.
    """
    dtype, shape, offset = tensors.meta[name]
    if dtype != "F8_E4M3":
        raise UnsupportedError(f"tensor {name} is {dtype}: only F8_E4M3 block-scaled FP8 is supported")
    scale_name = name + SCALE_SUFFIX
    if scale_name not in tensors.meta:
        raise FormatError(f"{tensors.where[name]}: FP8 tensor {name} has no {scale_name} (per-block scales); "
                          "only block-scaled FP8 checkpoints are supported")
    count = int(np.prod(shape, dtype=np.int64))
    bits = np.fromfile(tensors.where[name], dtype=np.uint8, count=count, offset=offset)
    if bits.size != count:
        raise FormatError(f"{tensors.where[name]}: tensor {name} is truncated")
    block = getattr(tensors, "fp8_block", DEFAULT_BLOCK)
    return dequant_blocks(bits.reshape(shape), tensors.get(scale_name), block, name)
