"""Disk probe: random reads of whole expert blocks, the way a streaming engine reads a miss.

Method (colibrì's storage probe, DESIGN.md §6): a file is opened with O_DIRECT so the page cache is
never what gets measured; reads of one expert block (the model's expert bytes rounded up to 4 KiB) land
at random 4 KiB-aligned offsets in page-aligned anonymous ``mmap`` buffers through ``os.preadv``
(``os.pread`` cannot use O_DIRECT buffers; ``preadv`` releases the GIL, so N threads are N requests in
flight = queue depth N). Each repetition reads for a fixed wall time; the figure is bytes / wall time.

The O_DIRECT primitives live in :mod:`colibri_plan.directio` (the engine reads experts with the same
ones). When O_DIRECT is refused (EINVAL on some overlays and FUSE mounts) or meaningless (tmpfs/ramfs
keep the file in RAM), reads fall back to buffered ``preadv`` after ``posix_fadvise(DONTNEED)``; the
section says so (``o_direct: false``, ``page_cache_method``) and carries a warning.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from colibri_plan.directio import (  # noqa: F401 - ALIGN, RAM_FILESYSTEMS re-exported for callers
    ALIGN,
    RAM_FILESYSTEMS,
    align_up,
    aligned_buffer,
    drop_cache,
    open_for_read,
    read_full,
)
from colibri_plan.errors import InputError
from colibri_plan.fileio import clean_stale
from colibri_plan.formats.profile import stat
from colibri_plan.profiler.machine import filesystem_of

#: GLM-5.2 routed expert at int4: gate + up [2048, 6144] + down [6144, 2048], data + f32 row scales
DEFAULT_BLOCK_BYTES = 18_915_328
_CHUNK = 16 << 20

Progress = Callable[[str], None]


def write_test_file(path: str | os.PathLike, nbytes: int, progress: Progress | None = None) -> bool:
    """Create ``path`` with ``nbytes`` (multiple of 4 KiB) of incompressible bytes, written with O_DIRECT
    when the filesystem takes it (no page cache left behind). Returns whether O_DIRECT was used."""
    rng = np.random.default_rng(0x5EED)
    chunk = aligned_buffer(_CHUNK)
    words = np.frombuffer(chunk, dtype=np.uint64)
    words[:] = rng.integers(0, 2**63, words.size, dtype=np.uint64)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        direct = True
    except OSError:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        direct = False
    try:
        off = 0
        while off < nbytes:
            n = min(_CHUNK, nbytes - off)
            words += np.uint64(0x9E3779B97F4A7C15)  # new bytes per chunk: nothing dedups or compresses
            view = memoryview(chunk)[:n]
            try:
                done = os.pwritev(fd, [view], off)
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                os.close(fd)  # O_DIRECT accepted at open but refused on write: start over buffered
                fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
                direct, off = False, 0
                continue
            off += done
            if progress and off % (256 << 20) < n:
                progress(f"disk: writing test file {off >> 20}/{nbytes >> 20} MiB")
        os.fsync(fd)
        drop_cache(fd)
    finally:
        os.close(fd)
    return direct


def _timed_reads(fd: int, file_bytes: int, block_bytes: int, queue_depth: int, seconds: float,
                 sequential: bool, seed: int | None) -> tuple[float, int, list[float]]:
    """Run ``queue_depth`` reader threads for ``seconds``; return (wall s, bytes read, per-read s).
    ``seed`` None draws fresh offsets each time (a drive or host cache cannot learn them)."""
    n_slots = (file_bytes - block_bytes) // ALIGN + 1
    lat: list[float] = []
    total = [0]
    lock = threading.Lock()
    start = threading.Barrier(queue_depth + 1)
    stop_at = [0.0]
    seq_next = [random.Random(seed).randrange(n_slots) * ALIGN]
    seeds = [None if seed is None else seed * 1000 + k for k in range(queue_depth)]

    stop = threading.Event()  # set when the main thread leaves early (Ctrl-C, an error)

    def reader(k: int) -> None:
        rnd = random.Random(seeds[k])
        buf = aligned_buffer(block_bytes)
        mine, got = [], 0
        try:
            start.wait()
        except threading.BrokenBarrierError:  # stop_readers aborted the start
            return
        while not stop.is_set() and (time.perf_counter() < stop_at[0] or not mine):
            if sequential:
                with lock:
                    off = seq_next[0]
                    seq_next[0] = off + block_bytes if off + 2 * block_bytes <= file_bytes else 0
            else:
                off = rnd.randrange(n_slots) * ALIGN  # random 4 KiB-aligned offset
            t0 = time.perf_counter()
            got += read_full(fd, buf, off, block_bytes)
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)
            total[0] += got

    threads = [threading.Thread(target=reader, args=(k,), daemon=True, name=f"colibri-disk-reader-{k}")
               for k in range(queue_depth)]
    try:
        for t in threads:
            t.start()
        stop_at[0] = time.perf_counter() + seconds
        t0 = time.perf_counter()
        start.wait()
        for t in threads:
            t.join()
    except BaseException:
        # Ctrl-C or an error here: the readers still use fd, which the caller closes next; stop them first
        stop_readers(threads, stop, start)
        raise
    return time.perf_counter() - t0, total[0], lat


def stop_readers(threads: list[threading.Thread], stop: threading.Event, start: threading.Barrier) -> None:
    """Tell reader threads to stop (``stop`` set, the ``start`` barrier aborted for those not started
    yet) and wait until every one has ended, so the file descriptor they read can be closed safely.
    Each reader finishes at most the one read it is in (milliseconds). A second Ctrl-C while waiting
    does not cut the wait short."""
    stop.set()
    start.abort()
    for t in threads:
        while t.ident is not None and t.is_alive():
            try:
                t.join()
            except KeyboardInterrupt:
                continue


def measure(fd: int, file_bytes: int, block_bytes: int, queue_depth: int, repetitions: int,
            seconds: float, o_direct: bool, sequential: bool = False, seed: int | None = None) -> dict:
    """Read-bandwidth figure at one queue depth: ``{queue_depth, block_bytes, read_gbps{..},
    latency_ms{p50, p99}, reads, seconds_per_repetition}`` (GB = 1e9 B)."""
    gbps, lat = [], []
    for r in range(repetitions):
        if not o_direct:
            drop_cache(fd)
        wall, nbytes, l = _timed_reads(fd, file_bytes, block_bytes, queue_depth, seconds, sequential,
                                       None if seed is None else seed + r)
        gbps.append(nbytes / wall / 1e9)
        lat.extend(l)
    ms = np.asarray(lat) * 1e3
    return {"queue_depth": queue_depth, "block_bytes": block_bytes, "read_gbps": stat(gbps),
            "latency_ms": {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))},
            "reads": len(lat), "seconds_per_repetition": seconds}


def probe_disk(path: str | os.PathLike | None = None, block_bytes: int = DEFAULT_BLOCK_BYTES,
               file_bytes: int = 1 << 30, queue_depths=(1, 4, 8, 16), repetitions: int = 3,
               seconds: float = 1.0, progress: Progress | None = None) -> dict:
    """Measure random and sequential reads of ``block_bytes`` blocks (rounded up to 4 KiB).

    Args:
        path: a directory (a test file of ``file_bytes`` is created there and removed afterwards), an
            existing file (read only, never written), or None for a test file in the current folder.
        queue_depths: concurrent readers to measure random reads at.
        repetitions, seconds: repetitions per figure and wall seconds per repetition.

    Returns:
        The profile's ``disk`` section (see :mod:`colibri_plan.formats.profile`).

    Raises:
        InputError: ``path`` does not exist, or the file is smaller than one block.
    """
    say = progress or (lambda _m: None)
    block = align_up(block_bytes)
    target = Path(path) if path is not None else Path.cwd()
    if not target.exists():
        raise InputError(f"--path {target} does not exist; give a folder or a file on the disk to probe")
    created = None
    if target.is_dir():
        clean_stale(target, ".colibri-probe-", ".bin")   # a killed profile's test file (its pid is gone)
        fd_tmp, name = tempfile.mkstemp(prefix=f".colibri-probe-{os.getpid()}-", suffix=".bin", dir=target)
        os.close(fd_tmp)
        created = Path(name)
        probe_file = created
    else:
        probe_file = target
    fd = -1
    try:
        if created is not None:
            size = align_up(max(file_bytes, 2 * block))
            free = shutil.disk_usage(target).free
            if size > free // 2:  # never fill the disk: shrink the test file, say so
                size = max(2 * block, (free // 2) // ALIGN * ALIGN)
                say(f"disk: only {free >> 20} MiB free in {target}; test file shrunk to {size >> 20} MiB")
                if size > free // 2:
                    raise InputError(f"{target} has {free >> 20} MiB free, too little for a {size >> 20} MiB "
                                     "test file; give --path on a disk with more room")
            say(f"disk: writing a {size >> 20} MiB test file in {target}")
            write_test_file(created, size, say)
        size = (probe_file.stat().st_size // ALIGN) * ALIGN
        if size < block:
            raise InputError(f"{probe_file} has {probe_file.stat().st_size:,} B, less than one {block:,} B "
                             "block; give a larger file or a folder")
        fs = filesystem_of(probe_file)
        fd, direct, method, warning = open_for_read(probe_file)
        random_rows = []
        for qd in queue_depths:
            say(f"disk: random {block} B reads at queue depth {qd}")
            random_rows.append(measure(fd, size, block, int(qd), repetitions, seconds, direct))
        say("disk: sequential reads")
        seq = measure(fd, size, block, 1, repetitions, seconds, direct, sequential=True)
        seq["method"] = "one reader, consecutive blocks from a random start"
        fault = _fault_probe(probe_file, size, block, say)
    finally:
        if fd >= 0:
            os.close(fd)
        if created is not None:
            created.unlink(missing_ok=True)
    return {
        "path": str(target), "file": str(probe_file) if created is None else "(temporary, removed)",
        "file_bytes": size, "filesystem": fs, "o_direct": direct, "page_cache_method": method,
        "block_bytes": block, "offset_alignment_bytes": ALIGN,
        "method": "os.preadv into page-aligned mmap buffers, one thread per request in flight, "
                  "random 4 KiB-aligned offsets, fixed wall time per repetition",
        "random": random_rows, "sequential": seq, "mmap_fault": fault,
        "warnings": [warning] if warning else [],
    }


def _fault_probe(probe_file: Path, size: int, block: int, say: Progress) -> dict:
    """The page-fault figures of a mapped file (:mod:`.fault`: what llama.cpp's mmap gets) on the same
    test file: runs from a quarter MiB to 64 MiB and one projection of the model's expert block, those
    that fit twice in the file; ``{"unavailable": why}`` when mapping fails."""
    from colibri_plan.profiler import fault

    runs = sorted({256 << 10, max(4096, block // 3 // 4096 * 4096), 8 << 20, 64 << 20})
    runs = [r for r in runs if 2 * r <= size]
    if not runs:
        return {"unavailable": f"test file of {size} B too small for the fault probe"}
    say("disk: page faults of a mapped file (llama.cpp's mmap)")
    try:
        return fault.probe_faults(probe_file, runs, total_bytes=min(256 << 20, size // 2))
    except (OSError, ValueError) as exc:
        return {"unavailable": f"fault probe failed: {exc}"}
