"""CUDA backend (CuPy): kernels from ``shaders/cuda/*.cu`` compiled by NVRTC (``cupy.RawModule``).

Weights use :func:`colibri_plan.backends.staging.padded_layout`, one ``cudaMalloc`` per tensor (data, then
float32 scales at a 256-byte aligned offset), filled through pinned staging. Each op makes one
host-to-device copy (a pointer table plus the padded activations), its launches and one device-to-host
copy: :meth:`CUDABackend.expert_ffn` runs a whole batch of experts in two launches (gate/up fused with
SiLU·up, then down). Repeated work shapes replay a captured CUDA graph. With ``timing = True``,
``last_device_seconds`` holds the GPU time of the last op (CUDA events). This file is the driver context
and the host-staged ops; its parts, bound at open: :class:`~.launch.Launcher` (kernel instances and
launch shapes), :class:`~.device.CudaDeviceOps` (the ``d_*`` ops, activations kept on the GPU between
ops), :class:`~.experts.CudaExperts` (routed experts on them) and the shared
:class:`~colibri_plan.backends.batched.BatchedExperts`.
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np

from colibri_plan.backends import programs, staging
from colibri_plan.backends.base import Backend, DeviceInfo
from colibri_plan.backends.batched import BatchedExperts
from colibri_plan.backends.cuda.device import CudaDeviceOps
from colibri_plan.backends.cuda.experts import CudaExperts, expert_rows_args, ffn_table
from colibri_plan.backends.cuda.graph import CudaStepGraphs
from colibri_plan.backends.cuda.launch import Launcher
from colibri_plan.backends.cuda.prologue import CudaPrologue
from colibri_plan.backends.cuda.routing import CudaRouting
from colibri_plan.backends.cuda.segments import CudaSegments
from colibri_plan.backends.handles import DArray, DeviceWeight, ExpertWeights
from colibri_plan.backends.pools import Replays, WorkBuffers
from colibri_plan.backends.staging import PaddedWeight
from colibri_plan.errors import DeviceOutOfMemoryError, InputError
from colibri_plan.quant import QuantTensor

_RESERVE_BYTES = 512 << 20  # left free at open (at most 1/8 of it) for the module and work buffers


class CUDABackend(Backend):
    """Quantized matmul, batched fused expert FFN, rmsnorm and the device-activation ops (``d_*``,
    :mod:`~colibri_plan.backends.cuda.device`) on NVIDIA GPUs."""

    name = "cuda"
    optional_ops = frozenset({"d_expert_ffn_rows", "d_router_topk", "d_capture_step", "upload_expert_mapped",
                              "d_attention_prologue"})

    @classmethod
    def unavailable_reason(cls) -> str | None:
        no_gpu = "CuPy finds no usable CUDA device (no NVIDIA GPU or driver here)"
        return programs.import_problem("cupy", "CuPy is not installed (pip install 'colibri-plan[cuda]')",
                                 lambda cp: None if cp.cuda.is_available() else no_gpu,
                                 "CuPy cannot initialise CUDA: {exc}")

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        import cupy

        rt = cupy.cuda.runtime
        drv, run = rt.driverGetVersion(), rt.runtimeGetVersion()
        out = []
        for i in range(rt.getDeviceCount()):
            p = rt.getDeviceProperties(i)
            with cupy.cuda.Device(i):
                free, total = rt.memGetInfo()
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            kind = "igpu" if p.get("integrated", 0) else "gpu"  # Jetson-style: computes on host memory
            driver = (f"CUDA driver {drv // 1000}.{drv % 1000 // 10}, "
                      f"runtime {run // 1000}.{run % 1000 // 10}, sm_{p['major']}{p['minor']}")
            out.append(cls.device_info(i, name, kind, total, free, driver))
        return out

    # ---- lifecycle -------------------------------------------------------------------------------
    def _open(self) -> None:
        import cupy

        self.cp, self.rt = cupy, cupy.cuda.runtime
        self.dev = cupy.cuda.Device(self.device.index)
        with self.dev:
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self._events = (cupy.cuda.Event(), cupy.cuda.Event())
            free, _ = self.rt.memGetInfo()
            self._sms = int(self.dev.attributes["MultiProcessorCount"])
        self._capacity = int(free) - min(_RESERVE_BYTES, int(free) // 8)
        # parts: kernel instances and launch shapes (their caches named here for benchmarks and tests)
        lr = self.launcher = Launcher(cupy, self.dev, self._sms)
        self._launcher, self._resident, self._fn = lr.config, lr.resident, lr.fn
        self._module_fn = lr.module_fn
        self._fns, self._occupancy, self._launchers = lr.fns, lr.occupancy, lr.launchers
        self._graphs = Replays(64)  # work shape + buffers -> captured CUDA graph
        self._timed_run = False  # the events of the last op were recorded (timing on, through _run)
        self.use_graphs = True
        self._work = WorkBuffers(lambda name, n: self._malloc(n))  # device Memory, grow-only
        self._pinned = WorkBuffers(self._alloc_pinned)  # NS(a: uint8 view of pinned memory, ptr)
        # benchmarks: each op's kernels run this many times; GPU time at 2 less at 1 = the kernels' own
        self.kernel_passes = 1
        # the device-activation ops, the routed experts on them and the host path's batched experts
        self.dops = self.bind(CudaDeviceOps(self))
        experts = self.bind(CudaExperts(self, self.dops))
        self.bind(CudaRouting(self.dops))
        self.bind(CudaPrologue(self, self.dops))  # a GQA layer's q/k norms, RoPE and cache append: one launch
        self.bind(CudaStepGraphs(self, self.dops, experts))  # a decode step captured once, replayed
        self.bind(CudaSegments(self, self.dops))  # ... or as segments between host hand-offs
        self.bind(BatchedExperts(self, self._ffn_batch))

    def _close(self) -> None:
        self._synchronize()
        for cache in (self._work, self._pinned, self.launcher, self._graphs):
            cache.clear()
        self.dops.close()  # its events and work buffers

    def _synchronize(self) -> None:
        with self.dev:
            self.stream.synchronize()

    def capacity_bytes(self) -> int | None:
        """Free device memory when opened, less a reserve (512 MiB, at most 1/8) for work buffers."""
        return self._capacity

    def _device_seconds(self) -> float | None:
        return self.cp.cuda.get_elapsed_time(*self._events) / 1e3 if self._timed_run else None

    # ---- memory ----------------------------------------------------------------------------------
    def _malloc(self, nbytes: int):
        cp = self.cp
        try:
            with self.dev:
                return cp.cuda.memory.Memory(max(1, int(nbytes)))  # plain cudaMalloc, freed on release
        except (cp.cuda.memory.OutOfMemoryError, cp.cuda.runtime.CUDARuntimeError) as exc:
            if not isinstance(exc, cp.cuda.memory.OutOfMemoryError) and getattr(
                    exc, "status", None) != getattr(self.rt, "errorMemoryAllocation", 2):
                raise
            raise self._oom(f"ran out of memory allocating {nbytes} B: {exc}", nbytes) from exc

    def _alloc_pinned(self, name: str, nbytes: int) -> NS:
        a = np.frombuffer(self.cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
        return NS(a=a, ptr=a.ctypes.data)  # address cached: .ctypes costs ~10 us per access

    def _h2d(self, dst_ptr: int, src: np.ndarray) -> None:
        """Copy host bytes to the device through the pinned staging buffer, in chunks."""
        stage = self._pinned.get("stage", min(src.nbytes, staging.STAGE_BYTES))

        def put(off: int, n: int) -> None:
            self.rt.memcpyAsync(dst_ptr + off, stage.ptr, n, self.rt.memcpyHostToDevice, self.stream.ptr)
            self.stream.synchronize()  # the staging buffer is refilled next
        with self.dev:
            staging.copy_in_chunks(src, stage.a, put)

    def _upload(self, qt: QuantTensor) -> PaddedWeight:
        data, scales, in_pad = staging.padded_layout(qt)
        dbytes = -(-data.nbytes // 256) * 256
        mem = self._malloc(dbytes + scales.nbytes)  # raises DeviceOutOfMemoryError, nothing held
        self._h2d(mem.ptr, data)
        self._h2d(mem.ptr + dbytes, scales)
        return PaddedWeight(mem.ptr, mem.ptr + dbytes, in_pad, mem)

    def upload_expert_mapped(self, gate: QuantTensor, up: QuantTensor, down: QuantTensor) -> ExpertWeights:
        """An expert's three matrices in mapped page-locked host memory (``cudaHostAlloc``), in the layout
        of :meth:`_upload`: every kernel that takes a VRAM expert reads these over PCIe, zero-copy (with
        unified addressing a pinned allocation's host address is its device address: CUDA Programming
        Guide, "Unified Virtual Address Space"). The pinned tier of a plan whose ``compute.ram_pinned``
        names this discrete GPU (engine/unified.py). Not counted against the VRAM capacity
        (``mapped_bytes``).

        Raises:
            InputError: not QuantTensors, or a format this backend does not take.
            DeviceOutOfMemoryError: the host could not page-lock that much memory (nothing stays held).
        """
        self._check_open()
        done = []
        for qt in (gate, up, down):
            if not isinstance(qt, QuantTensor) or qt.fmt not in self.formats:
                raise InputError(f"upload_expert_mapped: {getattr(qt, 'fmt', type(qt).__name__)} is not a "
                                 f"QuantTensor of a format of {self.name} ({', '.join(self.formats)})")
            data, scales, in_pad = staging.padded_layout(qt)
            dbytes = -(-data.nbytes // 256) * 256
            n = dbytes + scales.nbytes
            try:
                host = np.frombuffer(self.cp.cuda.alloc_pinned_memory(n), np.uint8, n)
            except (MemoryError, self.rt.CUDARuntimeError) as exc:
                for w in done:
                    self.free(w)
                raise DeviceOutOfMemoryError(
                    f"{self.name}: could not page-lock {n} B of host memory for a mapped expert "
                    f"({self.mapped_bytes} B mapped): {exc}; pin fewer experts (solve --ram) or compute "
                    "the pinned tier on the CPU", requested_bytes=n, held_bytes=self.mapped_bytes,
                    capacity_bytes=None) from exc
            host[:data.nbytes] = data.reshape(-1).view(np.uint8)
            host[dbytes:] = scales.reshape(-1).view(np.uint8)
            ptr = host.ctypes.data
            pw = PaddedWeight(ptr, ptr + dbytes, in_pad, host)  # host holds the memory
            done.append(DeviceWeight(qt.fmt, qt.out_features, qt.in_features, qt.nbytes, pw, id(self),
                                     host_mapped=True))
            self.mapped_bytes += qt.nbytes
        return ExpertWeights(*done)

    def _free(self, w) -> None:
        if w.host_mapped:  # pinned memory goes back to CuPy's pool at once: no queued kernel may read it
            self._synchronize()
        w.payload.mem = None  # cudaFree when the last reference goes (it waits for running kernels)

    # ---- launches --------------------------------------------------------------------------------
    def _stage_args(self, table: list[int], xs, in_pad: int) -> int:
        """Fill pinned [u64 table | x_0 | x_1 ...] (x_i zero-padded to [T_i, in_pad]); returns its bytes.
        The table refers to the x block by the device address it will have: work["args"] + table bytes."""
        tb, rows = len(table) * 8, sum(x.shape[0] for x in xs)
        n = tb + rows * in_pad * 4
        host = self._pinned.get("args", n).a
        self._work.get("args", n)
        staging.stage_rows(xs, in_pad, host[tb:n].view(np.float32).reshape(rows, in_pad))  # [sum T_i, in_pad]
        host[:tb].view(np.uint64)[:] = table
        return n

    def _enqueue(self, n: int, launches, out_ptr: int, out_nbytes: int) -> None:
        rt, s, base = self.rt, self.stream, self._work["args"].ptr
        rt.memcpyAsync(base, self._pinned["args"].ptr, n, rt.memcpyHostToDevice, s.ptr)
        for _ in range(self.kernel_passes):
            for (fn, grid, block, smem, scalars), table_off in launches:
                fn(grid, block, (np.uint64(base + table_off),) + scalars, shared_mem=smem)
        rt.memcpyAsync(self._pinned["out"].ptr, out_ptr, out_nbytes, rt.memcpyDeviceToHost, s.ptr)

    def _run(self, n: int, launches, out_ptr: int, out_nbytes: int) -> np.ndarray:
        """Copy the staged arguments up, launch, copy ``out_nbytes`` back as float32. A work shape and buffers
        seen twice are captured as a CUDA graph, then replayed: one driver call (host time bounds decode)."""
        host_out, s = self._pinned.get("out", out_nbytes).a, self.stream
        key = (self.kernel_passes, n, out_ptr, out_nbytes, self._work["args"].ptr, self._pinned["args"].ptr,
               self._pinned["out"].ptr, tuple((id(lr), off) for lr, off in launches))
        self._timed_run = self.timing
        with self.dev, s:
            graph = self._graphs.get(key)
            if graph is None and self.use_graphs and self._graphs.seen_before(key):
                graph = self._capture(key, n, launches, out_ptr, out_nbytes)
            if self.timing:
                self._events[0].record(s)
            if graph is not None:
                graph.launch(stream=s)
            else:
                self._enqueue(n, launches, out_ptr, out_nbytes)
            if self.timing:
                self._events[1].record(s)
            s.synchronize()
        return host_out[:out_nbytes].view(np.float32).copy()

    def _capture(self, key, *work):
        s = self.stream
        try:
            s.begin_capture()
            try:
                self._enqueue(*work)
            finally:
                graph = s.end_capture()
        except Exception:  # noqa: BLE001 - graphs are an optimisation: fall back to plain launches
            self.use_graphs = False
            return None
        return self._graphs.put(key, graph)  # bounded: the least recently used shape is dropped

    # ---- ops -------------------------------------------------------------------------------------
    def _matmul(self, x: np.ndarray, w) -> np.ndarray:
        p, T, out = w.payload, x.shape[0], w.out_features
        # the x block follows the 8-word table: its device address is known before staging
        y = self._work.get("y", T * out * 4).ptr
        xdev = self._work.get("args", 64 + T * p.in_pad * 4).ptr + 64
        n = self._stage_args([p.data, p.scales, xdev, y, T, 0, 0, 0], [x], p.in_pad)
        # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
        launches = [(self._launcher("mm", w.fmt, 1, out, out, p.in_pad, out, T), 0)]
        return self._run(n, launches, y, T * out * 4).reshape(T, out)

    def _ffn_batch(self, xs, experts, b) -> np.ndarray:
        n, H, I, Hp, Ip, tok = len(experts), b.H, b.I, b.Hp, b.Ip, b.tok
        h = self._work.get("h", tok[-1] * Ip * 4).ptr
        y = self._work.get("y", tok[-1] * H * 4).ptr
        xdev = self._work.get("args", 128 * n + tok[-1] * Hp * 4).ptr + 128 * n
        # table rows 0..n-1: gate/up of each expert; rows n..2n-1: its down; expert i's rows from tok[i]
        table = ffn_table(experts, b.counts, tok[:-1], [xdev + t0 * Hp * 4 for t0 in tok[:-1]], h, y)
        nbytes = self._stage_args(table, xs, Hp)
        Tm, e0 = max(b.counts), experts[0]
        launches = [(self._launcher("gate_up", e0.gate.fmt, n, Ip, I, Hp, Ip, Tm), 0),  # h = SiLU(x.g) * x.u
                    (self._launcher("mm", e0.down.fmt, n, H, H, Ip, H, Tm), 64 * n)]  # y_i = h_i . down^T
        return self._run(nbytes, launches, y, tok[-1] * H * 4).reshape(tok[-1], H)

    # ---- optional ops --------------------------------------------------------------------------
    def d_expert_ffn_rows(self, x: DArray, experts, rows, gates) -> DArray:
        """Routed experts of a prefill on the device x: y [T, H] with y[t] = Σ_i gates[i][k] ·
        down_i(SiLU(x[t]·gate_iᵀ) ⊙ x[t]·up_iᵀ) over the experts i (in order) whose ``rows[i]`` holds t at
        position k. x a float32 [T, H] DArray of this backend; ``experts`` n ExpertWeights of this
        backend; ``rows`` n int arrays of distinct token indices in [0, T); ``gates`` n float32 arrays
        of the same lengths. Queued on the stream (no host wait); experts of mixed kinds run through
        the host (``expert_ffn`` on their gathered rows).

        Raises:
            InputError: x not a 2-D DArray of this backend, counts or lengths that do not match, a row
            outside [0, T), a gate that is not finite, or weights that do not chain with x.
        """
        experts, rows, gates, fused = expert_rows_args(self, x, experts, rows, gates)
        T, H = x.shape
        if not experts:
            return self.d_zeros((T, H))
        if not fused:  # mixed kinds: the host path on each expert's rows, summed in order
            xh = self.d_get(x)
            out = np.zeros((T, H), np.float32)
            for r, g, y in zip(rows, gates, self.expert_ffn([xh[r] for r in rows], experts)):
                out[r] += y * g[:, None]
            return self.d_put(out)
        return DArray((T, H), self._d_expert_rows(x, experts, rows, gates), id(self))


BACKEND = CUDABackend
