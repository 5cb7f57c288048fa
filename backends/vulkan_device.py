"""Device activations of the Vulkan backend: the ``_d_*`` hooks of
:class:`~colibri_plan.backends.device_ops.DeviceOps` (a mixin of ``VulkanBackend``; driver calls only).

**Arrays.** A Vulkan DArray's ``buf`` is a :class:`VkArray` whose ``b`` is a storage buffer record of
``vulkan_util.make_buffer`` (``buf`` the VkBuffer, ``mem`` its VkDeviceMemory, ``size`` bytes, ``map``
its host mapping or None); ``offset`` is always 0, since every op writes a fresh buffer and ``d_view``
shares it. Memory is of the "h" role (``vulkan_util.memory_roles``: device-local; also host-visible and
mapped on CPU and integrated devices, where ``d_put``/``d_get`` then copy through the mapping). Buffers
come from a pool of size classes and return to it when the last DArray (or view) on them is collected;
close destroys them. They are not counted in ``memory_used`` (weights only).

**One submission per batch.** Ops are recorded into one open command buffer (a barrier, then the
dispatch, fill or copy) and submitted only when the host needs a result: ``d_get`` (the only fence
wait of a decode step's chain), ``synchronize``, freeing a weight (a recorded op may read it), a staged
upload over ``INLINE_BYTES``, or every ``MAX_OPS`` ops (where the device cannot push descriptors, a
descriptor set is allocated per op and freed with its batch). Small host data (``d_put`` of a hidden
state, the scales of ``d_scale_rows``) rides inside the command buffer (vkCmdUpdateBuffer), so it does
not end the batch either. The batch writes the timestamps that ``last_gpu_seconds`` reads; its command
buffer is re-begun for the next batch rather than freed.

**Host cost per op** (the decode chain is host-bound on a GPU): descriptors pushed
(``vulkan_objects.Device.dispatch``) from each buffer's pre-packed VkDescriptorBufferInfo, structs made
once, arrays back to the pool by ``VkArray.__del__`` (a ``weakref.finalize`` per op cost more).

**Shaders.** ``matmul.comp`` reads x straight from its buffer when its rows are already the weight's
padded length (a multiple of 128 floats), else from a zero-padded copy (op 5 of ``elementwise.comp``);
``rmsnorm.comp`` with ``WBIND = 1`` (the weight in its own buffer); ``elementwise.comp`` for add (also
1-D broadcast), SiLU·mul, row scales, RoPE and the routed experts' gated sum (``vulkan_experts``);
``attention_gqa.comp`` for attention (head_dim ≤ 256, or up to 1024 with a wider MAXD; a workgroup
per query row and group of up to 8 query heads of one kv head, which share its K/V reads; a row's keys
cut into slices merged by a second dispatch when that leaves the device short of work);
``head_matmul.comp`` for per-head matrices (tiles of 16 outputs by 16 tokens, or by 1 at decode).
"""

from __future__ import annotations

import atexit
from types import SimpleNamespace as NS
from typing import Any

import numpy as np

from colibri_plan.backends import vulkan_util as vu
from colibri_plan.backends.device_ops import DArray
from colibri_plan.errors import UnsupportedError

MAX_OPS = 256  # ops per batch: (without push descriptors) 1 set each, within the pool's 1024
UPDATE_BYTES = 65536  # vkCmdUpdateBuffer's limit per command
INLINE_BYTES = 1 << 18  # host data up to this size is recorded into the batch instead of staged
POOL_KEEP_BYTES = 256 << 20  # freed activation buffers kept for reuse, at most
POOL_MAX_BUFFER = 16 << 20  # larger freed buffers (KV cache pages) are released, not kept
ATT_WG, ATT_TILE = 128, 64  # attention_gqa.comp: invocations, keys per tile
ATT_MAXD, MAX_HEAD_DIM = 256, 1024  # its MAXD up to head_dim 256 (wider: d in whole ATT_WG), the widest
ATT_MIN_KEYS = 64  # fewest keys per slice of a query row's keys (below that, merging costs more)
ATT_MAX_HG = 8  # query heads of one kv head per workgroup, at most (registers: HG x MAXD / ATT_WG <= 16)
MAX_GROUPS = 65535  # workgroups per grid dimension every device offers (maxComputeWorkGroupCount)
_AT_EXIT = [False]  # set when the interpreter exits: arrays collected then do nothing
atexit.register(_AT_EXIT.__setitem__, 0, True)
EW_ADD, EW_ADD_ROW, EW_SILU_MUL, EW_SCALE_ROWS, EW_ROPE, EW_PAD, EW_GATED_SUM = range(7)  # elementwise.comp


