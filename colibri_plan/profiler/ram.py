"""RAM probe: read bandwidth with all cores, the bound on CPU expert matmul.

Method: an int64 array far larger than the last-level cache is split into one contiguous part per
thread; each thread runs ``numpy.add.reduce`` over its part (numpy releases the GIL in reductions, and an
integer sum is a pure streaming read). Bandwidth = array bytes / wall time of the slowest thread.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from colibri_plan.errors import IntegrityError
from colibri_plan.formats.profile import stat
from colibri_plan.profiler.machine import usable_cores


def probe_ram(array_bytes: int = 512 << 20, repetitions: int = 7, threads: int | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Measure all-core RAM read bandwidth.

    Args:
        array_bytes: size of the array read each repetition (keep it >> the last-level cache).
        repetitions: timed passes after one warm-up pass (which also faults the pages in).
        threads: reader threads (default: usable cores).

    Returns:
        The profile's ``ram`` section: ``{read_gbps{min, median, max, repetitions}, checksum_gbps{...}
        (all-core crc32), threads, array_bytes, method}`` (GB = 1e9 B).
    """
    threads = threads or usable_cores()
    if progress:
        progress(f"ram: read bandwidth, {threads} thread(s), {array_bytes >> 20} MiB array")
    a = np.ones(max(1, array_bytes // 8), dtype=np.int64)
    parts = np.array_split(a, threads)
    gbps = []
    with ThreadPoolExecutor(threads) as pool:
        for r in range(repetitions + 1):
            t0 = time.perf_counter()
            sums = list(pool.map(np.add.reduce, parts))
            dt = time.perf_counter() - t0
            if int(sum(sums)) != a.size:  # the reads really happened
                raise IntegrityError("RAM probe: the array sum is wrong; memory or threads misbehaved")
            if r:
                gbps.append(a.nbytes / dt / 1e9)
    # crc32 over the same parts in the same threads (zlib releases the GIL): the CPU cost of checking
    # each expert the engine streams from disk, which competes with expert compute for the cores
    views = [memoryview(part).cast("B") for part in parts]
    crc = []
    with ThreadPoolExecutor(threads) as pool:
        for r in range(min(repetitions, 3) + 1):
            t0 = time.perf_counter()
            list(pool.map(zlib.crc32, views))
            if r:
                crc.append(a.nbytes / (time.perf_counter() - t0) / 1e9)
    return {"read_gbps": stat(gbps), "checksum_gbps": stat(crc), "threads": threads,
            "array_bytes": int(a.nbytes),
            "method": "numpy int64 sum, one contiguous part per thread; checksum: zlib.crc32 per part"}
