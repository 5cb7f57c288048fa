"""CUDA backend (CuPy): kernels from ``shaders/cuda/matmul.cu`` compiled by NVRTC (``cupy.RawModule``).

Weights use the padded layout of :func:`colibri_plan.backends.base.padded_layout`, one plain
``cudaMalloc`` per tensor (data, then float32 scales at a 256-byte aligned offset), filled through a
pinned host staging buffer. Each op makes one host-to-device copy (a pointer table plus the zero-padded
activations), its launches, and one device-to-host copy: :meth:`CUDABackend.expert_ffn` runs the whole
batch of experts in two launches (gate/up fused with SiLU·up, then down), whatever the batch size.
``last_device_seconds`` holds the GPU time of the last op's kernels (CUDA events), for benchmarks.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
from colibri_plan.backends.base import Backend, DeviceInfo, ExpertWeights, padded_layout

from colibri_plan.errors import DeviceOutOfMemoryError, UnsupportedError
from colibri_plan.quant import FORMATS, QuantTensor, group_size

_FMT_ID = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3, "int4": 4, "int2": 5}
_GSHIFT = {32: 0, 64: 1, 128: 2}  # log2(G / 32): 16-byte words of int4 per group
_WARPS = 8  # warps per block
_R_MM, _R_GU = 4, 2  # rows per warp: 4 (matmul) or 2 x 2 matrices (gate/up) 16-byte loads in flight
_RESERVE_BYTES = 512 << 20  # left free at open for the module, work buffers and CuPy itself
_STAGE_BYTES = 64 << 20  # pinned staging chunk for uploads


def _fmt_id(fmt: str) -> int:
    return 6 if group_size(fmt) else _FMT_ID[fmt]


@dataclass
class _CudaWeight:
    mem: Any  # cupy.cuda.memory.Memory holding data then scales
    data_ptr: int
    scales_ptr: int
    in_pad: int


class CUDABackend(Backend):
    """Quantized matmul, batched fused expert FFN and rmsnorm on NVIDIA GPUs (see the module docstring)."""

    name = "cuda"
    formats = FORMATS

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("cupy") is None:
            return "CuPy is not installed (pip install 'colibri-plan[cuda]')"
        try:
            import cupy

            if not cupy.cuda.is_available():
                return "CuPy finds no usable CUDA device (no NVIDIA GPU or driver here)"
        except Exception as exc:  # noqa: BLE001 - a broken CUDA install raises many kinds
            return f"CuPy cannot initialise CUDA: {exc}"
        return None

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        try:
            if cls.unavailable_reason() is not None:
                return []
            import cupy

            rt = cupy.cuda.runtime
            drv, run = rt.driverGetVersion(), rt.runtimeGetVersion()
            out = []
            for i in range(rt.getDeviceCount()):
                p = rt.getDeviceProperties(i)
                with cupy.cuda.Device(i):
                    free, total = rt.memGetInfo()
                name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
                integrated = bool(p.get("integrated", 0))  # Jetson/GH200-style: shares host memory
                out.append(DeviceInfo(
                    backend=cls.name, index=i, name=name, kind="igpu" if integrated else "gpu",
                    total_memory_bytes=int(total), free_memory_bytes=int(free), unified_memory=integrated,
                    formats=cls.formats,
                    driver=f"CUDA driver {drv // 1000}.{drv % 1000 // 10}, runtime {run // 1000}."
                           f"{run % 1000 // 10}, sm_{p['major']}{p['minor']}"))
            return out
        except Exception:  # noqa: BLE001 - discovery never raises
            return []

    # ---- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> None:
        import cupy

        self.cp, self.rt = cupy, cupy.cuda.runtime
        self.dev = cupy.cuda.Device(self.device.index)
        src = importlib.resources.files("colibri_plan.shaders").joinpath("cuda", "matmul.cu").read_text()
        names = [f"mm<{f},{_R_MM}>" for f in range(7)] + [f"gate_up<{f},{_R_GU}>" for f in range(7)]
        with self.dev:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.module = cupy.RawModule(code=src, options=("--std=c++14",), name_expressions=names)
            self._events = (cupy.cuda.Event(), cupy.cuda.Event())
            free, _ = self.rt.memGetInfo()
            self._sms = int(self.dev.attributes["MultiProcessorCount"])
        self._capacity = max(0, int(free) - _RESERVE_BYTES)
        self._fns: dict[str, Any] = {}
        self._occupancy: dict[tuple, int] = {}
        self._work: dict[str, Any] = {}  # name -> Memory (device, grow-only)
        self._pinned: dict[str, np.ndarray] = {}  # name -> uint8 view of pinned host memory
        self.last_device_seconds: float | None = None

    def _close(self) -> None:
        with self.dev:
            self.stream.synchronize()
        self._work.clear()
        self._pinned.clear()
        self._fns.clear()

    def _synchronize(self) -> None:
        with self.dev:
            self.stream.synchronize()

    def capacity_bytes(self) -> int | None:
        """Free device memory when opened, less a reserve for kernels and work buffers."""
        return self._capacity

    # ---- memory ----------------------------------------------------------------------------------
    def _oom(self, nbytes: int, exc: Exception) -> DeviceOutOfMemoryError:
        return DeviceOutOfMemoryError(
            f"cuda device {self.device.name!r} ran out of memory allocating {nbytes} B "
            f"({self.held_bytes} B of weights held): {exc}",
            requested_bytes=nbytes, held_bytes=self.held_bytes, capacity_bytes=self._capacity)

    def _malloc(self, nbytes: int):
        cp = self.cp
        try:
            with self.dev:
                return cp.cuda.memory.Memory(max(1, int(nbytes)))  # plain cudaMalloc, freed on release
        except cp.cuda.memory.OutOfMemoryError as exc:
            raise self._oom(nbytes, exc) from exc
        except cp.cuda.runtime.CUDARuntimeError as exc:
            if getattr(exc, "status", None) != getattr(self.rt, "errorMemoryAllocation", 2):
                raise
            raise self._oom(nbytes, exc) from exc

    def _pinned_view(self, name: str, nbytes: int) -> np.ndarray:
        buf = self._pinned.get(name)
        if buf is None or buf.nbytes < nbytes:
            mem = self.cp.cuda.alloc_pinned_memory(max(nbytes, 1 << 16))
            buf = self._pinned[name] = np.frombuffer(mem, np.uint8, max(nbytes, 1 << 16))
        return buf

    def _work_ptr(self, name: str, nbytes: int) -> int:
        mem = self._work.get(name)
        if mem is None or mem.size < nbytes:
            self._work.pop(name, None)
            mem = self._work[name] = self._malloc(max(nbytes, 1 << 16))
        return mem.ptr

    def _h2d(self, dst_ptr: int, src: np.ndarray) -> None:
        """Copy host bytes to the device through the pinned staging buffer, in chunks."""
        src = src.reshape(-1).view(np.uint8)
        stage = self._pinned_view("stage", min(src.nbytes, _STAGE_BYTES))
        with self.dev:
            for off in range(0, src.nbytes, stage.nbytes):
                n = min(stage.nbytes, src.nbytes - off)
                stage[:n] = src[off:off + n]
                self.rt.memcpyAsync(dst_ptr + off, stage.ctypes.data, n, self.rt.memcpyHostToDevice,
                                    self.stream.ptr)
                self.stream.synchronize()  # the staging buffer is refilled next

    def _upload(self, qt: QuantTensor) -> _CudaWeight:
        data, scales, in_pad = padded_layout(qt)
        dbytes = -(-data.nbytes // 256) * 256
        mem = self._malloc(dbytes + scales.nbytes)  # raises DeviceOutOfMemoryError, nothing held
        self._h2d(mem.ptr, data)
        self._h2d(mem.ptr + dbytes, scales)
        return _CudaWeight(mem, mem.ptr, mem.ptr + dbytes, in_pad)

    def _free(self, w) -> None:
        w.payload.mem = None  # cudaFree when the last reference goes (it waits for running kernels)

    # ---- launches --------------------------------------------------------------------------------
    def _fn(self, name: str, fmt: str, smem: int):
        key = f"{name}<{_fmt_id(fmt)},{_R_MM if name == 'mm' else _R_GU}>"
        fn = self._fns.get(key)
        if fn is None:
            fn = self._fns[key] = self.module.get_function(key)
        if smem > 48 * 1024 and fn.max_dynamic_shared_size_bytes < smem:
            limit = self.dev.attributes.get("MaxSharedMemoryPerBlockOptin", 48 * 1024)
            if smem > limit:
                raise UnsupportedError(f"cuda: rows of {smem // 4} columns need {smem} B of shared memory; "
                                       f"this GPU allows {limit} B per block")
            fn.max_dynamic_shared_size_bytes = smem
        return fn

    def _resident(self, fn, smem: int) -> int:
        """Blocks of ``fn`` that fit on one SM at once (CUDA occupancy calculator); 2 if unknown."""
        key = (fn.__name__, smem)
        if key not in self._occupancy:
            try:
                n = self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    fn.kernel.ptr, 32 * _WARPS, smem)
            except Exception:  # noqa: BLE001 - older CuPy without the binding
                n = 2
            self._occupancy[key] = max(1, int(n))
        return self._occupancy[key]

    def _launch(self, name: str, fmt: str, n_mats: int, table_ptr: int, rows_grid: int, rows: int,
                in_pad: int, stride: int) -> None:
        R = _R_MM if name == "mm" else _R_GU
        fn = self._fn(name, fmt, in_pad * 4)
        i32 = np.int32
        tiles = -(-rows_grid // (R * _WARPS))
        # one wave of resident blocks over all matrices; each block loops over its row tiles
        blocks = max(1, min(tiles, -(-self._resident(fn, in_pad * 4) * self._sms // n_mats)))
        fn((blocks, n_mats), (32 * _WARPS,),
           (np.uint64(table_ptr), i32(rows), i32(in_pad), i32(stride), i32(_GSHIFT.get(group_size(fmt), 0))),
           shared_mem=in_pad * 4)

    def _stage_args(self, table_words: int, xs, in_pad: int) -> tuple[np.ndarray, int, list[int]]:
        """Pinned [u64 table | x_0 | x_1 ...] (x_i zero-padded to [T_i, in_pad]) and its device copy
        address; returns the host table to fill, the device base address and each x_i's address."""
        tb = table_words * 8
        n = tb + sum(x.shape[0] for x in xs) * in_pad * 4
        host = self._pinned_view("args", n)
        base = self._work_ptr("args", n)
        xptrs, off = [], tb
        for x in xs:  # x [T, in] -> padded [T, in_pad] inside the pinned buffer
            view = host[off:off + x.shape[0] * in_pad * 4].view(np.float32).reshape(x.shape[0], in_pad)
            view[:, : x.shape[1]] = x
            view[:, x.shape[1]:] = 0.0
            xptrs.append(base + off)
            off += view.nbytes
        return host[:tb].view(np.uint64), base, xptrs

    def _run(self, n: int, launches, out_ptr: int, out_nbytes: int) -> np.ndarray:
        """Copy the staged arguments up, launch, copy ``out_nbytes`` back; returns them as float32."""
        host_in = self._pinned["args"]
        host_out = self._pinned_view("out", out_nbytes)
        rt, s = self.rt, self.stream
        with self.dev, s:
            rt.memcpyAsync(self._work["args"].ptr, host_in.ctypes.data, n, rt.memcpyHostToDevice, s.ptr)
            self._events[0].record(s)
            for args in launches:
                self._launch(*args)
            self._events[1].record(s)
            rt.memcpyAsync(host_out.ctypes.data, out_ptr, out_nbytes, rt.memcpyDeviceToHost, s.ptr)
            s.synchronize()
        self.last_device_seconds = self.cp.cuda.get_elapsed_time(*self._events) / 1e3
        return host_out[:out_nbytes].view(np.float32).copy()

    # ---- ops -------------------------------------------------------------------------------------
    def _matmul(self, x: np.ndarray, w) -> np.ndarray:
        p, (T, _), out = w.payload, x.shape, w.out_features
        table, base, (xptr,) = self._stage_args(8, [x], p.in_pad)
        y = self._work_ptr("y", T * out * 4)
        table[:] = (p.data_ptr, p.scales_ptr, xptr, y, T, 0, 0, 0)
        nbytes = 64 + T * p.in_pad * 4
        # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
        launches = [("mm", w.fmt, 1, base, out, out, p.in_pad, out)]
        return self._run(nbytes, launches, y, T * out * 4).reshape(T, out)

    def _expert_ffn(self, xs, experts: list[ExpertWeights]) -> list[np.ndarray]:
        e0 = experts[0]
        key = (e0.gate.fmt, e0.down.fmt, e0.gate.in_features, e0.gate.out_features)
        if e0.gate.fmt != e0.up.fmt or any((e.gate.fmt, e.down.fmt, e.gate.in_features, e.gate.out_features)
                                           != key or e.up.fmt != e.gate.fmt for e in experts):
            if len(experts) == 1:
                return super()._expert_ffn(xs, experts)
            return [self._expert_ffn([x], [e])[0] for x, e in zip(xs, experts)]  # mixed batch
        n, H, I = len(experts), e0.gate.in_features, e0.gate.out_features
        Hp, Ip = e0.gate.payload.in_pad, e0.down.payload.in_pad
        tok = np.cumsum([0] + [x.shape[0] for x in xs])
        table, base, xptrs = self._stage_args(16 * n, xs, Hp)
        h = self._work_ptr("h", int(tok[-1]) * Ip * 4)
        y = self._work_ptr("y", int(tok[-1]) * H * 4)
        for i, e in enumerate(experts):  # rows 0..n-1: gate/up entries; rows n..2n-1: down entries
            g, u, d, T = e.gate.payload, e.up.payload, e.down.payload, int(tok[i + 1] - tok[i])
            hi = h + int(tok[i]) * Ip * 4
            table[8 * i:8 * i + 8] = (g.data_ptr, g.scales_ptr, u.data_ptr, u.scales_ptr, xptrs[i], hi, T, 0)
            table[8 * (n + i):8 * (n + i) + 8] = (d.data_ptr, d.scales_ptr, hi, y + int(tok[i]) * H * 4, T,
                                                  0, 0, 0)
        nbytes = 128 * n + int(tok[-1]) * Hp * 4
        launches = [("gate_up", e0.gate.fmt, n, base, Ip, I, Hp, Ip),  # h [T_i, I_pad] per expert
                    ("mm", e0.down.fmt, n, base + 64 * n, H, H, Ip, H)]  # y [T_i, H] = h . down^T
        flat = self._run(nbytes, launches, y, int(tok[-1]) * H * 4)
        return [flat[tok[i] * H:tok[i + 1] * H].reshape(-1, H) for i in range(n)]

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        cp = self.cp
        with self.dev, self.stream:
            xd, wd = cp.asarray(x), cp.asarray(weight)
            yd = cp.empty_like(xd)
            self.module.get_function("rmsnorm")((x.shape[0],), (256,),
                                                (xd, wd, yd, np.int32(x.shape[1]), np.float32(eps)))
            y = cp.asnumpy(yd, stream=self.stream)
            self.stream.synchronize()
        return y


BACKEND = CUDABackend
