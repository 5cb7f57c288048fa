"""Host<->device links: H2D and D2H bandwidth at expert-sized blocks, pinned and pageable.

- CUDA devices (through CuPy): ``cudaMemcpy`` of one block between a device buffer and either pinned
  host memory (``cupy.cuda.alloc_pinned_memory``) or an ordinary numpy array (pageable), several copies
  per repetition, timed on the host after a device synchronize.
- OpenCL GPUs (through pyopencl): ``enqueue_copy`` from a mapped ``ALLOC_HOST_PTR`` buffer (pinned)
  or a numpy array (pageable).
- Unified-memory devices (integrated GPUs, Apple, CPU devices such as PoCL or lavapipe): no copy is
  needed; the link is marked ``unified_memory: true`` and its bandwidth is the RAM read bandwidth.
- Other discrete devices (Vulkan) borrow the figures of the same GPU model measured through CUDA or
  OpenCL (same device name, same index preferred), with the method saying so; otherwise they are skipped.
- The ``numpy`` and ``cpu`` backends are the host itself and have no link.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from colibri_plan.formats.profile import stat

#: backends that compute on the host itself: no link to measure
HOST_BACKENDS = ("numpy", "cpu")
#: backends whose host<->device copies this module measures directly
PROBED_BACKENDS = ("cuda", "opencl")
LINK_KEYS = ("h2d_pinned_gbps", "h2d_pageable_gbps", "d2h_pinned_gbps", "d2h_pageable_gbps")


def _timed(copy: Callable[[], None], sync: Callable[[], None], nbytes: int, copies: int,
           repetitions: int) -> dict:
    copy()
    sync()  # warm-up: first-touch and driver set-up stay out of the figure
    gbps = []
    for _ in range(repetitions):
        t0 = time.perf_counter()
        for _ in range(copies):
            copy()
        sync()
        gbps.append(nbytes * copies / (time.perf_counter() - t0) / 1e9)
    return stat(gbps)


def probe_cuda_link(device_index: int, block_bytes: int, repetitions: int = 5, copies: int = 8) -> dict:
    """H2D/D2H figures of CUDA device ``device_index`` through CuPy (cudaMemcpy, one block per copy)."""
    import cupy as cp

    rt = cp.cuda.runtime
    with cp.cuda.Device(device_index):
        dev = cp.empty(block_bytes, dtype=cp.uint8)
        pinned_mem = cp.cuda.alloc_pinned_memory(block_bytes)
        pinned = np.frombuffer(pinned_mem, dtype=np.uint8, count=block_bytes)
        pinned[:] = 1
        pageable = np.ones(block_bytes, dtype=np.uint8)
        sync = cp.cuda.Device(device_index).synchronize
        d, p, g = dev.data.ptr, pinned.ctypes.data, pageable.ctypes.data
        # cudaMemcpyKind: 1 = host-to-device, 2 = device-to-host (stable CUDA runtime enum values)
        h2d, d2h = getattr(rt, "memcpyHostToDevice", 1), getattr(rt, "memcpyDeviceToHost", 2)
        out = {
            "h2d_pinned_gbps": _timed(lambda: rt.memcpy(d, p, block_bytes, h2d), sync, block_bytes, copies,
                                      repetitions),
            "h2d_pageable_gbps": _timed(lambda: rt.memcpy(d, g, block_bytes, h2d), sync, block_bytes,
                                        copies, repetitions),
            "d2h_pinned_gbps": _timed(lambda: rt.memcpy(p, d, block_bytes, d2h), sync, block_bytes, copies,
                                      repetitions),
            "d2h_pageable_gbps": _timed(lambda: rt.memcpy(g, d, block_bytes, d2h), sync, block_bytes,
                                        copies, repetitions),
        }
        del dev, pinned, pinned_mem
    out["method"] = "cupy.cuda.runtime.memcpy, pinned = cudaHostAlloc, pageable = numpy array"
    return out


def probe_opencl_link(device_name: str, block_bytes: int, repetitions: int = 5, copies: int = 8) -> dict:
    """H2D/D2H figures of the OpenCL device called ``device_name`` through pyopencl."""
    import pyopencl as cl

    matches = [d for p in cl.get_platforms() for d in p.get_devices()
               if d.name.strip() == device_name.strip()]
    if not matches:
        raise LookupError(f"no OpenCL device named {device_name!r}")
    ctx = cl.Context([matches[0]])
    q = cl.CommandQueue(ctx)
    mf = cl.mem_flags
    dev = cl.Buffer(ctx, mf.READ_WRITE, block_bytes)
    host_buf = cl.Buffer(ctx, mf.READ_WRITE | mf.ALLOC_HOST_PTR, block_bytes)
    pinned, _ev = cl.enqueue_map_buffer(q, host_buf, cl.map_flags.READ | cl.map_flags.WRITE, 0,
                                        (block_bytes,), np.uint8)
    pinned[:] = 1
    pageable = np.ones(block_bytes, dtype=np.uint8)
    sync = q.finish
    out = {
        "h2d_pinned_gbps": _timed(lambda: cl.enqueue_copy(q, dev, pinned), sync, block_bytes, copies,
                                  repetitions),
        "h2d_pageable_gbps": _timed(lambda: cl.enqueue_copy(q, dev, pageable), sync, block_bytes, copies,
                                    repetitions),
        "d2h_pinned_gbps": _timed(lambda: cl.enqueue_copy(q, pinned, dev), sync, block_bytes, copies,
                                  repetitions),
        "d2h_pageable_gbps": _timed(lambda: cl.enqueue_copy(q, pageable, dev), sync, block_bytes, copies,
                                    repetitions),
        "method": "pyopencl enqueue_copy, pinned = mapped ALLOC_HOST_PTR buffer, pageable = numpy array",
    }
    return out


def _unified_entry(ram: dict) -> dict:
    if "unavailable" in ram:
        figures = {k: {"unavailable": f"RAM bandwidth not measured: {ram['unavailable']}"} for k in LINK_KEYS}
    else:
        figures = {k: dict(ram["read_gbps"]) for k in LINK_KEYS}
    return {**figures, "method": "unified memory: the device reads host RAM without a copy; "
                                 "figures are the RAM read bandwidth"}


def probe_links(devices: list[dict], ram: dict, block_bytes: int, repetitions: int = 5, copies: int = 8,
                progress: Callable[[str], None] | None = None) -> tuple[list[dict], list[dict]]:
    """Link figures of every non-host device.

    Args:
        devices: DeviceInfo dicts (see :func:`colibri_plan.profiler.machine.list_all_devices`).
        ram: the profile's ``ram`` section (bandwidth of unified links).
        block_bytes: bytes per copy (the model's expert block).

    Returns:
        (links entries, skipped [{"backend", "device_index", "reason"}]). Never raises for a device
        that fails; it is skipped with the reason.
    """
    links, skipped, later = [], [], []
    # devices a copy API is probed through come first, so the others can borrow their figures
    for d in sorted(devices, key=lambda d: d["backend"] not in PROBED_BACKENDS):
        if d["backend"] in HOST_BACKENDS:
            continue
        base = {"backend": d["backend"], "device_index": d["index"], "device_name": d["name"],
                "device_kind": d["kind"], "block_bytes": int(block_bytes)}
        unified = bool(d.get("unified_memory")) or d["kind"] in ("cpu", "igpu")
        if unified:
            links.append({**base, "unified_memory": True, **_unified_entry(ram)})
            continue
        if progress:
            progress(f"links: {d['backend']}:{d['index']} {d['name']} H2D/D2H at {block_bytes} B")
        try:
            if d["backend"] == "cuda":
                figs = probe_cuda_link(d["index"], block_bytes, repetitions, copies)
            elif d["backend"] == "opencl":
                figs = probe_opencl_link(d["name"], block_bytes, repetitions, copies)
            else:
                later.append((d, base))
                continue
        except Exception as exc:  # noqa: BLE001 - one device failing must not sink the profile
            skipped.append({"backend": d["backend"], "device_index": d["index"],
                            "reason": f"{type(exc).__name__}: {exc}"})
            continue
        links.append({**base, "unified_memory": False, "copies_per_repetition": copies, **figs})
    for d, base in later:  # e.g. vulkan: the same physical GPU's link, measured through cuda/opencl
        same = sorted((e for e in links if not e["unified_memory"] and _same_gpu(e, d)),
                      key=lambda e: e["device_index"] != d["index"])  # same index first
        if same:
            src = same[0]
            links.append({**base, "unified_memory": False,
                          **{k: src[k] for k in LINK_KEYS if k in src},
                          "method": f"same GPU model as {src['backend']}:{src['device_index']} (figures "
                                    f"copied; {d['backend']} copies are not probed)"})
        else:
            skipped.append({"backend": d["backend"], "device_index": d["index"],
                            "reason": f"host<->device copies are not probed through {d['backend']} and no "
                                      "cuda/opencl device with the same name was measured"})
    return links, skipped


def _same_gpu(entry: dict, d: dict) -> bool:
    """Same GPU model (device names match); identical GPUs of one host share their link figures."""
    return entry["device_name"].strip().lower() == d["name"].strip().lower()
