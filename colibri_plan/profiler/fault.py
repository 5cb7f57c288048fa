"""Page-fault read probe: what a program that maps its weights (llama.cpp's default ``mmap``) gets from the
disk when the pages it touches are not cached.

Our engine reads misses with O_DIRECT, one expert block per request, several in flight
(:mod:`.disk`). A mapped file is read by the kernel on a page fault instead: the faulting thread waits
for a read-around window (the file's readahead size; ``POSIX_FADV_SEQUENTIAL``, which llama.cpp sets,
doubles it), and touching further pages of the same run is served by asynchronous readahead of the next
window. So a contiguous run of ``L`` uncached bytes costs about ``run_s + L / stream_gbps``: one
synchronous fault to start it and a readahead stream, one request in flight, after it.

Method: a test file (the disk probe's writer, no page cache left behind) is mapped read-only with
``POSIX_FADV_SEQUENTIAL``; for each run length, runs at random page-aligned offsets are touched one byte
per 4 KiB page (a strided numpy read: each page is faulted in order, as a matmul walks its weight rows),
the cache dropped before every repetition (``MADV_DONTNEED`` on the mapping, then ``POSIX_FADV_DONTNEED``).
Wall time and the process's major faults (``getrusage``) give GB/s and faults per run; two run lengths
give ``run_s`` and ``stream_gbps`` (the line through the two seconds-per-run). Units: bytes, seconds,
GB/s (1e9 B/s).
"""

from __future__ import annotations

import mmap
import os
import random
import resource
import time

import numpy as np

from colibri_plan.directio import drop_cache

PAGE = 4096
#: run lengths probed by default: from under a readahead window to a long sequential stretch
DEFAULT_RUNS = (256 << 10, 2 << 20, 8 << 20, 64 << 20)
#: runs start at least this far apart, beyond any readahead window, so no run is read by another's window
SPACING_BYTES = 48 << 20


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (``/proc/self/io``; 0 where absent)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _touch(view: np.ndarray, offset: int, nbytes: int) -> int:
    """Fault in ``nbytes`` of ``view`` from ``offset`` in address order, one byte per page; returns a sum
    (kept so the reads cannot be skipped)."""
    return int(view[offset:offset + nbytes:PAGE].sum(dtype=np.uint64))


def measure_runs(path: str | os.PathLike, run_bytes: int, total_bytes: int, repetitions: int = 2,
                 seed: int = 0) -> dict:
    """Touch runs of ``run_bytes`` at random offsets of the mapped ``path``, at least
    :data:`SPACING_BYTES` apart, until ``total_bytes`` per repetition; returns ``{run_bytes, runs,
    read_gbps, seconds_per_run, major_faults_per_run, read_bytes_per_run}`` (medians over repetitions;
    ``read_bytes_per_run``: what the kernel read from storage per run, readahead included)."""
    size = os.path.getsize(path) // PAGE * PAGE
    run = max(PAGE, run_bytes // PAGE * PAGE)
    stride = run + max(SPACING_BYTES, run)
    slots = max(1, (size - run) // stride + 1)
    n = max(1, min(slots, total_bytes // run))
    rng = random.Random(seed)
    gbps, per_run, faults, reads = [], [], [], []
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)      # what llama.cpp's loader sets
        for _ in range(repetitions):
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            try:
                mm.madvise(mmap.MADV_DONTNEED)
                drop_cache(fd)
                view = np.frombuffer(mm, dtype=np.uint8)
                offsets = [k * stride for k in rng.sample(range(slots), n)]
                b0 = _read_bytes()
                f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, time.perf_counter()
                for off in offsets:
                    _touch(view, off, run)
                wall = time.perf_counter() - t0
                f1 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
                b1 = _read_bytes()
                del view
            finally:
                mm.close()
            gbps.append(n * run / wall / 1e9)
            per_run.append(wall / n)
            faults.append((f1 - f0) / n)
            reads.append((b1 - b0) / n)
    finally:
        drop_cache(fd)
        os.close(fd)
    return {"run_bytes": run, "runs": n, "read_gbps": float(np.median(gbps)),
            "seconds_per_run": float(np.median(per_run)), "major_faults_per_run": float(np.median(faults)),
            "read_bytes_per_run": float(np.median(reads))}


def fit_runs(rows: list[dict]) -> dict:
    """``{run_s, stream_gbps}`` from two or more :func:`measure_runs` rows: the least-squares line
    seconds_per_run = run_s + run_bytes / (stream_gbps x 1e9); run_s is floored at 0."""
    x = np.array([r["run_bytes"] for r in rows], dtype=np.float64)
    y = np.array([r["seconds_per_run"] for r in rows], dtype=np.float64)
    slope, icept = np.polyfit(x, y, 1) if len(rows) > 1 else (y[0] / x[0], 0.0)
    slope = max(float(slope), 1e-15)
    return {"run_s": max(0.0, float(icept)), "stream_gbps": 1.0 / slope / 1e9}


def readahead_kb(path: str | os.PathLike) -> int | None:
    """The block device's ``read_ahead_kb`` under ``path`` (sysfs; None where it cannot be found)."""
    try:
        dev = os.stat(path).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for cand in (f"{base}/queue/read_ahead_kb", f"{base}/../queue/read_ahead_kb",
                     f"{base}/bdi/read_ahead_kb"):
            if os.path.exists(cand):
                with open(cand) as f:
                    return int(f.read().strip())
    except (OSError, ValueError):
        pass
    return None


def probe_faults(path: str | os.PathLike, runs=DEFAULT_RUNS, total_bytes: int = 256 << 20,
                 repetitions: int = 3) -> dict:
    """The ``mmap_fault`` figures for the test file ``path`` (read only, at least ~3 GB so the longest
    runs have room): one :func:`measure_runs` row per run length, their :func:`fit_runs` line, and the
    device's readahead setting (what sizes the read-around window)."""
    rows = [measure_runs(path, int(r), total_bytes, repetitions, seed=k) for k, r in enumerate(runs)]
    return {"method": "mmap with POSIX_FADV_SEQUENTIAL, one byte per 4 KiB page of runs at random offsets "
                      f">= {SPACING_BYTES >> 20} MiB apart, one thread, page cache dropped per repetition, "
                      "bytes read from /proc/self/io", "read_ahead_kb": readahead_kb(path),
            "rows": rows, **fit_runs(rows)}
