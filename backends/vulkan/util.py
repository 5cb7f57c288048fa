"""Driver plumbing of the Vulkan backend: struct boilerplate, instance and device discovery, memory
types per role, buffers, the pipeline-cache header; the device's fixed objects are ``objects.Device``.

Only the modules of :mod:`colibri_plan.backends.vulkan` use this one. Functions take the imported
``vulkan`` module as ``vk`` so that nothing here imports it at load time. Generic logic (cache folders
and files, staging, batching, replays) is in the shared parts (``programs``, ``staging``, ``pools``).
"""

from __future__ import annotations

import functools
import os
import re
import struct
import threading
from pathlib import Path
from types import SimpleNamespace as NS

from colibri_plan.backends import programs

MAXE, WG, ROWS = 8, 64, 4  # matmul.comp: experts per dispatch (its MAXE), invocations, rows per workgroup
COMPUTE, STORAGE = 0x20, 7  # VK_SHADER_STAGE_COMPUTE_BIT, VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
FENCE_TIMEOUT_NS = 600 * 10**9
DL, HV, HC, HCACHED = 1, 2, 4, 8  # VkMemoryPropertyFlagBits: DEVICE_LOCAL, HOST_VISIBLE, _COHERENT, _CACHED
CACHE_MAGIC = b"CPVKPC01"  # our file: magic, sha256 of the driver's blob, then the blob
_V11, _V12 = (1 << 22) | (1 << 12), (1 << 22) | (2 << 12)  # VK_MAKE_API_VERSION(0, 1, 1|2, 0)
_PROBE: list = []  # [reason, [(physical index, facts)]], computed once per process
_INSTANCE: list = []  # [VkInstance, VkPhysicalDevice array, pid] of this process, made on first use
_LOCK = threading.Lock()
_LIVE = [0]  # VkDevices created and not yet destroyed, in this process (objects.Device)


def check(vk, res: int) -> None:
    """Raise the ``vulkan`` package's exception for a failed VkResult (positive codes are not errors
    of the package's VkError kind, so callers test VK_TIMEOUT themselves before calling this)."""
    if res != 0:
        raise vk.exception_codes.get(res, RuntimeError)(f"Vulkan call failed with VkResult {res}")


@functools.cache
def _stype(ctype: str) -> str:
    return "VK_STRUCTURE_TYPE_" + re.sub(r"([a-z])([A-Z])", r"\1_\2", ctype[2:]).upper()


def new(vk, ctype: str, stype: str = "", **fields):
    """``ffi.new`` of a Vulkan struct; ``sType`` from its name (VkFenceCreateInfo -> FENCE_CREATE_INFO).
    Pointees given in ``fields`` must be kept alive by the caller while the struct is used."""
    fields.setdefault("sType", getattr(vk, "VK_STRUCTURE_TYPE_" + stype if stype else _stype(ctype)))
    return vk.ffi.new(ctype + "*", fields)


def enum(vk, ctype: str, fn, *args):
    """Call a count-then-fill Vulkan enumerator; returns the ffi array."""
    n = vk.ffi.new("uint32_t*")
    fn(*args, n, vk.ffi.NULL)
    arr = vk.ffi.new(f"{ctype}[]", n[0])
    fn(*args, n, arr)
    return arr


def create_instance(vk):
    """A new Vulkan 1.1 instance (the caller destroys it); backends use :func:`instance`."""
    app = new(vk, "VkApplicationInfo", apiVersion=_V11)
    h = vk.ffi.new("VkInstance*")
    check(vk, vk.lib.vkCreateInstance(new(vk, "VkInstanceCreateInfo", pApplicationInfo=app), vk.ffi.NULL, h))
    return h[0]


