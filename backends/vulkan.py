"""Vulkan backend: the GLSL compute shaders of ``shaders/vulkan`` run from their committed SPIR-V.

Driver calls go through the ``vulkan`` package's cffi objects (``vk.ffi`` structs, ``vk.lib`` functions),
which avoids its slow struct wrappers on the hot path and its traps: ``VK_WHOLE_SIZE`` overflows (real
sizes are passed), a numpy view of mapped memory must not outlive ``vkUnmapMemory`` (views are made per
call), nested structs live only as long as the outer one (pointees are kept in locals), push constants
are an ffi array, ``VK_TIMEOUT`` is a result code, ``import vulkan`` raises OSError without the loader.

One storage buffer per weight (per block of rows over ``maxStorageBufferRange``): padded rows, then
float32 scales; memory types per role in ``vulkan_util.memory_roles``. Each call shape records its command
buffer once and replays it; pipelines come from a cache persisted on disk (``vulkan_util.cache_path``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from importlib import resources
from types import SimpleNamespace as NS

import numpy as np

from colibri_plan.backends import vulkan_util as vu
from colibri_plan.backends.base import Backend, DeviceInfo, padded_layout
from colibri_plan.errors import ColibriError, DeviceOutOfMemoryError, UnsupportedError
from colibri_plan.quant import FORMATS, group_size

MAXE, WG, ROWS = 8, 64, 4  # experts per dispatch (the shader's MAXE), invocations and rows per workgroup
_CODE = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3, "int4": 4, "int2": 5}  # the shader's FMT
_CMD_KEEP = 256  # recorded command buffers kept (least recently used dropped)
_USAGE = 0x20 | 0x1 | 0x2  # VK_BUFFER_USAGE_: STORAGE_BUFFER | TRANSFER_SRC | TRANSFER_DST
_COMPUTE, _STORAGE = vu.COMPUTE, 7  # VK_SHADER_STAGE_COMPUTE_BIT, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
_FENCE_TIMEOUT_NS = 600 * 10**9


class VulkanBackend(Backend):
    """Quantized matmul, fused expert FFN and RMSNorm on any Vulkan 1.1 device (lavapipe included)."""

    name = "vulkan"
    formats = FORMATS

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return vu.probe()[0]

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        return [DeviceInfo("vulkan", j, f.name, f.kind, f.total, f.free, f.kind != "gpu", FORMATS, f.driver)
                for j, (_, f) in enumerate(vu.probe()[1])]

    # ---- set-up ------------------------------------------------------------------------------------
    def _open(self) -> None:
        import vulkan as vk

        self.vk, ffi, lib = vk, vk.ffi, vk.lib
        self._undo, self._cmds, self._pipes, self._io, self._live = [], OrderedDict(), {}, {}, {}
        self._inst = vu.create_instance(vk)
        self._undo.append(lambda: lib.vkDestroyInstance(self._inst, ffi.NULL))
        try:
            self._setup(vk, ffi, lib)
        except BaseException:
            self._close()
            raise

    def _setup(self, vk, ffi, lib) -> None:
        phys_index = vu.probe()[1][self.device.index][0]
        pd = vu.enum(vk, "VkPhysicalDevice", lib.vkEnumeratePhysicalDevices, self._inst)[phys_index]
        f = self.facts = vu.device_facts(vk, pd)
        self.max_buffer_bytes = min(f.max_range, f.max_alloc or f.max_range)
        prio = ffi.new("float[1]", [1.0])
        qinfo = vu.new(vk, "VkDeviceQueueCreateInfo", queueFamilyIndex=f.queue, queueCount=1,
                       pQueuePriorities=prio)
        feats = ffi.new("VkPhysicalDeviceFeatures*", {"shaderStorageBufferArrayDynamicIndexing": 1})
        info = vu.new(vk, "VkDeviceCreateInfo", queueCreateInfoCount=1, pQueueCreateInfos=qinfo,
                      pEnabledFeatures=feats)
        self._dev = self._make(lib.vkCreateDevice, "VkDevice", pd, info,
                               undo=lambda h: lib.vkDestroyDevice(h, ffi.NULL), device=False)
        q = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self._dev, f.queue, 0, q)
        self._queue = q[0]
        self._pool = self._make(lib.vkCreateCommandPool, "VkCommandPool", vu.new(
            vk, "VkCommandPoolCreateInfo", flags=2, queueFamilyIndex=f.queue))  # RESET_COMMAND_BUFFER
        fence = self._make(lib.vkCreateFence, "VkFence", vu.new(vk, "VkFenceCreateInfo"))
        self._fence = ffi.new("VkFence[1]", [fence])
        self._queries = self._make(lib.vkCreateQueryPool, "VkQueryPool", vu.new(
            vk, "VkQueryPoolCreateInfo", queryType=2, queryCount=2))  # TIMESTAMP: start and end of a call
        binds = ffi.new("VkDescriptorSetLayoutBinding[4]", [
            {"binding": b, "descriptorType": _STORAGE, "descriptorCount": n, "stageFlags": _COMPUTE}
            for b, n in enumerate((MAXE, MAXE, 1, 1))])  # A[MAXE], B[MAXE], x, y as in matmul.comp
        self._dsl = ffi.new("VkDescriptorSetLayout[1]", [self._make(
            lib.vkCreateDescriptorSetLayout, "VkDescriptorSetLayout",
            vu.new(vk, "VkDescriptorSetLayoutCreateInfo", bindingCount=4, pBindings=binds))])
        pcr = ffi.new("VkPushConstantRange*", {"stageFlags": _COMPUTE, "offset": 0, "size": 64})
        self._layout = self._make(lib.vkCreatePipelineLayout, "VkPipelineLayout", vu.new(
            vk, "VkPipelineLayoutCreateInfo", setLayoutCount=1, pSetLayouts=self._dsl,
            pushConstantRangeCount=1, pPushConstantRanges=pcr))
        sizes = ffi.new("VkDescriptorPoolSize*", {"type": _STORAGE, "descriptorCount": 1024 * (2 * MAXE + 2)})
        self._dpool = self._make(lib.vkCreateDescriptorPool, "VkDescriptorPool", vu.new(
            vk, "VkDescriptorPoolCreateInfo", flags=1, maxSets=1024, poolSizeCount=1, pPoolSizes=sizes))
        self._mods = {}
        for shader in ("matmul", "rmsnorm"):
            code = (resources.files("colibri_plan.shaders") / "vulkan" / f"{shader}.spv").read_bytes()
            words = ffi.cast("uint32_t*", ffi.from_buffer(code))
            self._mods[shader] = self._make(lib.vkCreateShaderModule, "VkShaderModule", vu.new(
                vk, "VkShaderModuleCreateInfo", codeSize=len(code), pCode=words))
        self.pipeline_cache_path = vu.cache_path(f)
        self._cache_blob, self.pipeline_cache_state = vu.read_cache(self.pipeline_cache_path, f)
        cdata = ffi.from_buffer(self._cache_blob)
        self._pcache = self._make(lib.vkCreatePipelineCache, "VkPipelineCache", vu.new(
            vk, "VkPipelineCacheCreateInfo", initialDataSize=len(self._cache_blob), pInitialData=cdata))
        self._roles, direct, self._capacity = vu.memory_roles(f)
        self.weight_memory = "direct" if direct else "staged"

    def _make(self, fn, ctype, *args, undo=None, device=True):
        """Create a handle with ``fn(dev?, *args, NULL, &h)``; its destroy call is queued for close."""
        ffi, h = self.vk.ffi, self.vk.ffi.new(ctype + "*")
        vu.check(self.vk, fn(*((self._dev,) if device else ()), *args, ffi.NULL, h))
        destroy = getattr(self.vk.lib, "vkDestroy" + ctype[2:], None)
        self._undo.append((lambda: undo(h[0])) if undo else (lambda: destroy(self._dev, h[0], ffi.NULL)))
        return h[0]

    def _pipeline(self, shader: str, spec: tuple[int, ...]):
        key = (shader, spec)
        if key not in self._pipes:
            vk, ffi = self.vk, self.vk.ffi
            data = ffi.new("uint32_t[]", list(spec))
            entries = ffi.new("VkSpecializationMapEntry[]", [(i, 4 * i, 4) for i in range(len(spec))])
            spec_info = ffi.new("VkSpecializationInfo*", (len(spec), entries, 4 * len(spec), data))
            name = ffi.new("char[]", b"main")
            stage = {"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, "stage": _COMPUTE,
                     "module": self._mods[shader], "pName": name, "pSpecializationInfo": spec_info}
            info = vu.new(vk, "VkComputePipelineCreateInfo", stage=stage, layout=self._layout)
            create = vk.lib.vkCreateComputePipelines
            self._pipes[key] = self._make(create, "VkPipeline", self._pcache, 1, info)
        return self._pipes[key]

    # ---- memory --------------------------------------------------------------------------------------
    def _buffer(self, size: int, role: str) -> NS:
        """A buffer bound to fresh memory of the role's best type; mapped for host-visible io roles."""
        return vu.make_buffer(self.vk, self._dev, size, _USAGE, self._roles[role], self.facts, role != "w")

    def _release(self, b: NS) -> None:
        vu.release_buffer(self.vk, self._dev, b)

    def _write(self, b: NS, data: np.ndarray, offset: int = 0) -> None:
        """Copy bytes into a weight buffer: through a mapping (direct) or a staging buffer and a copy."""
        vk, ffi, lib = self.vk, self.vk.ffi, self.vk.lib
        src = data.reshape(-1).view(np.uint8)
        if self.weight_memory == "direct":
            p = ffi.new("void**")
            vu.check(vk, lib.vkMapMemory(self._dev, b.mem, offset, src.nbytes, 0, p))
            np.frombuffer(ffi.buffer(p[0], src.nbytes), np.uint8)[:] = src
            lib.vkUnmapMemory(self._dev, b.mem)
            return
        st = self._buffer(src.nbytes, "stage")
        try:
            np.frombuffer(st.map, np.uint8)[:] = src
            region = ffi.new("VkBufferCopy*", (0, offset, src.nbytes))
            self._run_once(lambda cb: lib.vkCmdCopyBuffer(cb, st.buf, b.buf, 1, region))
        finally:
            self._release(st)

    def _io_buffer(self, role: str, nbytes: int) -> NS:
        """The persistent activation buffer of a role (x in, h between FFN halves, y out), grown by 2x."""
        b = self._io.get(role)
        if b is None or b.size < nbytes:
            if nbytes > self.max_buffer_bytes:
                raise UnsupportedError(f"vulkan: {nbytes} B of activations exceed the device's largest "
                                       f"buffer ({self.max_buffer_bytes} B); pass fewer tokens per call")
            self._drop_cmds(lambda e: True)  # recorded commands refer to the old buffer
            if b is not None:
                self._release(b)
            self._io[role] = b = self._buffer(min(self.max_buffer_bytes, max(1 << 16, 2 * nbytes)), role)
        return b

    def capacity_bytes(self) -> int | None:
        return self._capacity

    # ---- weights -------------------------------------------------------------------------------------
    def _upload(self, qt):
        vk = self.vk
        data, scales, in_pad = padded_layout(qt)  # uint8 [out, row_bytes], float32 scales, padded columns
        g = group_size(qt.fmt) or 0
        row_bytes, nscale = data.shape[1], (0 if qt.scales is None else scales.size // qt.out_features)
        per_row = row_bytes + 4 * nscale
        rows = min(qt.out_features, (self.max_buffer_bytes - 16) // per_row, 65535 * ROWS)
        if rows < 1:
            raise UnsupportedError(f"vulkan: one row of a {qt.fmt} [{qt.out_features}, {qt.in_features}] "
                                   f"weight takes {per_row} B, over the device's largest buffer "
                                   f"({self.max_buffer_bytes} B); this device cannot hold it")
        w = NS(code=_CODE["int4" if g else qt.fmt], group=g, nchunk=row_bytes // 16, nscale=nscale,
               in_pad=in_pad, out=qt.out_features, parts=[])
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
            raise DeviceOutOfMemoryError(
                f"vulkan device {self.device.name!r}: no memory for a {qt.fmt} [{qt.out_features}, "
                f"{qt.in_features}] weight of {qt.nbytes} B ({type(exc).__name__}; {self.held_bytes} B "
                "held); place fewer experts on this device",
                requested_bytes=qt.nbytes, held_bytes=self.held_bytes,
                capacity_bytes=self._capacity) from None
        except BaseException:
            self._free_parts(w)
            raise
        self._live[id(w)] = w
        return w

    def _free_parts(self, w: NS) -> None:
        self._drop_cmds(lambda e: id(w) in e.owners)
        for part in w.parts:
            self._release(part.b)
        w.parts = []
        self._live.pop(id(w), None)

    def _free(self, w) -> None:
        self._free_parts(w.payload)

    # ---- ops -----------------------------------------------------------------------------------------
    def _put_x(self, xs: list[np.ndarray], in_pad: int) -> NS:
        """Activations of every expert, one after another, as rows zero-padded to ``in_pad`` floats."""
        total = sum(x.shape[0] for x in xs)
        b = self._io_buffer("x", 4 * total * in_pad)
        view = np.frombuffer(b.map, np.float32, count=total * in_pad).reshape(total, in_pad)
        t = 0
        for x in xs:  # x [T_i, in] -> rows t .. t+T_i of the padded [total, in_pad] buffer
            view[t:t + x.shape[0], :x.shape[1]] = x
            t += x.shape[0]
        view[:, xs[0].shape[1]:] = 0.0
        return b

    def _get_y(self, rows: int, cols: int) -> np.ndarray:
        return np.frombuffer(self._io["y"].map, np.float32, count=rows * cols).reshape(rows, cols).copy()

    @staticmethod
    def _nt(counts) -> int:
        return 1 if max(counts) == 1 else 8  # tokens per pass: two pipelines per format, not four

    def _matmul(self, x, w):
        p, T = w.payload, x.shape[0]
        xb = self._put_x([x], p.in_pad)
        yb = self._io_buffer("y", 4 * T * p.out)

        def steps():
            pipe = self._pipeline("matmul", (WG, p.code, p.group, self._nt([T]), ROWS, 0))
            return [(pipe, [q.b], [q.b], xb, yb, [p.nchunk, q.n, p.in_pad // 4, p.out, q.r0, q.soff, p.nscale,
                                                  0] + [T] * MAXE, -(-q.n // ROWS), 1) for q in p.parts]
        self._run(("mm", id(p), T), {id(p)}, steps)
        return self._get_y(T, p.out)  # y [T, out]

    def _expert_ffn(self, xs, experts):
        ps = [(e.gate.payload, e.up.payload, e.down.payload) for e in experts]
        (g0, _, d0), one = ps[0], (lambda p: (p.code, p.group, p.out, p.in_pad, len(p.parts)))
        if len(g0.parts) > 1 or len(d0.parts) > 1 or any(
                one(g) != one(g0) or one(u) != one(g0) or one(d) != one(d0) for g, u, d in ps):
            return super()._expert_ffn(xs, experts)  # mixed formats or split weights: one matmul at a time
        counts = [x.shape[0] for x in xs]
        tok = [0, *np.cumsum(counts).tolist()]  # expert i owns rows tok[i] .. tok[i+1]-1 of x, h and y
        T, I, H = tok[-1], g0.out, d0.out
        xb = self._put_x(xs, g0.in_pad)
        hb, yb = self._io_buffer("h", 4 * T * d0.in_pad), self._io_buffer("y", 4 * T * H)

        def steps():
            nt = self._nt(counts)
            gate_up = self._pipeline("matmul", (WG, g0.code, g0.group, nt, ROWS, 1))
            down = self._pipeline("matmul", (WG, d0.code, d0.group, nt, ROWS, 0))
            first, second = [("fill", hb, 4 * T * d0.in_pad), "barrier"], ["barrier"]
            for c in range(0, len(ps), MAXE):  # one dispatch per MAXE experts: gate/up, then down
                sub, t = ps[c:c + MAXE], tok[c:c + MAXE + 1]
                t = t + [t[-1]] * (MAXE + 1 - len(t))
                first.append((gate_up, [p[0].parts[0].b for p in sub], [p[1].parts[0].b for p in sub], xb, hb,
                              [g0.nchunk, I, g0.in_pad // 4, d0.in_pad, 0, g0.parts[0].soff, g0.nscale, *t],
                              -(-I // ROWS), len(sub)))
                downs = [p[2].parts[0].b for p in sub]
                pc = [d0.nchunk, H, d0.in_pad // 4, H, 0, d0.parts[0].soff, d0.nscale, *t]
                second.append((down, downs, downs, hb, yb, pc, -(-H // ROWS), len(sub)))
            return first + second
        self._run(("ffn", tuple(id(p) for trip in ps for p in trip), tuple(counts)),
                  {id(p) for trip in ps for p in trip}, steps)
        y = self._get_y(T, H)  # [T, H] -> one [T_i, H] block per expert
        return [y[tok[i]:tok[i + 1]] for i in range(len(xs))]

    def _rmsnorm(self, x, weight, eps):
        T, H = x.shape
        xb = self._io_buffer("x", 4 * (T * H + H))
        view = np.frombuffer(xb.map, np.float32, count=T * H + H)
        view[:T * H], view[T * H:] = x.reshape(-1), weight  # x [T, H] then weight [H] in one buffer
        yb = self._io_buffer("y", 4 * T * H)
        pc = [H, T * H, int(np.float32(eps).view(np.uint32))]
        self._run(("rms", T, H, pc[2]), set(), lambda: [
            (self._pipeline("rmsnorm", (WG,)), [xb], [xb], xb, yb, pc, T, 1)])
        return self._get_y(T, H)

    # ---- command buffers -----------------------------------------------------------------------------
    def _run(self, key, owners: set, steps) -> None:
        """Replay the command buffer recorded for ``key`` (recording it from ``steps()`` once) and wait."""
        e = self._cmds.get(key)
        if e is None:
            e = self._cmds[key] = self._record(steps(), owners)
            while len(self._cmds) > _CMD_KEEP:
                self._free_cmd(self._cmds.popitem(last=False)[1])
        self._cmds.move_to_end(key)
        self._submit(e.submit)

    def _record(self, steps, owners: set) -> NS:
        vk, ffi, lib = self.vk, self.vk.ffi, self.vk.lib
        e = NS(cbp=ffi.new("VkCommandBuffer[1]"), sets=[], owners=owners)
        info = vu.new(vk, "VkCommandBufferAllocateInfo", commandPool=self._pool, commandBufferCount=1)
        vu.check(vk, lib.vkAllocateCommandBuffers(self._dev, info, e.cbp))
        cb = e.cbp[0]
        try:
            vu.check(vk, lib.vkBeginCommandBuffer(cb, vu.new(vk, "VkCommandBufferBeginInfo")))
            lib.vkCmdResetQueryPool(cb, self._queries, 0, 2)
            lib.vkCmdWriteTimestamp(cb, 0x1, self._queries, 0)  # TOP_OF_PIPE
            for st in steps:
                if callable(st):
                    st(cb)
                elif st == "barrier":
                    self._barrier(cb)
                elif st[0] == "fill":
                    lib.vkCmdFillBuffer(cb, st[1].buf, 0, st[2], 0)
                else:
                    pipe, a, b, xb, yb, pc, gx, gy = st
                    e.sets.append(self._set(a, b, xb, yb))
                    lib.vkCmdBindPipeline(cb, 1, pipe)  # VK_PIPELINE_BIND_POINT_COMPUTE
                    lib.vkCmdBindDescriptorSets(cb, 1, self._layout, 0, 1, e.sets[-1], 0, ffi.NULL)
                    words = ffi.new("uint32_t[]", pc)  # push constants: an ffi array
                    lib.vkCmdPushConstants(cb, self._layout, _COMPUTE, 0, 4 * len(pc), words)
                    lib.vkCmdDispatch(cb, gx, gy, 1)
            self._barrier(cb)  # shader writes -> host reads
            lib.vkCmdWriteTimestamp(cb, 0x2000, self._queries, 1)  # BOTTOM_OF_PIPE
            vu.check(vk, lib.vkEndCommandBuffer(cb))
        except BaseException:
            self._free_cmd(e)
            raise
        e.submit = vu.new(vk, "VkSubmitInfo", commandBufferCount=1, pCommandBuffers=e.cbp)
        return e

    def _barrier(self, cb) -> None:
        # shader/transfer writes -> shader reads/writes, transfers and host reads
        mb = vu.new(self.vk, "VkMemoryBarrier", srcAccessMask=0x40 | 0x1000,
                    dstAccessMask=0x20 | 0x40 | 0x1000 | 0x2000)
        null = self.vk.ffi.NULL  # stages: compute|transfer -> compute|transfer|host
        self.vk.lib.vkCmdPipelineBarrier(cb, 0x800 | 0x1000, 0x800 | 0x1000 | 0x4000, 0, 1, mb, 0, null, 0,
                                         null)

    def _set(self, a: list, b: list, xb: NS, yb: NS):
        """A descriptor set: binding 0 = a[MAXE], 1 = b[MAXE] (spare slots repeat the first), 2 = x, 3 = y."""
        vk, ffi, lib = self.vk, self.vk.ffi, self.vk.lib
        ds = ffi.new("VkDescriptorSet[1]")
        info = vu.new(vk, "VkDescriptorSetAllocateInfo", descriptorPool=self._dpool, descriptorSetCount=1,
                    pSetLayouts=self._dsl)
        if lib.vkAllocateDescriptorSets(self._dev, info, ds) != 0:  # pool full: drop recorded commands, retry
            self._drop_cmds(lambda e: True)
            vu.check(vk, lib.vkAllocateDescriptorSets(self._dev, info, ds))
        bufs = [*a, *[a[0]] * (MAXE - len(a)), *b, *[b[0]] * (MAXE - len(b)), xb, yb]
        infos = ffi.new("VkDescriptorBufferInfo[]", [(q.buf, 0, q.size) for q in bufs])  # real sizes
        writes = ffi.new("VkWriteDescriptorSet[4]", [
            {"sType": vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, "dstSet": ds[0], "dstBinding": i,
             "descriptorCount": n, "descriptorType": 7, "pBufferInfo": infos + start}
            for i, (start, n) in enumerate(((0, MAXE), (MAXE, MAXE), (2 * MAXE, 1), (2 * MAXE + 1, 1)))])
        lib.vkUpdateDescriptorSets(self._dev, 4, writes, 0, ffi.NULL)
        return ds

    def _free_cmd(self, e: NS) -> None:
        lib = self.vk.lib
        for ds in e.sets:
            lib.vkFreeDescriptorSets(self._dev, self._dpool, 1, ds)
        lib.vkFreeCommandBuffers(self._dev, self._pool, 1, e.cbp)

    def _drop_cmds(self, pred) -> None:
        for key in [k for k, e in self._cmds.items() if pred(e)]:
            self._free_cmd(self._cmds.pop(key))

    def _submit(self, submit) -> None:
        vk, lib = self.vk, self.vk.lib
        vu.check(vk, lib.vkQueueSubmit(self._queue, 1, submit, self._fence[0]))
        if self.device.kind != "cpu":  # poll briefly: a sleeping wait adds wake-up latency to short ops
            until = time.perf_counter() + 0.002  # (never on CPU devices: it would steal their cores)
            while lib.vkGetFenceStatus(self._dev, self._fence[0]) == 1 and time.perf_counter() < until:
                pass  # 1 = VK_NOT_READY
        res = lib.vkWaitForFences(self._dev, 1, self._fence, 1, _FENCE_TIMEOUT_NS)
        if res == vk.VK_TIMEOUT:  # not a VkError: check it by value
            raise ColibriError(f"vulkan device {self.device.name!r} did not finish within "
                               f"{_FENCE_TIMEOUT_NS // 10**9} s; it may be hung")
        vu.check(vk, res)
        vu.check(vk, lib.vkResetFences(self._dev, 1, self._fence))

    def _run_once(self, record) -> None:
        """Record ``record(cb)`` into a fresh command buffer, run it, wait and free it."""
        e = self._record([record], set())
        try:
            self._submit(e.submit)
        finally:
            self._free_cmd(e)

    # ---- teardown ------------------------------------------------------------------------------------
    def last_gpu_seconds(self) -> float | None:
        """Device time of the last call (matmul, expert_ffn, rmsnorm) from its timestamps, without the
        host's share; None when the queue has no timestamps."""
        f, t = self.facts, self.vk.ffi.new("uint64_t[2]")
        if not f.timestamp_bits or self.vk.lib.vkGetQueryPoolResults(
                self._dev, self._queries, 0, 2, 16, t, 8, 1) != 0:  # VK_QUERY_RESULT_64_BIT
            return None
        return ((t[1] - t[0]) & ((1 << f.timestamp_bits) - 1)) * f.timestamp_ns * 1e-9

    def _synchronize(self) -> None:
        self.vk.lib.vkQueueWaitIdle(self._queue)

    def _close(self) -> None:
        if getattr(self, "_dev", None) is not None:
            self.vk.lib.vkDeviceWaitIdle(self._dev)
            self._drop_cmds(lambda e: True)
            for w in list(self._live.values()):
                self._free_parts(w)
            for b in self._io.values():
                self._release(b)
            self._io = {}
            if getattr(self, "_pcache", None) is not None:
                vu.save_cache(self.vk, self._dev, self._pcache, self.pipeline_cache_path, self._cache_blob)
        for undo in reversed(self._undo):
            undo()
        self._undo, self._dev = [], None


BACKEND = VulkanBackend
