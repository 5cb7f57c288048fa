"""What the machine is: CPU, cores, RAM, OS, filesystems and the compute devices of every backend.

Linux facts come from ``/proc/cpuinfo``, ``/proc/meminfo`` and ``/proc/mounts``; elsewhere the fields
fall back to :mod:`platform` / :func:`os.cpu_count` and say ``unknown``. Nothing here raises on a
missing file.

A Vulkan or OpenCL device of CPU type (Mesa lavapipe, PoCL) computes in host memory: when the user names
its backend with ``--backends``, :func:`list_host_memory_devices` lists it as a unified-memory device
(kind ``igpu``, ``unified_memory`` true) so a plan can choose it for the host tiers from real figures;
the default profile leaves it a CPU device (nobody wants experts computed there unasked).
"""

from __future__ import annotations

import os
import platform
import re
import sys
from pathlib import Path

from colibri_plan.errors import ColibriError
from colibri_plan.meminfo import meminfo  # noqa: F401 - re-exported: the one /proc/meminfo reader


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def cpu_model() -> str:
    """CPU model name ("model name" in /proc/cpuinfo, else platform.processor())."""
    for line in _read("/proc/cpuinfo").splitlines():
        if line.lower().startswith(("model name", "hardware", "cpu model")):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def usable_cores() -> int:
    """Logical cores this process may run on (the affinity mask when the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _unescape(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem_of(path: str | os.PathLike) -> dict:
    """The mount holding ``path``: ``{"device", "mountpoint", "fstype", "options"}`` (longest matching
    mount point in /proc/mounts; fstype "unknown" when it cannot be told)."""
    real = os.path.realpath(path)
    best = {"device": "unknown", "mountpoint": "/", "fstype": "unknown", "options": ""}
    best_len = -1
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt = _unescape(parts[1])
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= best_len:  # later equal-length entries are stacked on top
            best_len = len(mnt)
            best = {"device": _unescape(parts[0]), "mountpoint": mnt, "fstype": parts[2], "options": parts[3]}
    return best


def list_all_devices(backends=None) -> tuple[list[dict], list[dict]]:
    """Devices of every backend (or the named ones).

    Returns:
        (devices as DeviceInfo dicts, skipped as [{"backend", "reason"}]). Never raises.
    """
    from colibri_plan.backends import BACKEND_NAMES, get_backend

    devices, skipped = [], []
    for name in backends or BACKEND_NAMES:
        try:
            cls = get_backend(name)
            reason = cls.unavailable_reason()
            found = [] if reason else cls.list_devices()
            if not reason and not found:
                reason = "no devices found"
        except ImportError as exc:
            reason = f"backend module not installed ({exc})"
            found = []
        except (ColibriError, Exception) as exc:  # noqa: BLE001 - discovery never raises
            reason = f"{type(exc).__name__}: {exc}"
            found = []
        if reason:
            skipped.append({"backend": name, "reason": reason})
        devices.extend(d.to_dict() for d in found)
    return devices, skipped


def machine_info() -> dict:
    """The profile's ``machine`` section without the fingerprint (added by the caller with the GPUs)."""
    mem = meminfo()
    return {
        "cpu_model": cpu_model(),
        "cores": usable_cores(),
        "logical_cpus": os.cpu_count() or 1,
        "ram_total_bytes": mem.get("MemTotal", 0),
        "ram_available_bytes": mem.get("MemAvailable", mem.get("MemFree", 0)),
        "os": platform.platform(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python": sys.version.split()[0],
        "numpy": _numpy_version(),
    }


def _numpy_version() -> str:
    import numpy

    return numpy.__version__


#: backends whose CPU-type devices (lavapipe, PoCL) compute in host memory through a GPU API
HOST_MEMORY_BACKENDS = ("vulkan", "opencl")


def list_host_memory_devices(devices: list[dict], backends=None) -> list[dict]:
    """``devices`` with each CPU-type device of a :data:`HOST_MEMORY_BACKENDS` backend the user named in
    ``backends`` listed as a unified-memory device: kind ``igpu``, ``unified_memory`` true,
    ``host_memory_device`` true and a ``note`` saying why (its memory is host memory, so its experts come
    out of the RAM budget, never counted twice). ``backends`` None (the default profile): unchanged."""
    asked = set(backends or ())
    out = []
    for d in devices:
        if d.get("backend") in asked and d.get("backend") in HOST_MEMORY_BACKENDS and d.get("kind") == "cpu":
            d = {**d, "kind": "igpu", "unified_memory": True, "host_memory_device": True,
                 "note": f"a CPU-type {d['backend']} device whose memory is host memory, listed as a "
                         f"unified-memory device because --backends named {d['backend']}"}
        out.append(d)
    return out


def relabel_rows(rows: list[dict], devices: list[dict]) -> list[dict]:
    """Matmul / expert_ffn rows of the devices :func:`list_host_memory_devices` relabelled, with their
    ``device_kind`` as listed (``igpu``), so their figures are never taken for the CPU's."""
    kinds = {(d["backend"], d["index"]): d["kind"] for d in devices if d.get("host_memory_device")}
    return [{**r, "device_kind": kinds[(r.get("backend"), r.get("device_index"))]}
            if (r.get("backend"), r.get("device_index")) in kinds else r for r in rows]
