"""Metal backend (PyObjC): Apple GPUs, shared-storage buffers on unified memory.

UNVERIFIED: no macOS machine was available to us, so this file and ``shaders/metal/matmul.metal`` have
never been compiled or run; they follow the same contract, layout
(:func:`colibri_plan.backends.base.padded_layout`) and kernel structure as the OpenCL backend, which is
tested. Off macOS, :meth:`MetalBackend.unavailable_reason` says so and every test skips with that reason.

The ``.metal`` source is compiled at run time (``newLibraryWithSource``). Weights live in
``MTLResourceStorageModeShared`` buffers: on Apple silicon the GPU reads them from the memory the CPU
wrote, with no transfer. One command buffer per op; an expert batch is one command buffer with two
dispatches per expert (gate/up fused with SiLU·up, then down), which run in order in a serial encoder.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import platform
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_plan.backends.base import Backend, DeviceInfo, ExpertWeights, padded_layout
from colibri_plan.errors import BackendUnavailableError, DeviceOutOfMemoryError
from colibri_plan.quant import FORMATS, QuantTensor, group_size

_FMT_ID = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3, "int4": 4, "int2": 5}
_NEEDS = "Metal needs macOS with PyObjC (pyobjc-framework-Metal)"
_SIMDGROUPS = 4  # rows (simdgroups of 32) per threadgroup


def _devices() -> list:
    import Metal

    devs = list(Metal.MTLCopyAllDevices() or [])
    if not devs:
        d = Metal.MTLCreateSystemDefaultDevice()
        devs = [d] if d is not None else []
    return devs


@dataclass
class _MetalWeight:
    data: Any  # MTLBuffer uint8 [out, row_bytes]
    scales: Any  # MTLBuffer float32
    in_pad: int


class MetalBackend(Backend):
    """Quantized matmul, fused expert FFN and rmsnorm through Metal (unverified; see the module docstring)."""

    name = "metal"
    formats = FORMATS

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if sys.platform != "darwin" or importlib.util.find_spec("Metal") is None:
            return _NEEDS
        try:
            if not _devices():
                return "no Metal device found"
        except Exception as exc:  # noqa: BLE001 - a broken PyObjC install raises many kinds
            return f"{_NEEDS}: {exc}"
        return None

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        try:
            if cls.unavailable_reason() is not None:
                return []
            out = []
            for i, d in enumerate(_devices()):
                unified = bool(d.hasUnifiedMemory())
                total = int(d.recommendedMaxWorkingSetSize())
                out.append(DeviceInfo(
                    backend=cls.name, index=i, name=str(d.name()), kind="igpu" if unified else "gpu",
                    total_memory_bytes=total, free_memory_bytes=max(0, total - int(d.currentAllocatedSize())),
                    unified_memory=unified, formats=cls.formats, driver=f"macOS {platform.mac_ver()[0]}"))
            return out
        except Exception:  # noqa: BLE001 - discovery never raises
            return []

    # ---- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> None:
        import Metal

        self.mtl = Metal
        self.dev = _devices()[self.device.index]
        self.queue = self.dev.newCommandQueue()
        src = importlib.resources.files("colibri_plan.shaders").joinpath("metal", "matmul.metal").read_text()
        self.lib, err = self.dev.newLibraryWithSource_options_error_(src, None, None)
        if self.lib is None:
            raise BackendUnavailableError(f"metal: the kernels do not compile: {err}")
        self._pipes: dict[str, Any] = {}
        self._shared = Metal.MTLResourceStorageModeShared

    def _close(self) -> None:
        self._pipes.clear()

    def capacity_bytes(self) -> int | None:
        return int(self.dev.recommendedMaxWorkingSetSize())

    def _pipe(self, name: str):
        if name not in self._pipes:
            fn = self.lib.newFunctionWithName_(name)
            pso, err = self.dev.newComputePipelineStateWithFunction_error_(fn, None)
            if pso is None:
                raise BackendUnavailableError(f"metal: cannot build pipeline {name}: {err}")
            self._pipes[name] = pso
        return self._pipes[name]

    # ---- memory ----------------------------------------------------------------------------------
    def _buffer(self, host: np.ndarray | None, nbytes: int):
        n = max(16, int(nbytes))
        if host is None:
            return self.dev.newBufferWithLength_options_(n, self._shared)
        raw = np.ascontiguousarray(host).tobytes()
        raw += bytes(n - len(raw))  # Metal copies `n` bytes: never let it read past the host data
        return self.dev.newBufferWithBytes_length_options_(raw, n, self._shared)

    def _upload(self, qt: QuantTensor) -> _MetalWeight:
        data, scales, in_pad = padded_layout(qt)
        bufs = [self._buffer(a, a.nbytes) for a in (data, scales)]
        if any(b is None for b in bufs):  # Metal answers nil when it cannot allocate
            raise DeviceOutOfMemoryError(
                f"metal device {self.device.name!r} could not allocate {qt.nbytes} B "
                f"({self.held_bytes} B held)", requested_bytes=qt.nbytes, held_bytes=self.held_bytes,
                capacity_bytes=self.capacity_bytes())
        return _MetalWeight(bufs[0], bufs[1], in_pad)

    def _free(self, w) -> None:
        w.payload.data = w.payload.scales = None  # released with the last reference

    def _work(self, nbytes: int):
        buf = self._buffer(None, nbytes)
        if buf is None:
            raise DeviceOutOfMemoryError(f"metal: no memory for {nbytes} B of work buffers",
                                         requested_bytes=nbytes, held_bytes=self.held_bytes)
        return buf

    @staticmethod
    def _view(buf, nbytes: int) -> np.ndarray:
        """float32 view of a shared buffer's memory (zero copy)."""
        return np.frombuffer(buf.contents().as_buffer(nbytes), np.float32)

    # ---- ops -------------------------------------------------------------------------------------
    def _params(self, fmt: str, in_pad: int, rows: int, T: int, stride: int, x_off: int, y_off: int) -> bytes:
        g = group_size(fmt) or 8
        return struct.pack("<8I", in_pad, rows, T, stride, x_off, y_off, in_pad // g, g // 8)

    def _dispatch(self, enc, name: str, buffers, params: bytes, rows_grid: int) -> None:
        enc.setComputePipelineState_(self._pipe(name))
        for i, (buf, off) in enumerate(buffers):
            enc.setBuffer_offset_atIndex_(buf, off, i)
        enc.setBytes_length_atIndex_(params, len(params), len(buffers))
        groups = -(-rows_grid // _SIMDGROUPS)
        enc.dispatchThreadgroups_threadsPerThreadgroup_(self.mtl.MTLSizeMake(groups, 1, 1),
                                                        self.mtl.MTLSizeMake(32 * _SIMDGROUPS, 1, 1))

    def _commit(self, cb) -> None:
        cb.commit()
        cb.waitUntilCompleted()
        if cb.error() is not None:
            raise BackendUnavailableError(f"metal: command buffer failed: {cb.error()}")

    def _stage_x(self, xs, in_pad: int):
        """One shared buffer holding every x_i zero-padded to [T_i, in_pad]; returns it and offsets."""
        rows = sum(x.shape[0] for x in xs)
        buf = self._work(rows * in_pad * 4)
        view = self._view(buf, rows * in_pad * 4).reshape(rows, in_pad)
        view[:] = 0.0
        offs, t = [], 0
        for x in xs:
            view[t:t + x.shape[0], : x.shape[1]] = x
            offs.append(t * in_pad)
            t += x.shape[0]
        return buf, offs

    def _matmul(self, x: np.ndarray, w) -> np.ndarray:
        p, T, out = w.payload, x.shape[0], w.out_features
        xb, _ = self._stage_x([x], p.in_pad)
        yb = self._work(T * out * 4)
        cb = self.queue.commandBuffer()
        enc = cb.computeCommandEncoder()
        # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
        self._dispatch(enc, f"mm_{self._fid(w.fmt)}", [(p.data, 0), (p.scales, 0), (xb, 0), (yb, 0)],
                       self._params(w.fmt, p.in_pad, out, T, out, 0, 0), out)
        enc.endEncoding()
        self._commit(cb)
        return self._view(yb, T * out * 4).reshape(T, out).copy()

    def _expert_ffn(self, xs, experts: list[ExpertWeights]) -> list[np.ndarray]:
        if any(e.gate.fmt != e.up.fmt for e in experts) or len({e.gate.payload.in_pad for e in experts}) > 1:
            return super()._expert_ffn(xs, experts)
        xb, xoffs = self._stage_x(xs, experts[0].gate.payload.in_pad)
        h_rows = [e.down.payload.in_pad for e in experts]  # h_i [T_i, I_pad], zero-padded by gate_up
        h_offs = np.cumsum([0] + [x.shape[0] * r for x, r in zip(xs, h_rows)])
        y_offs = np.cumsum([0] + [x.shape[0] * e.down.out_features for x, e in zip(xs, experts)])
        hb, yb = self._work(int(h_offs[-1]) * 4), self._work(int(y_offs[-1]) * 4)
        cb = self.queue.commandBuffer()
        enc = cb.computeCommandEncoder()  # serial: each dispatch sees the previous one's writes
        for i, (x, e) in enumerate(zip(xs, experts)):
            T, g, u, d = x.shape[0], e.gate.payload, e.up.payload, e.down.payload
            self._dispatch(enc, f"gate_up_{self._fid(e.gate.fmt)}",
                           [(g.data, 0), (g.scales, 0), (u.data, 0), (u.scales, 0), (xb, 0), (hb, 0)],
                           self._params(e.gate.fmt, g.in_pad, e.gate.out_features, T, h_rows[i], xoffs[i],
                                        int(h_offs[i])), h_rows[i])
            H = e.down.out_features
            self._dispatch(enc, f"mm_{self._fid(e.down.fmt)}", [(d.data, 0), (d.scales, 0), (hb, 0), (yb, 0)],
                           self._params(e.down.fmt, d.in_pad, H, T, H, int(h_offs[i]), int(y_offs[i])), H)
        enc.endEncoding()
        self._commit(cb)
        y = self._view(yb, int(y_offs[-1]) * 4)
        return [y[y_offs[i]:y_offs[i + 1]].reshape(x.shape[0], -1).copy() for i, x in enumerate(xs)]

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        T, H = x.shape
        xb, wb, yb = self._buffer(x, x.nbytes), self._buffer(weight, weight.nbytes), self._work(x.nbytes)
        cb = self.queue.commandBuffer()
        enc = cb.computeCommandEncoder()
        enc.setComputePipelineState_(self._pipe("rmsnorm"))
        for i, b in enumerate((xb, wb, yb)):
            enc.setBuffer_offset_atIndex_(b, 0, i)
        enc.setBytes_length_atIndex_(struct.pack("<I", H), 4, 3)
        enc.setBytes_length_atIndex_(struct.pack("<f", eps), 4, 4)
        enc.dispatchThreadgroups_threadsPerThreadgroup_(self.mtl.MTLSizeMake(T, 1, 1),
                                                        self.mtl.MTLSizeMake(256, 1, 1))
        enc.endEncoding()
        self._commit(cb)
        return self._view(yb, x.nbytes).reshape(T, H).copy()

    @staticmethod
    def _fid(fmt: str) -> int:
        return 6 if group_size(fmt) else _FMT_ID[fmt]


BACKEND = MetalBackend
