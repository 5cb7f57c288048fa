"""O_DIRECT reads into page-aligned buffers: the primitives the profiler and the engine share.

O_DIRECT needs the file offset, the length and the buffer address aligned to the logical block size;
4096 bytes covers every disk seen here. An anonymous ``mmap`` is page aligned, and ``os.preadv`` into it
works where ``os.pread`` cannot (it allocates its own unaligned buffer) and releases the GIL, so N
threads keep N requests in flight (queue depth N). When O_DIRECT is refused (tmpfs, some overlays and
FUSE mounts) reads fall back to buffered ``preadv`` followed by ``posix_fadvise(DONTNEED)`` so the page
cache keeps as little as possible; callers report that fallback.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

ALIGN = 4096
#: filesystems that keep file data in RAM: O_DIRECT opens may succeed but bypass nothing
RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "shm"})


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a``."""
    return -(-int(n) // a) * a


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """A page-aligned anonymous mapping of ``align_up(nbytes)`` bytes (valid for O_DIRECT I/O), its pages
    already faulted in so the first timed read does not pay for them."""
    buf = mmap.mmap(-1, align_up(max(1, nbytes)))
    np.frombuffer(buf, dtype=np.uint8)[::ALIGN] = 0
    return buf


def filesystem_of(path: str | os.PathLike) -> str:
    """Filesystem type of the mount holding ``path`` (longest matching mount point in /proc/mounts), or
    "unknown"."""
    real = os.path.realpath(path)
    best, fstype = "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def open_for_read(path: str | os.PathLike, buffered: bool = False) -> tuple[int, bool, str, str | None]:
    """Open ``path`` read-only, with O_DIRECT when it really bypasses the page cache.

    ``buffered`` (a plan that chose buffered reads, planner/reads.py): open without O_DIRECT; the caller
    keeps the page cache within the plan's bytes (``page_cache_method`` "buffered+bounded_lru").

    Returns:
        (fd, o_direct, page_cache_method, warning or None); ``page_cache_method`` is "o_direct",
        "buffered+fadvise_dontneed", "buffered+bounded_lru" or "buffered" (RAM filesystems). A test read
        of one 4 KiB page checks that O_DIRECT works.

    Raises:
        OSError: the file cannot be opened at all.
    """
    fstype = filesystem_of(path)
    if fstype in RAM_FILESYSTEMS:
        fd = os.open(path, os.O_RDONLY)
        return fd, False, "buffered", (f"{path} is on {fstype}, which keeps files in RAM: O_DIRECT bypasses "
                                       "nothing there, so reads are memory reads, not disk reads")
    if buffered:
        return os.open(path, os.O_RDONLY), False, "buffered+bounded_lru", None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        reason = exc.strerror or str(exc)
    else:
        try:
            os.preadv(fd, [aligned_buffer(ALIGN)], 0)
            return fd, True, "o_direct", None
        except OSError as exc:
            os.close(fd)
            reason = exc.strerror or str(exc)
    fd = os.open(path, os.O_RDONLY)
    return fd, False, "buffered+fadvise_dontneed", (
        f"O_DIRECT refused on {path} ({fstype}: {reason}); using buffered reads followed by "
        "posix_fadvise(DONTNEED), which the page cache may still flatter")


def drop_cache(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """posix_fadvise(DONTNEED) on a byte range (0, 0 = the whole file); errors are ignored."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def read_full(fd: int, buf, offset: int, nbytes: int) -> int:
    """Read ``nbytes`` at ``offset`` into the start of ``buf`` with ``os.preadv`` (looping over short
    reads); returns the bytes read, fewer only at end of file."""
    got = 0
    view = memoryview(buf)
    while got < nbytes:
        n = os.preadv(fd, [view[got:nbytes]], offset + got)
        if n <= 0:
            break
        got += n
    return got
