"""Device activations of the CUDA backend: :class:`CudaDeviceOps`, the part whose ``_d_*`` hooks
(:mod:`colibri_plan.backends.device_ops`) :class:`~colibri_plan.backends.cuda.backend.CUDABackend` binds at
open, as driver calls.

A :class:`~colibri_plan.backends.device_ops.DArray` of this backend holds a 1-D CuPy float32 array
(``buf``, allocated from CuPy's memory pool on the backend's stream) and an element ``offset``; its device
address is ``buf.data.ptr + 4 * offset``. Every op is enqueued on the backend's non-blocking stream and
returns at once: the host waits only in ``d_get`` (and in a ``d_put`` that reuses a staging slot whose
copy has not run yet, or one of more than ``_PUT_RING_BYTES``). Pool memory freed on the stream is reused
in stream order, so dropping a DArray while kernels still read it is safe.

Kernels: ``shaders/cuda/trunk.cu`` (add, SiLU·mul, row scales, RoPE, row padding), ``matmul.cu``
(``mm_args``: the quantized weight kernels of the host path with their table entries as a kernel argument;
``rmsnorm``) and ``attention.cu`` (``attention_gqa``, ``attention_combine``); ``d_head_matmul`` is one
cuBLAS strided-batched SGEMM and the block write of ``d_write_rows`` one ``cudaMemcpy2DAsync``.

Host cost per op is what bounds decode (a layer is ~15 ops of a few µs of GPU time each), so an op is
a pool allocation and a direct ``cuLaunchKernel`` with a parameter block made once per kernel and
overwritten per call (:class:`_Launch`; ``RawKernel.__call__`` spends ~20 µs converting arguments), and
the backend's device and stream are made current on the calling thread once (:meth:`_d_go`), not
entered per op. Matmul: one launch of ``mm_args`` whose table entries (weights, scales, x, y, T, rows)
travel as kernel arguments; :meth:`_d_matmul_many` puts up to ``_MM_ARGS_MAX`` matrices that read the
same x (q/k/v, gate/up) in one launch. x is read in place when it already is [T, in_pad] rows at a
16-byte aligned address (every common hidden size is a multiple of 128); otherwise ``tr_pad_rows``
first copies it into a grow-only work buffer (T·in_pad floats, ~0.1% of the weight bytes mm reads,
cheaper than an unpadded variant of every mm instance). Not thread-safe (one stream, one parameter
block per kernel), like the host-staged ops.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import struct
import threading
from typing import Any

import numpy as np

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.pools import WorkBuffers
from colibri_plan.errors import UnsupportedError

_THREADS = 256  # threads per block of the elementwise, norm and attention kernels
_RMS_WARP_MAX = 1024  # rmsnorm rows up to this width: one warp per row (matmul.cu RMS_VEC float4s a lane)
_ATT_TILE = 256  # attention.cu ATT_TILE: keys per tile
_GQA_HEADS = 8  # attention.cu GQA_HEADS: query heads per block
ATT_MAX_HEAD_DIM = 608  # widest head_dim whose attention_gqa block fits 48 KiB of shared memory (d threads)
# fewest keys per split of a query row's key range: 8 with captured slices per doubling decoded 64 tokens
# after 16 at 470 tok/s, 64 at 454 (H200, 24 layers; bench/results/h200-step-profile-r3/prof-bucket-8.json)
_ATT_MIN_KEYS = 8
# a captured step's slices: "bucket" counts its keys as the power of two above them (a graph per doubling),
# "fill" as many as fill the SMs at any context (one graph; short contexts leave slices empty), "exact"
# the eager count (a graph per _ATT_MIN_KEYS keys)
_ATT_CAPTURED = "bucket"
_PUT_SLOTS = 8  # pinned staging slots of d_put, reused round-robin (an event says when a slot is free)
_PUT_RING_BYTES = 1 << 20  # larger uploads (weights, tables) go through the chunked, synchronous staging
_MM_ARGS_MAX = 4  # matmul.cu MM_ARGS_MAX: matrices per mm_args launch
# float32 weights (routers) at this many tokens or more go to cuBLAS: the GEMV's 4-token passes over a
# 32-row router at a 512-token prefill were 570 us a layer on an H200 (bench/results/h200-step-profile-r3)
_BLAS_MIN_TOKENS = 16
_ZEROS = (0,) * (8 * _MM_ARGS_MAX)  # the table entries an mm_args launch leaves unused
# parameter kinds of each kernel, in the order of its CUDA signature: p pointer / u64, i int, f float,
# t matmul.cu's MMArgs (8 · _MM_ARGS_MAX u64 by value)
_SIGNATURES = {"tr_add": "pppqii", "tr_silu_mul": "pppq", "tr_scale_rows": "ppfpqi", "tr_rope": "pppqiiiii",
               "tr_pad_rows": "ppiii", "rmsnorm": "pppppif", "attention_gqa": "pppppiiiiifi",
               "attention_combine": "ppii", "mm_args": "tiiii", "tr_expert_sum": "pppqi",
               "tr_expert_scatter": "ppppqii",
               "route_topk": "ppppiiiiiiiiff", "route_fused": "pppppppppqqqiiiiiiiiiiiff",
               # a captured decode step's (backends/cuda/graph.py): the position read from device memory
               "tr_rope_at": "pppqiiipii", "tr_copy_rows_at": "ppqqpi", "tr_expert_table": "ppppiqqqii",
               "attention_gqa_at": "pppppiiipiifi", "tr_qkv_prologue": "pppppppppiiiiiifi",
               "tr_qkv_prologue_at": "pppppppppiiiiiifpi",  # backends/cuda/prologue.py's
               "gate_up": "piiii", "mm": "piiii"}  # gate_up, mm: the host path's, table in device memory
_CURRENT = threading.local()  # .token: the backend whose device and stream this thread has made current
_TOKENS = itertools.count(1)  # one per backend state (an id() could be reused by a later backend)
_PACK = {"p": "Q", "q": "Q", "i": "i4x", "f": "f4x", "t": f"{8 * _MM_ARGS_MAX}Q"}  # one 8-byte slot each


def rms_threads(d: int) -> int:
    """Threads per block (one row) of matmul.cu's ``rmsnorm`` for rows of ``d`` floats: 32 up to
    ``_RMS_WARP_MAX`` (no shared memory, no block barrier), else ``_THREADS``."""
    return 32 if d <= _RMS_WARP_MAX else _THREADS


class _Launch:
    """A kernel with its own parameter block: each call packs the arguments over the last call's (the
    driver copies them at launch, so nothing waits) and calls ``cuLaunchKernel`` directly.

    Args:
        fn: a CuPy RawKernel (its ``kernel.ptr`` is the CUfunction of the current device).
        signature: parameter kinds (``_SIGNATURES``).
        launch_kernel: ``cupy.cuda.driver.launchKernel``.
    """

    __slots__ = ("fn", "fptr", "_pack", "_buf", "_params", "_pptr", "_launch")

    def __init__(self, fn, signature: str, launch_kernel):
        layout = struct.Struct("<" + "".join(_PACK[c] for c in signature))
        offsets, off = [], 0
        for c in signature:  # each parameter starts at its slot; MMArgs takes 8 · _MM_ARGS_MAX bytes
            offsets.append(off)
            off += struct.calcsize("<" + _PACK[c])
        self.fn, self.fptr, self._pack, self._launch = fn, fn.kernel.ptr, layout.pack_into, launch_kernel
        self._buf = ctypes.create_string_buffer(layout.size)
        base = ctypes.addressof(self._buf)
        self._params = (ctypes.c_void_p * len(offsets))(*(base + o for o in offsets))  # void *args[]
        self._pptr = ctypes.addressof(self._params)

    def __call__(self, gx: int, gy: int, gz: int, block: int, smem: int, stream: int, *args) -> None:
        self._pack(self._buf, 0, *args)
        self._launch(self.fptr, gx, gy, gz, block, 1, 1, smem, stream, self._pptr, 0)


class CudaDeviceOps:
    """The ``_d_*`` hooks on CuPy memory (see the module docstring).

    Args:
        backend: the open CUDA backend (its device, stream, pinned staging, kernels and launch shapes).
    """

    HOOKS = ("_d_put", "_d_get", "_d_zeros", "_d_write_rows", "_d_write_block", "_d_head_matmul", "_d_add",
             "_d_silu_mul", "_d_scale_rows", "_d_rope", "_d_rmsnorm", "_d_add_rmsnorm", "_d_matmul",
             "_d_matmul_many", "_d_attention")

    def __init__(self, backend):
        b = self.be = backend
        self.cp, self.rt, self.dev, self.stream, self._sms = b.cp, b.rt, b.dev, b.stream, b._sms
        self._pinned, self._h2d, self._launcher = b._pinned, b._h2d, b._launcher
        self._module_fn, self._index, self._dstate = b._module_fn, int(b.device.index), None
        # while a decode step is captured (backends/cuda/graph.py): NS(posp, pos, slot): the device address
        # of the step's position (int32) and its value at capture, and slot(ptr): the device address of the
        # input slot that holds a cache array's address (the cache ops read them there)
        self.graph = None

    def close(self) -> None:
        self._dstate = None  # its events, work buffers and launches

    # ---- state -----------------------------------------------------------------------------------
    def _d_state(self):
        """Lazily made state (the simulated and real backends open without it)."""
        st = self._dstate
        if st is None:
            cp = self.cp
            with self.dev:
                events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(_PUT_SLOTS)]
            st = self._dstate = {"slot": 0, "events": events, "pending": [False] * _PUT_SLOTS,
                                 "names": tuple(f"dput{i}" for i in range(_PUT_SLOTS)),
                                 "work": WorkBuffers(lambda name, n: cp.empty(n, cp.uint8)),
                                 "launches": {}, "index": self._index, "sptr": self.stream.ptr,
                                 "token": next(_TOKENS), "ndarray": cp.ndarray, "f32": cp.float32}
        return st

    def _d_go(self) -> None:
        """Make this backend's device and stream the calling thread's current ones unless this backend
        did so last on this thread: CuPy's pool then hands out memory of the stream (freed blocks are
        reused in stream order) and its memsets run there. Per op, a thread-local read and
        cudaGetDevice (which catches another device made current behind our back); the switch happens
        once per thread, and again after another CUDA backend's device op on it. (``with`` blocks of
        the host-staged ops restore this state on exit.)"""
        st = self._dstate or self._d_state()
        if getattr(_CURRENT, "token", 0) != st["token"] or self.rt.getDevice() != st["index"]:
            self.dev.use()
            self.stream.use()
            _CURRENT.token = st["token"]

    def _d_kernel(self, name: str, fn=None) -> _Launch:
        """The :class:`_Launch` of kernel ``name`` (``Launcher.module_fn``), or of ``fn``, a matmul.cu
        instance of kernel ``name`` from the backend's launcher."""
        launches = self._d_state()["launches"]
        key = name if fn is None else id(fn)
        k = launches.get(key)
        if k is None:
            fn = self._module_fn(name) if fn is None else fn
            with self.dev:  # kernel.ptr: the CUfunction of this device
                k = launches[key] = _Launch(fn, _SIGNATURES[name], self.cp.cuda.driver.launchKernel)
        return k

    def _d_empty(self, n: int):
        """float32 [n] from CuPy's pool, on the stream (after :meth:`_d_go`); ``cupy.ndarray`` itself,
        not ``cupy.empty``'s wrapper."""
        st = self._dstate
        return st["ndarray"]((n,), st["f32"])

    def _d_work(self, name: str, nbytes: int) -> int:
        """Address of a grow-only device work buffer (pool memory of the stream, after :meth:`_d_go`; a
        replaced one is reused in stream order, never while a queued kernel still reads it)."""
        return self._d_state()["work"].get(name, nbytes).data.ptr

    @staticmethod
    def _ptr(a: DArray) -> int:
        return a.buf.data.ptr + 4 * a.offset

    @staticmethod
    def _blocks(n: int) -> int:
        return max(1, min(-(-n // _THREADS), 65535))  # grid-stride kernels: any grid covers n

    # ---- transfers -------------------------------------------------------------------------------
    def _d_put(self, a: np.ndarray) -> Any:
        if self.graph is not None:  # a replay would read whatever the staging slot holds by then
            raise UnsupportedError("cuda: a host upload (d_put) inside a captured decode step")
        n = a.nbytes
        self._d_go()
        out = self._d_empty(a.size)
        if n == 0:
            return out
        dst = out.data.ptr
        if n > _PUT_RING_BYTES:
            self._h2d(dst, a)  # chunked through pinned staging; waits (setup-time uploads)
            return out
        st = self._dstate
        i = st["slot"] = (st["slot"] + 1) % _PUT_SLOTS
        ev = st["events"][i]
        if st["pending"][i]:
            ev.synchronize()  # that slot's earlier copy has read its pinned bytes (normally long done)
        stage = self._pinned.get(st["names"][i], n)
        stage.a[:n] = a.reshape(-1).view(np.uint8)
        self.rt.memcpyAsync(dst, stage.ptr, n, self.rt.memcpyHostToDevice, st["sptr"])
        ev.record(self.stream)
        st["pending"][i] = True
        return out

    def _d_get(self, a: DArray) -> np.ndarray:
        if self.graph is not None:
            raise UnsupportedError("cuda: a host read (d_get) inside a captured decode step")
        n = a.nbytes
        if n == 0:
            return np.zeros(a.shape, np.float32)
        host = self._pinned.get("dget", n)
        self._d_go()
        self.rt.memcpyAsync(host.ptr, self._ptr(a), n, self.rt.memcpyDeviceToHost, self.stream.ptr)
        self.stream.synchronize()  # the one host synchronisation of the device ops
        return host.a[:n].view(np.float32).reshape(a.shape).copy()

    def _d_zeros(self, shape: tuple[int, ...]) -> Any:
        self._d_go()
        return self.cp.zeros(math.prod(shape), self.cp.float32)  # a memset on the stream

    def _d_write_rows(self, dst: DArray, row0: int, src: DArray) -> None:
        n = src.nbytes
        g = self.graph
        if n and g is not None:  # rows at the step's position, read on the device
            self._d_go()
            self._d_kernel("tr_copy_rows_at")(self._blocks(src.size), 1, 1, _THREADS, 0, self._dstate["sptr"],
                                              self._ptr(src), g.slot(self._ptr(dst)), src.size,
                                              math.prod(dst.shape[1:]), g.posp, row0 - g.pos)
        elif n:
            row_bytes = 4 * math.prod(dst.shape[1:])
            self._d_go()
            self.rt.memcpyAsync(self._ptr(dst) + row0 * row_bytes, self._ptr(src), n,
                                self.rt.memcpyDeviceToDevice, self.stream.ptr)

    def _d_write_block(self, dst: DArray, row0: int, col0: int, src: DArray) -> None:
        if self.graph is not None:
            raise UnsupportedError("cuda: a cache block write (MLA) inside a captured decode step")
        (t, w), d = src.shape, dst.shape[1]
        if t and w:  # one cudaMemcpy2DAsync: T rows of W floats into rows of D floats from column col0
            self._d_go()
            self.rt.memcpy2DAsync(self._ptr(dst) + 4 * (row0 * d + col0), 4 * d, self._ptr(src), 4 * w, 4 * w,
                                  t, self.rt.memcpyDeviceToDevice, self.stream.ptr)

    def _d_head_matmul(self, x: DArray, w: DArray) -> Any:
        """y[t, b] = w[b] · x[t, b] as one cuBLAS strided-batched SGEMM over the B heads, written straight
        in y's [T, B, N] layout: column-major C_b (N x T, ld B·N) = W_b^T-op (N x K) · X_b (K x T, ld B·K)."""
        (T, B, K), N = x.shape, w.shape[1]
        self._d_go()
        y = self._d_empty(T * B * N)
        if y.size:
            st = self._dstate
            blas, handle = st.get("cublas") or self._d_cublas()
            blas.setStream(handle, st["sptr"])
            blas.sgemmStridedBatched(handle, blas.CUBLAS_OP_T, blas.CUBLAS_OP_N, N, T, K, st["one"],
                                     self._ptr(w), K, N * K, self._ptr(x), B * K, K, st["zero"], y.data.ptr,
                                     B * N, N, B)
        return y

    def _d_cublas(self):
        """(CuPy's cuBLAS module, this device's handle in host pointer mode), made once; alpha 1 and beta 0
        as host floats whose addresses the calls pass."""
        import importlib

        cp, st = self.cp, self._dstate
        blas = getattr(cp.cuda, "cublas", None) or importlib.import_module("cupy_backends.cuda.libs.cublas")
        with self.dev:
            handle = cp.cuda.device.get_cublas_handle()
        blas.setPointerMode(handle, blas.CUBLAS_POINTER_MODE_HOST)
        st["scalars"] = np.array([1.0, 0.0], np.float32)  # kept alive with the state
        st["one"], st["zero"] = st["scalars"].ctypes.data, st["scalars"].ctypes.data + 4
        st["cublas"] = (blas, handle)
        return st["cublas"]

    # ---- kernels ---------------------------------------------------------------------------------
    # (the hot path: a decode layer is ~15 of these, each a few µs of Python around one driver call)
    def _d_launch(self, name: str, n_out: int, grid: int, yi: int, *args, threads: int = _THREADS):
        """A new float32 [n_out] y and one launch of ``name`` (blocks of ``threads``) with y's address
        inserted at parameter ``yi`` of ``args`` (skipped when there is no work)."""
        self._d_go()
        st = self._dstate
        k = st["launches"].get(name) or self._d_kernel(name)
        y = st["ndarray"]((n_out,), st["f32"])  # _d_empty
        if n_out:
            k(grid, 1, 1, threads, 0, st["sptr"], *args[:yi], y.data.ptr, *args[yi:])
        return y

    def _d_elementwise(self, name: str, a: DArray, yi: int, *args) -> Any:
        n = a.size  # grid-stride kernels: any grid covers n (_blocks)
        return self._d_launch(name, n, min(-(-n // _THREADS), 65535) or 1, yi, self._ptr(a), *args)

    def _d_add(self, a: DArray, b: DArray) -> Any:
        # y = a + b; b [d] broadcast over the rows
        return self._d_elementwise("tr_add", a, 2, self._ptr(b), a.size, a.shape[1], int(b.shape != a.shape))

    def _d_silu_mul(self, g: DArray, u: DArray) -> Any:
        return self._d_elementwise("tr_silu_mul", g, 2, self._ptr(u), g.size)

    def _d_scale_rows(self, a: DArray, s: np.ndarray) -> Any:
        # decode (one row): the scale goes as a kernel argument; else s [N] is put on the device, held
        # until the launch is queued (freed earlier, y could be allocated on top of it)
        held = self._d_put(s) if s.shape[0] > 1 else None
        sp = 0 if held is None else held.data.ptr
        y = self._d_elementwise("tr_scale_rows", a, 3, sp, float(s[0]), a.size, a.shape[1])
        del held  # back to the pool of the stream: reused only by work queued after this kernel
        return y

    def _d_rope(self, x: DArray, table: DArray, pos0: int, rotary_dim: int, interleave: bool) -> Any:
        t, heads, d = x.shape
        g = self.graph
        if g is not None:  # positions from the step's device position
            return self._d_elementwise("tr_rope_at", x, 2, self._ptr(table), x.size, heads, d, rotary_dim,
                                       g.posp, pos0 - g.pos, int(interleave))
        return self._d_elementwise("tr_rope", x, 2, self._ptr(table), x.size, heads, d, rotary_dim, pos0,
                                   int(interleave))

    def _d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> Any:
        rows, d = x.shape  # a block per row: one warp for short rows (per-head norms), else _THREADS
        return self._d_launch("rmsnorm", x.size, rows, 3, self._ptr(x), 0, self._ptr(weight), 0, d, eps,
                              threads=rms_threads(d))

    def _d_add_rmsnorm(self, a: DArray, b: DArray, weight: DArray, eps: float) -> tuple[Any, Any]:
        # h = a + b and rmsnorm(h) in one launch (rmsnorm's b, h): the bits of d_add then d_rmsnorm
        rows, d = a.shape
        self._d_go()
        h = self._d_empty(a.size)
        y = self._d_launch("rmsnorm", a.size, rows, 3, self._ptr(a), self._ptr(b), self._ptr(weight),
                           h.data.ptr, d, eps, threads=rms_threads(d))
        return h, y

    def _d_matmul(self, x: DArray, w) -> Any:
        T, n_in = x.shape
        self._d_go()
        y = self._d_empty(T * w.out_features)
        if T:
            self._d_mm_launch(self._ptr(x), T, n_in, (w,), (y,))
        return y

    def _d_matmul_many(self, x: DArray, ws) -> list:
        """y_i [T, out_i] = x [T, in_pad] · W_i [out_i, in_pad]ᵀ: one mm_args launch per run of up to
        _MM_ARGS_MAX consecutive weights of one format and row length (q/k/v, gate/up)."""
        T, n_in = x.shape
        self._d_go()
        ys = [self._d_empty(T * w.out_features) for w in ws]
        if T == 0:
            return ys
        xp, i = self._ptr(x), 0
        while i < len(ws):
            fmt, in_pad = ws[i].fmt, ws[i].payload.in_pad
            j = i + 1
            while (j < len(ws) and j - i < _MM_ARGS_MAX and ws[j].fmt == fmt
                   and ws[j].payload.in_pad == in_pad):
                j += 1
            self._d_mm_launch(xp, T, n_in, ws[i:j], ys[i:j])
            i = j
        return ys

    def _d_mm_launch(self, xp: int, T: int, n_in: int, ws, ys) -> None:
        """One mm_args launch: y_m = x · W_mᵀ for the (at most _MM_ARGS_MAX) weights ``ws`` of one
        format and in_pad, x at device address ``xp`` [T, n_in] (padded first when it must be)."""
        n, in_pad = len(ws), ws[0].payload.in_pad
        rows = ws[0].out_features if n == 1 else max(w.out_features for w in ws)
        sptr = self._dstate["sptr"]
        xp = self._d_padded(xp, T, n_in, in_pad)
        if T >= _BLAS_MIN_TOKENS and ws[0].fmt == "f32":  # routers at prefill: one SGEMM each, not T/4 passes
            blas, handle = self._dstate.get("cublas") or self._d_cublas()
            blas.setStream(handle, sptr)
            for w, y in zip(ws, ys):  # column-major y (out x T) = W^T-op (out x in_pad) . x (in_pad x T)
                out, st = w.out_features, self._dstate
                blas.sgemmStridedBatched(handle, blas.CUBLAS_OP_T, blas.CUBLAS_OP_N, out, T, in_pad,
                                         st["one"], w.payload.data, in_pad, 0, xp, in_pad, 0, st["zero"],
                                         y.data.ptr, out, 0, 1)
            return
        fn, (blocks, _), (block,), smem, scalars = self._launcher("mm_args", ws[0].fmt, n, rows, rows, in_pad,
                                                                  rows, T)
        table = []  # entry m: W, S, x, y, T, rows, y_stride (y [T, out]), 0; unused entries 0
        for w, y in zip(ws, ys):
            p, out = w.payload, w.out_features
            table += (p.data, p.scales, xp, y.data.ptr, T, out, out, 0)
        k = self._dstate["launches"].get(id(fn)) or self._d_kernel("mm_args", fn)
        k(blocks, n, 1, block, smem, sptr, *table, *_ZEROS[:8 * (_MM_ARGS_MAX - n)], *scalars)

    def _d_padded(self, xp: int, T: int, n_in: int, in_pad: int) -> int:
        """Address of x [T, n_in] at ``xp`` as the matmul.cu kernels stage it, 16-byte aligned rows of
        ``in_pad`` floats: ``xp`` itself when it already is, else a work buffer ``tr_pad_rows`` fills."""
        if n_in == in_pad and xp % 16 == 0:
            return xp
        pad = self._d_work("mm_x", T * in_pad * 4)
        self._d_kernel("tr_pad_rows")(self._blocks(T * in_pad), 1, 1, _THREADS, 0, self._dstate["sptr"], xp,
                                      pad, T, n_in, in_pad)
        return pad

    def attention_splits(self, T: int, hq: int, hkv: int, keys: int, captured: bool = False) -> int:
        """Slices of each query row's ``keys`` keys that ``d_attention`` launches: more when (row, kv head)
        blocks alone would leave SMs idle (decode at long contexts). A captured step holds its count, so
        there ``keys`` counts as _ATT_CAPTURED says: a graph serves many contexts, not _ATT_MIN_KEYS keys
        (the kernel divides the step's real keys among the slices; a slice may be empty)."""
        if (captured or T == 1) and _ATT_CAPTURED != "exact":  # eager decode too: a replay's bits
            keys = 1 << 30 if _ATT_CAPTURED == "fill" else 1 << max(0, keys - 1).bit_length()
        base = T * hkv * -(-(hq // hkv) // _GQA_HEADS)
        return max(1, min(-(-keys // _ATT_MIN_KEYS), -(-4 * self._sms // base), 1024))

    def _d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                     window: int) -> Any:
        T, hq, d = q.shape
        hkv = k.shape[1]
        if T == 0:
            self._d_go()
            return self._d_empty(0)
        # a thread per channel: 256 up to head_dim 256, else d in whole warps (MLA's 64 + 512 = 576; the
        # kernel's 64 registers a thread allow 1024), as long as a block's smem stays in 48 KiB (no opt-in)
        threads = _THREADS if d <= _THREADS else -(-d // 32) * 32
        smem = 4 * (_GQA_HEADS * (d + _ATT_TILE + threads) + 3 * _GQA_HEADS)
        if d > ATT_MAX_HEAD_DIM:
            raise UnsupportedError(f"cuda d_attention: head_dim {d} is over {ATT_MAX_HEAD_DIM}, the most a "
                                   "block's 48 KiB of shared memory holds; run it on another backend")
        chunks = -(-(hq // hkv) // _GQA_HEADS)
        keys = min(pos0 + T, window) if window > 0 else pos0 + T  # the longest query row's key range
        g = self.graph
        splits = self.attention_splits(T, hq, hkv, keys, g is not None)
        gqa = self._d_kernel("attention_gqa" if g is None else "attention_gqa_at")
        combine = self._d_kernel("attention_combine") if splits > 1 else None
        self._d_go()
        sptr = self._dstate["sptr"]
        y = self._d_empty(T * hq * d)  # [T, Hq * d]
        yp = y.data.ptr
        # splits > 1: slices into part [T * Hq, splits, d + 2], merged into y by attention_combine
        part = self._d_work("att_part", 4 * T * hq * splits * (d + 2)) if combine else 0
        # a captured step reads the position and the cache's addresses on the device
        pos, kv = ((pos0,), (self._ptr(k), self._ptr(v))) if g is None else (
            (g.posp, pos0 - g.pos), (g.slot(self._ptr(k)), g.slot(self._ptr(v))))
        gqa(T, hkv * chunks, splits, threads, smem, sptr, self._ptr(q), *kv, 0 if combine else yp, part, hq,
            hkv, d, *pos, window, scale, splits)
        if combine is not None:
            combine(T * hq, 1, 1, 128, 0, sptr, part, yp, d, splits)
        return y
