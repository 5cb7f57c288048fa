"""Metal backend (PyObjC): Apple GPUs, shared-storage buffers on unified memory.

UNVERIFIED: no macOS machine was available to us, so this file and ``shaders/metal/*.metal`` have never
been compiled or run; they follow the same contract, layout
(:func:`colibri_plan.backends.staging.padded_layout`) and kernel structure as the OpenCL backend, which is
tested. Off macOS, :meth:`MetalBackend.unavailable_reason` says so and every test skips with that reason.

The ``.metal`` source is compiled at run time (``newLibraryWithSource``). Weights live in
``MTLResourceStorageModeShared`` buffers: on Apple silicon the GPU reads them from the memory the CPU
wrote, with no transfer. One command buffer per op; an expert batch is one command buffer with two
dispatches per expert (gate/up fused with SiLU·up, then down), which run in order in a serial encoder.
Device activations are host arrays in shared memory (``reference.HostArrays``, whose ``d_matmul`` runs this
backend's matmul); ``d_head_matmul`` is a kernel of ``shaders/metal/trunk.metal``.
"""

from __future__ import annotations

import contextlib
import platform
import struct
import sys
from typing import Any

import numpy as np

from colibri_plan.backends import programs, staging
from colibri_plan.backends.base import Backend, DeviceInfo
from colibri_plan.backends.batched import BatchedExperts
from colibri_plan.backends.reference import HostArrays
from colibri_plan.backends.staging import PaddedWeight
from colibri_plan.errors import BackendUnavailableError
from colibri_plan.quant import QuantTensor, group_size

_NEEDS = "Metal needs macOS with PyObjC (pyobjc-framework-Metal)"
_SIMDGROUPS = 4  # rows (simdgroups of 32) per threadgroup


def _mtl_devices() -> list:
    import Metal

    devs = list(Metal.MTLCopyAllDevices() or [])
    if not devs:
        d = Metal.MTLCreateSystemDefaultDevice()
        devs = [d] if d is not None else []
    return devs


