"""Link probe vs a plain CuPy copy on a CUDA GPU (acceptance: H2D pinned within ±15%).

The reference is CuPy's own high-level path — ``device_array.set(pinned_host_array)`` from
``cupyx.empty_pinned``, timed with CUDA events — against the profiler's ``probe_cuda_link`` (runtime
``cudaMemcpy`` timed on the host), both at one expert block, alternating, ``--runs`` times each.

    python bench/profile_vs_cupy.py --device 0 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from colibri_plan.fileio import atomic_write_text
from colibri_plan.profiler.disk import DEFAULT_BLOCK_BYTES
from colibri_plan.profiler.links import probe_cuda_link


def cupy_copy_gbps(device: int, block: int, copies: int) -> dict:
    """GB/s of plain CuPy copies (H2D pinned/pageable via .set, D2H pinned via .get(out=))."""
    import cupy as cp
    import cupyx
    import numpy as np

    with cp.cuda.Device(device):
        dev = cp.empty(block, dtype=cp.uint8)
        pinned = cupyx.empty_pinned((block,), dtype=np.uint8)
        pinned[:] = 1
        pageable = np.ones(block, dtype=np.uint8)
        start, end = cp.cuda.Event(), cp.cuda.Event()

        def timed(fn) -> float:
            fn()
            cp.cuda.Device(device).synchronize()
            start.record()
            for _ in range(copies):
                fn()
            end.record()
            end.synchronize()
            return block * copies / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9

        return {"h2d_pinned_gbps": timed(lambda: dev.set(pinned)),
                "h2d_pageable_gbps": timed(lambda: dev.set(pageable)),
                "d2h_pinned_gbps": timed(lambda: dev.get(out=pinned))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--out", default="bench/results/profile_vs_cupy.json")
    a = ap.parse_args(argv)
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() <= a.device:
            raise RuntimeError(f"no CUDA device {a.device}")
    except Exception as exc:  # noqa: BLE001 - say why and stop
        print(f"CUDA is not usable here: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    keys = ("h2d_pinned_gbps", "h2d_pageable_gbps", "d2h_pinned_gbps")
    ref = {k: [] for k in keys}
    ours = {k: [] for k in keys}
    for r in range(a.runs):
        for k, v in cupy_copy_gbps(a.device, a.block_bytes, a.copies).items():
            ref[k].append(v)
        probe = probe_cuda_link(a.device, a.block_bytes, repetitions=1, copies=a.copies)
        for k in keys:
            ours[k].append(probe[k]["median"])
        print(f"run {r + 1}: cupy H2D pinned {ref['h2d_pinned_gbps'][-1]:.2f} GB/s, probe "
              f"{ours['h2d_pinned_gbps'][-1]:.2f} GB/s", file=sys.stderr)
    rows = []
    print(f"block {a.block_bytes} B, {a.copies} copies per run, median of {a.runs}")
    print(f"{'link':<18} {'cupy GB/s':>9}  {'probe GB/s':>10}  {'probe/cupy':>10}")
    for k in keys:
        c, o = statistics.median(ref[k]), statistics.median(ours[k])
        rows.append({"figure": k, "cupy": ref[k], "probe": ours[k], "cupy_median": c, "probe_median": o,
                     "ratio": o / c})
        print(f"{k:<18} {c:9.2f}  {o:10.2f}  {o / c:10.3f}")
    ok = abs(rows[0]["ratio"] - 1) <= 0.15
    print(f"H2D pinned within ±15%: {'yes' if ok else 'NO'}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(a.out, json.dumps({"device": a.device, "block_bytes": a.block_bytes, "rows": rows},
                                        indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
