"""Device activations of the Vulkan backend: :class:`VulkanDeviceOps`, the part whose ``_d_*`` hooks
(:mod:`colibri_plan.backends.device_ops`) :class:`~colibri_plan.backends.vulkan.backend.VulkanBackend`
binds at open; driver calls only, recorded into the backend's :class:`~.batch.Batch` (one submission per
batch; arrays pooled by size class: see there). A DArray's ``offset`` is always 0, since every op writes a
fresh buffer and ``d_view`` shares it. Arrays are not counted in ``memory_used`` (weights only).

**Host cost per op** (the decode chain is host-bound on a GPU): descriptors pushed
(``objects.Device.dispatch``) from each buffer's pre-packed VkDescriptorBufferInfo, structs made once.

**Shaders.** ``matmul.comp`` reads x straight from its buffer when its rows are already the weight's
padded length (a multiple of 128 floats), else from a zero-padded copy (op 5 of ``elementwise.comp``);
``rmsnorm.comp`` with ``WBIND = 1`` (the weight in its own buffer); ``elementwise.comp`` for add (also
1-D broadcast), SiLU·mul, row scales, RoPE and the routed experts' gated sum (``experts``);
``attention_gqa.comp`` for attention (head_dim ≤ 256, or up to 1024 with a wider MAXD; a workgroup
per query row and group of up to 8 query heads of one kv head, which share its K/V reads; a row's keys
cut into slices merged by a second dispatch when that leaves the device short of work);
``head_matmul.comp`` for per-head matrices (tiles of 16 outputs by 16 tokens, or by 1 at decode); the
block write of ``d_write_rows`` is one copy command with a region per row.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.vulkan import util as vu
from colibri_plan.backends.vulkan.batch import VkArray
from colibri_plan.errors import UnsupportedError

ATT_WG, ATT_TILE = 128, 64  # attention_gqa.comp: invocations, keys per tile
ATT_MAXD, MAX_HEAD_DIM = 256, 1024  # its MAXD up to head_dim 256 (wider: d in whole ATT_WG), the widest
ATT_MIN_KEYS = 64  # fewest keys per slice of a query row's keys (below that, merging costs more)
ATT_MAX_HG = 8  # query heads of one kv head per workgroup, at most (registers: HG x MAXD / ATT_WG <= 16)
MAX_GROUPS = 65535  # workgroups per grid dimension every device offers (maxComputeWorkGroupCount)
EW_ADD, EW_ADD_ROW, EW_SILU_MUL, EW_SCALE_ROWS, EW_ROPE, EW_PAD, EW_GATED_SUM = range(7)  # elementwise.comp


class VulkanDeviceOps:
    """The ``_d_*`` hooks on Vulkan buffers (see the module docstring); ``d_matmul_many`` keeps the
    contract's loop of ``d_matmul`` (``experts`` says why).

    Args:
        backend: the open Vulkan backend; batch: its :class:`~.batch.Batch`.
    """

    HOOKS = ("_d_put", "_d_get", "_d_zeros", "_d_matmul", "_d_rmsnorm", "_d_add", "_d_silu_mul",
             "_d_scale_rows", "_d_rope", "_d_write_rows", "_d_write_block", "_d_head_matmul", "_d_attention")

    def __init__(self, backend, batch):
        self.be, self.vk, self._d, self.batch = backend, backend.vk, backend._d, batch

    def _ew(self, op: int, ins: list[VkArray], n: int, d: int, *extra: int) -> VkArray:
        """One elementwise.comp op writing n floats (rows of d) into a new array."""
        out = self.batch.take(4 * n)
        groups = min(-(-n // vu.WG), MAX_GROUPS)  # the shader loops over the rest
        pipe = self._d.pipeline("elementwise", (vu.WG,))
        pc = [op, n, max(d, 1), *extra, 0, 0, 0, 0][:7]  # every member the shader uses is set
        self.batch.dispatch(pipe, ins, out, pc, groups)
        return out

    # ---- hooks -------------------------------------------------------------------------------------
    def _d_put(self, a: np.ndarray) -> VkArray:
        h = self.batch.take(a.nbytes)
        self.batch.upload_into(h, a)
        return h

    def _d_get(self, a: DArray) -> np.ndarray:
        h = a.buf
        if h.b.map is None and a.nbytes:  # copy to the mapped read-back buffer, then wait
            rb = self.be._io.get("y", a.nbytes)
            region = self.vk.ffi.new("VkBufferCopy*", (4 * a.offset, 0, a.nbytes))
            cb = self.batch.cb(h)
            self._d.barrier(cb)
            self.vk.lib.vkCmdCopyBuffer(cb, h.b.buf, rb.buf, 1, region)
            self.batch.flush()
            return np.frombuffer(rb.map, np.float32, count=a.size).copy()
        self.batch.flush()
        if not a.nbytes:
            return np.zeros(a.shape, np.float32)
        return np.frombuffer(h.b.map, np.float32, count=a.size, offset=4 * a.offset).copy()

    def _d_zeros(self, shape: tuple[int, ...]) -> VkArray:
        h = self.batch.take(4 * int(np.prod(shape, dtype=np.int64)))
        self.vk.lib.vkCmdFillBuffer(self.batch.cb(h), h.b.buf, 0, h.b.size, 0)
        self.batch.op_done()
        return h

    def _d_matmul(self, x: DArray, w) -> VkArray:
        p, (T, n_in) = w.payload, x.shape
        xh = x.buf
        if n_in != p.in_pad:  # matmul.comp reads rows of in_pad floats, zeros past in (vec4 loads)
            xh = self._ew(EW_PAD, [x.buf], T * p.in_pad, p.in_pad, n_in)
        y = self.batch.take(4 * T * p.out)
        pipe = self._d.pipeline("matmul", (vu.WG, p.code, p.group, self.be._nt([max(T, 1)]), vu.ROWS, 0))
        for q in p.parts:  # a weight over the buffer limit: one dispatch per block of rows
            pc = [p.nchunk, q.n, p.in_pad // 4, p.out, q.r0, q.soff, p.nscale, 0] + [T] * vu.MAXE
            self.batch.dispatch(pipe, [q.b], y, pc, -(-q.n // vu.ROWS), x=xh)
        return y

    def _d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> VkArray:
        (T, H), y = x.shape, self.batch.take(x.nbytes)
        pc = [H, 0, int(np.float32(eps).view(np.uint32)), T]
        gx = min(T, MAX_GROUPS)  # more rows (per-head norms of a long prefill): a 2-D grid
        pipe = self._d.pipeline("rmsnorm", (vu.WG, 1))
        self.batch.dispatch(pipe, [weight.buf], y, pc, gx, -(-T // max(gx, 1)), x=x.buf)
        return y

    def _d_add(self, a: DArray, b: DArray) -> VkArray:
        return self._ew(EW_ADD if b.shape == a.shape else EW_ADD_ROW, [a.buf, b.buf], a.size, a.shape[1])

    def _d_silu_mul(self, g: DArray, u: DArray) -> VkArray:
        return self._ew(EW_SILU_MUL, [g.buf, u.buf], g.size, g.shape[1])

    def _d_scale_rows(self, a: DArray, s: np.ndarray) -> VkArray:
        return self._ew(EW_SCALE_ROWS, [a.buf, self._d_put(s)], a.size, a.shape[1])

    def _d_rope(self, x: DArray, table: DArray, pos0: int, rotary_dim: int, interleave: bool) -> VkArray:
        t, heads, d = x.shape
        return self._ew(EW_ROPE, [x.buf, table.buf], x.size, d, heads, rotary_dim, pos0, int(interleave))

    def _d_write_rows(self, dst: DArray, row0: int, src: DArray) -> None:
        if src.nbytes:  # one copy command
            row = src.size // src.shape[0]  # floats per row
            self.batch.copy(src.buf, dst.buf, [(4 * src.offset, 4 * (dst.offset + row0 * row), src.nbytes)])

    def _d_write_block(self, dst: DArray, row0: int, col0: int, src: DArray) -> None:
        (t, w), d = src.shape, dst.shape[1]
        if t and w:  # one copy command, a region per row: src row i -> dst row row0 + i from column col0
            so, do = 4 * src.offset, 4 * (dst.offset + row0 * d + col0)
            self.batch.copy(src.buf, dst.buf, [(so + 4 * i * w, do + 4 * i * d, 4 * w) for i in range(t)])

    def _d_head_matmul(self, x: DArray, w: DArray) -> VkArray:
        (t, b, k), n = x.shape, w.shape[1]
        out = self.batch.take(4 * t * b * n)  # [T, B, N]
        if t and b and n:
            if max(b, -(-t // 16)) > MAX_GROUPS:
                raise UnsupportedError(f"vulkan d_head_matmul: {b} heads x {t} tokens; at most {MAX_GROUPS} "
                                       "heads and 16 x that many tokens per call")
            tt = 1 if t == 1 else 16  # tokens per workgroup (head_matmul.comp TT): decode idles none
            self.batch.dispatch(self._d.pipeline("head_matmul", (tt,)), [x.buf, w.buf], out, [t, b, n, k],
                           -(-n // 16), -(-t // tt), b)
        return out

    def _d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                     window: int) -> Any:
        t, hq, d = q.shape
        if d > MAX_HEAD_DIM:
            raise UnsupportedError(f"vulkan d_attention: head_dim {d} is over the shader's {MAX_HEAD_DIM}; "
                                   "run this model's attention on another backend")
        if max(t, hq) > MAX_GROUPS:
            raise UnsupportedError(f"vulkan d_attention: {t} query rows x {hq} heads; at most 65535 of each "
                                   "per call (pass fewer tokens)")
        g, maxd = hq // k.shape[1], ATT_MAXD if d <= ATT_MAXD else -(-d // ATT_WG) * ATT_WG
        most = max(1, ATT_MAX_HG * ATT_MAXD // maxd)  # the accumulators' registers bound heads x MAXD
        hg = max(n for n in range(1, min(g, most) + 1) if g % n == 0)  # heads sharing K/V reads
        keys = min(n_keys, window) if window else n_keys  # the most keys a query row sees
        want = self.be.d_att_workgroups.get(self.be.device.kind, 512)
        splits = max(1, min(-(-keys // ATT_MIN_KEYS), -(-want // (t * hq // hg)), 1024))
        out = self.batch.take(4 * t * hq * d)
        pc = [hq, k.shape[1], d, pos0, window, int(np.float32(scale).view(np.uint32)), splits]
        pipe = self._d.pipeline("attention_gqa", (ATT_WG, ATT_TILE, 0, hg, maxd))
        if splits == 1:
            self.batch.dispatch(pipe, [q.buf, k.buf, v.buf], out, pc, hq // hg, t)
            return out
        part = self.batch.take(4 * t * hq * splits * (d + 2))  # [T * Hq, splits, d + 2]: sums, max, sum
        self.batch.dispatch(pipe, [q.buf, k.buf, v.buf], part, pc, hq // hg, t, splits)
        merge = self._d.pipeline("attention_gqa", (ATT_WG, ATT_TILE, 1, 1, ATT_MAXD))
        self.batch.dispatch(merge, [part], out, pc, t * hq)
        return out
