"""Disk probe vs fio on the same file, block size and queue depth (acceptance: within ±15%).

fio (io_uring by default, direct=1, randread, bs = one expert block, offsets 4 KiB-aligned, iodepth = QD,
one job) and the profiler's probe (QD threads of O_DIRECT ``preadv``) take turns on one test file, ``--runs``
times each per queue depth; the medians and their ratio are printed and written as JSON.

    .venv/bin/python bench/profile_vs_fio.py --path /tmp/x --queue-depths 1,4,8 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from colibri_plan.fileio import atomic_write_text
from colibri_plan.profiler import disk
from colibri_plan.profiler.machine import filesystem_of


def run_fio(path: Path, block: int, qd: int, seconds: float, engine: str, threads: bool) -> float:
    """One fio run; returns read GB/s (1e9 B/s)."""
    cmd = ["fio", "--name=colibri", f"--filename={path}", "--rw=randread", f"--bs={block}", "--direct=1",
           "--blockalign=4096", "--norandommap", "--randrepeat=0", "--time_based", f"--runtime={seconds}",
           "--group_reporting", "--output-format=json", "--invalidate=1"]
    if threads:  # the probe's shape exactly: QD jobs, one synchronous read each
        cmd += ["--ioengine=psync", "--iodepth=1", f"--numjobs={qd}", "--thread"]
    else:
        cmd += [f"--ioengine={engine}", f"--iodepth={qd}", "--numjobs=1"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    doc = json.loads(out[out.index("{"):])
    return doc["jobs"][0]["read"]["bw_bytes"] / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default=".", help="folder for the test file (on the disk to compare)")
    ap.add_argument("--block-bytes", type=int, default=disk.DEFAULT_BLOCK_BYTES)
    ap.add_argument("--file-bytes", type=int, default=2 << 30)
    ap.add_argument("--queue-depths", default="1,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="wall seconds per run")
    ap.add_argument("--engine", default="io_uring", help="fio ioengine (io_uring or libaio)")
    ap.add_argument("--fio-threads", action="store_true", help="fio as QD psync jobs instead of iodepth")
    ap.add_argument("--out", default="bench/results/profile_vs_fio.json")
    a = ap.parse_args(argv)
    if shutil.which("fio") is None:
        print("fio is not installed (apt-get install fio)", file=sys.stderr)
        return 2
    block = disk.align_up(a.block_bytes)
    qds = [int(q) for q in a.queue_depths.split(",")]
    fd_tmp, name = tempfile.mkstemp(prefix=".colibri-fio-", suffix=".bin", dir=a.path)
    os.close(fd_tmp)
    path = Path(name)
    rows = []
    try:
        print(f"writing {a.file_bytes >> 20} MiB test file {path}", file=sys.stderr)
        disk.write_test_file(path, disk.align_up(a.file_bytes))
        size = path.stat().st_size
        fs = filesystem_of(path)
        fd, direct, method, warning = disk.open_for_read(path)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        try:
            for qd in qds:
                fio_v, ours_v = [], []
                for r in range(a.runs):  # alternate (and swap who goes first) so drift hits both alike
                    for who in (("fio", "probe") if r % 2 == 0 else ("probe", "fio")):
                        if who == "fio":
                            fio_v.append(run_fio(path, block, qd, a.seconds, a.engine, a.fio_threads))
                        else:
                            m = disk.measure(fd, size, block, qd, 1, a.seconds, direct)
                            ours_v.append(m["read_gbps"]["median"])
                    print(f"QD{qd} run {r + 1}: fio {fio_v[-1]:.3f} GB/s, probe {ours_v[-1]:.3f} GB/s",
                          file=sys.stderr)
                f, o = statistics.median(fio_v), statistics.median(ours_v)
                rows.append({"queue_depth": qd, "fio_gbps": fio_v, "probe_gbps": ours_v, "fio_median": f,
                             "probe_median": o, "ratio": o / f})
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    print(f"\nblock {block} B, file {size >> 20} MiB on {fs['fstype']} ({fs['device']}), "
          f"page cache: {method}, fio {'psync x QD jobs' if a.fio_threads else a.engine + ' iodepth=QD'}, "
          f"median of {a.runs}")
    print(f"{'QD':>3}  {'fio GB/s':>9}  {'probe GB/s':>10}  {'probe/fio':>9}  within ±15%")
    for r in rows:
        ok = abs(r["ratio"] - 1) <= 0.15
        print(f"{r['queue_depth']:>3}  {r['fio_median']:9.3f}  {r['probe_median']:10.3f}  {r['ratio']:9.3f}  "
              f"{'yes' if ok else 'NO'}")
    result = {"load_average_end": list(os.getloadavg()),
              "block_bytes": block, "file_bytes": size, "filesystem": fs, "o_direct": direct,
              "fio_engine": "psync-jobs" if a.fio_threads else a.engine, "runs": a.runs,
              "seconds_per_run": a.seconds, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0 if all(abs(r["ratio"] - 1) <= 0.15 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