def instance(vk) -> tuple:
    """(the process's VkInstance, its VkPhysicalDevice array): created on first use, shared by the probe
    and every backend, kept until the process ends (the driver reclaims it then).

    One per process because drivers do not promise any number of them: an NVIDIA driver refuses new
    instances with VK_ERROR_INCOMPATIBLE_DRIVER after a few dozen have been created in one process, even
    destroyed ones. Each backend's VkDevice is its own (``objects.Device``).

    Raises:
        vk.VkError: vkCreateInstance failed (e.g. VkErrorIncompatibleDriver: no driver).
    """
    with _LOCK:
        if not _INSTANCE or _INSTANCE[2] != os.getpid():  # a forked child cannot use its parent's
            inst = create_instance(vk)
            _INSTANCE[:] = [inst, enum(vk, "VkPhysicalDevice", vk.lib.vkEnumeratePhysicalDevices, inst),
                            os.getpid()]
        return _INSTANCE[0], _INSTANCE[1]


def live_devices() -> int:
    """VkDevices of this process created by :class:`Device` and not yet destroyed."""
    return _LIVE[0]


def device_facts(vk, pd) -> NS:
    """What the backend needs to know about a physical device, as plain Python values; ``problem`` is
    None when the device can run our shaders, else why not."""
    ffi, lib = vk.ffi, vk.lib
    p = ffi.new("VkPhysicalDeviceProperties*")
    lib.vkGetPhysicalDeviceProperties(pd, p)
    sub = new(vk, "VkPhysicalDeviceSubgroupProperties")
    ids = new(vk, "VkPhysicalDeviceIDProperties", "PHYSICAL_DEVICE_ID_PROPERTIES")
    m3 = new(vk, "VkPhysicalDeviceMaintenance3Properties", "PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES")
    drv = new(vk, "VkPhysicalDeviceDriverProperties")
    sub.pNext, ids.pNext, m3.pNext = ids, m3, drv if p.apiVersion >= _V12 else ffi.NULL  # driver: 1.2
    lib.vkGetPhysicalDeviceProperties2(pd, new(vk, "VkPhysicalDeviceProperties2",
                                               "PHYSICAL_DEVICE_PROPERTIES_2", pNext=sub))
    exts = {ffi.string(e.extensionName).decode() for e in
            enum(vk, "VkExtensionProperties", lib.vkEnumerateDeviceExtensionProperties, pd, ffi.NULL)}
    has_budget = "VK_EXT_memory_budget" in exts  # push descriptors: 2 * MAXE + 2 <= 32, the least allowed
    push = "VK_KHR_push_descriptor" in exts
    budget = new(vk, "VkPhysicalDeviceMemoryBudgetPropertiesEXT",
                 "PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT")
    mp2 = new(vk, "VkPhysicalDeviceMemoryProperties2", "PHYSICAL_DEVICE_MEMORY_PROPERTIES_2",
              pNext=budget if has_budget else ffi.NULL)
    lib.vkGetPhysicalDeviceMemoryProperties2(pd, mp2)
    mp = mp2.memoryProperties
    feats = ffi.new("VkPhysicalDeviceFeatures*")
    lib.vkGetPhysicalDeviceFeatures(pd, feats)
    queues = enum(vk, "VkQueueFamilyProperties", lib.vkGetPhysicalDeviceQueueFamilyProperties, pd)
    v = p.driverVersion
    driver = (ffi.string(drv.driverName).decode() + " " + ffi.string(drv.driverInfo).decode()).strip()
    if not driver:  # NVIDIA packs 10.8.8.6 bits; others use VK_MAKE_VERSION
        driver = (f"{v >> 22}.{(v >> 14) & 0xFF}.{(v >> 6) & 0xFF}" if p.vendorID == 0x10DE
                  else f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}")
    n_heaps = mp.memoryHeapCount
    f = NS(name=ffi.string(p.deviceName).decode(), api=p.apiVersion, driver=driver, vendor=p.vendorID,
           device=p.deviceID, cache_uuid=bytes(p.pipelineCacheUUID), uuid=bytes(ids.deviceUUID),
           max_range=int(p.limits.maxStorageBufferRange), max_alloc=int(m3.maxMemoryAllocationSize),
           subgroup=sub.subgroupSize, kind={1: "igpu", 2: "gpu", 4: "cpu"}.get(p.deviceType, "gpu"),
           types=[(t.propertyFlags, t.heapIndex) for t in mp.memoryTypes[0:mp.memoryTypeCount]],
           heaps=[(int(h.size), h.flags) for h in mp.memoryHeaps[0:n_heaps]],
           budget=([int(budget.heapBudget[i]) - int(budget.heapUsage[i]) for i in range(n_heaps)]
                   if has_budget else None),
           queue=next((i for i, q in enumerate(queues) if q.queueFlags & 2), None),  # QUEUE_COMPUTE_BIT
           timestamp_ns=float(p.limits.timestampPeriod), push_descriptor=push)
    f.timestamp_bits = 0 if f.queue is None else queues[f.queue].timestampValidBits
    f.problem = ("Vulkan 1.1 is required" if f.api < _V11 else
                 "no compute queue" if f.queue is None else
                 "subgroup arithmetic in compute shaders is required"
                 if (sub.supportedOperations & 5) != 5 or not sub.supportedStages & COMPUTE else
                 "subgroups of at least 4 invocations are required" if f.subgroup < 4 else
                 "shaderStorageBufferArrayDynamicIndexing is required"
                 if not feats.shaderStorageBufferArrayDynamicIndexing else None)
    local = [i for i, (_, fl) in enumerate(f.heaps) if fl & 1] or list(range(n_heaps))  # HEAP_DEVICE_LOCAL
    f.total = sum(f.heaps[i][0] for i in local)
    f.free = None if f.budget is None else sum(f.budget[i] for i in local)
    return f


