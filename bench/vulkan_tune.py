"""Vulkan work-group shapes for the batched expert FFN: invocations per workgroup x rows per workgroup.

Times ``expert_ffn`` (8 experts, GLM-5.2 shapes H=6144, I=2048, 1 token each, int4 by default) for each
(WG, ROWS) pair of the Vulkan backend and prints weight GB/s per pair, best first, so the module's
defaults (``WG``, ``ROWS`` in ``colibri_plan/backends/vulkan.py``) can be set from a measurement on the
target GPU. The 8 experts (~151 MB at int4) exceed an H200's 50 MB L2, so figures are HBM-bound, not
cache-bound. Wall time per call includes the host's share (the same for every pair); device time comes
from timestamps around each call's commands.

    python bench/vulkan_tune.py [--fmt int4] [--calls 50] [--repeats 5] [--out /tmp/vulkan_tune.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.vulkan import util as vkmod

H, I, E = 6144, 2048, 8  # GLM-5.2 hidden size, routed expert width, top-k
PAIRS = [(32, 1), (32, 2), (64, 1), (64, 2), (64, 4), (64, 8), (128, 2), (128, 4), (128, 8), (256, 4)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fmt", default="int4")
    p.add_argument("--calls", type=int, default=50, help="expert_ffn calls per timed pass")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    cls = get_backend("vulkan")
    reason = cls.unavailable_reason()
    if reason:
        print(f"vulkan unavailable: {reason}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    qts = [[quant.quantize(rng.standard_normal(s, dtype=np.float32) / np.float32(s[1] ** 0.5), args.fmt)
            for s in ((I, H), (I, H), (H, I))] for _ in range(E)]
    xs = [rng.standard_normal((1, H), dtype=np.float32) for _ in range(E)]
    ebytes = sum(q.nbytes for e in qts for q in e)
    rows, ref = [], None
    for wg, nrows in PAIRS:
        vkmod.WG, vkmod.ROWS = wg, nrows
        with cls.open(args.device) as be:
            experts = [be.upload_expert(*e) for e in qts]
            ys = be.expert_ffn(xs, experts)  # warm-up: pipelines and the recorded command buffer
            ref = ys if ref is None else ref
            err = max(float(np.abs(y - r).max() / np.abs(r).max()) for y, r in zip(ys, ref))
            passes, gpu = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    be.expert_ffn(xs, experts)
                    gpu.append(be.last_gpu_seconds() or float("nan"))
                passes.append((time.perf_counter() - t0) / args.calls)
            s, g = float(np.median(passes)), float(np.median(gpu))
            rows.append({"wg": wg, "rows": nrows, "seconds": s, "weight_gbps": ebytes / s / 1e9,
                         "gpu_seconds": g, "gpu_weight_gbps": ebytes / g / 1e9,
                         "max_rel_diff_vs_first": err, "device": be.device.name})
            print(f"WG={wg:4} ROWS={nrows}: {s * 1e6:8.1f} us ({g * 1e6:8.1f} us on the device)",
                  file=sys.stderr)
    rows.sort(key=lambda r: r["seconds"])
    print(f"{'WG':>4} {'ROWS':>4} {'us/call':>9} {'GB/s':>8} {'device us':>10} {'device GB/s':>12}"
          f"  ({args.fmt}, {E} experts, H={H}, I={I}, T=1)")
    for r in rows:
        print(f"{r['wg']:>4} {r['rows']:>4} {r['seconds'] * 1e6:9.1f} {r['weight_gbps']:8.1f} "
              f"{r['gpu_seconds'] * 1e6:10.1f} {r['gpu_weight_gbps']:12.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"fmt": args.fmt, "weight_bytes": ebytes, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
