"""The ``cpu`` backend: the engine's fast host path, numba kernels on all cores.

Quantized formats (int8, int4, int4-gG, int2) run the numba kernels of
:mod:`colibri_plan.backends.cpu_kernels`: a parallel loop over output rows, the packed bytes unpacked in
the inner loop (never dequantized to memory), so a GEMV reads each weight byte once from RAM.
``attention_absorb`` (MLA decode) runs one head per core step. Float formats (f32/f16/bf16, the dense
trunk) use the numpy reference path (float32 BLAS, f16/bf16
converted a block of rows at a time). Weights stay in host memory, referenced, not copied.

Why numba (figures in ``docs/backends.md``): on a 2-core AVX-512 host the int4 GEMV at GLM-5.2 expert
shapes reads weights at about half the RAM read bandwidth, several times the numpy blocked path and
the OpenCL (PoCL) kernels on the same CPU.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from colibri_plan.backends.base import DeviceInfo, DeviceWeight, ExpertWeights
from colibri_plan.backends.numpy_ref import NumpyBackend, host_device, package_version
from colibri_plan.errors import BackendUnavailableError
from colibri_plan.quant import FORMATS, GROUP_FORMATS, QuantTensor, group_size

#: formats the numba kernels handle; the rest go through the numpy path
INT4_FORMATS = ("int4",) + GROUP_FORMATS

# numba's "workqueue" threading layer (used when OpenMP and TBB are missing) must not be entered from
# two threads at once; one lock per process costs ~100 ns per call, and two concurrent GEMVs on the
# same cores would not be faster
_KERNEL_LOCK = threading.Lock()
_kernels = None


def _load_kernels():
    """Import (and on first use, compile or load from cache) the numba kernels."""
    global _kernels
    if _kernels is None:
        from colibri_plan.backends import cpu_kernels  # heavy: imports numba/llvmlite

        _kernels = cpu_kernels
    return _kernels


class _Parallel:
    """Holds the kernel lock and sets numba's parallel chunk size for one call (restored after)."""

    def __init__(self, numba, chunk: int):
        self.numba, self.chunk, self.old = numba, chunk, 0

    def __enter__(self):
        _KERNEL_LOCK.acquire()
        try:
            self.old = self.numba.set_parallel_chunksize(self.chunk)
        except BaseException:
            _KERNEL_LOCK.release()
            raise

    def __exit__(self, *exc):
        self.numba.set_parallel_chunksize(self.old)
        _KERNEL_LOCK.release()


class HostWeight(NamedTuple):
    """Payload of an uploaded weight: the packed QuantTensor plus the views the int4 kernels take."""

    qt: QuantTensor
    data3: np.ndarray | None = None  # int4 family: uint8 [out, blocks, block bytes] (see q4_matmul)
    scales2: np.ndarray | None = None  # int4 family: float32 [out, groups] (1 group for per-row int4)
    group: int = 0  # int4 family: columns per scale group (per-row int4: the padded row width)
    pairs: bool = False  # int4-g32: two groups per 32-byte block


