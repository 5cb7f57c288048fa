"""The recording side of the Vulkan backend's device activations: arrays (:class:`VkArray`, pooled by size
class in :class:`BufferPool`) and the open command buffer they are recorded into (:class:`Batch`).

**One submission per batch.** Ops are recorded into one open command buffer (a barrier, then the
dispatch, fill or copy) and submitted only when the host needs a result: ``d_get`` (the only fence wait
of a decode step's chain), ``synchronize``, freeing a weight (a recorded op may read it), a staged upload
over ``INLINE_BYTES``, or every ``MAX_OPS`` ops (where the device cannot push descriptors, a descriptor
set is allocated per op and freed with its batch). Small host data (``d_put`` of a hidden state, the
scales of ``d_scale_rows``) rides inside the command buffer (vkCmdUpdateBuffer), so it does not end the
batch either. The batch writes the timestamps that ``last_gpu_seconds`` reads; its command buffer is
re-begun for the next batch rather than freed.

**Arrays.** A DArray's ``buf`` is a :class:`VkArray` whose ``b`` is a storage buffer record of
``util.make_buffer`` (``buf`` the VkBuffer, ``mem`` its VkDeviceMemory, ``size`` bytes, ``map`` its host
mapping or None); memory of the "h" role (``util.memory_roles``). Buffers come from a pool of size classes
and return to it when the last DArray (or view) on them is collected (``VkArray.__del__``: a
``weakref.finalize`` per op cost more); close destroys them.
"""

from __future__ import annotations

import atexit
from types import SimpleNamespace as NS

import numpy as np

from colibri_plan.backends.vulkan import util as vu
from colibri_plan.errors import UnsupportedError

MAX_OPS = 256  # ops per batch: (without push descriptors) 1 set each, within the pool's 1024
UPDATE_BYTES = 65536  # vkCmdUpdateBuffer's limit per command
INLINE_BYTES = 1 << 18  # host data up to this size is recorded into the batch instead of staged
POOL_KEEP_BYTES = 256 << 20  # freed activation buffers kept for reuse, at most
POOL_MAX_BUFFER = 16 << 20  # larger freed buffers (KV cache pages) are released, not kept
_AT_EXIT = [False]  # set when the interpreter exits: arrays collected then do nothing
atexit.register(_AT_EXIT.__setitem__, 0, True)


class VkArray:
    """``DArray.buf`` of the Vulkan backend: ``b``, a buffer record of ``util.make_buffer``."""

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


