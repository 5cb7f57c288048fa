"""CPU GEMV (T = 1) and prefill GEMM throughput of the ``cpu`` backend per format, against RAM bandwidth.

For each format (int8, int4 per-row, int4-g32/g64/g128, int4-g32h) and shape (out, in) it times
``matmul`` of one token (GEMV) and of ``--prefill`` tokens, cycling through a pool of weights larger
than the last-level cache (``--pool-bytes``) so each call streams its weight from RAM. Weight GB/s =
packed bytes (data + scales) read per second. RAM read bandwidth is measured in the same run,
interleaved with the formats (the profiler's probe, ``colibri_plan/profiler/ram.py``: numpy sums in one
thread per core), and each GEMV figure is divided by the median RAM figure and by the mean of the probes
just before and after it ("local": less sensitive to other processes): the "fraction of RAM bandwidth"
of issue 14 (≥ 0.8). ``--threads N`` runs the kernels on N numba threads (``NUMBA_NUM_THREADS``, set
before numba loads) and the RAM probe on N reader threads, so both sides of the fraction use the same
cores (default: every usable core). The machine may be shared: the load average before and after is
recorded; compare figures of one run.

    .venv/bin/python bench/cpu_gemv.py [--threads 2] [--repeats 7] [--compare-parallel] [--out FILE]

``--roots NAME=DIR ...`` compares source trees: each (round, tree) runs this script in a fresh process
importing ``colibri_plan`` from DIR (``cpu_decode_overhead._use_root``), the trees' order reversed every
other round (``--rounds``), each run with its own RAM probes; the JSON holds every run and, per tree,
shape and format, the medians over rounds of GB/s and of the fraction of the run's own RAM figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {"trunk 4096x4096": (4096, 4096), "expert up 2048x6144": (2048, 6144),
          "expert down 6144x2048": (6144, 2048),  # GLM-5.2 expert shapes
          "peer up 1024x2048": (1024, 2048), "peer down 2048x1024": (2048, 1024),
          # bench/peer_llamacpp's checkpoint now (expert width 768: a down row of 24 int4-g32 groups)
          "peer up 768x2048": (768, 2048), "peer down 2048x768": (2048, 768),
          "peer kv 512x2048": (512, 2048)}  # a 0.6 MB int4-g32h GEMV, near the serial bounds
FORMATS = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g32h")


def ram_gbps(array_bytes: int, threads: int | None = None) -> float:
    """One RAM read figure (GB/s) on ``threads`` reader threads (default: every usable core), the
    profiler's probe with 3 repetitions (median)."""
    from colibri_plan.profiler.ram import probe_ram

    return float(probe_ram(array_bytes, repetitions=3, threads=threads)["read_gbps"]["median"])


