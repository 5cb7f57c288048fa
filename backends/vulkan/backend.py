"""Vulkan backend: the GLSL compute shaders of ``shaders/vulkan`` run from their committed SPIR-V.

Driver calls go through the ``vulkan`` package's cffi objects (``vk.ffi`` structs, ``vk.lib`` functions),
which avoids its slow struct wrappers on the hot path and its traps: ``VK_WHOLE_SIZE`` overflows (real
sizes are passed), a numpy view of mapped memory must not outlive ``vkUnmapMemory`` (views are made per
call), nested structs live only as long as the outer one (pointees are kept in locals), push constants
are an ffi array, ``VK_TIMEOUT`` is a result code, ``import vulkan`` raises OSError without the loader.

One storage buffer per weight (per row block over ``maxStorageBufferRange``): padded rows, then scales;
memory types per role: ``util.memory_roles``; fixed objects: ``objects.Device``. Each call shape's command
buffer is recorded once, then replayed (``pools.Replays``); pipelines are cached on disk. Parts bound at
open: the device activations (:class:`~.device.VulkanDeviceOps` recording into a :class:`~.batch.Batch`),
the routed experts on them (:class:`~.experts.VulkanExperts`) and the host path's batched experts
(:class:`~colibri_plan.backends.batched.BatchedExperts` over ``_ffn_batch``).
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace as NS

import numpy as np

from colibri_plan.backends import programs, staging
from colibri_plan.backends.base import Backend, DeviceInfo
from colibri_plan.backends.batched import BatchedExperts, ffn_fusable
from colibri_plan.backends.pools import Replays, WorkBuffers
from colibri_plan.backends.vulkan import util as vu
from colibri_plan.backends.vulkan.batch import Batch
from colibri_plan.backends.vulkan.device import VulkanDeviceOps
from colibri_plan.backends.vulkan.experts import VulkanExperts, ffn_steps
from colibri_plan.backends.vulkan.objects import Device
from colibri_plan.errors import UnsupportedError
from colibri_plan.quant import group_size

_CMD_KEEP = 256  # recorded command buffers kept (least recently used dropped)
_USAGE = 0x20 | 0x1 | 0x2  # VK_BUFFER_USAGE_: STORAGE_BUFFER | TRANSFER_SRC | TRANSFER_DST


class VulkanBackend(Backend):
    """Quantized matmul, fused expert FFN, RMSNorm and the device-activation ops on any Vulkan 1.1 device
    (see the module docstring)."""

    name = "vulkan"
    #: push descriptors where the device has VK_KHR_push_descriptor (False: a descriptor set per
    #: dispatch, as on devices without it; read when a backend opens)
    push_descriptors = True
    #: attention workgroups wanted in flight, by device kind: fewer (row, head) pairs than this cut each
    #: row's keys into slices (decode at long contexts), merged by a second dispatch
    d_att_workgroups = {"gpu": 512, "igpu": 64, "cpu": 8}
    #: map host-visible activation memory (False: treat it as device-only, as on a discrete GPU without
    #: resizable BAR, so that tests on a CPU device cover the update, staging and read-back paths)
    d_map_host_visible = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return vu.probe()[0]

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        found = vu.probe()[1]
        return [cls.device_info(j, f.name, f.kind, f.total, f.free, f.driver)
                for j, (_, f) in enumerate(found)]

    # ---- set-up ------------------------------------------------------------------------------------
    def _open(self) -> None:
        import vulkan as vk

        self.vk, self._d, self._live, self._gc, self.batch = vk, None, {}, None, None
        self._cmds = Replays(_CMD_KEEP, lambda e: self._d.free_cmd(e))
        # activations in (x), FFN intermediate (h), results (y): grown by 2x, within one buffer's limit
        self._io = WorkBuffers(lambda role, n: self._buffer(n, role), lambda b: self._release(b),
                               lambda n: min(self.max_buffer_bytes, max(1 << 16, 2 * n)), self._io_grow)
        try:
            pd = vu.instance(vk)[1][vu.probe()[1][self.device.index][0]]  # the process's one instance
            f = self.facts = vu.device_facts(vk, pd)
            self.max_buffer_bytes = min(f.max_range, f.max_alloc or f.max_range)
            self.pipeline_cache_path = vu.cache_path(f)
            self._cache_blob, self.pipeline_cache_state = vu.read_cache(self.pipeline_cache_path, f)
            self._d = Device(vk, pd, f, vu.MAXE, self._cache_blob, self.push_descriptors)
            # collected unclosed: the VkDevice and its buffers go too (no driver calls at exit)
            self._gc = weakref.finalize(self, self._d.close)
            self._gc.atexit = False
            self._roles, direct, self._capacity = vu.memory_roles(f)
            self.weight_memory = "direct" if direct else "staged"
            # parts: the device activations' batch and hooks, the routed experts on them, the host path's
            self.batch = Batch(self)
            dops = self.bind(VulkanDeviceOps(self, self.batch))
            self.bind(VulkanExperts(self, dops))
            self.bind(BatchedExperts(self, self._ffn_batch, self._ffn_fusable))
        except BaseException:
            self._close()
            raise

    def capacity_bytes(self) -> int | None:
        return self._capacity

    # ---- memory --------------------------------------------------------------------------------------
    def _buffer(self, size: int, role: str) -> NS:
        """A buffer bound to fresh memory of the role's best type; mapped for host-visible io roles."""
        return self._d.buffer(size, _USAGE, self._roles[role], role != "w")

    def _release(self, b: NS) -> None:
        self._d.release(b)  # nothing once the device is closed (a DArray collected after close)

    def _write(self, b: NS, data: np.ndarray, offset: int = 0, direct: bool | None = None) -> None:
        """Copy bytes into a buffer: through a mapping (direct; default: weights' ``weight_memory``) or a
        staging buffer and copies."""
        vk, ffi, lib = self.vk, self.vk.ffi, self.vk.lib
        src = data.reshape(-1).view(np.uint8)
        if (self.weight_memory == "direct") if direct is None else direct:
            p = ffi.new("void**")
            vu.check(vk, lib.vkMapMemory(self._d.dev, b.mem, offset, src.nbytes, 0, p))
            np.frombuffer(ffi.buffer(p[0], src.nbytes), np.uint8)[:] = src
            lib.vkUnmapMemory(self._d.dev, b.mem)
            return
        st = self._buffer(min(src.nbytes, staging.STAGE_BYTES), "stage")

        def put(off: int, n: int) -> None:
            region = ffi.new("VkBufferCopy*", (0, offset + off, n))
            self._run_once(lambda cb: lib.vkCmdCopyBuffer(cb, st.buf, b.buf, 1, region))
        try:
            staging.copy_in_chunks(src, np.frombuffer(st.map, np.uint8), put)
        finally:
            self._release(st)

    def _io_grow(self, role: str, nbytes: int) -> None:
        if nbytes > self.max_buffer_bytes:
            raise UnsupportedError(f"vulkan: {nbytes} B of activations exceed the device's largest "
                                   f"buffer ({self.max_buffer_bytes} B); pass fewer tokens per call")
        self._cmds.drop()  # recorded commands refer to the old buffer

    # ---- weights -------------------------------------------------------------------------------------
    def _upload(self, qt):
        vk = self.vk
        data, scales, in_pad = staging.padded_layout(qt)  # uint8 [out, row_bytes], float32 scales, columns
        g = group_size(qt.fmt) or 0
        row_bytes, nscale = data.shape[1], (0 if qt.scales is None else scales.size // qt.out_features)
        per_row = row_bytes + 4 * nscale
        rows = min(qt.out_features, (self.max_buffer_bytes - 16) // per_row, 65535 * vu.ROWS)
        if rows < 1:
            raise UnsupportedError(f"vulkan: one row of a {qt.fmt} [{qt.out_features}, {qt.in_features}] "
                                   f"weight takes {per_row} B, over the device's largest buffer "
                                   f"({self.max_buffer_bytes} B); this device cannot hold it")
        w = NS(code=programs.KERNEL_FORMAT["int4" if g else qt.fmt], group=g, nchunk=row_bytes // 16,
               nscale=nscale, in_pad=in_pad, out=qt.out_features, parts=[])
        scales = scales.reshape(qt.out_features, -1) if nscale else scales
        try:  # weights over the buffer limit are split into blocks of rows, one buffer each
            for r0 in range(0, qt.out_features, rows):
                n = min(rows, qt.out_features - r0)
                b = self._buffer(-(-(n * per_row) // 16) * 16, "w")  # whole uvec4s: scales are read as uvec4
                w.parts.append(NS(b=b, r0=r0, n=n, soff=n * row_bytes // 4))
                self._write(b, data[r0:r0 + n])
                if nscale:
                    self._write(b, scales[r0:r0 + n], offset=n * row_bytes)
        except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory) as exc:
            self._free_parts(w)
            raise self._oom(f"no memory for a {qt.fmt} [{qt.out_features}, {qt.in_features}] weight of "
                            f"{qt.nbytes} B ({type(exc).__name__})", qt.nbytes) from None
        except BaseException:
            self._free_parts(w)
            raise
        self._live[id(w)] = w
        return w

    def _free_parts(self, w: NS) -> None:
        if self.batch is not None:
            self.batch.flush()  # a recorded batch may still read the weight
        self._cmds.drop(lambda e: id(w) in e.owners)
        for part in w.parts:
            self._release(part.b)
        w.parts = []
        self._live.pop(id(w), None)

    def _free(self, w) -> None:
        self._free_parts(w.payload)

    # ---- ops -----------------------------------------------------------------------------------------
    def _put_x(self, xs: list[np.ndarray], in_pad: int) -> NS:
        """Activations of every expert, one after another, as rows zero-padded to ``in_pad`` floats."""
        total = sum(x.shape[0] for x in xs)  # x_i [T_i, in] -> rows of the padded [total, in_pad] buffer
        staging.stage_rows(xs, in_pad, self._x_view(total * in_pad).reshape(total, in_pad))
        return self._io["x"]

    def _x_view(self, n: int) -> np.ndarray:
        return np.frombuffer(self._io.get("x", 4 * n).map, np.float32, count=n)  # n floats of x

    def _get_y(self, rows: int, cols: int) -> np.ndarray:
        return np.frombuffer(self._io["y"].map, np.float32, count=rows * cols).reshape(rows, cols).copy()

    @staticmethod
    def _nt(counts) -> int:
        return 1 if max(counts) == 1 else 8  # tokens per pass: two pipelines per format, not four

    def _matmul(self, x, w):
        p, T = w.payload, x.shape[0]
        xb = self._put_x([x], p.in_pad)
        yb = self._io.get("y", 4 * T * p.out)

        def steps():
            pipe = self._d.pipeline("matmul", (vu.WG, p.code, p.group, self._nt([T]), vu.ROWS, 0))
            return [(pipe, [q.b], [q.b], xb, yb, [p.nchunk, q.n, p.in_pad // 4, p.out, q.r0, q.soff, p.nscale,
                                                  0] + [T] * vu.MAXE, -(-q.n // vu.ROWS), 1) for q in p.parts]
        self._run(("mm", id(p), T), {id(p)}, steps)
        return self._get_y(T, p.out)  # y [T, out]

    def _ffn_fusable(self, e) -> bool:
        # a weight split over several buffers (over maxStorageBufferRange) runs as matmuls, block by block
        return ffn_fusable(e) and len(e.gate.payload.parts) == 1 and len(e.down.payload.parts) == 1

    def _ffn_batch(self, xs, experts, b) -> np.ndarray:
        ps = [(e.gate.payload, e.up.payload, e.down.payload) for e in experts]
        T, I, H = b.tok[-1], b.I, b.H
        xb = self._put_x(xs, b.Hp)
        hb, yb = self._io.get("h", 4 * T * b.Ip), self._io.get("y", 4 * T * H)

        def steps():  # h zeroed (down reads its padding), gate/up, then down
            gate_up, down = ffn_steps(self._d, ps, b.tok, self._nt(b.counts), b.Hp // 4, I, H, b.Ip)
            fill = [("fill", hb, 4 * T * b.Ip), "barrier"]
            return (fill + [(p, a, c, xb, hb, *r) for p, a, c, *r in gate_up]
                    + ["barrier"] + [(p, a, c, hb, yb, *r) for p, a, c, *r in down])
        self._run(("ffn", tuple(id(p) for trip in ps for p in trip), tuple(b.counts)),
                  {id(p) for trip in ps for p in trip}, steps)
        return self._get_y(T, H)  # [T, H]: expert i's rows tok[i] .. tok[i+1]-1

    def _rmsnorm(self, x, weight, eps):
        (T, H), (_, offs) = x.shape, staging.pack((x, weight), self._x_view)  # x [T, H], then weight [H]
        xb, yb = self._io["x"], self._io.get("y", 4 * T * H)
        pc = [H, offs[1], int(np.float32(eps).view(np.uint32)), T]
        self._run(("rms", T, H, pc[2]), set(), lambda: [
            (self._d.pipeline("rmsnorm", (vu.WG,)), [xb], [xb], xb, yb, pc, T, 1)])
        return self._get_y(T, H)

    # ---- command buffers -----------------------------------------------------------------------------
    def _run(self, key, owners: set, steps) -> None:
        """Replay the command buffer recorded for ``key`` (recording it from ``steps()`` once) and wait."""
        e = self._cmds.get(key)
        if e is None:
            e = self._cmds.put(key, self._record(steps(), owners))
        self._d.submit(e.submit, poll=self.device.kind != "cpu")

    def _record(self, steps, owners: set) -> NS:
        """A command buffer of ``steps``: "barrier", ("fill", buffer, bytes), a callable(cb), or a dispatch
        (pipeline, a buffers, b buffers, x, y, push constants, groups x, groups y), between timestamps."""
        vk, ffi, lib, d = self.vk, self.vk.ffi, self.vk.lib, self._d
        e = NS(cbp=ffi.new("VkCommandBuffer[1]"), sets=[], owners=owners)
        info = vu.new(vk, "VkCommandBufferAllocateInfo", commandPool=d.pool, commandBufferCount=1)
        vu.check(vk, lib.vkAllocateCommandBuffers(d.dev, info, e.cbp))
        cb = e.cbp[0]
        try:
            vu.check(vk, lib.vkBeginCommandBuffer(cb, vu.new(vk, "VkCommandBufferBeginInfo")))
            lib.vkCmdResetQueryPool(cb, d.queries, 0, 2)
            lib.vkCmdWriteTimestamp(cb, 0x1, d.queries, 0)  # TOP_OF_PIPE
            for st in steps:
                if callable(st):
                    st(cb)
                elif st == "barrier":
                    d.barrier(cb)
                elif st[0] == "fill":
                    lib.vkCmdFillBuffer(cb, st[1].buf, 0, st[2], 0)
                else:
                    pipe, a, b, xb, yb, pc, gx, gy = st  # spare slots of a[MAXE], b[MAXE] repeat the first
                    a, b = [*a, *[a[0]] * (vu.MAXE - len(a))], [*b, *[b[0]] * (vu.MAXE - len(b))]
                    d.dispatch(cb, pipe, a, b, xb, yb, pc, (gx, gy, 1), e.sets, self._cmds.drop)
            d.barrier(cb)  # shader writes -> host reads
            lib.vkCmdWriteTimestamp(cb, 0x2000, d.queries, 1)  # BOTTOM_OF_PIPE
            vu.check(vk, lib.vkEndCommandBuffer(cb))
        except BaseException:
            d.free_cmd(e)
            raise
        e.submit = vu.new(vk, "VkSubmitInfo", commandBufferCount=1, pCommandBuffers=e.cbp)
        return e

    def _run_once(self, record) -> None:
        """Record ``record(cb)`` into a fresh command buffer, run it, wait and free it."""
        e = self._record([record], set())
        try:
            self._d.submit(e.submit, poll=self.device.kind != "cpu")
        finally:
            self._d.free_cmd(e)

    # ---- timing and teardown -------------------------------------------------------------------------
    def _device_seconds(self) -> float | None:
        return self._d.gpu_seconds()  # timestamps around every call's commands

    def _synchronize(self) -> None:
        self.batch.flush()
        self.vk.lib.vkQueueWaitIdle(self._d.queue)

    def _close(self) -> None:
        if self._d is not None and self._d.dev is not None:
            self.vk.lib.vkDeviceWaitIdle(self._d.dev)
            if self.batch is not None:
                self.batch.close()
            self._cmds.drop()
            for w in list(self._live.values()):
                self._free_parts(w)
            self._io.clear()
            self._d.save_cache(self.pipeline_cache_path, self._cache_blob)
        if self._gc is not None:
            self._gc()  # Device.close, once: the buffers left, the objects, the VkDevice
        elif self._d is not None:
            self._d.close()


BACKEND = VulkanBackend
