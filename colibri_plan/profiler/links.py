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

Peer links (:func:`probe_peer_links`, the profile's optional ``peer_links`` section): for every ordered
pair of CUDA devices, whether the source can address the destination's memory directly
(``cudaDeviceCanAccessPeer``; peer access is then enabled) and the GB/s of ``cudaMemcpyPeer`` at the
expert block size; without peer access the driver stages the copy through host memory, and the figure
says what that costs. With fewer than two CUDA devices the section is ``{"unavailable": reason}``.
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


# ---- GPU <-> GPU -------------------------------------------------------------------------------
PEER_METHOD = ("cupy.cuda.runtime.memcpyPeer of one block per copy (peer access enabled where "
               "deviceCanAccessPeer allows it, else staged by the driver), timed after synchronizing both "
               "devices")


def _enable_peer(rt, src: int, dst: int) -> bool:
    """Let device ``src`` address ``dst``'s memory; True when enabled now or already before.

    Raises:
        Exception: the runtime's error for anything other than "already enabled".
    """
    import cupy as cp

    with cp.cuda.Device(src):
        try:
            rt.deviceEnablePeerAccess(dst)
        except Exception as exc:  # noqa: BLE001 - CUDARuntimeError; only "already enabled" is fine
            if "AlreadyEnabled" not in str(exc) and getattr(exc, "status", None) != 704:
                raise
    return True


def probe_cuda_peer(src: int, dst: int, block_bytes: int, repetitions: int = 5, copies: int = 8) -> dict:
    """One ordered pair of CUDA devices through CuPy.

    Returns:
        {"can_access_peer": bool, "peer_access_enabled": bool, "copy_gbps": stat (GB/s = 1e9 B/s of
        ``block_bytes`` copies from ``src`` to ``dst``), "copies_per_repetition", "method"}.

    Raises:
        Exception: CuPy or the CUDA runtime failing (the caller records the reason).
    """
    import cupy as cp

    rt = cp.cuda.runtime
    can = bool(rt.deviceCanAccessPeer(src, dst))
    enabled = _enable_peer(rt, src, dst) if can else False
    with cp.cuda.Device(src):
        a = cp.ones(block_bytes, dtype=cp.uint8)
    with cp.cuda.Device(dst):
        b = cp.empty(block_bytes, dtype=cp.uint8)
    s_dev, d_dev = cp.cuda.Device(src), cp.cuda.Device(dst)

    def sync() -> None:
        s_dev.synchronize()
        d_dev.synchronize()

    a_ptr, b_ptr = a.data.ptr, b.data.ptr
    with s_dev:
        figure = _timed(lambda: rt.memcpyPeer(b_ptr, dst, a_ptr, src, block_bytes), sync, block_bytes,
                        copies, repetitions)
    del a, b
    return {"can_access_peer": can, "peer_access_enabled": enabled, "copy_gbps": figure,
            "copies_per_repetition": copies, "method": PEER_METHOD}


def probe_peer_links(devices: list[dict], block_bytes: int, repetitions: int = 5, copies: int = 8,
                     progress: Callable[[str], None] | None = None) -> list[dict] | dict:
    """GPU<->GPU copy figures for every ordered pair of the CUDA devices in ``devices``.

    Args:
        devices: DeviceInfo dicts; only ``backend == "cuda"`` ones are paired (one per physical card).
        block_bytes: bytes per copy (the model's expert block).

    Returns:
        A list of {"src": "cuda:I", "dst": "cuda:J", "src_name", "dst_name", "block_bytes",
        "can_access_peer", "peer_access_enabled", "copy_gbps": stat or {"unavailable": reason},
        "copies_per_repetition", "method"} (a failing pair records its reason, never raises), or
        ``{"unavailable": reason}`` with fewer than two CUDA devices or no CuPy.
    """
    cuda = sorted((d for d in devices if d.get("backend") == "cuda"), key=lambda d: d["index"])
    if len(cuda) < 2:
        return {"unavailable": f"{len(cuda)} CUDA device(s) in this profile; GPU<->GPU links need two or "
                               "more (profile with --backends ...,cuda on a multi-GPU host)"}
    try:
        import cupy  # noqa: F401 - only to say plainly when CuPy is missing
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken CUDA install
        return {"unavailable": f"CuPy cannot be imported ({type(exc).__name__}: {exc})"}
    out = []
    for s in cuda:
        for d in cuda:
            if s["index"] == d["index"]:
                continue
            entry = {"src": f"cuda:{s['index']}", "dst": f"cuda:{d['index']}", "src_name": s["name"],
                     "dst_name": d["name"], "block_bytes": int(block_bytes)}
            if progress:
                progress(f"peer links: {entry['src']} -> {entry['dst']} at {block_bytes} B")
            try:
                entry.update(probe_cuda_peer(s["index"], d["index"], block_bytes, repetitions, copies))
            except Exception as exc:  # noqa: BLE001 - one pair failing must not sink the profile
                entry.update({"can_access_peer": False, "peer_access_enabled": False,
                              "copy_gbps": {"unavailable": f"{type(exc).__name__}: {exc}"},
                              "method": PEER_METHOD})
            out.append(entry)
    return out
