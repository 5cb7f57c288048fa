"""OpenCL backend (pyopencl): every platform's devices, e.g. PoCL on a CPU or NVIDIA's driver on a GPU.

Kernels are ``shaders/opencl/*.cl``, compiled at run time once per (format, work shape) and cached as
program binaries per device and driver under ``<cache>/opencl/<sha256>.bin`` (``<cache>`` is
``$COLIBRI_PLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/colibri-plan`` or ``~/.cache/colibri-plan``: see
``programs.cache_dir``), with a checksum; a cached binary that fails to load is rebuilt from source.
Weights use the padded layout of :func:`colibri_plan.backends.staging.padded_layout`. Work shape: on CPU
devices one work-item per row (measured fastest for int4 GEMV on PoCL), on GPUs one work-group of 64 per
row with a local-memory reduction.

Parts bound at open: the device activations (``d_*``, routed experts on the device x included) of
:class:`~colibri_plan.backends.opencl.device.OpenCLDeviceOps`, and the batched expert FFN of
:class:`~colibri_plan.backends.batched.BatchedExperts` over this file's ``_ffn_batch``.
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

import numpy as np

from colibri_plan.backends import programs, staging
from colibri_plan.backends.base import Backend, DeviceInfo
from colibri_plan.backends.batched import BatchedExperts
from colibri_plan.backends.opencl.device import OpenCLDeviceOps, is_oom
from colibri_plan.backends.pools import WorkBuffers
from colibri_plan.backends.staging import PaddedWeight
from colibri_plan.quant import QuantTensor, group_size

# kernels without a weight format
_SOURCES = {"rmsnorm": "norm.cl", "attention_gqa": "attention.cl", "attention_combine": "attention.cl",
            **dict.fromkeys(("add", "silu_mul", "scale_rows", "rope", "pad_rows", "expert_sum",
                             "head_matmul"), "trunk.cl")}
# argument types per kernel (b: buffer or local memory, I: uint, Q: ulong, f: float): typed scalar
# arguments take plain Python numbers and cost ~0.5 us per launch where untyped numpy scalars cost ~60 us
_ARGS = {"matmul": "bbbIbIIIII", "matmul_many": "bbbbbbbbbIbbbbIIIIII", "expert_sum": "bQbbI",
         "gate_up": "bbbbbIbIIIII", "rmsnorm": "bbbIf", "add": "bQbQbQII", "silu_mul": "bQbQbQ",
         "scale_rows": "bQbQbI", "rope": "bQbQbQIIIII", "pad_rows": "bQbQII",
         "attention_gqa": "bQbQbQbIIIIIfIIIbbb", "attention_combine": "bbIII", "head_matmul": "bbQbQIIII"}
_DTYPES = {"I": np.uint32, "Q": np.uint64, "f": np.float32}
_MAGIC = b"CPCLPB01"  # cache files: magic, sha256 of the program binary, the binary


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


def _kind(cl, dev) -> str:
    """"cpu", "igpu" (a GPU on host memory: CL_DEVICE_HOST_UNIFIED_MEMORY) or "gpu"."""
    if dev.type & cl.device_type.CPU:
        return "cpu"
    try:
        return "igpu" if dev.host_unified_memory else "gpu"
    except cl.Error:
        return "gpu"


def _check(cl) -> str | None:
    if not cl.get_platforms():  # raises without an ICD loader or platforms
        return "no OpenCL platform found; install an ICD such as pocl-opencl-icd"
    return None if _cl_devices() else "OpenCL platforms have no devices"


class OpenCLBackend(Backend):
    """Quantized matmul, fused expert FFN, rmsnorm and the device-activation ops through pyopencl (see the
    module docstring)."""

    name = "opencl"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return programs.import_problem(
            "pyopencl", "pyopencl is not installed (pip install 'colibri-plan[opencl]')", _check,
            "no OpenCL platform found ({exc}); install an ICD such as pocl-opencl-icd")

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        import pyopencl as cl

        return [cls.device_info(i, d.name.strip(), _kind(cl, d), d.global_mem_size, None,
                          f"{' '.join(p.version.split(',')[0].split())}; driver {d.driver_version.strip()}")
                for i, (p, d) in enumerate(_cl_devices())]

    # ---- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> None:
        import pyopencl as cl
        import pyopencl.tools  # noqa: F401 - the memory pool of DArray buffers

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
        self._programs: dict[tuple, Any] = {}  # (source, options): one build for all kernels of a file
        self.ew = min(64, self.dev.max_work_group_size)  # work-group of the elementwise kernels
        self.attn_tile = 64  # most K/V rows per tile of attention_gqa (fewer where local memory is short)
        self.attn_splits: int | None = None  # key splits of attention_gqa; None: by the device's size
        self._pool = cl.tools.MemoryPool(cl.tools.ImmediateAllocator(self.queue))  # DArray buffers
        self._inflight: deque = deque()  # events of non-blocking uploads: they own the host copies
        # grow-only work buffers (activations, outputs) reused between calls
        self._scratch = WorkBuffers(self._scratch_alloc, grow=lambda n: max(n, 4096))
        self.bind(BatchedExperts(self, self._ffn_batch))
        self.bind(OpenCLDeviceOps(self))

    def _close(self) -> None:
        self.queue.finish()
        self._inflight.clear()
        self._kernels.clear()
        self._programs.clear()
        self._scratch.clear()
        self._pool.free_held()

    def _synchronize(self) -> None:
        self.queue.finish()
        self._inflight.clear()

    def capacity_bytes(self) -> int | None:
        return int(self.dev.global_mem_size)

    # ---- programs --------------------------------------------------------------------------------
    def _build(self, source_name: str, options: list[str]):
        """Program from the binary cache, else compiled from source and cached."""
        cl = self.cl
        src = programs.kernel_source("opencl", source_name)
        path = programs.cache_file("opencl", self.platform.name, self.platform.version, self.dev.name,
                             self.dev.driver_version, self.dev.version, " ".join(options), src)
        blob, state = programs.read_cache_file(path, _MAGIC)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cl.CompilerWarning)  # PoCL notes are not errors
            if state == "loaded":
                try:
                    prg = cl.Program(self.ctx, [self.dev], [blob]).build(options=options)
                    self.cache_hits += 1
                    return prg
                except cl.Error:
                    pass  # a binary this driver refuses: rebuild below and overwrite
            prg = cl.Program(self.ctx, src).build(options=options)
        binary = prg.get_info(cl.program_info.BINARIES)[0]
        programs.write_cache_file(path, _MAGIC, binary)  # unwritable: rebuilt next time
        return prg

    def _kernel(self, name: str, fmt: str | None, tpi: int = 1, extra: tuple[str, ...] = ()):
        key = (name, fmt, tpi, self.ls, extra)
        if key not in self._kernels:
            if fmt is None:
                src, opts = _SOURCES[name], [f"-DLS={self.ls}", *extra]
            else:
                g = group_size(fmt)
                src = "matmul.cl"
                opts = [f"-DFMT={programs.kernel_format(fmt)}", f"-DLS={self.ls}", f"-DTPI={tpi}"]
                opts += [f"-DGROUP={g}"] if g else []
            pkey = (src, tuple(opts))
            if pkey not in self._programs:
                self._programs[pkey] = self._build(src, opts)
            knl = self.cl.Kernel(self._programs[pkey], name)
            knl.set_scalar_arg_dtypes([_DTYPES.get(c) for c in _ARGS[name]])
            self._kernels[key] = knl
        return self._kernels[key]

    def _tpi(self, T: int) -> int:
        # tokens per work-item: each weight chunk is decoded once for up to 4 tokens
        return 1 if T == 1 else 4

    # ---- memory ----------------------------------------------------------------------------------
    def _buffer(self, nbytes: int, flags=None):
        return self.cl.Buffer(self.ctx, flags or self.cl.mem_flags.READ_WRITE, max(4, int(nbytes)))

    def _upload(self, qt: QuantTensor) -> PaddedWeight:
        cl = self.cl
        data, scales, in_pad = staging.padded_layout(qt)
        made = []
        try:
            for host in (data, scales):
                if host.nbytes > self.dev.max_mem_alloc_size:
                    raise self._oom(f"one buffer of {host.nbytes} B exceeds the driver's "
                                    f"{self.dev.max_mem_alloc_size} B per-allocation limit", qt.nbytes)
                buf = self._buffer(host.nbytes, cl.mem_flags.READ_ONLY)
                made.append(buf)
                # a blocking copy makes lazy drivers (NVIDIA) allocate now, so failures surface here
                cl.enqueue_copy(self.queue, buf, host, is_blocking=True)
        except cl.Error as exc:
            for buf in made:
                buf.release()
            if not is_oom(cl, exc):
                raise
            raise self._oom(f"ran out of memory uploading {qt.nbytes} B: {exc}", qt.nbytes) from exc
        except BaseException:
            for buf in made:
                buf.release()
            raise
        return PaddedWeight(made[0], made[1], in_pad)

    def _free(self, w) -> None:
        w.payload.data.release()
        w.payload.scales.release()

    def _scratch_alloc(self, name: str, nbytes: int):
        try:
            return self._buffer(nbytes)
        except self.cl.Error as exc:
            raise self._oom(f"cannot allocate {nbytes} B of work memory: {exc}", nbytes) from exc

    def _put_x(self, xs: list[np.ndarray], in_pad: int) -> tuple[Any, np.ndarray]:
        """Copy activations x_i [T_i, in], stacked and zero-padded to [Σ T_i, in_pad]; returns the buffer
        and the host array, which must stay alive until the queue has read it."""
        host = staging.stage_rows(xs, in_pad, np.empty((sum(x.shape[0] for x in xs), in_pad), np.float32))
        buf = self._scratch.get("x", host.nbytes)
        self.cl.enqueue_copy(self.queue, buf, host, is_blocking=False)
        return buf, host

    # ---- ops -------------------------------------------------------------------------------------
    def _launch(self, knl, rows: int, T: int, tpi: int, *args) -> None:
        group = self.ls if self.ls > 1 else self.rows_per_group
        knl(self.queue, (-(-rows * self.ls // group) * group, -(-T // tpi)), (group, 1), *args)

    def _matmul(self, x: np.ndarray, w) -> np.ndarray:
        p, T = w.payload, x.shape[0]
        tpi = self._tpi(T)
        xb, keep = self._put_x([x], p.in_pad)
        y = np.empty((T, w.out_features), np.float32)
        yb = self._scratch.get("y", y.nbytes)
        # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
        self._launch(self._kernel("matmul", w.fmt, tpi), w.out_features, T, tpi, p.data, p.scales, xb, 0,
                     yb, 0, p.in_pad, T, w.out_features, w.out_features)
        self.cl.enqueue_copy(self.queue, y, yb, is_blocking=True)
        del keep
        return y

    def _ffn_batch(self, xs, experts, b) -> np.ndarray:
        xb, keep = self._put_x(xs, b.Hp)
        hb = self._scratch.get("h", b.tok[-1] * b.Ip * 4)  # h_i [T_i, I_pad], zero-padded by gate_up
        yb = self._scratch.get("y", b.tok[-1] * b.H * 4)
        for e, T, t0 in zip(experts, b.counts, b.tok):  # all enqueued back to back, one read at the end
            self._ffn_launches(e, T, xb, t0 * b.Hp, hb, t0 * b.Ip, yb, t0 * b.H)
        y = np.empty((b.tok[-1], b.H), np.float32)
        self.cl.enqueue_copy(self.queue, y, yb, is_blocking=True)
        del keep
        return y

    def _ffn_launches(self, e, T: int, xb, xo: int, hb, ho: int, yb, yo: int) -> None:
        """One expert's two launches: h [T, I_pad] = SiLU(x·gateᵀ) ⊙ (x·upᵀ) at float ``ho`` of ``hb`` (zero
        in its padding), then y [T, H] = h·downᵀ at ``yo`` of ``yb``; x rows of H_pad floats at ``xo``."""
        tpi, g, u, d = self._tpi(T), e.gate.payload, e.up.payload, e.down.payload
        Hp, Ip, H = g.in_pad, d.in_pad, e.down.out_features
        self._launch(self._kernel("gate_up", e.gate.fmt, tpi), Ip, T, tpi, g.data, g.scales, u.data, u.scales,
                     xb, xo, hb, ho, Hp, T, Ip, e.gate.out_features)
        self._launch(self._kernel("matmul", e.down.fmt, tpi), H, T, tpi, d.data, d.scales, hb, ho, yb, yo,
                     Ip, T, H, H)

    def _rmsnorm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        cl, (T, H) = self.cl, x.shape
        xb, wb = self._scratch.get("nx", x.nbytes), self._scratch.get("nw", weight.nbytes)
        yb = self._scratch.get("ny", x.nbytes)
        cl.enqueue_copy(self.queue, xb, x, is_blocking=False)
        cl.enqueue_copy(self.queue, wb, weight, is_blocking=False)
        self._kernel("rmsnorm", None)(self.queue, (T * self.ls,), (self.ls,), xb, wb, yb, H, eps)
        y = np.empty_like(x)
        cl.enqueue_copy(self.queue, y, yb, is_blocking=True)
        return y


BACKEND = OpenCLBackend
