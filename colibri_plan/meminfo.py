"""Host memory from ``/proc/meminfo``: the one reader the profiler, the engine and the backends share.

A leaf module: it imports nothing of the project. Nothing here raises; off Linux (no ``/proc/meminfo``)
the readers return empty/None and :func:`host_memory` falls back to ``os.sysconf``.
"""

from __future__ import annotations

import os
import re

MEMINFO_PATH = "/proc/meminfo"
_LINE = re.compile(r"(\w+):\s+(\d+)\s*(kB)?")


def meminfo(path: str = MEMINFO_PATH) -> dict[str, int]:
    """``/proc/meminfo`` as bytes, e.g. {"MemTotal": ..., "MemAvailable": ...} (kB lines x 1024; counts
    without a unit as they are). Empty when the file cannot be read."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def mem_available_bytes() -> int | None:
    """MemAvailable in bytes (None where the OS does not say)."""
    return meminfo().get("MemAvailable")


def host_memory() -> tuple[int, int | None]:
    """(total, available) host RAM in bytes: MemTotal/MemAvailable, else total from ``os.sysconf`` and
    available None (0 total when even that is unknown)."""
    info = meminfo()
    if "MemTotal" in info:
        return info["MemTotal"], info.get("MemAvailable")
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), None
    except (ValueError, OSError, AttributeError):
        return 0, None