class VkArray:
    """``DArray.buf`` of the Vulkan backend: ``b``, a buffer record of ``vulkan_util.make_buffer``."""

    __slots__ = ("b", "_give", "__weakref__")

    def __init__(self, b: NS, give=None):
        self.b, self._give = b, give

    def __del__(self):  # cheaper than a weakref.finalize per op: the buffer goes back to its pool
        if self._give is not None:
            self._give(self.b)


def size_class(nbytes: int) -> int:
    """Bytes allocated for a request of ``nbytes``: at least 256, in steps of 1/8 of the next power of two
    (at most 12.5 % more), so freed buffers serve later requests of about the same size."""
    n = max(256, -(-int(nbytes) // 4) * 4)
    step = max(256, (1 << (n - 1).bit_length()) // 8)
    return -(-n // step) * step


class BufferPool:
    """Activation buffers by size class: ``take`` reuses a freed one or makes one; a buffer comes back when
    its :class:`VkArray` is garbage-collected (at most ``keep_bytes`` are kept, and none over
    POOL_MAX_BUFFER: those are released)."""

    def __init__(self, make, release, keep_bytes: int = POOL_KEEP_BYTES):
        self._make, self._release, self.keep_bytes = make, release, keep_bytes
        self._free: dict[int, list[NS]] = {}
        self._made: dict[int, NS] = {}
        self._sizes: dict[tuple[int, int], int] = {}  # (nbytes, cap) -> bytes allocated
        self._exit = _AT_EXIT  # held here: module globals may be gone when the last arrays are collected
        self.free_bytes, self.closed = 0, False

    def take(self, nbytes: int, cap: int) -> VkArray:
        """An array of at least ``nbytes``: its size class, or the bytes asked when that class is over
        ``cap`` (the largest buffer) or POOL_MAX_BUFFER (KV pages: never pooled, so never rounded up)."""
        size = self._sizes.get((nbytes, cap))
        if size is None:
            size = size_class(nbytes)
            if size > min(cap, POOL_MAX_BUFFER):
                size = max(256, -(-int(nbytes) // 4) * 4)
            if len(self._sizes) > 4096:  # many shapes (prefills of every length): start over
                self._sizes.clear()
            self._sizes[nbytes, cap] = size
        spare = self._free.get(size)
        if spare:
            b = spare.pop()
            self.free_bytes -= size
        else:
            b = self._make(size)
            self._made[id(b)] = b
        return VkArray(b, self._give)

    def _give(self, b: NS) -> None:
        if self.closed or self._exit[0]:  # never driver calls at interpreter exit
            return
        if b.size > POOL_MAX_BUFFER or self.free_bytes + b.size > self.keep_bytes:
            self._release(self._made.pop(id(b)))
            return
        self._free.setdefault(b.size, []).append(b)
        self.free_bytes += b.size

    def trim(self) -> None:
        """Release every freed buffer (before retrying an allocation the driver refused)."""
        for spare in self._free.values():
            for b in spare:
                self._release(self._made.pop(id(b)))
        self._free, self.free_bytes = {}, 0

    def close(self) -> None:
        """Release every buffer, in use or not; later collections do nothing."""
        self.closed = True
        for b in self._made.values():
            self._release(b)
        self._made, self._free, self.free_bytes = {}, {}, 0


class VulkanDeviceOps:
    """The ``_d_*`` hooks on Vulkan buffers (see the module docstring); ``VulkanBackend`` calls
    ``_d_init`` when it opens, ``_d_flush`` before it synchronizes or frees a weight, ``_d_close`` when it
    closes."""

    #: attention workgroups wanted in flight, by device kind: fewer (row, head) pairs than this cut each
    #: row's keys into slices (decode at long contexts), merged by a second dispatch
    d_att_workgroups = {"gpu": 512, "igpu": 64, "cpu": 8}
    #: map host-visible activation memory (False: treat it as device-only, as on a discrete GPU without
    #: resizable BAR, so that tests on a CPU device cover the update, staging and read-back paths)
    d_map_host_visible = True

    def _d_init(self) -> None:
        self._batch: NS | None = None
        self._spare: NS | None = None  # a command buffer whose batch has run, for the next batch
        self._pool = BufferPool(self._d_make, lambda b: self._release(b))

    def _d_make(self, size: int) -> NS:
        vk = self.vk
        if size > self.max_buffer_bytes:
            raise UnsupportedError(f"vulkan: a device array of {size} B exceeds the device's largest buffer "
                                   f"({self.max_buffer_bytes} B); split it (fewer tokens or cache rows)")
        for retry in (True, False):
            try:
                b = self._buffer(size, "h")
                break
            except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory) as exc:
                if not retry:
                    raise self._oom(f"no memory for a device array of {size} B ({type(exc).__name__})",
                                    size) from None
                self._pool.trim()
        if b.map is not None and not self.d_map_host_visible:
            vk.lib.vkUnmapMemory(self._d.dev, b.mem)
            b.map = None
        return b

    def _take(self, nbytes: int) -> VkArray:
        self._check_open()
        return self._pool.take(nbytes, self.max_buffer_bytes)

    # ---- the batch ---------------------------------------------------------------------------------
    def _cb(self, *keep: VkArray):
        """The batch's open command buffer (begun on first use); ``keep``: arrays its commands use, held
        until it has run."""
        self._check_open()
        if self._batch is None:
            vk, ffi, lib, d = self.vk, self.vk.ffi, self.vk.lib, self._d
            e, self._spare = self._spare, None  # the last batch's command buffer, reset by its begin
            if e is None:
                e = NS(cbp=ffi.new("VkCommandBuffer[1]"), sets=[], keep=[], ops=0)
                info = vu.new(vk, "VkCommandBufferAllocateInfo", commandPool=d.pool, commandBufferCount=1)
                vu.check(vk, lib.vkAllocateCommandBuffers(d.dev, info, e.cbp))
                e.submit = vu.new(vk, "VkSubmitInfo", commandBufferCount=1, pCommandBuffers=e.cbp)
                e.begin = vu.new(vk, "VkCommandBufferBeginInfo", flags=1)  # ONE_TIME_SUBMIT
            try:
                vu.check(vk, lib.vkBeginCommandBuffer(e.cbp[0], e.begin))
            except BaseException:
                d.free_cmd(e)
                raise
            lib.vkCmdResetQueryPool(e.cbp[0], d.queries, 0, 2)
            lib.vkCmdWriteTimestamp(e.cbp[0], 0x1, d.queries, 0)  # TOP_OF_PIPE
            self._batch = e
        self._batch.keep.extend(keep)
        return self._batch.cbp[0]

    def _op_done(self) -> None:
        self._batch.ops += 1
        if self._batch.ops >= MAX_OPS:
            self._d_flush()

    def _d_flush(self) -> None:
        """Submit the batch and wait for it (nothing to do without one)."""
        e, self._batch = getattr(self, "_batch", None), None
        if e is None:
            return
        vk, lib, d = self.vk, self.vk.lib, self._d
        cb = e.cbp[0]
        try:
            d.barrier(cb)  # shader and transfer writes -> host reads
            lib.vkCmdWriteTimestamp(cb, 0x2000, d.queries, 1)  # BOTTOM_OF_PIPE
            vu.check(vk, lib.vkEndCommandBuffer(cb))
            d.submit(e.submit, poll=self.device.kind != "cpu")
        except BaseException:
            d.free_cmd(e)  # its descriptor sets too
            raise
        d.free_sets(e)  # the command buffer is kept for the next batch
        e.keep, e.ops, self._spare = [], 0, e  # e.keep's arrays may go back to the pool now

    def _d_close(self) -> None:
        """Drop an unsubmitted batch and destroy every activation buffer (the device is idle)."""
        for e in (getattr(self, "_batch", None), getattr(self, "_spare", None)):
            if e is not None:
                self._d.free_cmd(e)
        self._batch = self._spare = None
        if getattr(self, "_pool", None) is not None:
            self._pool.close()

    def _dispatch(self, pipe, ins: list, out: VkArray, pc: list[int], gx: int, gy: int = 1, gz: int = 1,
                  x: VkArray | None = None) -> None:
        """Record a barrier and one dispatch: ``ins`` (VkArrays or weight buffer records) bound as A[0..]
        (and B[0..]), ``x`` (default ins[0]) at binding 2, ``out`` at binding 3."""
        cb, d = self._cb(*[a for a in (*ins, x, out) if type(a) is VkArray]), self._d
        a = [i.b if type(i) is VkArray else i for i in ins]
        a += [a[0]] * (d.maxe - len(a))  # spare slots repeat the first
        d.barrier(cb)  # earlier ops' writes -> this dispatch's reads
        d.dispatch(cb, pipe, a, a, a[0] if x is None else x.b, out.b, pc, (gx, gy, gz), self._batch.sets,
                   self._cmds.drop)
        self._op_done()

    def _upload_into(self, h: VkArray, data: np.ndarray) -> None:
        """Host float32 ``data`` into the fresh array ``h`` (no recorded op uses it yet): through its
        mapping, recorded into the batch (up to INLINE_BYTES), or staged after a flush."""
        src = data.reshape(-1).view(np.uint8)
        if not src.nbytes:
            return
        if h.b.map is not None:
            np.frombuffer(h.b.map, np.uint8, count=src.nbytes)[:] = src
        elif src.nbytes <= INLINE_BYTES:
            cb, ffi = self._cb(h), self.vk.ffi
            for o in range(0, src.nbytes, UPDATE_BYTES):  # copied into the command buffer when recorded
                chunk = src[o:o + UPDATE_BYTES]
                self.vk.lib.vkCmdUpdateBuffer(cb, h.b.buf, o, chunk.nbytes, ffi.from_buffer(chunk))
            self._op_done()
        else:
            self._d_flush()  # staged copies wait for themselves; keep the order of earlier ops
            self._write(h.b, src, direct=False)

    def _ew(self, op: int, ins: list[VkArray], n: int, d: int, *extra: int) -> VkArray:
        """One elementwise.comp op writing n floats (rows of d) into a new array."""
        out = self._take(4 * n)
        groups = min(-(-n // vu.WG), MAX_GROUPS)  # the shader loops over the rest
        pipe = self._d.pipeline("elementwise", (vu.WG,))
        pc = [op, n, max(d, 1), *extra, 0, 0, 0, 0][:7]  # every member the shader uses is set
        self._dispatch(pipe, ins, out, pc, groups)
        return out

    # ---- hooks -------------------------------------------------------------------------------------
    def _d_put(self, a: np.ndarray) -> VkArray:
        h = self._take(a.nbytes)
        self._upload_into(h, a)
        return h

    def _d_get(self, a: DArray) -> np.ndarray:
        h = a.buf
        if h.b.map is None and a.nbytes:  # copy to the mapped read-back buffer, then wait
            rb = self._io.get("y", a.nbytes)
            region = self.vk.ffi.new("VkBufferCopy*", (4 * a.offset, 0, a.nbytes))
            cb = self._cb(h)
            self._d.barrier(cb)
            self.vk.lib.vkCmdCopyBuffer(cb, h.b.buf, rb.buf, 1, region)
            self._d_flush()
            return np.frombuffer(rb.map, np.float32, count=a.size).copy()
        self._d_flush()
        if not a.nbytes:
            return np.zeros(a.shape, np.float32)
        return np.frombuffer(h.b.map, np.float32, count=a.size, offset=4 * a.offset).copy()

    def _d_zeros(self, shape: tuple[int, ...]) -> VkArray:
        h = self._take(4 * int(np.prod(shape, dtype=np.int64)))
        self.vk.lib.vkCmdFillBuffer(self._cb(h), h.b.buf, 0, h.b.size, 0)
        self._op_done()
        return h

    def _d_matmul(self, x: DArray, w) -> VkArray:
        p, (T, n_in) = w.payload, x.shape
        xh = x.buf
        if n_in != p.in_pad:  # matmul.comp reads rows of in_pad floats, zeros past in (vec4 loads)
            xh = self._ew(EW_PAD, [x.buf], T * p.in_pad, p.in_pad, n_in)
        y = self._take(4 * T * p.out)
        pipe = self._d.pipeline("matmul", (vu.WG, p.code, p.group, self._nt([max(T, 1)]), vu.ROWS, 0))
        for q in p.parts:  # a weight over the buffer limit: one dispatch per block of rows
            pc = [p.nchunk, q.n, p.in_pad // 4, p.out, q.r0, q.soff, p.nscale, 0] + [T] * vu.MAXE
            self._dispatch(pipe, [q.b], y, pc, -(-q.n // vu.ROWS), x=xh)
        return y

    def _d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> VkArray:
        (T, H), y = x.shape, self._take(x.nbytes)
        pc = [H, 0, int(np.float32(eps).view(np.uint32)), T]
        gx = min(T, MAX_GROUPS)  # more rows (per-head norms of a long prefill): a 2-D grid
        self._dispatch(self._d.pipeline("rmsnorm", (vu.WG, 1)), [weight.buf], y, pc, gx, -(-T // max(gx, 1)),
                       x=x.buf)
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
        if not src.nbytes:
            return
        row = src.size // src.shape[0]  # floats per row
        region = self.vk.ffi.new("VkBufferCopy*", (4 * src.offset, 4 * (dst.offset + row0 * row), src.nbytes))
        cb = self._cb(dst.buf, src.buf)
        self._d.barrier(cb)  # earlier writes of src, reads and writes of dst -> this copy
        self.vk.lib.vkCmdCopyBuffer(cb, src.buf.b.buf, dst.buf.b.buf, 1, region)
        self._op_done()

    def _d_write_block(self, dst: DArray, row0: int, col0: int, src: DArray) -> None:
        (t, w), d = src.shape, dst.shape[1]
        if not (t and w):
            return
        # one copy command, a region per row: src row i -> dst row row0 + i from column col0 (bytes)
        so, do = 4 * src.offset, 4 * (dst.offset + row0 * d + col0)
        rows = [(so + 4 * i * w, do + 4 * i * d, 4 * w) for i in range(t)]
        regions = self.vk.ffi.new("VkBufferCopy[]", rows)
        cb = self._cb(dst.buf, src.buf)
        self._d.barrier(cb)  # earlier writes of src, reads and writes of dst -> this copy
        self.vk.lib.vkCmdCopyBuffer(cb, src.buf.b.buf, dst.buf.b.buf, t, regions)
        self._op_done()

    def _d_head_matmul(self, x: DArray, w: DArray) -> VkArray:
        (t, b, k), n = x.shape, w.shape[1]
        out = self._take(4 * t * b * n)  # [T, B, N]
        if t and b and n:
            if max(b, -(-t // 16)) > MAX_GROUPS:
                raise UnsupportedError(f"vulkan d_head_matmul: {b} heads x {t} tokens; at most {MAX_GROUPS} "
                                       "heads and 16 x that many tokens per call")
            tt = 1 if t == 1 else 16  # tokens per workgroup (head_matmul.comp TT): decode idles none
            self._dispatch(self._d.pipeline("head_matmul", (tt,)), [x.buf, w.buf], out, [t, b, n, k],
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
        want = self.d_att_workgroups.get(self.device.kind, 512)
        splits = max(1, min(-(-keys // ATT_MIN_KEYS), -(-want // (t * hq // hg)), 1024))
        out = self._take(4 * t * hq * d)
        pc = [hq, k.shape[1], d, pos0, window, int(np.float32(scale).view(np.uint32)), splits]
        pipe = self._d.pipeline("attention_gqa", (ATT_WG, ATT_TILE, 0, hg, maxd))
        if splits == 1:
            self._dispatch(pipe, [q.buf, k.buf, v.buf], out, pc, hq // hg, t)
            return out
        part = self._take(4 * t * hq * splits * (d + 2))  # [T * Hq, splits, d + 2]: sums, max, sum
        self._dispatch(pipe, [q.buf, k.buf, v.buf], part, pc, hq // hg, t, splits)
        self._dispatch(self._d.pipeline("attention_gqa", (ATT_WG, ATT_TILE, 1, 1, ATT_MAXD)), [part], out, pc,
                       t * hq)
        return out
