"""Device activations (``d_*``) of the OpenCL backend: :class:`OpenCLDeviceOps`, the part whose ``_d_*``
hooks (:mod:`colibri_plan.backends.device_ops`) :class:`~colibri_plan.backends.opencl.backend.OpenCLBackend`
binds at open.

A DArray's ``buf`` is a pyopencl buffer (a ``PooledBuffer`` of the backend's memory pool, back in the
pool when dropped), ``offset`` counts floats. Every op is enqueued on the backend's one in-order queue
(so a recycled buffer is rewritten only after the work reading it), and only ``d_get`` waits. Uploads
copy the host array and keep pyopencl's transfer event (which owns the copy) until a blocking read.

Kernels: matmul.cl (``matmul``, ``matmul_many``: x read in place, or zero-padded by a device pass;
``gate_up`` of the experts), norm.cl, trunk.cl (elementwise, RoPE, ``expert_sum``, ``head_matmul``),
attention.cl (``attention_gqa``, split over the keys on GPUs for decode); the block write of
``d_write_rows`` is one rectangular copy (clEnqueueCopyBufferRect).

Routed experts (``_d_expert_ffn``): the host path's kernels (``OpenCLBackend._ffn_batch``), per expert
``gate_up`` (h_i = SiLU(x·gate_iᵀ) ⊙ x·up_iᵀ, [T, I_pad], zero in the padding) then ``matmul``
(y_i = h_i·down_iᵀ, [T, H]), all reading the device x, then ``expert_sum`` (y = Σ_i gates[i]·y_i into a
fresh [T, H] buffer, in the host's order and float32 roundings). The only transfer is the upload of the
n float32 gates; nothing waits. Experts whose gate and up formats differ take the contract's host path.

The part reads the backend's work-group settings (``ls``, ``attn_tile``, ``attn_splits``) and launches
through its ``_launch`` at call time, so a caller may change them after open.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from colibri_plan.backends.batched import ffn_fusable
from colibri_plan.backends.device_ops import DeviceOps
from colibri_plan.backends.handles import DArray
from colibri_plan.errors import UnsupportedError

_OOM_CODES = ("MEM_OBJECT_ALLOCATION_FAILURE", "OUT_OF_RESOURCES", "OUT_OF_HOST_MEMORY",
              "INVALID_BUFFER_SIZE")
MANY = 4  # most matrices of one matmul_many launch (its W/S/y argument slots)


def is_oom(cl, exc) -> bool:
    """Whether the pyopencl error ``exc`` is the driver running out of memory."""
    return any(getattr(cl.status_code, c, None) == exc.code for c in _OOM_CODES)


class OpenCLDeviceOps:
    """The ``_d_*`` hooks on pyopencl buffers (module docstring).

    Args:
        backend: the open OpenCL backend (its context, queue, memory pool, kernels and launch).
    """

    HOOKS = ("_d_put", "_d_get", "_d_zeros", "_d_matmul", "_d_matmul_many", "_d_rmsnorm", "_d_add",
             "_d_silu_mul", "_d_scale_rows", "_d_rope", "_d_write_rows", "_d_write_block", "_d_head_matmul",
             "_d_attention", "_d_expert_ffn")

    def __init__(self, backend):
        b = self.be = backend
        self.cl, self.queue, self.dev, self.ew = b.cl, b.queue, b.dev, b.ew
        self._pool, self._inflight, self._kernel, self._tpi = b._pool, b._inflight, b._kernel, b._tpi

    def _alloc(self, nbytes: int):
        try:
            return self._pool.allocate(max(4, int(nbytes)))
        except self.cl.Error as exc:
            if not is_oom(self.cl, exc):
                raise
            raise self.be._oom(f"cannot allocate {nbytes} B of activations: {exc}", nbytes) from exc

    def _d_put(self, host: np.ndarray) -> Any:
        """A buffer holding a copy of ``host``, filled without waiting: pyopencl's event owns the copy and
        waits for the transfer when dropped, so events are kept until a blocking read drains the queue."""
        buf = self._alloc(host.nbytes)
        if host.nbytes:
            self._inflight.append(self.cl.enqueue_copy(self.queue, buf, host.copy(), is_blocking=False))
            if len(self._inflight) > 256:
                self._inflight.popleft()  # the oldest transfer: long finished, dropping it does not wait
        return buf

    def _ew(self, name: str, n: int, *args):
        """A ``trunk.cl`` kernel making n floats (a new buffer, returned); grid rounded up to whole groups."""
        y = self._alloc(4 * n)
        if n:
            self._kernel(name, None)(self.queue, (-(-n // self.ew) * self.ew,), (self.ew,), y, n, *args)
        return y

    def _flat(self, a: DArray):
        """a's floats at offset 0 of a buffer (norm.cl takes no offsets): a.buf, or a device copy."""
        if a.offset == 0:
            return a.buf
        buf = self._alloc(a.nbytes)
        if a.size:
            self.cl.enqueue_copy(self.queue, buf, a.buf, byte_count=a.nbytes, src_offset=4 * a.offset)
        return buf

    def _padded(self, x: DArray, in_pad: int) -> tuple[Any, int]:
        """(buffer, float offset) of x [T, n_in] as rows of in_pad floats (matmul.cl reads padded rows):
        x in place, or a zero-padded device copy [T, in_pad]."""
        T, n_in = x.shape
        if n_in == in_pad:
            return x.buf, x.offset
        return self._ew("pad_rows", T * in_pad, x.buf, x.offset, n_in, in_pad), 0

    def _d_get(self, a: DArray) -> np.ndarray:
        host = np.empty(a.shape, np.float32)
        if host.nbytes:
            self.cl.enqueue_copy(self.queue, host, a.buf, src_offset=4 * a.offset, is_blocking=True)
        self._inflight.clear()  # the queue is in order: every earlier upload has finished
        return host

    def _d_zeros(self, shape: tuple[int, ...]) -> Any:
        nbytes = 4 * math.prod(shape)
        buf = self._alloc(nbytes)
        if nbytes:
            self.cl.enqueue_fill_buffer(self.queue, buf, np.float32(0), 0, nbytes)
        return buf

    def _d_matmul(self, x: DArray, w) -> Any:
        p, T = w.payload, x.shape[0]
        y = self._alloc(4 * T * w.out_features)  # [T, out]
        if T == 0:
            return y
        xb, xo = self._padded(x, p.in_pad)
        tpi = self._tpi(T)
        # y [T, out] = x [T, in_pad] . W [out, in_pad]^T
        self.be._launch(self._kernel("matmul", w.fmt, tpi), w.out_features, T, tpi, p.data, p.scales, xb, xo,
                     y, 0, p.in_pad, T, w.out_features, w.out_features)
        return y

    def _d_matmul_many(self, x: DArray, ws: list) -> list:
        """Weights of one format and padding, up to MANY at a time, in one ``matmul_many`` launch over
        their stacked rows (x padded once; a lone weight: ``matmul``); each row's sum is ``matmul``'s, so
        results equal d_matmul's."""
        T, out = x.shape[0], [None] * len(ws)
        groups: dict[tuple, list[int]] = {}
        for i, w in enumerate(ws):
            groups.setdefault((w.fmt, w.payload.in_pad), []).append(i)
        tpi = self._tpi(T)
        for (fmt, in_pad), idx in groups.items():
            xb, xo = self._padded(x, in_pad) if T else (x.buf, x.offset)
            for k in range(0, len(idx), MANY):
                part = idx[k: k + MANY]
                ys = [self._alloc(4 * T * ws[i].out_features) for i in part]  # [T, out_i] each
                for i, y in zip(part, ys):
                    out[i] = y
                if T == 0:
                    continue
                if len(part) == 1:  # matmul: fewer arguments to set per launch (they cost on PoCL)
                    p, o = ws[part[0]].payload, ws[part[0]].out_features
                    self.be._launch(self._kernel("matmul", fmt, tpi), o, T, tpi, p.data, p.scales, xb, xo,
                                 ys[0], 0, in_pad, T, o, o)
                    continue
                wsl = [ws[i].payload for i in part] + [ws[part[0]].payload] * (MANY - len(part))
                ends = list(itertools.accumulate(ws[i].out_features for i in part))
                ends += [ends[-1]] * (MANY - len(part))  # unused slots: empty row ranges
                ysl = ys + [ys[0]] * (MANY - len(part))
                # y_i [T, out_i] = x [T, in_pad] . W_i [out_i, in_pad]^T over the stacked rows 0 .. ends[-1]
                self.be._launch(self._kernel("matmul_many", fmt, tpi), ends[-1], T, tpi,
                             *[b for p in wsl for b in (p.data, p.scales)], xb, xo, *ysl, in_pad, T, *ends)
        return out

    def _d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> Any:
        (n, d), y = x.shape, self._alloc(x.nbytes)  # [N, d]
        if n:
            self._kernel("rmsnorm", None)(self.queue, (n * self.be.ls,), (self.be.ls,), self._flat(x),
                                          self._flat(weight), y, d, eps)
        return y

    def _d_add(self, a: DArray, b: DArray) -> Any:
        bcast = int(b.shape != a.shape)  # b [d] over the rows of a
        return self._ew("add", a.size, a.buf, a.offset, b.buf, b.offset, a.shape[1], bcast)

    def _d_silu_mul(self, g: DArray, u: DArray) -> Any:
        return self._ew("silu_mul", g.size, g.buf, g.offset, u.buf, u.offset)

    def _d_scale_rows(self, a: DArray, s: np.ndarray) -> Any:
        return self._ew("scale_rows", a.size, a.buf, a.offset, self._d_put(s), a.shape[1])

    def _d_rope(self, x: DArray, table: DArray, pos0: int, rotary_dim: int, interleave: bool) -> Any:
        return self._ew("rope", x.size, x.buf, x.offset, table.buf, table.offset, x.shape[1], x.shape[2],
                        rotary_dim, pos0, int(interleave))

    def _d_write_rows(self, dst: DArray, row0: int, src: DArray) -> None:
        if src.size:  # a buffer-to-buffer copy on the queue
            row = math.prod(dst.shape[1:])
            self.cl.enqueue_copy(self.queue, dst.buf, src.buf, byte_count=src.nbytes,
                                 src_offset=4 * src.offset, dst_offset=4 * (dst.offset + row0 * row))

    def _d_write_block(self, dst: DArray, row0: int, col0: int, src: DArray) -> None:
        (t, w), d = src.shape, dst.shape[1]
        if t and w:  # one rectangular copy (clEnqueueCopyBufferRect): T rows of W floats into rows of D
            so, do = 4 * src.offset, 4 * (dst.offset + row0 * d + col0)  # origins as (byte in row, row)
            self.cl.enqueue_copy(self.queue, dst.buf, src.buf, src_origin=(so % (4 * w), so // (4 * w), 0),
                                 dst_origin=(do % (4 * d), do // (4 * d), 0), region=(4 * w, t, 1),
                                 src_pitches=(4 * w, 4 * w * t), dst_pitches=(4 * d, 4 * d * t))

    def _d_head_matmul(self, x: DArray, w: DArray) -> Any:
        (T, B, K), N = x.shape, w.shape[1]
        y = self._alloc(4 * T * B * N)  # [T, B, N]
        if T and B and N:
            tt = 1 if T == 1 else 16  # tokens per work-group (trunk.cl HM_T): decode wastes no items
            knl = self._kernel("head_matmul", None, extra=(f"-DHM_T={tt}",))
            knl(self.queue, (-(-N // 16) * 16, -(-T // tt) * tt, B), (16, tt, 1), y, x.buf, x.offset, w.buf,
                w.offset, T, B, N, K)
        return y

    def _d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                     window: int) -> Any:
        cl, (T, hq, d), ls = self.cl, q.shape, self.be.ls
        out = self._alloc(q.nbytes)  # [T, Hq * d]
        ks = d | 1  # odd row stride of the local K tile: the items' rows fall in different banks
        # local memory: the K tile [tile, ks], the query [d] and the tile's scores [tile], red[LS]
        tile = min(self.be.attn_tile, ((self.dev.local_mem_size - 4 * ls - 256) // 4 - d) // (ks + 1))
        if tile < 1:
            lm = self.dev.local_mem_size
            raise UnsupportedError(f"opencl d_attention: head_dim {d} does not fit the {lm} B of local memory"
                                   f" of {self.be.device.name!r}; run attention on the CPU")
        if T:
            span = min(n_keys, window) if window else n_keys  # most keys one query row sees
            # decode on a GPU: split the keys until there are ~4 work-groups per compute unit
            splits = self.be.attn_splits or (1 if self.be.device.kind == "cpu" else max(1, min(
                64, -(-4 * self.dev.max_compute_units // (T * hq)), span // (4 * tile))))
            part = self._alloc(4 * T * hq * splits * (d + 2)) if splits > 1 else out  # [T, Hq, S, 2 + d]
            knl = self._kernel("attention_gqa", None, extra=(f"-DNACC={-(-d // ls)}",))
            # a work-group of LS items per (head, query row, split)
            knl(self.queue, (hq * ls, T, splits), (ls, 1, 1), q.buf, q.offset, k.buf, k.offset, v.buf,
                v.offset, out, hq, k.shape[1], d, pos0, window, scale, tile, ks, splits, part,
                cl.LocalMemory(4 * tile * ks), cl.LocalMemory(4 * (d + tile)))
            if splits > 1:
                self._kernel("attention_combine", None, extra=(f"-DNACC={-(-d // ls)}",))(
                    self.queue, (hq * ls, T), (ls, 1), part, out, hq, d, splits)
        return out

    def _d_expert_ffn(self, x: DArray, experts: list, gates: np.ndarray) -> Any:
        if not all(ffn_fusable(e) for e in experts):
            return DeviceOps._d_expert_ffn(self.be, x, experts, gates)  # the contract's host path
        (T, H), n = x.shape, len(experts)
        if T == 0:
            return self._alloc(0)
        ys = self._alloc(4 * n * T * H)  # y_i [T, H] at float i·T·H: expert_sum reads [n, T·H]
        hs = self._alloc(4 * T * sum(e.down.payload.in_pad for e in experts))  # h_i [T, I_pad_i], stacked
        xs: dict[int, tuple[Any, int]] = {}  # x as rows of Hp floats, per Hp (one padding per width)
        h0 = 0
        for i, e in enumerate(experts):  # enqueued back to back: no wait
            Hp = e.gate.payload.in_pad
            if Hp not in xs:
                xs[Hp] = self._padded(x, Hp)
            self.be._ffn_launches(e, T, *xs[Hp], hs, h0, ys, i * T * H)
            h0 += T * e.down.payload.in_pad
        # y [T, H] = Σ_i gates[i] · y_i, accumulated from 0 in expert order (the host combine's roundings)
        return self._ew("expert_sum", T * H, ys, self._d_put(gates), n)
