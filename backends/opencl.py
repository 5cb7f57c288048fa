"""OpenCL backend (pyopencl): every platform's devices, e.g. PoCL on a CPU or NVIDIA's driver on a GPU.

Kernels are ``shaders/opencl/*.cl``, compiled at run time once per (format, work shape) and cached as
program binaries per device and driver under ``<cache>/opencl/<sha256>.bin`` (``<cache>`` is
``$COLIBRI_PLAN_CACHE_DIR`` or ``~/.cache/colibri-plan``); a cached binary that fails to load is rebuilt
from source. Weights use the padded layout of :func:`colibri_plan.backends.base.padded_layout`.
Work shape: on CPU devices one work-item per row (measured fastest for int4 GEMV on PoCL), on GPUs one
work-group of 64 per row with a local-memory reduction.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from colibri_plan.backends.base import Backend, DeviceInfo, ExpertWeights, padded_layout
from colibri_plan.errors import DeviceOutOfMemoryError
from colibri_plan.fileio import atomic_write_bytes
from colibri_plan.quant import FORMATS, QuantTensor, group_size

_FMT_ID = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3, "int4": 4, "int2": 5}
_OOM_CODES = ("MEM_OBJECT_ALLOCATION_FAILURE", "OUT_OF_RESOURCES", "OUT_OF_HOST_MEMORY",
              "INVALID_BUFFER_SIZE")


def cache_dir() -> Path:
    """Folder of cached OpenCL program binaries (created on first write)."""
    root = os.environ.get("COLIBRI_PLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "colibri-plan")
    return Path(root) / "opencl"


def _cl_devices() -> list:
    """[(platform, device)] over all platforms, in the order of DeviceInfo.index."""
    import pyopencl as cl

    out = []
    for p in cl.get_platforms():
        try:
            out.extend((p, d) for d in p.get_devices())
        except cl.Error:  # a platform with no devices raises DEVICE_NOT_FOUND
            continue
    return out


def _kind(cl, dev) -> tuple[str, bool]:
    if dev.type & cl.device_type.CPU:
        return "cpu", True
    try:
        unified = bool(dev.host_unified_memory)
    except cl.Error:
        unified = False
    return ("igpu", True) if unified else ("gpu", False)


@dataclass
class _CLWeight:
    data: Any  # cl.Buffer uint8 [out, row_bytes]
    scales: Any  # cl.Buffer float32 (per-row, per-group, or a 1-element dummy)
    in_pad: int


class OpenCLBackend(Backend):
    """Quantized matmul, fused expert FFN and rmsnorm through pyopencl (see the module docstring)."""

    name = "opencl"
    formats = FORMATS

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("pyopencl") is None:
            return "pyopencl is not installed (pip install 'colibri-plan[opencl]')"
        try:
            import pyopencl as cl

            platforms = cl.get_platforms()
        except Exception as exc:  # noqa: BLE001 - no ICD loader / no platforms raise various errors
            return f"no OpenCL platform found ({exc}); install an ICD such as pocl-opencl-icd"
        if not platforms:
            return "no OpenCL platform found; install an ICD such as pocl-opencl-icd"
        if not _cl_devices():
            return "OpenCL platforms have no devices"
        return None

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        try:
            if cls.unavailable_reason() is not None:
                return []
            import pyopencl as cl

            out = []
            for i, (p, d) in enumerate(_cl_devices()):
                kind, unified = _kind(cl, d)
                out.append(DeviceInfo(
                    backend=cls.name, index=i, name=d.name.strip(), kind=kind,
                    total_memory_bytes=int(d.global_mem_size), free_memory_bytes=None,
                    unified_memory=unified, formats=cls.formats,
                    driver=f"{' '.join(p.version.split(',')[0].split())}; driver {d.driver_version.strip()}"))
            return out
        except Exception:  # noqa: BLE001 - discovery never raises
            return []

    # ---- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> None:
        import pyopencl as cl

        self.cl = cl
        self.platform, self.dev = _cl_devices()[self.device.index]
        self.ctx = cl.Context([self.dev])
        self.queue = cl.CommandQueue(self.ctx, self.dev)
        gpu = self.device.kind != "cpu"
        self.ls = min(64, self.dev.max_work_group_size) if gpu else 1
        # CPU devices: rows (work-items) per work-group; one row per group was the best int4 GEMV on PoCL
        self.rows_per_group = 1
        self.cache_hits = 0  # programs loaded from cached binaries (tests read it)
        self._kernels: dict[tuple, Any] = {}
        self._scratch: dict[str, Any] = {}

    def _close(self) -> None:
        self.queue.finish()
        self._kernels.clear()
        self._scratch.clear()

    def _synchronize(self) -> None:
        self.queue.finish()

    def capacity_bytes(self) -> int | None:
        return int(self.dev.global_mem_size)

    # ---- programs --------------------------------------------------------------------------------
    def _build(self, source_name: str, options: list[str]):
        """Program from the binary cache, else compiled from source and cached."""
        cl = self.cl
        src = importlib.resources.files("colibri_plan.shaders").joinpath("opencl", source_name).read_text()
        ident = [self.platform.name, self.platform.version, self.dev.name, self.dev.driver_version,
                 self.dev.version, " ".join(options), src]
        path = cache_dir() / (hashlib.sha256("\0".join(ident).encode()).hexdigest()[:32] + ".bin")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cl.CompilerWarning)  # PoCL notes are not errors
            if path.is_file():
                try:
                    prg = cl.Program(self.ctx, [self.dev], [path.read_bytes()]).build(options=options)
                    self.cache_hits += 1
                    return prg
                except (cl.Error, OSError):
                    pass  # stale or foreign binary: rebuild below and overwrite
            prg = cl.Program(self.ctx, src).build(options=options)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, prg.get_info(cl.program_info.BINARIES)[0])
        except Exception:  # noqa: BLE001 - an unwritable cache only costs a rebuild next time
            pass
        return prg

    def _kernel(self, name: str, fmt: str | None, tpi: int = 1):
        key = (name, fmt, tpi, self.ls)
        if key not in self._kernels:
            if fmt is None:
                prg = self._build("norm.cl", [f"-DLS={self.ls}"])
            else:
                g = group_size(fmt)
                opts = [f"-DFMT={6 if g else _FMT_ID[fmt]}", f"-DLS={self.ls}", f"-DTPI={tpi}"]
                prg = self._build("matmul.cl", opts + ([f"-DGROUP={g}"] if g else []))
            self._kernels[key] = self.cl.Kernel(prg, name)
        return self._kernels[key]

    def _tpi(self, T: int) -> int:
        # tokens per work-item: each weight chunk is decoded once for up to 4 tokens
        return 1 if T == 1 else 4

    # ---- memory ----------------------------------------------------------------------------------
    def _buffer(self, nbytes: int, flags=None):
        return self.cl.Buffer(self.ctx, flags or self.cl.mem_flags.READ_WRITE, max(4, int(nbytes)))

    def _upload(self, qt: QuantTensor) -> _CLWeight:
        cl = self.cl
        data, scales, in_pad = padded_layout(qt)
        made = []
        try:
            for host in (data, scales):
                if host.nbytes > self.dev.max_mem_alloc_size:
                    raise DeviceOutOfMemoryError(
                        f"opencl device {self.device.name!r}: one buffer of {host.nbytes} B exceeds the "
                        f"driver's {self.dev.max_mem_alloc_size} B per-allocation limit",
                        requested_bytes=qt.nbytes, held_bytes=self.held_bytes,
                        capacity_bytes=self.capacity_bytes())
                buf = self._buffer(host.nbytes, cl.mem_flags.READ_ONLY)
                made.append(buf)
                # a blocking copy makes lazy drivers (NVIDIA) allocate now, so failures surface here
                cl.enqueue_copy(self.queue, buf, host, is_blocking=True)
        except cl.Error as exc:
            for buf in made:
                buf.release()
            if not any(getattr(cl.status_code, c, None) == exc.code for c in _OOM_CODES):
                raise
            raise DeviceOutOfMemoryError(
                f"opencl device {self.device.name!r} ran out of memory uploading {qt.nbytes} B "
                f"({self.held_bytes} B held): {exc}", requested_bytes=qt.nbytes,
                held_bytes=self.held_bytes, capacity_bytes=self.capacity_bytes()) from exc
        except BaseException:
            for buf in made:
                buf.release()
            raise
        return _CLWeight(made[0], made[1], in_pad)

    def _free(self, w) -> None:
        w.payload.data.release()
        w.payload.scales.release()

    def _scratch_buffer(self, name: str, nbytes: int):
        """A grow-only work buffer (activations, outputs) reused between calls."""
        buf = self._scratch.get(name)
        if buf is None or buf.size < nbytes:
            try:
                buf = self._scratch[name] = self._buffer(max(nbytes, 4096))
            except self.cl.Error as exc:
                raise DeviceOutOfMemoryError(f"opencl: cannot allocate {nbytes} B of work memory: {exc}",
                                             requested_bytes=nbytes, held_bytes=self.held_bytes) from exc
        return buf

    def _put_x(self, name: str, xs: list[np.ndarray], in_pad: int) -> tuple[Any, list[int], Any]:
        """Copy activations [T_i, in] zero-padded to [T_i, in_pad], stacked; returns buffer, offsets."""
        n = sum(x.shape[0] for x in xs)
        host = np.zeros((n, in_pad), np.float32)
        offs, t = [], 0
        for x in xs:
            host[t:t + x.shape[0], : x.shape[1]] = x
            offs.append(t * in_pad)
            t += x.shape[0]
        buf = self._scratch_buffer(name, host.nbytes)
        self.cl.enqueue_copy(self.queue, buf, host, is_blocking=False)
        return buf, offs, host  # NOTE: keep `host` alive until the queue has read it

    # ---- ops -------------------------------------------------------------------------------------
    def _launch(self, knl, rows: int, T: int, tpi: int, *args) -> None:
        u32 = np.uint32
        knl.set_args(*[u32(a) if isinstance(a, (int, np.integer)) else a for a in args])
        group = self.ls if self.ls > 1 else self.rows_per_group
        gsize = (-(-rows * self.ls // group) * group, -(-T // tpi))
        self.cl.enqueue_nd_range_kernel(self.queue, knl, gsize, (group, 1))

    def _matmul(self, x: np.ndarray, w) -> np.ndarray:
        p, T = w.payload, x.shape[0]
        tpi = self._tpi(T)
        xb, offs, keep = self._put_x("x", [x], p.in_pad)
        y = np.empty((T, w.out_features), np.float32)
        yb = self._scratch_buffer("y", y.nbytes)
        # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
        self._launch(self._kernel("matmul", w.fmt, tpi), w.out_features, T, tpi, p.data, p.scales, xb, 0,
                     yb, 0, p.in_pad, T, w.out_features, w.out_features)
        self.cl.enqueue_copy(self.queue, y, yb, is_blocking=True)
        del keep
        return y

    def _expert_ffn(self, xs, experts: list[ExpertWeights]) -> list[np.ndarray]:
        if any(e.gate.fmt != e.up.fmt for e in experts):
            return super()._expert_ffn(xs, experts)
        if len({e.gate.payload.in_pad for e in experts}) > 1:  # mixed widths: one expert at a time
            return [self._expert_ffn([x], [e])[0] for x, e in zip(xs, experts)]
        xb, xoffs, keep = self._put_x("x", list(xs), experts[0].gate.payload.in_pad)
        h_rows = [e.down.payload.in_pad for e in experts]  # I_pad: h is [T_i, I_pad], zero-padded
        h_offs = np.cumsum([0] + [x.shape[0] * r for x, r in zip(xs, h_rows)])
        y_offs = np.cumsum([0] + [x.shape[0] * e.down.out_features for x, e in zip(xs, experts)])
        hb = self._scratch_buffer("h", int(h_offs[-1]) * 4)
        yb = self._scratch_buffer("y", int(y_offs[-1]) * 4)
        for i, (x, e) in enumerate(zip(xs, experts)):  # all enqueued back to back, one read at the end
            T, tpi = x.shape[0], self._tpi(x.shape[0])
            g, u, d = e.gate.payload, e.up.payload, e.down.payload
            # h [T, I_pad] = SiLU(x . gate^T) * (x . up^T)
            self._launch(self._kernel("gate_up", e.gate.fmt, tpi), h_rows[i], T, tpi, g.data, g.scales,
                         u.data, u.scales, xb, xoffs[i], hb, int(h_offs[i]), g.in_pad, T, h_rows[i],
                         e.gate.out_features)
            # y [T, H] = h [T, I_pad] . down^T
            self._launch(self._kernel("matmul", e.down.fmt, tpi), e.down.out_features, T, tpi, d.data,
                         d.scales, hb, int(h_offs[i]), yb, int(y_offs[i]), d.in_pad, T, e.down.out_features,
                         e.down.out_features)
        y = np.empty(int(y_offs[-1]), np.float32)
        self.cl.enqueue_copy(self.queue, y, yb, is_blocking=True)
        del keep
        return [y[y_offs[i]:y_offs[i + 1]].reshape(x.shape[0], -1) for i, x in enumerate(xs)]

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        cl, (T, H) = self.cl, x.shape
        xb = self._scratch_buffer("nx", x.nbytes)
        wb = self._scratch_buffer("nw", weight.nbytes)
        yb = self._scratch_buffer("ny", x.nbytes)
        cl.enqueue_copy(self.queue, xb, x, is_blocking=False)
        cl.enqueue_copy(self.queue, wb, weight, is_blocking=False)
        knl = self._kernel("rmsnorm", None)
        knl.set_args(xb, wb, yb, np.uint32(H), np.float32(eps))
        cl.enqueue_nd_range_kernel(self.queue, knl, (T * self.ls,), (self.ls,))
        y = np.empty_like(x)
        cl.enqueue_copy(self.queue, y, yb, is_blocking=True)
        return y


BACKEND = OpenCLBackend
