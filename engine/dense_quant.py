"""Quantized dense trunk of a pack: which tensors are quantized, how they are stored, how they run.

Storage (in the pack's ``dense.safetensors``; per-tensor formats in ``pack.json`` under
``format.dense_tensors``, a map name -> format for every tensor not stored as float32):

| format            | tensors stored                                                             |
|-------------------|----------------------------------------------------------------------------|
| f32               | ``name`` float32 [out, in] (as before; no entry in ``dense_tensors``)       |
| f16               | ``name`` float16 [out, in]                                                 |
| bf16              | ``name`` uint16 [out, in] (bf16 bits)                                      |
| int8/int4/int4-gG | ``name`` data (``colibri_plan.quant.data_shape``) + ``name.scales`` float32 |
| int4-gGh          | as int4-gG, ``name.scales`` float16                                       |

Quantized: the 2-D matrices of the trunk (GQA attention q/k/v/o, shared experts, dense FFN layers, the
LM head). Kept float32: the embedding (gathered by row), norms, biases, routers and the shared-expert
gate (small; routing must stay stable), and MLA projections (a later step).

At load, float formats are widened to float32 arrays; integer formats become :class:`QuantLinear`
objects holding their :class:`~colibri_plan.quant.QuantTensor`, which the trunk uploads to its device
as it is (its ``d_matmul`` runs the format's kernel).
"""

from __future__ import annotations

import re

import numpy as np

from colibri_plan.errors import FormatError
from colibri_plan.quant import FLOAT_FORMATS, QuantTensor, check_format, dequantize, quantize, scale_dtype

__all__ = ["DENSE_FORMATS", "QuantLinear", "decode_dense", "encode_dense",
           "is_quantizable", "SCALES_SUFFIX"]

#: formats ``model pack --dense-quant`` accepts
DENSE_FORMATS = ("f32", "f16", "bf16", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g32h")
#: suffix of the float32 scales tensor of a quantized dense tensor
SCALES_SUFFIX = ".scales"

_QUANTIZABLE = re.compile(r"^(lm_head|layers\.\d+\.(attn\.[qkvo]|(shared|ffn)\.(gate|up|down)))$")


def is_quantizable(name: str, arr: np.ndarray) -> bool:
    """True for the 2-D trunk matrices stored in the dense format (see the module docstring)."""
    return arr.ndim == 2 and bool(_QUANTIZABLE.match(name))


def encode_dense(dense: dict[str, np.ndarray], fmt: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Arrays to store for ``dense`` (name -> float32 array) with the trunk matrices in ``fmt``.

    Returns:
        (tensors name -> array to save, formats name -> format of every tensor not stored as f32).

    Raises:
        UnsupportedError: unknown format. FormatError: ``fmt`` is not a dense format (int2).
    """
    check_format(fmt)
    if fmt not in DENSE_FORMATS:
        raise FormatError(f"dense format {fmt!r} is not supported; use one of {', '.join(DENSE_FORMATS)}")
    tensors: dict[str, np.ndarray] = {}
    formats: dict[str, str] = {}
    for name, v in sorted(dense.items()):
        v = np.ascontiguousarray(v, dtype=np.float32)
        if fmt == "f32" or not is_quantizable(name, v):
            tensors[name] = v
            continue
        qt = quantize(v, fmt)
        formats[name] = fmt
        tensors[name] = np.ascontiguousarray(qt.data)
        if qt.scales is not None:
            tensors[name + SCALES_SUFFIX] = np.ascontiguousarray(qt.scales, dtype=scale_dtype(fmt))
    return tensors, formats


def decode_dense(raw: dict[str, np.ndarray], formats: dict[str, str], where: str) -> dict:
    """The engine's dense dict from the stored arrays: float32 arrays, and a :class:`QuantLinear` for
    each integer-format tensor.

    Args:
        raw: tensors as read from ``dense.safetensors``. formats: ``format.dense_tensors`` of the index.
        where: the pack, for messages.

    Raises:
        FormatError: a recorded tensor is missing, has no scales or the wrong shape/dtype.
    """
    out: dict = {}
    for name, arr in raw.items():
        if name.endswith(SCALES_SUFFIX) and name[: -len(SCALES_SUFFIX)] in formats:
            continue
        fmt = formats.get(name, "f32")
        if fmt == "f32":
            out[name] = np.ascontiguousarray(arr, dtype=np.float32)
            continue
        if fmt in FLOAT_FORMATS:
            want = np.float16 if fmt == "f16" else np.uint16
            if arr.dtype != want or arr.ndim != 2:
                raise FormatError(f"{where}: dense tensor {name} is {arr.dtype} {arr.shape}, the index "
                                  f"says {fmt}")
            qt = QuantTensor(fmt, arr.shape[0], arr.shape[1], arr, None)
            out[name] = dequantize(qt)
            continue
        scales = raw.get(name + SCALES_SUFFIX)
        if scales is None or arr.ndim != 2:
            raise FormatError(f"{where}: dense tensor {name} ({fmt}) lacks its {name + SCALES_SUFFIX} tensor")
        n_in = arr.shape[1] * (1 if fmt == "int8" else 2)  # int4 packs two columns a byte
        try:
            qt = QuantTensor(fmt, arr.shape[0], n_in, arr, scales)
        except FormatError as exc:
            raise FormatError(f"{where}: dense tensor {name}: {exc}") from None
        out[name] = QuantLinear(qt)
    missing = [n for n in formats if n not in out]
    if missing:
        raise FormatError(f"{where}: the index records dense tensor(s) {', '.join(missing[:3])} the dense "
                          "file lacks; re-create the pack")
    return out


class QuantLinear:
    """A quantized weight W [out, in] standing in for its float32 array in the loaded dense dict: the
    trunk uploads its QuantTensor as it is (``trunk.Trunk``); ``np.asarray(ql)`` dequantizes.
    ``__array_ufunc__ = None`` keeps numpy from silently running a float product on it.

    Attributes:
        qt: the QuantTensor. shape: (out, in). nbytes: stored bytes (data + scales).
    """

    __array_ufunc__ = None

    def __init__(self, qt: QuantTensor):
        self.qt = qt
        self.shape = (qt.out_features, qt.in_features)
        self.ndim, self.dtype = 2, np.dtype(np.float32)
        self.size = qt.out_features * qt.in_features
        self.nbytes = int(qt.data.nbytes + (0 if qt.scales is None else qt.scales.nbytes))

    def dequantize(self) -> np.ndarray:
        """W as float32 [out, in]."""
        return dequantize(self.qt)

    def __array__(self, dtype=None, copy=None):
        w = self.dequantize()
        return w if dtype is None else w.astype(dtype)