class Batch:
    """The open command buffer of a Vulkan backend's device ops and the pool of its arrays (the module
    docstring). ``current`` is the batch being recorded (None between batches), ``spare`` the last one's
    command buffer, kept for the next.

    Args:
        backend: the open Vulkan backend (its device objects, buffers, staging and limits).
    """

    def __init__(self, backend):
        self.be, self.vk, self._d = backend, backend.vk, backend._d
        self._poll, self._drop_recorded = backend.device.kind != "cpu", backend._cmds.drop
        self.current: NS | None = None
        self.spare: NS | None = None  # a command buffer whose batch has run, for the next batch
        self.pool = BufferPool(self._make, lambda b: backend._release(b))

    def _make(self, size: int) -> NS:
        vk, be = self.vk, self.be
        if size > be.max_buffer_bytes:
            raise UnsupportedError(f"vulkan: a device array of {size} B exceeds the device's largest buffer "
                                   f"({be.max_buffer_bytes} B); split it (fewer tokens or cache rows)")
        for retry in (True, False):
            try:
                b = be._buffer(size, "h")
                break
            except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory) as exc:
                if not retry:
                    raise be._oom(f"no memory for a device array of {size} B ({type(exc).__name__})",
                                  size) from None
                self.pool.trim()
        if b.map is not None and not be.d_map_host_visible:
            vk.lib.vkUnmapMemory(self._d.dev, b.mem)
            b.map = None
        return b

    def take(self, nbytes: int) -> VkArray:
        """A fresh device array of at least ``nbytes`` (the pool's size class)."""
        self.be._check_open()
        return self.pool.take(nbytes, self.be.max_buffer_bytes)

    def cb(self, *keep: VkArray):
        """The batch's open command buffer (begun on first use); ``keep``: arrays its commands use, held
        until it has run."""
        self.be._check_open()
        if self.current is None:
            vk, ffi, lib, d = self.vk, self.vk.ffi, self.vk.lib, self._d
            e, self.spare = self.spare, None  # the last batch's command buffer, reset by its begin
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
            self.current = e
        self.current.keep.extend(keep)
        return self.current.cbp[0]

    def op_done(self) -> None:
        """Count a recorded op; the batch is submitted every MAX_OPS."""
        self.current.ops += 1
        if self.current.ops >= MAX_OPS:
            self.flush()

    def flush(self) -> None:
        """Submit the batch and wait for it (nothing to do without one)."""
        e, self.current = self.current, None
        if e is None:
            return
        vk, lib, d = self.vk, self.vk.lib, self._d
        cb = e.cbp[0]
        try:
            d.barrier(cb)  # shader and transfer writes -> host reads
            lib.vkCmdWriteTimestamp(cb, 0x2000, d.queries, 1)  # BOTTOM_OF_PIPE
            vu.check(vk, lib.vkEndCommandBuffer(cb))
            d.submit(e.submit, poll=self._poll)
        except BaseException:
            d.free_cmd(e)  # its descriptor sets too
            raise
        d.free_sets(e)  # the command buffer is kept for the next batch
        e.keep, e.ops, self.spare = [], 0, e  # e.keep's arrays may go back to the pool now

    def close(self) -> None:
        """Drop an unsubmitted batch and destroy every activation buffer (the device is idle)."""
        for e in (self.current, self.spare):
            if e is not None:
                self._d.free_cmd(e)
        self.current = self.spare = None
        self.pool.close()

    def dispatch(self, pipe, ins: list, out: VkArray, pc: list[int], gx: int, gy: int = 1, gz: int = 1,
                 x: VkArray | None = None, b: list | None = None) -> None:
        """Record a barrier and one dispatch: ``ins`` (VkArrays or weight buffer records) bound as A[0..]
        and, unless ``b`` (matmul.comp's up weights) is given, as B[0..]; ``x`` (default ins[0]) at
        binding 2, ``out`` at binding 3."""
        cb, d = self.cb(*[a for a in (*ins, x, out) if type(a) is VkArray]), self._d
        a = [i.b if type(i) is VkArray else i for i in ins]
        a += [a[0]] * (d.maxe - len(a))  # spare slots repeat the first
        bb = a if b is None or b is ins else b + [b[0]] * (d.maxe - len(b))  # a twice: not copied twice
        d.barrier(cb)  # earlier ops' writes -> this dispatch's reads
        d.dispatch(cb, pipe, a, bb, a[0] if x is None else x.b, out.b, pc, (gx, gy, gz), self.current.sets,
                   self._drop_recorded)
        self.op_done()

    def copy(self, src: VkArray, dst: VkArray, regions: list[tuple[int, int, int]]) -> None:
        """Record a barrier and one vkCmdCopyBuffer of ``regions`` (src byte, dst byte, bytes)."""
        cb = self.cb(dst, src)
        self._d.barrier(cb)  # earlier writes of src, reads and writes of dst -> this copy
        self.vk.lib.vkCmdCopyBuffer(cb, src.b.buf, dst.b.buf, len(regions),
                                    self.vk.ffi.new("VkBufferCopy[]", regions))
        self.op_done()

    def upload_into(self, h: VkArray, data: np.ndarray) -> None:
        """Host float32 ``data`` into the fresh array ``h`` (no recorded op uses it yet): through its
        mapping, recorded into the batch (up to INLINE_BYTES), or staged after a flush."""
        src = data.reshape(-1).view(np.uint8)
        if not src.nbytes:
            return
        if h.b.map is not None:
            np.frombuffer(h.b.map, np.uint8, count=src.nbytes)[:] = src
        elif src.nbytes <= INLINE_BYTES:
            cb, ffi = self.cb(h), self.vk.ffi
            for o in range(0, src.nbytes, UPDATE_BYTES):  # copied into the command buffer when recorded
                chunk = src[o:o + UPDATE_BYTES]
                self.vk.lib.vkCmdUpdateBuffer(cb, h.b.buf, o, chunk.nbytes, ffi.from_buffer(chunk))
            self.op_done()
        else:
            self.flush()  # staged copies wait for themselves; keep the order of earlier ops
            self.be._write(h.b, src, direct=False)