def probe() -> tuple[str | None, list]:
    """(why Vulkan is unusable or None, [(physical device index, facts)] of usable devices). Never raises."""
    if not _PROBE:
        reason, found = None, []
        try:
            import vulkan as vk
        except OSError:
            reason = ("libvulkan.so.1 (the Vulkan loader) is not installed: apt-get install libvulkan1 "
                      "and a Vulkan driver")
        except ImportError:
            reason = "the `vulkan` package is not installed: pip install 'colibri-plan[vulkan]'"
        else:
            try:
                facts = [device_facts(vk, pd) for pd in instance(vk)[1]]
                found = [(i, f) for i, f in enumerate(facts) if f.problem is None]
                if not found:
                    reason = "no usable Vulkan device" + "".join(f"; {f.name}: {f.problem}" for f in facts)
            except vk.VkErrorIncompatibleDriver:
                reason = "the Vulkan loader found no driver (ICD): install one, e.g. mesa-vulkan-drivers"
            except Exception as exc:  # noqa: BLE001 - discovery never raises
                reason = f"Vulkan instance or device query failed: {exc!r}"
        _PROBE[:] = [reason, found]
    return _PROBE[0], _PROBE[1]


def cache_path(facts: NS) -> Path:
    """``programs.cache_dir("vulkan") / <device uuid>.bin``."""
    return programs.cache_dir("vulkan") / f"{facts.uuid.hex()}.bin"


def read_cache(path: Path, facts: NS) -> tuple[bytes, str]:
    """(driver blob, state) where state is "loaded", "absent" or "corrupt: why" (blob then b"").

    After our checksum (``programs.read_cache_file``), checks the VkPipelineCacheHeaderVersionOne the blob
    starts with (header length 32, version 1, vendorID, deviceID, pipelineCacheUUID), so a blob from
    another driver never reaches it.
    """
    blob, state = programs.read_cache_file(path, CACHE_MAGIC)
    if state != "loaded":
        return blob, state
    head = [int.from_bytes(blob[i:i + 4], "little") for i in range(0, 16, 4)]
    if len(blob) < 32 or (*head, blob[16:32]) != (32, 1, facts.vendor, facts.device, facts.cache_uuid):
        return b"", "corrupt: header does not match this device and driver"
    return blob, "loaded"


