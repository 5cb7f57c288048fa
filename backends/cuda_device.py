"""Device activations of the CUDA backend: the ``_d_*`` hooks of :mod:`colibri_plan.backends.device_ops`
as driver calls, mixed into :class:`colibri_plan.backends.cuda.CUDABackend`.

A :class:`~colibri_plan.backends.device_ops.DArray` of this backend holds a 1-D CuPy float32 array
(``buf``, allocated from CuPy's memory pool on the backend's stream) and an element ``offset``; its device
address is ``buf.data.ptr + 4 * offset``. Every op is enqueued on the backend's non-blocking stream and
returns at once: the host waits only in ``d_get`` (and in a ``d_put`` that reuses a staging slot whose
copy has not run yet, or one of more than ``_PUT_RING_BYTES``). Pool memory freed on the stream is reused
in stream order, so dropping a DArray while kernels still read it is safe.

Kernels: ``shaders/cuda/trunk.cu`` (add, SiLU·mul, row scales, RoPE, the matmul table/padding prep),
``matmul.cu`` (``mm``: the quantized weight kernels of the host path; ``rmsnorm``) and ``attention.cu``
(``attention_gqa``, ``attention_combine``). Matmul: ``mm`` reads its pointers from a table in device memory
and x as [T, in_pad] rows. One small kernel writes the table entry (kernel arguments are copied at
launch, so the single table slot needs no host synchronisation: the next prep runs after this mm on the
stream) and, only when ``in`` is not already a multiple of 128 (every common hidden size is), pads x into
a grow-only work buffer: a copy of T·in_pad floats is ~0.1% of the weight bytes mm reads, cheaper than a
second, unpadded variant of every mm instance. Not thread-safe (one stream, one table slot), like the
host-staged ops.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from colibri_plan.backends import _shared as sh
from colibri_plan.backends.device_ops import DArray
from colibri_plan.errors import UnsupportedError

_THREADS = 256  # threads per block of the elementwise, norm and attention kernels
_ATT_TILE = 256  # attention.cu ATT_TILE: keys per tile
_GQA_HEADS = 8  # attention.cu GQA_HEADS: query heads per block
_ATT_MIN_KEYS = 64  # fewest keys per split of a query row's key range (below that, merging costs more)
_PUT_SLOTS = 8  # pinned staging slots of d_put, reused round-robin (an event says when a slot is free)
_PUT_RING_BYTES = 1 << 20  # larger uploads (weights, tables) go through the chunked, synchronous staging
_TRUNK_KERNELS = ("tr_add", "tr_silu_mul", "tr_scale_rows", "tr_rope", "tr_mm_prep")
_u64, _i32, _f32 = np.uint64, np.int32, np.float32


class CUDADeviceOps:
    """The ``_d_*`` hooks on CuPy memory; see the module docstring. Needs the backend's ``cp``, ``rt``,
    ``dev``, ``stream``, ``_sms``, ``_fns``, ``_pinned``, ``_launcher`` and ``_h2d``."""

    # ---- state -----------------------------------------------------------------------------------
    def _d_state(self):
        """Lazily made per-backend state (the simulated and real backends open without it)."""
        st = self.__dict__.get("_dstate")
        if st is None:
            cp = self.cp
            with self.dev:
                events = [cp.cuda.Event(block=False, disable_timing=True) for _ in range(_PUT_SLOTS)]
            st = self._dstate = {"slot": 0, "events": events, "pending": [False] * _PUT_SLOTS,
                                 "names": tuple(f"dput{i}" for i in range(_PUT_SLOTS)),
                                 "work": sh.WorkBuffers(lambda name, n: cp.empty(n, cp.uint8))}
        return st

    def _d_fn(self, name: str):
        """Kernel ``name`` of trunk.cu / attention.cu / matmul.cu (rmsnorm), compiled by NVRTC once per
        source file on first use (CuPy caches the binaries on disk)."""
        fn = self._fns.get(name)
        if fn is None:
            source = ("trunk.cu" if name in _TRUNK_KERNELS else "matmul.cu" if name == "rmsnorm"
                      else "attention.cu")
            with self.dev:
                mod = self._fns.get(source)
                if mod is None:
                    mod = self._fns[source] = self.cp.RawModule(code=sh.kernel_source("cuda", source),
                                                                options=("--std=c++14",))  # cuda.py's
                fn = self._fns[name] = mod.get_function(name)
        return fn

    def _d_empty(self, n: int):
        """float32 [n] from CuPy's pool, on the stream (call inside ``with self.dev, self.stream``)."""
        return self.cp.empty(n, self.cp.float32)

    def _d_work(self, name: str, nbytes: int) -> int:
        """Address of a grow-only device work buffer (pool memory of the stream: call inside ``with
        self.dev, self.stream``; a replaced one is reused in stream order, never while a queued kernel
        still reads it)."""
        return self._d_state()["work"].get(name, nbytes).data.ptr

    @staticmethod
    def _ptr(a: DArray) -> int:
        return a.buf.data.ptr + 4 * a.offset

    @staticmethod
    def _blocks(n: int) -> int:
        return max(1, min(-(-n // _THREADS), 65535))  # grid-stride kernels: any grid covers n

    # ---- transfers -------------------------------------------------------------------------------
    def _d_put(self, a: np.ndarray) -> Any:
        n = a.nbytes
        with self.dev, self.stream:
            out = self._d_empty(a.size)
            if n == 0:
                return out
            dst = out.data.ptr
            if n > _PUT_RING_BYTES:
                self._h2d(dst, a)  # chunked through pinned staging; waits (setup-time uploads)
                return out
            st = self._d_state()
            i = st["slot"] = (st["slot"] + 1) % _PUT_SLOTS
            ev = st["events"][i]
            if st["pending"][i]:
                ev.synchronize()  # that slot's earlier copy has read its pinned bytes (normally long done)
            stage = self._pinned.get(st["names"][i], n)
            stage.a[:n] = a.reshape(-1).view(np.uint8)
            self.rt.memcpyAsync(dst, stage.ptr, n, self.rt.memcpyHostToDevice, self.stream.ptr)
            ev.record(self.stream)
            st["pending"][i] = True
        return out

    def _d_get(self, a: DArray) -> np.ndarray:
        n = a.nbytes
        if n == 0:
            return np.zeros(a.shape, np.float32)
        host = self._pinned.get("dget", n)
        with self.dev:
            self.rt.memcpyAsync(host.ptr, self._ptr(a), n, self.rt.memcpyDeviceToHost, self.stream.ptr)
            self.stream.synchronize()  # the one host synchronisation of the device ops
        return host.a[:n].view(np.float32).reshape(a.shape).copy()

    def _d_zeros(self, shape: tuple[int, ...]) -> Any:
        with self.dev, self.stream:
            return self.cp.zeros(math.prod(shape), self.cp.float32)  # a memset on the stream

    def _d_write_rows(self, dst: DArray, row0: int, src: DArray) -> None:
        n = src.nbytes
        if n:
            row_bytes = 4 * math.prod(dst.shape[1:])
            with self.dev:
                self.rt.memcpyAsync(self._ptr(dst) + row0 * row_bytes, self._ptr(src), n,
                                    self.rt.memcpyDeviceToDevice, self.stream.ptr)

    # ---- kernels ---------------------------------------------------------------------------------
    def _d_launch(self, name: str, n_out: int, grid: int, args: tuple):
        """A new float32 [n_out] y and one launch of ``name`` with ``args`` where "y" stands for y's
        address (skipped when there is no work)."""
        fn = self._d_fn(name)
        with self.dev, self.stream:
            y = self._d_empty(n_out)
            if n_out:
                yp = _u64(y.data.ptr)
                fn((grid,), (_THREADS,), tuple(yp if a is None else a for a in args))
        return y

    def _d_elementwise(self, name: str, a: DArray, *args) -> Any:
        n = a.size
        return self._d_launch(name, n, self._blocks(n), (_u64(self._ptr(a)),) + args)

    def _d_add(self, a: DArray, b: DArray) -> Any:
        n, d = a.size, a.shape[1]
        # y = a + b; b [d] broadcast over the rows
        return self._d_elementwise("tr_add", a, _u64(self._ptr(b)), None, _u64(n), _i32(d),
                                   _i32(b.shape != a.shape))

    def _d_silu_mul(self, g: DArray, u: DArray) -> Any:
        return self._d_elementwise("tr_silu_mul", g, _u64(self._ptr(u)), None, _u64(g.size))

    def _d_scale_rows(self, a: DArray, s: np.ndarray) -> Any:
        # decode (one row): the scale goes as a kernel argument; else s [N] is put on the device, held
        # until the launch is queued (freed earlier, y could be allocated on top of it)
        held = self._d_put(s) if s.shape[0] > 1 else None
        sp = 0 if held is None else held.data.ptr
        y = self._d_elementwise("tr_scale_rows", a, _u64(sp), _f32(s[0]), None, _u64(a.size),
                                _i32(a.shape[1]))
        del held  # back to the pool of the stream: reused only by work queued after this kernel
        return y

    def _d_rope(self, x: DArray, table: DArray, pos0: int, rotary_dim: int, interleave: bool) -> Any:
        t, heads, d = x.shape
        return self._d_elementwise("tr_rope", x, _u64(self._ptr(table)), None, _u64(x.size), _i32(heads),
                                   _i32(d), _i32(rotary_dim), _i32(pos0), _i32(interleave))

    def _d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> Any:
        rows, d = x.shape  # a block per row
        return self._d_launch("rmsnorm", x.size, rows, (_u64(self._ptr(x)), _u64(self._ptr(weight)), None,
                                                        _i32(d), _f32(eps)))

    def _d_matmul(self, x: DArray, w) -> Any:
        p, (T, n_in), out = w.payload, x.shape, w.out_features
        xp = self._ptr(x)
        fn, mgrid, mblock, smem, scalars = self._launcher("mm", w.fmt, 1, out, out, p.in_pad, out, max(T, 1))
        prep = self._d_fn("tr_mm_prep")
        with self.dev, self.stream:
            if T == 0:
                return self._d_empty(0)
            table = self._d_work("mm_table", 64)
            if n_in != p.in_pad or xp % 16:  # mm stages x as 16-byte aligned rows of in_pad floats
                xpad, grid = self._d_work("mm_x", T * p.in_pad * 4), self._blocks(T * p.in_pad)
            else:
                xpad, grid = xp, 1  # x already is [T, in_pad]: only the table entry is written
            y = self._d_empty(T * out)  # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
            prep((grid,), (_THREADS,), (_u64(table), _u64(p.data), _u64(p.scales), _u64(xp), _u64(xpad),
                                        _u64(y.data.ptr), _i32(T), _i32(n_in), _i32(p.in_pad)))
            fn(mgrid, mblock, (_u64(table),) + scalars, shared_mem=smem)
        return y

    def _d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                     window: int) -> Any:
        T, hq, d = q.shape
        hkv = k.shape[1]
        if T == 0:
            with self.dev, self.stream:
                return self._d_empty(0)
        if d > _THREADS:
            raise UnsupportedError(f"cuda d_attention: head_dim {d} > {_THREADS} is not supported")
        chunks = -(-(hq // hkv) // _GQA_HEADS)
        keys = min(pos0 + T, window) if window > 0 else pos0 + T  # the longest query row's key range
        base = T * hkv * chunks
        # split the keys when (row, kv head) blocks alone would leave SMs idle (decode at long contexts)
        splits = max(1, min(-(-keys // _ATT_MIN_KEYS), -(-4 * self._sms // base), 1024))
        smem = 4 * (_GQA_HEADS * (d + _ATT_TILE + _THREADS) + 3 * _GQA_HEADS)  # < 48 KiB: no opt-in
        fn = self._d_fn("attention_gqa")
        combine = self._d_fn("attention_combine") if splits > 1 else None
        with self.dev, self.stream:
            y = self._d_empty(T * hq * d)  # [T, Hq * d]
            yp = _u64(y.data.ptr)
            # splits > 1: slices into part [T * Hq, splits, d + 2], merged into y by attention_combine
            part = _u64(self._d_work("att_part", 4 * T * hq * splits * (d + 2)) if combine else 0)
            fn((T, hkv * chunks, splits), (_THREADS,),
               (_u64(self._ptr(q)), _u64(self._ptr(k)), _u64(self._ptr(v)), _u64(0) if combine else yp, part,
                _i32(hq), _i32(hkv), _i32(d), _i32(pos0), _i32(window), _f32(scale), _i32(splits)),
               shared_mem=smem)
            if combine is not None:
                combine((T * hq,), (128,), (part, yp, _i32(d), _i32(splits)))
        return y