def int4_layout(qt: QuantTensor) -> HostWeight:
    """The blocked views of an int4 / int4-gG weight for ``q4_matmul`` (no copy unless a row does not
    end on a whole block: then data is padded with the zero code and scales with 0.0)."""
    out, nb = qt.data.shape
    g = group_size(qt.fmt)
    if g is None:  # per-row: one block per row
        return HostWeight(qt, qt.data.reshape(out, 1, nb), qt.scales.reshape(out, 1), 2 * nb)
    pairs = g == 32  # a 16-byte loop stays scalar in LLVM; two groups per block vectorise
    groups = qt.scales.shape[1] + (qt.scales.shape[1] % 2 if pairs else 0)
    data, scales = qt.data, qt.scales
    if groups * g // 2 != nb or groups != scales.shape[1]:
        data = np.full((out, groups * g // 2), 0x88, np.uint8)
        data[:, :nb] = qt.data
        scales = np.zeros((out, groups), np.float32)
        scales[:, : qt.scales.shape[1]] = qt.scales
    bb = 32 if pairs else g // 2
    return HostWeight(qt, data.reshape(out, -1, bb), scales, g, pairs)


def int4_activations(x: np.ndarray, nbytes: int, group: int):
    """Activations prepared for the int4 kernels (see ``cpu_kernels``).

    Args:
        x: float32 [T, in] with in <= 2·nbytes.
        nbytes: packed bytes per weight row.
        group: columns per scale group (even; 2·nbytes for per-row int4).

    Returns:
        (xe, xd, xsum): xe = x[:, 0::2], xd = x[:, 1::2] − 16·x[:, 0::2], both float32 [T, nbytes];
        xsum float32 [T, groups] = Σ x per group. Padding columns are zero.
    """
    T, n = x.shape
    groups = -(-2 * nbytes // group)
    xp = np.zeros((T, groups * group), np.float32)
    xp[:, :n] = x
    xe = np.ascontiguousarray(xp[:, 0:2 * nbytes:2])  # [T, nb]
    xd = np.ascontiguousarray(xp[:, 1:2 * nbytes:2] - np.float32(16.0) * xe)  # [T, nb]
    xsum = xp.reshape(T, groups, group).sum(axis=2, dtype=np.float64).astype(np.float32)  # [T, groups]
    return xe, xd, xsum


def int2_activations(x: np.ndarray, nbytes: int):
    """(x0, d1, d2, d3, xsum) for ``q2_matmul``: planes float32 [T, nbytes] and xsum float32 [T]."""
    T, n = x.shape
    xp = np.zeros((T, 4 * nbytes), np.float32)
    xp[:, :n] = x
    p = [xp[:, i::4] for i in range(4)]
    planes = [p[0]] + [p[i] - np.float32(4.0) * p[i - 1] for i in (1, 2, 3)]
    xsum = x.sum(axis=1, dtype=np.float64).astype(np.float32)
    return (*[np.ascontiguousarray(a) for a in planes], xsum)


class CpuBackend(NumpyBackend):
    """numba kernels on every core of the host (see the module docstring).

    Args:
        device: the host DeviceInfo.
        capacity_bytes: optional cap on held weight bytes (tests); None = unbounded.
    """

    name = "cpu"
    formats = FORMATS

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            if importlib.util.find_spec("numba") is None:
                return "numba is not installed (pip install numba)"
        except (ImportError, ValueError) as exc:
            return f"numba cannot be found: {exc}"
        return None

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        if cls.unavailable_reason() is not None:
            return []
        try:
            threads = os.environ.get("NUMBA_NUM_THREADS") or str(os.cpu_count() or 1)
            driver = (f"numba {package_version('numba')}, llvmlite {package_version('llvmlite')}, "
                      f"{threads} threads")
            return [host_device(cls.name, cls.formats, driver)]
        except Exception:  # noqa: BLE001 - discovery never raises
            return []

    def _open(self) -> None:
        try:
            self._k = _load_kernels()
            import numba

            self._numba = numba
        except Exception as exc:  # a broken numba/llvmlite install: say why, do not crash later
            raise BackendUnavailableError(f"cpu backend unavailable: numba failed to import: {exc}") from exc

    def _upload(self, qt: QuantTensor) -> HostWeight:
        qt = super()._upload(qt)
        return int4_layout(qt) if qt.fmt in INT4_FORMATS else HostWeight(qt)

    def _matmul(self, x: np.ndarray, w: DeviceWeight) -> np.ndarray:
        hw: HostWeight = w.payload
        qt = hw.qt
        if qt.fmt not in INT4_FORMATS + ("int8", "int2"):
            return NumpyBackend._matmul(self, x, DeviceWeight(qt.fmt, qt.out_features, qt.in_features,
                                                              qt.nbytes, qt))
        y = np.empty((x.shape[0], qt.out_features), np.float32)  # [T, out]
        if qt.fmt in INT4_FORMATS:
            xe, xd, xsum = self._int4_x(x, hw)
            with self._parallel(self._tiles(qt.out_features)):
                self._k.q4_matmul(hw.data3, hw.scales2, xe, xd, xsum, hw.pairs, y)
        elif qt.fmt == "int2":
            x0, d1, d2, d3, xsum = int2_activations(x, qt.data.shape[1])
            with self._parallel(qt.out_features):
                self._k.q2_matmul(qt.data, qt.scales, x0, d1, d2, d3, xsum, y)
        else:
            with self._parallel(qt.out_features):
                self._k.q8_matmul(qt.data, qt.scales, x, y)
        return y

    @staticmethod
    def _int4_x(x: np.ndarray, hw: HostWeight):
        # activations in the weight's block shape: xe, xd [T, blocks, bb]; xsum [T, groups]
        _, blocks, bb = hw.data3.shape
        xe, xd, xsum = int4_activations(x, blocks * bb, hw.group)
        T = x.shape[0]
        return xe.reshape(T, blocks, bb), xd.reshape(T, blocks, bb), xsum

    def _parallel(self, iterations: int):
        """Context for a kernel call: the process lock and dynamic scheduling of the kernel's prange
        steps in chunks of ~1/64 of the matrix (one 32-row tile for a 2048-row int4 weight): a core
        that is descheduled on a shared machine then stalls one chunk, not half the rows (measured 34
        vs 29 GB/s with static halves on an idle 2-core host)."""
        return _Parallel(self._numba, max(1, iterations // 64))

    def _tiles(self, rows: int) -> int:
        return -(-rows // self._k.ROW_TILE)

    def _attention_absorb(self, q_abs, q_rope, latent, k_rope, scale) -> np.ndarray:
        out = np.empty_like(q_abs)  # [H, R], one head per parallel step
        with self._parallel(64):
            self._k.attention_absorb(q_abs, q_rope, latent, k_rope, np.float32(scale), out)
        return out

    def _expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        out = []
        for x, e in zip(xs, experts):
            g: HostWeight = e.gate.payload
            u: HostWeight = e.up.payload
            if g.qt.fmt not in INT4_FORMATS or u.qt.fmt != g.qt.fmt:
                out.extend(super()._expert_ffn([x], [e]))
                continue
            h = np.empty((x.shape[0], g.qt.out_features), np.float32)  # [T, I]
            xe, xd, xsum = self._int4_x(x, g)
            with self._parallel(self._tiles(g.qt.out_features)):  # gate+up in one pass, SiLU·mul fused
                self._k.q4_gate_up(g.data3, g.scales2, u.data3, u.scales2, xe, xd, xsum, g.pairs, h)
            out.append(self._matmul(h, e.down))  # [T, I] -> [T, H]
        return out


BACKEND = CpuBackend
