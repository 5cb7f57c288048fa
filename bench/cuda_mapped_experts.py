"""Experts the GPU reads from mapped host memory (``upload_expert_mapped``) against the same experts in VRAM.

The zero-copy pinned tier (engine/unified.py) computes pinned experts on a discrete GPU straight from
page-locked RAM over PCIe. This measures what that costs a decode step: ``expert_ffn`` over k experts at
one token, each expert its own memory (a pool cycled so no call finds the weights in L2), in VRAM and
mapped, by CUDA events (``timing = True``: the op's copies and kernels) and host wall clock, beside a
pinned host-to-device ``cudaMemcpy`` of the same bytes (the bus's own rate in the same run). Prints a
table; ``--out`` writes JSON.

    python3 bench/cuda_mapped_experts.py --hidden 2048 --width 768 --fmt int8 --out mapped.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.fileio import atomic_write_text


def h2d_gbps(be, nbytes: int, repeats: int = 8) -> float:
    """Pinned host -> device copy GB/s (1e9 B/s, median) of ``nbytes``."""
    cp, rt = be.cp, be.rt
    host = cp.cuda.alloc_pinned_memory(nbytes)
    dev = cp.cuda.memory.alloc(nbytes)
    hp = np.frombuffer(host, np.uint8, nbytes).ctypes.data
    rates = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        rt.memcpy(dev.ptr, hp, nbytes, rt.memcpyHostToDevice)
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates[1:]))


def timed(be, pool: list, k: int, hidden: int, calls: int) -> tuple[float, float]:
    """(median device seconds, median wall seconds) of expert_ffn over k experts of ``pool`` at 1 token,
    a fresh slice of the pool each call."""
    x = [np.random.default_rng(0).standard_normal((1, hidden), dtype=np.float32)] * k
    dev, wall = [], []
    for c in range(calls + 1):
        es = [pool[(c * k + j) % len(pool)] for j in range(k)]
        be.synchronize()
        t0 = time.perf_counter()
        be.expert_ffn(x, es)
        be.synchronize()
        wall.append(time.perf_counter() - t0)
        dev.append(be.last_gpu_seconds() or float("nan"))
    return float(np.median(dev[1:])), float(np.median(wall[1:]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--fmt", default="int8")
    ap.add_argument("--pool", type=int, default=48, help="experts per pool (more than L2 holds)")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    be = get_backend("cuda").open(0)
    be.timing = True
    rng = np.random.default_rng(1)
    qts = [quant.quantize(rng.standard_normal(s, dtype=np.float32) / 50, a.fmt)
           for s in ((a.width, a.hidden), (a.width, a.hidden), (a.hidden, a.width))]
    expert_bytes = sum(q.nbytes for q in qts)
    pools = {"vram": [be.upload_expert(*qts) for _ in range(a.pool)],
             "mapped": [be.upload_expert_mapped(*qts) for _ in range(a.pool)]}
    x = np.random.default_rng(2).standard_normal((1, a.hidden), dtype=np.float32)
    same = bool(np.array_equal(be.expert_ffn([x], [pools["vram"][0]])[0],
                               be.expert_ffn([x], [pools["mapped"][0]])[0]))
    rows = []
    for k in (int(v) for v in a.ks.split(",")):
        for where, pool in pools.items():
            dev_s, wall_s = timed(be, pool, k, a.hidden, a.calls)
            rows.append({"where": where, "experts": k, "device_s": dev_s, "wall_s": wall_s,
                         "device_gbps": k * expert_bytes / dev_s / 1e9,
                         "wall_gbps": k * expert_bytes / wall_s / 1e9})
    doc = {"source": "bench/cuda_mapped_experts.py", "device": be.device.name, "fmt": a.fmt,
           "hidden": a.hidden, "width": a.width, "expert_bytes": expert_bytes, "bits_equal": same,
           "h2d_pinned_gbps": h2d_gbps(be, 8 * expert_bytes), "rows": rows}
    be.close()
    print(f"{doc['device']}: {a.fmt} experts [{a.width}x{a.hidden}], {expert_bytes / 1e6:.2f} MB each; "
          f"mapped == VRAM bits: {same}; pinned H2D memcpy {doc['h2d_pinned_gbps']:.1f} GB/s")
    print(f"{'where':>7} {'k':>3} {'device us':>10} {'wall us':>9} {'dev GB/s':>9} {'wall GB/s':>10}")
    for r in rows:
        print(f"{r['where']:>7} {r['experts']:>3} {r['device_s'] * 1e6:10.1f} {r['wall_s'] * 1e6:9.1f} "
              f"{r['device_gbps']:9.1f} {r['wall_gbps']:10.1f}")
    if a.out:
        atomic_write_text(a.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
