"""The ``numpy`` backend: the reference every other backend is compared with, and the CPU fallback.

Weights stay quantized in host memory (upload keeps a reference to the QuantTensor's arrays, no copy):
each matmul dequantizes a block of rows at a time with :func:`colibri_plan.quant.dequantize` and
multiplies it with float32 BLAS, so the memory held is what the accounting says (the packed bytes) plus
one block of at most ``BLOCK_BYTES`` of float32 scratch. Device activations are host arrays
(:class:`~colibri_plan.backends.reference.HostArrays`); attention, GQA and MLA's alike, is the float64
reference.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

import numpy as np

from colibri_plan.backends.base import Backend, DeviceInfo, DeviceWeight
from colibri_plan.backends.reference import HostArrays
from colibri_plan.meminfo import host_memory
from colibri_plan.quant import FORMATS, QuantTensor, dequantize

#: float32 scratch per dequantized row block (small enough to stay in L2/L3 while BLAS reads it)
BLOCK_BYTES = 4 << 20


def cpu_name() -> str:
    """The CPU model name ("AMD EPYC ...") or the machine architecture when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def host_device(backend: str, formats: tuple[str, ...], driver: str) -> DeviceInfo:
    """The host CPU as a DeviceInfo: host RAM, ``unified_memory`` True (it computes on host memory)."""
    total, avail = host_memory()
    return DeviceInfo(backend=backend, index=0, name=f"{cpu_name()} ({os.cpu_count() or 1} cores)",
                      kind="cpu", total_memory_bytes=total, free_memory_bytes=avail,
                      unified_memory=True, formats=formats, driver=driver)


def row_block(qt: QuantTensor, r0: int, r1: int) -> QuantTensor:
    """Rows r0..r1 of a host QuantTensor as a QuantTensor (views, no copy)."""
    s = None if qt.scales is None else qt.scales[r0:r1]
    return QuantTensor(qt.fmt, r1 - r0, qt.in_features, qt.data[r0:r1], s)


def host_tensor(qt: QuantTensor) -> QuantTensor:
    """``qt`` as a weight in host memory: its arrays made C-contiguous (float32 scales), not copied."""
    data = np.ascontiguousarray(qt.data)
    scales = None if qt.scales is None else np.ascontiguousarray(qt.scales, dtype=np.float32)
    return QuantTensor(qt.fmt, qt.out_features, qt.in_features, data, scales)


def matmul_blocks(x: np.ndarray, qt: QuantTensor) -> np.ndarray:
    """y float32 [T, out] = x float32 [T, in] · Wᵀ: f32 straight through BLAS, other formats dequantized
    a block of at most ``BLOCK_BYTES`` of rows at a time."""
    if qt.fmt == "f32":
        return np.ascontiguousarray(x @ qt.data.T, dtype=np.float32)  # x [T, in] · Wᵀ -> [T, out]
    y = np.empty((x.shape[0], qt.out_features), np.float32)
    rows = max(1, BLOCK_BYTES // (4 * qt.in_features))
    for r0 in range(0, qt.out_features, rows):
        r1 = min(r0 + rows, qt.out_features)
        blk = dequantize(row_block(qt, r0, r1))  # [rows, in] float32 scratch
        y[:, r0:r1] = x @ blk.T
    return y


class NumpyBackend(Backend):
    """Reference backend: block-wise dequantize + float32 BLAS on the host.

    Args:
        device: the host DeviceInfo (from :meth:`list_devices`).
        capacity_bytes: optional cap on held weight bytes (for tests of the out-of-memory path);
            None means unbounded (host RAM).
    """

    name = "numpy"
    formats = FORMATS

    def __init__(self, device: DeviceInfo, capacity_bytes: int | None = None):
        self._capacity_bytes = capacity_bytes
        super().__init__(device)

    def _open(self) -> None:
        self.bind(HostArrays(self))

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None  # numpy is a hard dependency

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        return [host_device(cls.name, cls.formats, f"numpy {np.__version__}{_blas()}")]

    def capacity_bytes(self) -> int | None:
        return self._capacity_bytes

    def _upload(self, qt: QuantTensor) -> QuantTensor:
        return host_tensor(qt)

    def _matmul(self, x: np.ndarray, w: DeviceWeight) -> np.ndarray:
        return matmul_blocks(x, w.payload)


def _blas() -> str:
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]
        return f", {blas.get('name', '?')} {blas.get('version', '')}".rstrip()
    except Exception:  # noqa: BLE001 - informative only
        return ""


def package_version(pkg: str) -> str | None:
    """Installed version of ``pkg`` without importing it, or None."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


BACKEND = NumpyBackend
