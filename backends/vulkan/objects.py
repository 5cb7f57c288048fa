"""The fixed objects of a Vulkan backend's logical device (:class:`Device`): queue, command pool, fence,
timestamps, descriptor layouts, pipelines and their cache, and every buffer made on it.

Descriptors: with ``VK_KHR_push_descriptor`` (most GPU drivers, lavapipe) a dispatch pushes its buffers
into the command buffer (:meth:`Device.push_set`), so nothing is allocated or freed per op; without it, a
descriptor set is allocated per dispatch and freed with its command buffer (:meth:`Device.new_set`).
The structs of the hot path (barrier, push constants, descriptor writes) are made once and overwritten.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace as NS

from colibri_plan.backends import programs
from colibri_plan.backends.vulkan import util as vu
from colibri_plan.backends.vulkan.util import CACHE_MAGIC, COMPUTE, FENCE_TIMEOUT_NS, STORAGE, check, new
from colibri_plan.errors import ColibriError

PUSH_DESCRIPTOR = "VK_KHR_push_descriptor"
_PUSH_LAYOUT = 1  # VK_DESCRIPTOR_SET_LAYOUT_CREATE_PUSH_DESCRIPTOR_BIT_KHR


class Device:
    """A logical device with the objects every call uses: one compute queue, a command pool, a fence, a
    timestamp query pool (start and end of a call), the descriptor-set layout of matmul.comp (A[maxe],
    B[maxe], x, y) with 64 bytes of push constants, a descriptor pool, the shader modules and the
    pipeline cache (created from ``cache_blob``), and every buffer made by :meth:`buffer`. :meth:`close`
    destroys the buffers left, then the rest in reverse order (also when the backend is collected
    unclosed: it holds no reference to its backend, so a ``weakref.finalize`` can call it)."""

    def __init__(self, vk, pd, f: NS, maxe: int, cache_blob: bytes, push_descriptors: bool = True):
        self.vk, self.f, self.maxe, self.dev, self._undo, self._pipes = vk, f, maxe, None, [], {}
        self.buffers: dict[int, NS] = {}  # id -> buffer record of make_buffer, until released
        #: descriptors pushed into command buffers (VK_KHR_push_descriptor) rather than sets per dispatch
        self.push = bool(push_descriptors and f.push_descriptor)
        ffi, lib = vk.ffi, vk.lib
        try:
            prio = ffi.new("float[1]", [1.0])
            qinfo = new(vk, "VkDeviceQueueCreateInfo", queueFamilyIndex=f.queue, queueCount=1,
                        pQueuePriorities=prio)
            feats = ffi.new("VkPhysicalDeviceFeatures*", {"shaderStorageBufferArrayDynamicIndexing": 1})
            ext = ffi.new("char[]", PUSH_DESCRIPTOR.encode())
            exts = ffi.new("char*[1]", [ext])
            info = new(vk, "VkDeviceCreateInfo", queueCreateInfoCount=1, pQueueCreateInfos=qinfo,
                       pEnabledFeatures=feats, enabledExtensionCount=int(self.push),
                       ppEnabledExtensionNames=exts)
            self.dev = self.make(lib.vkCreateDevice, "VkDevice", pd, info,
                                 undo=self._destroy_device, device=False)
            vu._LIVE[0] += 1
            q = ffi.new("VkQueue*")
            lib.vkGetDeviceQueue(self.dev, f.queue, 0, q)
            self.queue = q[0]
            self.pool = self.make(lib.vkCreateCommandPool, "VkCommandPool", new(
                vk, "VkCommandPoolCreateInfo", flags=2, queueFamilyIndex=f.queue))  # RESET_COMMAND_BUFFER
            self.fence = ffi.new("VkFence[1]", [self.make(lib.vkCreateFence, "VkFence",
                                                          new(vk, "VkFenceCreateInfo"))])
            self.queries = self.make(lib.vkCreateQueryPool, "VkQueryPool", new(
                vk, "VkQueryPoolCreateInfo", queryType=2, queryCount=2))  # TIMESTAMP: start and end of a call
            binds = ffi.new("VkDescriptorSetLayoutBinding[4]", [
                {"binding": b, "descriptorType": STORAGE, "descriptorCount": n, "stageFlags": COMPUTE}
                for b, n in enumerate((maxe, maxe, 1, 1))])  # A[MAXE], B[MAXE], x, y as in matmul.comp
            self.dsl = ffi.new("VkDescriptorSetLayout[1]", [self.make(
                lib.vkCreateDescriptorSetLayout, "VkDescriptorSetLayout",
                new(vk, "VkDescriptorSetLayoutCreateInfo", bindingCount=4, pBindings=binds,
                    flags=_PUSH_LAYOUT if self.push else 0))])
            pcr = ffi.new("VkPushConstantRange*", {"stageFlags": COMPUTE, "offset": 0, "size": 64})
            self.layout = self.make(lib.vkCreatePipelineLayout, "VkPipelineLayout", new(
                vk, "VkPipelineLayoutCreateInfo", setLayoutCount=1, pSetLayouts=self.dsl,
                pushConstantRangeCount=1, pPushConstantRanges=pcr))
            sizes = ffi.new("VkDescriptorPoolSize*", {"type": STORAGE,
                                                      "descriptorCount": 1024 * (2 * maxe + 2)})
            self.dpool = self.make(lib.vkCreateDescriptorPool, "VkDescriptorPool", new(
                vk, "VkDescriptorPoolCreateInfo", flags=1, maxSets=1024, poolSizeCount=1, pPoolSizes=sizes))
            self.mods = {}
            for shader in ("matmul", "rmsnorm", "attention_gqa", "elementwise", "head_matmul"):
                code = programs.kernel_source("vulkan", f"{shader}.spv", binary=True)
                words = ffi.cast("uint32_t*", ffi.from_buffer(code))
                self.mods[shader] = self.make(lib.vkCreateShaderModule, "VkShaderModule", new(
                    vk, "VkShaderModuleCreateInfo", codeSize=len(code), pCode=words))
            self._prealloc()
            cdata = ffi.from_buffer(cache_blob)
            self.pcache = self.make(lib.vkCreatePipelineCache, "VkPipelineCache", new(
                vk, "VkPipelineCacheCreateInfo", initialDataSize=len(cache_blob), pInitialData=cdata))
        except BaseException:
            self.close()
            raise

    def _prealloc(self) -> None:
        """The structs every dispatch fills: descriptor writes over ``_infos`` (A[0..m), x, y, then
        B[0..m) when it differs from A), push constants, the barrier; the push-descriptor entry point."""
        vk, ffi, m = self.vk, self.vk.ffi, self.maxe
        self._infos = ffi.new("VkDescriptorBufferInfo[]", 3 * m + 2)
        self._writes = {}
        for same in (True, False):  # binding 1 (B) reads A's infos when the caller passes A twice
            w = self._writes[same] = ffi.new("VkWriteDescriptorSet[4]")
            for i, (start, n) in enumerate(((0, m), (0 if same else m + 2, m), (m, 1), (m + 1, 1))):
                w[i].sType, w[i].dstBinding = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, i
                w[i].descriptorCount, w[i].descriptorType, w[i].pBufferInfo = n, STORAGE, self._infos + start
        self._words = ffi.new("uint32_t[16]")  # push constants: 64 bytes
        # shader/transfer writes -> shader reads/writes, transfers and host reads
        self._mb = new(vk, "VkMemoryBarrier", srcAccessMask=0x40 | 0x1000,
                       dstAccessMask=0x20 | 0x40 | 0x800 | 0x1000 | 0x2000)
        self._push_fn = None
        if self.push:
            fn = self.vk.lib.vkGetDeviceProcAddr(self.dev, b"vkCmdPushDescriptorSetKHR")
            if fn == ffi.NULL:
                raise vk.VkErrorExtensionNotPresent("vkCmdPushDescriptorSetKHR not found")
            self._push_fn = ffi.cast("PFN_vkCmdPushDescriptorSetKHR", fn)

    def dispatch(self, cb, pipe, a: list[NS], b: list[NS], x: NS, y: NS, pc: list[int], groups: tuple,
                 sets: list, when_full) -> None:
        """Record one dispatch of ``pipe`` over buffer records ``a`` and ``b`` (maxe each: bindings 0 and
        1; ``b is a`` saves copying them twice), ``x`` (binding 2), ``y`` (binding 3), push constants
        ``pc`` (ints, at most 16) and ``groups`` (x, y, z). Descriptors are pushed, or written into a new
        set appended to ``sets`` (freed with the command buffer; ``when_full`` as for :meth:`new_set`)."""
        lib, ffi, same = self.vk.lib, self.vk.ffi, b is a
        lib.vkCmdBindPipeline(cb, 1, pipe)  # VK_PIPELINE_BIND_POINT_COMPUTE
        if self._push_fn is not None:
            packed = b"".join([q.info for q in a]) + x.info + y.info  # [m + 2] VkDescriptorBufferInfo
            if not same:
                packed += b"".join([q.info for q in b])
            ffi.memmove(self._infos, packed, len(packed))
            self._push_fn(cb, 1, self.layout, 0, 4, self._writes[same])
        else:
            sets.append(self.new_set([*a, *b, x, y], when_full))
            lib.vkCmdBindDescriptorSets(cb, 1, self.layout, 0, 1, sets[-1], 0, ffi.NULL)
        words, n = self._words, len(pc)
        words[0:n] = pc
        lib.vkCmdPushConstants(cb, self.layout, COMPUTE, 0, 4 * n, words)
        lib.vkCmdDispatch(cb, *groups)

    def _destroy_device(self, h) -> None:
        self.vk.lib.vkDestroyDevice(h, self.vk.ffi.NULL)
        vu._LIVE[0] -= 1

    def buffer(self, size: int, usage: int, types: list[int], map_it: bool) -> NS:
        """``vu.make_buffer`` on this device, kept in :attr:`buffers` until :meth:`release` or close."""
        b = vu.make_buffer(self.vk, self.dev, size, usage, types, self.f, map_it)
        self.buffers[id(b)] = b
        return b

    def release(self, b: NS) -> None:
        """``vu.release_buffer`` of a :meth:`buffer` buffer; nothing once the device is closed (its
        buffers went with it) or when ``b`` was already released."""
        if self.dev is not None and self.buffers.pop(id(b), None) is not None:
            vu.release_buffer(self.vk, self.dev, b)

    def make(self, fn, ctype, *args, undo=None, device=True):
        """Create a handle with ``fn(dev?, *args, NULL, &h)``; its destroy call is queued for close."""
        ffi, h = self.vk.ffi, self.vk.ffi.new(ctype + "*")
        check(self.vk, fn(*((self.dev,) if device else ()), *args, ffi.NULL, h))
        destroy = getattr(self.vk.lib, "vkDestroy" + ctype[2:], None)
        self._undo.append((lambda: undo(h[0])) if undo else (lambda: destroy(self.dev, h[0], ffi.NULL)))
        return h[0]

    def pipeline(self, shader: str, spec: tuple[int, ...]):
        """The compute pipeline of ``shader`` with specialisation constants ``spec`` (made once)."""
        key = (shader, spec)
        if key not in self._pipes:
            vk, ffi = self.vk, self.vk.ffi
            data = ffi.new("uint32_t[]", list(spec))
            entries = ffi.new("VkSpecializationMapEntry[]", [(i, 4 * i, 4) for i in range(len(spec))])
            spec_info = ffi.new("VkSpecializationInfo*", (len(spec), entries, 4 * len(spec), data))
            name = ffi.new("char[]", b"main")
            stage = {"sType": vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO, "stage": COMPUTE,
                     "module": self.mods[shader], "pName": name, "pSpecializationInfo": spec_info}
            info = new(vk, "VkComputePipelineCreateInfo", stage=stage, layout=self.layout)
            self._pipes[key] = self.make(vk.lib.vkCreateComputePipelines, "VkPipeline", self.pcache, 1, info)
        return self._pipes[key]

    def new_set(self, bufs: list[NS], when_full):
        """A descriptor set over ``bufs`` (binding 0: maxe buffers, 1: maxe, 2: x, 3: y); when the pool
        is full, ``when_full()`` frees sets (recorded commands) and it tries once more."""
        vk, ffi, lib, m = self.vk, self.vk.ffi, self.vk.lib, self.maxe
        ds = ffi.new("VkDescriptorSet[1]")
        info = new(vk, "VkDescriptorSetAllocateInfo", descriptorPool=self.dpool, descriptorSetCount=1,
                   pSetLayouts=self.dsl)
        if lib.vkAllocateDescriptorSets(self.dev, info, ds) != 0:
            when_full()
            check(vk, lib.vkAllocateDescriptorSets(self.dev, info, ds))
        infos = ffi.new("VkDescriptorBufferInfo[]", [(q.buf, 0, q.size) for q in bufs])  # real sizes
        writes = ffi.new("VkWriteDescriptorSet[4]", [
            {"sType": vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET, "dstSet": ds[0], "dstBinding": i,
             "descriptorCount": n, "descriptorType": STORAGE, "pBufferInfo": infos + start}
            for i, (start, n) in enumerate(((0, m), (m, m), (2 * m, 1), (2 * m + 1, 1)))])
        lib.vkUpdateDescriptorSets(self.dev, 4, writes, 0, ffi.NULL)
        return ds

    def barrier(self, cb) -> None:
        """Shader and transfer writes -> shader reads and writes, transfers and host reads."""
        null = self.vk.ffi.NULL  # stages: compute|transfer -> compute|transfer|host
        self.vk.lib.vkCmdPipelineBarrier(cb, 0x800 | 0x1000, 0x800 | 0x1000 | 0x4000, 0, 1, self._mb, 0, null,
                                         0, null)

    def submit(self, submit, poll: bool) -> None:
        """Submit and wait; ``poll``: spin briefly first (a sleeping wait adds wake-up latency to short
        ops; never on CPU devices, where it would steal their cores)."""
        vk, lib = self.vk, self.vk.lib
        check(vk, lib.vkQueueSubmit(self.queue, 1, submit, self.fence[0]))
        until = time.perf_counter() + 0.002 if poll else 0.0
        while lib.vkGetFenceStatus(self.dev, self.fence[0]) == 1 and time.perf_counter() < until:
            pass  # 1 = VK_NOT_READY
        res = lib.vkWaitForFences(self.dev, 1, self.fence, 1, FENCE_TIMEOUT_NS)
        if res == vk.VK_TIMEOUT:  # not a VkError: check it by value
            raise ColibriError(f"vulkan device {self.f.name!r} did not finish within "
                               f"{FENCE_TIMEOUT_NS // 10**9} s; it may be hung")
        check(vk, res)
        check(vk, lib.vkResetFences(self.dev, 1, self.fence))

    def free_sets(self, e: NS) -> None:
        """Free the descriptor sets of a recorded command buffer (none where descriptors are pushed)."""
        for ds in e.sets:
            self.vk.lib.vkFreeDescriptorSets(self.dev, self.dpool, 1, ds)
        e.sets = []

    def free_cmd(self, e: NS) -> None:
        """Free a recorded command buffer and its descriptor sets."""
        self.free_sets(e)
        self.vk.lib.vkFreeCommandBuffers(self.dev, self.pool, 1, e.cbp)

    def gpu_seconds(self) -> float | None:
        """Time between the last call's two timestamps; None when the queue has no timestamps."""
        f, t = self.f, self.vk.ffi.new("uint64_t[2]")
        if not f.timestamp_bits or self.vk.lib.vkGetQueryPoolResults(
                self.dev, self.queries, 0, 2, 16, t, 8, 1) != 0:  # VK_QUERY_RESULT_64_BIT
            return None
        return ((t[1] - t[0]) & ((1 << f.timestamp_bits) - 1)) * f.timestamp_ns * 1e-9

    def save_cache(self, path: Path, old_blob: bytes) -> None:
        """Write the pipeline cache's data (vkGetPipelineCacheData) when it differs from what was loaded."""
        ffi, lib, n = self.vk.ffi, self.vk.lib, self.vk.ffi.new("size_t*")
        if lib.vkGetPipelineCacheData(self.dev, self.pcache, n, ffi.NULL) != 0 or not n[0]:
            return
        buf = ffi.new("char[]", n[0])
        if lib.vkGetPipelineCacheData(self.dev, self.pcache, n, buf) == 0:
            blob = ffi.buffer(buf, n[0])[:]
            if blob != old_blob:
                programs.write_cache_file(path, CACHE_MAGIC, blob)

    def close(self) -> None:
        """Wait for the device, destroy the buffers left and every object; closing twice does nothing."""
        if self.dev is not None:
            self.vk.lib.vkDeviceWaitIdle(self.dev)
            for b in list(self.buffers.values()):
                vu.release_buffer(self.vk, self.dev, b)
            self.buffers = {}
        for undo in reversed(self._undo):
            undo()
        self._undo, self.dev = [], None