def pool(fmt: str, shape: tuple[int, int], pool_bytes: int, be, rng) -> list:
    """Uploaded weights of ``shape`` in ``fmt`` totalling >= pool_bytes (one random matrix quantized
    once, its arrays copied so every pool entry has its own memory)."""
    from colibri_plan import quant

    out, n = shape
    qt = quant.quantize(rng.standard_normal((out, n), dtype=np.float32), fmt)
    count = max(2, -(-pool_bytes // qt.nbytes))
    ws = []
    for _ in range(count):
        s = None if qt.scales is None else qt.scales.copy()
        ws.append(be.upload(quant.QuantTensor(fmt, out, n, qt.data.copy(), s)))
    return ws


def time_pool(be, ws, x, repeats: int) -> list[float]:
    """Seconds per matmul call: per repeat, one pass over the pool (median per pass)."""
    for w in ws[:2]:
        be.matmul(x, w)  # compile / warm
    passes = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in ws:
            be.matmul(x, w)
        passes.append((time.perf_counter() - t0) / len(ws))
    return passes


def check_args(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse bad arguments with a usage error (exit 2) before the backend opens or RAM is probed, rather
    than a KeyError / StatisticsError traceback after minutes of work; make --out's folder and check it."""
    from colibri_plan import quant
    from colibri_plan.errors import InputError
    from colibri_plan.fileio import check_output_path

    if bad := [f for f in a.formats.split(",") if f not in quant.FORMATS]:
        ap.error(f"--formats: {', '.join(map(repr, bad))} not a quant format ({', '.join(quant.FORMATS)})")
    if bad := [s for s in a.shapes.split(",") if s not in SHAPES]:
        ap.error(f"--shapes: unknown {', '.join(map(repr, bad))} (known: {', '.join(SHAPES)})")
    if a.threads is not None and not 1 <= a.threads <= (os.cpu_count() or 1):
        ap.error(f"--threads must be 1..{os.cpu_count()} (this machine's cores), got {a.threads}")
    if a.repeats < 1 or a.prefill < 0 or a.pool_bytes < 1 or a.ram_bytes < 1:
        ap.error(f"--repeats, --pool-bytes and --ram-bytes must be >= 1 and --prefill >= 0, got "
                 f"--repeats {a.repeats}, --prefill {a.prefill}, --pool-bytes {a.pool_bytes}, "
                 f"--ram-bytes {a.ram_bytes}")
    if a.out is not None:
        try:
            if str(a.out).strip():
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            check_output_path(a.out)
        except (InputError, OSError) as exc:
            ap.error(f"--out: {exc}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of keys of SHAPES")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--prefill", type=int, default=16, help="tokens of the batched (prefill) figure; 0: none")
    ap.add_argument("--pool-bytes", type=int, default=256 << 20)
    ap.add_argument("--ram-bytes", type=int, default=512 << 20)
    ap.add_argument("--compare-parallel", action="store_true",
                    help="also time each GEMV with the backend's serial path off (serial_bytes = 0)")
    ap.add_argument("--threads", type=int, default=None,
                    help="kernel threads (NUMBA_NUM_THREADS) and RAM probe threads; default: every core")
    ap.add_argument("--out", default=None, help="JSON output file")
    ap.add_argument("--roots", nargs="*", default=None, help="NAME=DIR source trees, interleaved")
    ap.add_argument("--rounds", type=int, default=2, help="with --roots: runs of each tree")
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)  # one run of --roots: the tree
    a = ap.parse_args()
    if a.root:  # before the first colibri_plan import
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from cpu_decode_overhead import _use_root

        _use_root(a.root)
    check_args(ap, a)
    if a.roots:
        compare_roots(a)
        return
    if a.threads is not None:  # before the cpu backend imports numba: its pool is sized once
        os.environ["NUMBA_NUM_THREADS"] = str(a.threads)
    from colibri_plan.backends import get_backend
    from colibri_plan.fileio import atomic_write_text

    rng = np.random.default_rng(0)
    be = get_backend("cpu").open(0)
    load0 = os.getloadavg()
    ram = [ram_gbps(a.ram_bytes, a.threads)]
    rows = []
    for sname in a.shapes.split(","):
        shape = SHAPES[sname]
        for fmt in a.formats.split(","):
            ws = pool(fmt, shape, a.pool_bytes, be, rng)
            nbytes = ws[0].nbytes
            x1 = rng.standard_normal((1, shape[1]), dtype=np.float32)
            s1 = time_pool(be, ws, x1, a.repeats)
            row = {"shape": sname, "out": shape[0], "in": shape[1], "fmt": fmt, "weight_bytes": nbytes,
                   "gemv_s": statistics.median(s1), "gemv_gbps": nbytes / statistics.median(s1) / 1e9,
                   "gemv_gbps_runs": [nbytes / s / 1e9 for s in s1]}
            if a.compare_parallel:  # the same pool, every call on the parallel kernels (no serial path)
                serial_bytes, be.serial_bytes = be.serial_bytes, 0
                sp = statistics.median(time_pool(be, ws, x1, a.repeats))
                be.serial_bytes = serial_bytes
                row.update(gemv_s_parallel=sp, gemv_gbps_parallel=nbytes / sp / 1e9)
            if a.prefill > 1:
                xt = rng.standard_normal((a.prefill, shape[1]), dtype=np.float32)
                st = time_pool(be, ws, xt, max(3, a.repeats // 2))
                row.update(prefill_tokens=a.prefill, prefill_s=statistics.median(st),
                           prefill_over_gemv=statistics.median(st) / row["gemv_s"])
            for w in ws:
                be.free(w)
            ram.append(ram_gbps(a.ram_bytes, a.threads))
            rows.append(row)
            par = f", all-parallel {row['gemv_gbps_parallel']:.1f}" if a.compare_parallel else ""
            print(f"  {sname:22} {fmt:9} {row['gemv_gbps']:6.1f} GB/s{par}  (RAM {ram[-1]:.1f})", flush=True)
    ram_med = statistics.median(ram)
    for i, r in enumerate(rows):  # probes run before and after each row: the machine may be shared
        r["ram_gbps_local"] = (ram[i] + ram[i + 1]) / 2
        r["fraction_of_ram"] = r["gemv_gbps"] / ram_med
        r["fraction_of_local_ram"] = r["gemv_gbps"] / r["ram_gbps_local"]
    load1 = os.getloadavg()
    print(f"\nRAM read (profiler probe, {a.threads or 'all'} thread(s), median of {len(ram)}): "
          f"{ram_med:.1f} GB/s "
          f"[{min(ram):.1f}..{max(ram):.1f}]; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    hdr = f"{'shape':22} {'format':9} {'MB':>6} {'GEMV ms':>8} {'GB/s':>6} {'of RAM':>7} {'of local':>8}"
    if a.compare_parallel:
        hdr += f" {'all-par GB/s':>12}"
    if a.prefill > 1:
        hdr += f" {f'T={a.prefill} / T=1':>11}"
    print(hdr)
    for r in rows:
        line = (f"{r['shape']:22} {r['fmt']:9} {r['weight_bytes'] / 1e6:6.1f} {r['gemv_s'] * 1e3:8.3f} "
                f"{r['gemv_gbps']:6.1f} {r['fraction_of_ram']:7.2f} {r['fraction_of_local_ram']:8.2f}")
        if a.compare_parallel:
            line += f" {r['gemv_gbps_parallel']:12.1f}"
        if a.prefill > 1:
            line += f" {r['prefill_over_gemv']:11.2f}"
        print(line)
    if a.out:
        doc = {"kind": "cpu-gemv", "device": be.device.name, "driver": be.device.driver,
               "threads": int(os.environ.get("NUMBA_NUM_THREADS") or os.cpu_count()),
               "load_average_before_after": [load0[0], load1[0]],
               "ram": {"method": "colibri_plan.profiler.ram.probe_ram (numpy sum per core), 3 reps each",
                       "samples_gbps": ram, "median_gbps": ram_med},
               "args": vars(a), "rows": rows}
        atomic_write_text(Path(a.out), json.dumps(doc, indent=1) + "\n")
    be.close()


def compare_roots(a: argparse.Namespace) -> None:
    """``--roots``: this script once per (round, tree) in a fresh process (see the module docstring)."""
    from colibri_plan.fileio import atomic_write_text

    roots = dict(r.split("=", 1) for r in a.roots)
    passed = ["--formats", a.formats, "--shapes", a.shapes, "--repeats", str(a.repeats), "--prefill",
              str(a.prefill), "--pool-bytes", str(a.pool_bytes), "--ram-bytes", str(a.ram_bytes)]
    passed += ["--threads", str(a.threads)] if a.threads is not None else []
    passed += ["--compare-parallel"] if a.compare_parallel else []
    runs: dict[str, list] = {n: [] for n in roots}
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for name in (list(roots) if rnd % 2 == 0 else list(roots)[::-1]):  # counterbalanced
                out = Path(tmp) / f"{name}-{rnd}.json"
                subprocess.run([sys.executable, __file__, *passed, "--root", roots[name], "--out", str(out)],
                               check=True, stdout=subprocess.DEVNULL)
                runs[name].append(json.loads(out.read_text()))
                print(f"round {rnd} {name}: " + ", ".join(
                    f"{r['shape'].split()[1]} {r['fmt']} {r['gemv_gbps']:.1f} GB/s "
                    f"({r['fraction_of_ram']:.2f})" for r in runs[name][-1]["rows"]), flush=True)
    summary = {}
    print(f"\n{'tree':10} {'shape':22} {'format':9} {'GB/s':>6} {'of RAM':>7} {'RAM GB/s':>8}"
          f"  (medians of {a.rounds})")
    for name, docs in runs.items():
        for i, r0 in enumerate(docs[0]["rows"]):
            rows = [d["rows"][i] for d in docs]
            s = {"gemv_gbps_median": statistics.median(r["gemv_gbps"] for r in rows),
                 "fraction_of_ram_median": statistics.median(r["fraction_of_ram"] for r in rows),
                 "ram_gbps_median": statistics.median(d["ram"]["median_gbps"] for d in docs)}
            summary.setdefault(name, {})[f"{r0['shape']} {r0['fmt']}"] = s
            print(f"{name:10} {r0['shape']:22} {r0['fmt']:9} {s['gemv_gbps_median']:6.1f} "
                  f"{s['fraction_of_ram_median']:7.2f} {s['ram_gbps_median']:8.1f}")
    if a.out:
        doc = {"kind": "cpu-gemv-roots", "command": " ".join(sys.argv), "roots": roots, "rounds": a.rounds,
               "load_average_before_after": [load0[0], os.getloadavg()[0]], "summary": summary, "runs": runs}
        atomic_write_text(Path(a.out), json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