class MetalBackend(Backend):
    """Quantized matmul, fused expert FFN, rmsnorm and the device-activation ops through Metal
    (unverified; see the module docstring)."""

    name = "metal"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if sys.platform != "darwin":
            return _NEEDS
        return programs.import_problem("Metal", _NEEDS, lambda _: None if _mtl_devices() else
                                 "no Metal device found", _NEEDS + ": {exc}")

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        out = []
        for i, d in enumerate(_mtl_devices()):
            total, kind = int(d.recommendedMaxWorkingSetSize()), "igpu" if d.hasUnifiedMemory() else "gpu"
            free = max(0, total - int(d.currentAllocatedSize()))
            out.append(cls.device_info(i, str(d.name()), kind, total, free, f"macOS {platform.mac_ver()[0]}"))
        return out

    # ---- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> None:
        import Metal

        self.mtl = Metal
        self.dev = _mtl_devices()[self.device.index]
        self.queue = self.dev.newCommandQueue()
        src = "".join(programs.kernel_source("metal", f) for f in ("matmul.metal", "trunk.metal"))
        self.lib, err = self.dev.newLibraryWithSource_options_error_(src, None, None)
        if self.lib is None:
            raise BackendUnavailableError(f"metal: the kernels do not compile: {err}")
        self._pipes: dict[str, Any] = {}
        self._shared = Metal.MTLResourceStorageModeShared
        self.bind(BatchedExperts(self, self._ffn_batch))
        self.bind(HostArrays(self), [h for h in HostArrays.HOOKS if h != "_d_head_matmul"])

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

    def _upload(self, qt: QuantTensor) -> PaddedWeight:
        data, scales, in_pad = staging.padded_layout(qt)
        bufs = [self._buffer(a, a.nbytes) for a in (data, scales)]
        if any(b is None for b in bufs):  # Metal answers nil when it cannot allocate
            raise self._oom(f"could not allocate {qt.nbytes} B", qt.nbytes)
        return PaddedWeight(bufs[0], bufs[1], in_pad)

    def _free(self, w) -> None:
        w.payload.data = w.payload.scales = None  # released with the last reference

    def _work(self, nbytes: int):
        buf = self._buffer(None, nbytes)
        if buf is None:
            raise self._oom(f"no memory for {nbytes} B of work buffers", nbytes)
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

    @contextlib.contextmanager
    def _encoder(self):
        """A compute encoder of a new command buffer, ended, committed and waited for on leaving."""
        cb = self.queue.commandBuffer()
        enc = cb.computeCommandEncoder()
        yield enc
        enc.endEncoding()
        self._commit(cb)

    def _commit(self, cb) -> None:
        cb.commit()
        cb.waitUntilCompleted()
        if cb.error() is not None:
            raise BackendUnavailableError(f"metal: command buffer failed: {cb.error()}")

    def _stage_x(self, xs, in_pad: int):
        """One shared buffer holding every x_i, stacked and zero-padded to [Σ T_i, in_pad] (zero copy)."""
        rows = sum(x.shape[0] for x in xs)
        buf = self._work(rows * in_pad * 4)
        staging.stage_rows(xs, in_pad, self._view(buf, rows * in_pad * 4).reshape(rows, in_pad))
        return buf

    def _matmul(self, x: np.ndarray, w) -> np.ndarray:
        p, T, out = w.payload, x.shape[0], w.out_features
        xb = self._stage_x([x], p.in_pad)
        yb = self._work(T * out * 4)
        with self._encoder() as enc:
            # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
            bufs = [(p.data, 0), (p.scales, 0), (xb, 0), (yb, 0)]
            self._dispatch(enc, f"mm_{programs.kernel_format(w.fmt)}", bufs,
                           self._params(w.fmt, p.in_pad, out, T, out, 0, 0), out)
        return self._view(yb, T * out * 4).reshape(T, out).copy()

    def _ffn_batch(self, xs, experts, b) -> np.ndarray:
        xb = self._stage_x(xs, b.Hp)
        hb = self._work(b.tok[-1] * b.Ip * 4)  # h_i [T_i, I_pad], zero-padded by gate_up
        yb = self._work(b.tok[-1] * b.H * 4)
        with self._encoder() as enc:  # serial: each dispatch sees the previous one's writes
            for e, T, t0 in zip(experts, b.counts, b.tok):
                g, u, d = e.gate.payload, e.up.payload, e.down.payload
                self._dispatch(enc, f"gate_up_{programs.kernel_format(e.gate.fmt)}",
                               [(g.data, 0), (g.scales, 0), (u.data, 0), (u.scales, 0), (xb, 0), (hb, 0)],
                               self._params(e.gate.fmt, b.Hp, b.I, T, b.Ip, t0 * b.Hp, t0 * b.Ip), b.Ip)
                self._dispatch(enc, f"mm_{programs.kernel_format(e.down.fmt)}",
                               [(d.data, 0), (d.scales, 0), (hb, 0), (yb, 0)],
                               self._params(e.down.fmt, b.Ip, b.H, T, b.H, t0 * b.Ip, t0 * b.H), b.H)
        return self._view(yb, b.tok[-1] * b.H * 4).reshape(b.tok[-1], b.H).copy()

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        T, H = x.shape
        xb, wb, yb = self._buffer(x, x.nbytes), self._buffer(weight, weight.nbytes), self._work(x.nbytes)
        with self._encoder() as enc:
            enc.setComputePipelineState_(self._pipe("rmsnorm"))
            for i, b in enumerate((xb, wb, yb)):
                enc.setBuffer_offset_atIndex_(b, 0, i)
            enc.setBytes_length_atIndex_(struct.pack("<I", H), 4, 3)
            enc.setBytes_length_atIndex_(struct.pack("<f", eps), 4, 4)
            enc.dispatchThreadgroups_threadsPerThreadgroup_(self.mtl.MTLSizeMake(T, 1, 1),
                                                            self.mtl.MTLSizeMake(256, 1, 1))
        return self._view(yb, x.nbytes).reshape(T, H).copy()

    def _d_head_matmul(self, x, w) -> np.ndarray:
        # device arrays here are the reference hooks' host arrays (shared memory): staged per call
        (T, B, K), N = x.shape, w.shape[1]
        if not (T and B and N):
            return np.zeros((T, B, N), np.float32)
        xb, wb = self._buffer(HostArrays._host(x), x.nbytes), self._buffer(HostArrays._host(w), w.nbytes)
        yb = self._work(4 * T * B * N)
        with self._encoder() as enc:
            enc.setComputePipelineState_(self._pipe("head_matmul"))
            for i, b in enumerate((xb, wb, yb)):
                enc.setBuffer_offset_atIndex_(b, 0, i)
            enc.setBytes_length_atIndex_(struct.pack("<4I", T, B, N, K), 16, 3)
            enc.dispatchThreadgroups_threadsPerThreadgroup_(self.mtl.MTLSizeMake(-(-N // 64), B, T),
                                                            self.mtl.MTLSizeMake(64, 1, 1))  # one per output
        return self._view(yb, 4 * T * B * N).reshape(T, B, N).copy()


BACKEND = MetalBackend
