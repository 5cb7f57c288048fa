"""Run one command under a memory limit: a cgroup v1 memory group, with the page cache charged to it.

A child group of ``/sys/fs/cgroup/memory`` is made per run (``memory.limit_in_bytes`` = the budget), the
command is started inside it (its pid written to ``cgroup.procs`` before it runs anything), and the
group's own counters are read while it runs and after: peak usage, the page cache (``cache``,
``mapped_file``) and anonymous memory (``rss``) at their highest, how often the limit was hit
(``memory.failcnt``) and whether the kernel's OOM killer ended it (``oom_kill``). File pages that another
group already holds would be read for free, so :func:`evict` drops the model files from the page cache
first (``posix_fadvise(DONTNEED)``) and :func:`resident_bytes` says how much of a file stayed cached.

Needs root and the cgroup v1 memory controller (mounted on these machines); :func:`check_cgroup` says
what is missing. Nothing here imports the project: bench/replay_llamacpp.py drives both engines with it.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")
MiB = 1024 * 1024
#: memory.stat keys kept, as the kernel names them (bytes)
STAT_KEYS = ("cache", "rss", "mapped_file", "shmem", "active_file", "inactive_file", "pgmajfault")


def check_cgroup(root: Path = ROOT) -> str | None:
    """Why a memory cgroup cannot be made here (None when it can): no v1 memory controller, or not root."""
    if not (root / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {root} (mount it: mount -t cgroup -o memory cgroup {root})"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable: run as root to make a child memory group"
    return None


def read_stat(group: Path) -> dict[str, int]:
    """The kept ``memory.stat`` counters of ``group`` (bytes; ``pgmajfault`` a count)."""
    out = {}
    for line in (group / "memory.stat").read_text().splitlines():
        k, _, v = line.partition(" ")
        if k in STAT_KEYS:
            out[k] = int(v)
    return out


def evict(paths) -> None:
    """Drop ``paths`` (files, or every file under a folder) from the page cache: written pages are
    flushed first, so DONTNEED can drop them."""
    for p in _files(paths):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths) -> int | None:
    """Bytes of ``paths`` now in the page cache (util-linux ``fincore``); None without fincore."""
    files = [str(p) for p in _files(paths)]
    if not files:
        return 0
    try:
        r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *files],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return sum(int(x) for x in r.stdout.split())


def _files(paths) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return out


@dataclass
class CgroupRun:
    """What one command did under its limit. Bytes unless named otherwise.

    ``rc`` is the exit status (negative: killed by that signal; -9 with ``oom_kills`` > 0 is the OOM
    killer). ``peak`` holds the highest sampled value of each ``memory.stat`` key and of ``usage``;
    ``max_usage_bytes`` is the kernel's own peak. ``stdout``/``stderr`` are the command's text."""
    argv: list[str]
    limit_bytes: int
    rc: int
    wall_s: float
    max_usage_bytes: int
    failcnt: int
    oom_kills: int
    peak: dict = field(default_factory=dict)
    end: dict = field(default_factory=dict)
    stdout: str = ""
    stderr: str = ""

    def to_dict(self, keep_output: bool = False) -> dict:
        d = {"argv": self.argv, "limit_bytes": self.limit_bytes, "limit_mib": self.limit_bytes / MiB,
             "rc": self.rc, "wall_s": self.wall_s, "max_usage_bytes": self.max_usage_bytes,
             "failcnt": self.failcnt, "oom_kills": self.oom_kills, "oom_killed": self.oom_kills > 0,
             "peak": self.peak, "end": self.end}
        if keep_output:
            d["stdout"], d["stderr"] = self.stdout, self.stderr
        return d


def _oom_kills(group: Path) -> int:
    for line in (group / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


def run_limited(argv: list[str], limit_bytes: int, *, env: dict | None = None, cwd=None,
                timeout_s: float = 600.0, sample_s: float = 0.2, name: str = "colibri-replay",
                root: Path = ROOT) -> CgroupRun:
    """Run ``argv`` in a fresh memory group of ``limit_bytes`` (the page cache it reads is charged to the
    group); returns the counters. The group is emptied and removed afterwards; a command past
    ``timeout_s`` is killed (rc -9, ``oom_kills`` 0).

    Raises:
        RuntimeError: no memory cgroup can be made here (see :func:`check_cgroup`).
    """
    why = check_cgroup(root)
    if why:
        raise RuntimeError(why)
    group = root / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(int(limit_bytes)))
        procs = str(group / "cgroup.procs")

        def enter():  # in the child, before exec: everything it maps from here on is charged to the group
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        peak = {k: 0 for k in (*STAT_KEYS, "usage")}
        done = threading.Event()

        def sample():
            while not done.is_set():
                try:
                    s = read_stat(group)
                    s["usage"] = int((group / "memory.usage_in_bytes").read_text())
                except OSError:
                    break
                for k, v in s.items():
                    peak[k] = max(peak[k], v)
                done.wait(sample_s)

        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             cwd=cwd, preexec_fn=enter)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
            err += f"\n[replay] killed after {timeout_s:.0f} s\n"
        wall = time.perf_counter() - t0
        done.set()
        th.join()
        end = read_stat(group)
        return CgroupRun(argv=list(argv), limit_bytes=int(limit_bytes), rc=p.returncode, wall_s=wall,
                         max_usage_bytes=int((group / "memory.max_usage_in_bytes").read_text()),
                         failcnt=int((group / "memory.failcnt").read_text()), oom_kills=_oom_kills(group),
                         peak=peak, end=end, stdout=out, stderr=err)
    finally:
        _remove(group)


def _remove(group: Path) -> None:
    """Empty the group (its charged page cache is reclaimed) and remove it; tries a few times because
    the last task may take a moment to leave."""
    for _ in range(50):
        try:
            (group / "memory.force_empty").write_text("0")
        except OSError:
            pass
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)