def memory_roles(f: NS) -> tuple[dict[str, list[int]], bool, int]:
    """Memory type indices per buffer role, best first, whether weights are written directly (mapped),
    and the bytes usable for weights.

    Roles: "w" weights (discrete GPU: DEVICE_LOCAL, mapped when a DEVICE_LOCAL|HOST_VISIBLE type sits on
    the VRAM heap, as with resizable BAR; CPU/integrated: HOST_VISIBLE|DEVICE_LOCAL, else HOST_VISIBLE),
    "x" activations in (written by the host, read by every workgroup), "h" the FFN intermediate (device
    only), "y" results (read back by the host: HOST_CACHED preferred), "stage" upload staging. Capacity:
    VK_EXT_memory_budget's budget of the weights' heap when present, else 90 % of the heap, less 64 MiB
    for activation buffers.
    """
    big = max((s for s, fl in f.heaps if fl & 1), default=0)

    def types(*wants):  # DEVICE_LOCAL types must sit on the VRAM heap, not a 256 MiB BAR window
        return [i for want in wants for i, (fl, h) in enumerate(f.types)
                if fl & want == want and (not want & DL or f.heaps[h][0] >= 0.9 * big)]
    direct = types(DL | HV | HC) if f.kind == "gpu" else types(HV | HC | DL, HV | HC)
    roles = {"w": direct or types(DL), "x": types(DL | HV | HC, HV | HC), "h": types(DL, 0),
             "y": types(HV | HC | HCACHED, HV | HC), "stage": types(HV | HC)}
    heap = f.types[roles["w"][0]][1]
    free = f.budget[heap] if f.budget is not None else int(0.9 * f.heaps[heap][0])
    return roles, bool(direct), max(0, free - (64 << 20))


def make_buffer(vk, dev, size: int, usage: int, types: list[int], f: NS, map_it: bool) -> NS:
    """A VkBuffer of ``size`` bytes bound to its own memory of the first of ``types`` it allows, mapped
    persistently when ``map_it`` and host-visible (``.map``: an ffi buffer, unmapped by release_buffer);
    ``.info``: the 24 bytes of its VkDescriptorBufferInfo.

    Raises:
        vk.VkErrorOutOfDeviceMemory: no allowed type, or the driver's allocation failed (the buffer is
            destroyed first, so nothing is left behind).
    """
    ffi, lib = vk.ffi, vk.lib
    h = ffi.new("VkBuffer*")
    check(vk, lib.vkCreateBuffer(dev, new(vk, "VkBufferCreateInfo", size=size, usage=usage), ffi.NULL, h))
    req = ffi.new("VkMemoryRequirements*")
    lib.vkGetBufferMemoryRequirements(dev, h[0], req)
    ok = [t for t in types if req.memoryTypeBits >> t & 1]
    mem = ffi.new("VkDeviceMemory*")
    res = -2  # no allowed memory type counts as VK_ERROR_OUT_OF_DEVICE_MEMORY
    if ok:
        info = new(vk, "VkMemoryAllocateInfo", allocationSize=req.size, memoryTypeIndex=ok[0])
        res = lib.vkAllocateMemory(dev, info, ffi.NULL, mem)
    if res != 0:
        lib.vkDestroyBuffer(dev, h[0], ffi.NULL)
        check(vk, res)
    lib.vkBindBufferMemory(dev, h[0], mem[0], 0)
    # info: its VkDescriptorBufferInfo (buffer, offset 0, range: the real size) packed once, copied per op
    info = struct.pack("<QQQ", int(ffi.cast("uintptr_t", h[0])), 0, size)
    b = NS(buf=h[0], mem=mem[0], size=size, map=None, info=info)
    if map_it and f.types[ok[0]][0] & HV:
        p = ffi.new("void**")
        check(vk, lib.vkMapMemory(dev, mem[0], 0, size, 0, p))  # the real size, never VK_WHOLE_SIZE
        b.map = ffi.buffer(p[0], size)
    return b


def release_buffer(vk, dev, b: NS) -> None:
    """Unmap (numpy views of ``b.map`` must be gone by now), destroy and free a make_buffer buffer."""
    if b.map is not None:
        vk.lib.vkUnmapMemory(dev, b.mem)
        b.map = None
    vk.lib.vkDestroyBuffer(dev, b.buf, vk.ffi.NULL)
    vk.lib.vkFreeMemory(dev, b.mem, vk.ffi.NULL)
