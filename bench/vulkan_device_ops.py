"""Vulkan device-activation ops (``d_*``, backends/vulkan_device.py): host time per op, wall time per op
in a chain, matmul weight bandwidth and attention KV bandwidth, each checked once against numpy.

The op table and its figures are those of ``bench/opencl_device_ops.py`` (same shapes, same chains; see
its docstring), run on a Vulkan device. For Vulkan, ``host_us`` is the time to record one op into the
open command buffer (nothing is submitted), ``wall_us`` adds the chain's one submission and fence wait
(``synchronize``) shared out over the chain. On a CPU device (lavapipe) the figures say nothing of a GPU.
Descriptors are pushed where the device has VK_KHR_push_descriptor; ``--descriptor-sets`` measures the
fallback (a descriptor set per dispatch) for comparison.

``--experts N`` adds the routed experts of a decode step (``d_expert_ffn``: N experts of [I, H], on the
device x) against the contract's host path (x down, ``expert_ffn``, the float32 combine, the sum up):
``host_us`` records the op, ``wall_us`` is one call and the ``d_get`` of its result, per call, median of
the repeats; ``weight_gbps`` the experts' weight bytes over ``wall_us``. Experts cycle through a pool
larger than the L2 cache, as the matmul rows do.

    python bench/vulkan_device_ops.py --device 0 --out /tmp/vulkan_device_ops.json
    python bench/vulkan_device_ops.py --device 0 --descriptor-sets --out /tmp/vulkan_device_ops_sets.json
    python bench/vulkan_device_ops.py --device 0 --experts 8 --hidden 6144 --width 2048 --fmt int4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.device_ops import DArray, DeviceOps
from colibri_plan.fileio import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from opencl_device_ops import print_op_table, run  # noqa: E402 - the backend-neutral op table


def expert_rows(be, args) -> list[dict]:
    """``d_expert_ffn`` on the device x vs the contract's host path, one decode token (module docstring)."""
    rng = np.random.default_rng(0)
    H, I, n = args.hidden, args.width, args.experts
    base = [quant.quantize(rng.standard_normal(s, dtype=np.float32) * np.float32(s[1] ** -0.5), args.fmt)
            for s in ((I, H), (I, H), (H, I))]
    ebytes = sum(q.nbytes for q in base)
    pool = [be.upload_expert(*base) for _ in range(max(n, -(-args.pool_bytes // ebytes)))]
    x, gates = rng.standard_normal((1, H), dtype=np.float32), np.full(n, 1.0 / n, np.float32)

    def host_path(dx, batch, g):
        return DArray(dx.shape, DeviceOps._d_expert_ffn(be, dx, batch, g), id(be))

    rows, ys = [], {}
    for name, op in (("d_expert_ffn", be.d_expert_ffn), ("d_expert_ffn host path", host_path)):
        host, wall, k = [], [], 0
        for _ in range(args.repeats):
            dx = be.d_put(x)
            be.synchronize()
            rec, t0 = 0.0, time.perf_counter()
            for _ in range(args.calls):
                batch, k = [pool[(k + j) % len(pool)] for j in range(n)], k + n
                t1 = time.perf_counter()
                y = op(dx, batch, gates)
                rec += time.perf_counter() - t1
                ys[name] = be.d_get(y)
            wall.append((time.perf_counter() - t0) / args.calls)
            host.append(rec / args.calls)
        w_s = float(np.median(wall))
        rows.append({"op": f"{name} {args.fmt} {n}x[{I},{H}]", "host_us": float(np.median(host)) * 1e6,
                     "wall_us": w_s * 1e6, "weight_gbps": n * ebytes / w_s / 1e9})
    ref = ys["d_expert_ffn host path"].astype(np.float64)
    rows[0]["max_err"] = float(np.max(np.abs(ys["d_expert_ffn"] - ref)) / max(np.max(np.abs(ref)), 1e-30))
    for e in pool:
        for w in e:
            be.free(w)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", type=int, default=0, help="Vulkan device index (colibri-plan backends)")
    ap.add_argument("--calls", type=int, default=200, help="calls per chain")
    ap.add_argument("--repeats", type=int, default=5, help="chains per op (the median is reported)")
    ap.add_argument("--pool-bytes", type=int, default=512 << 20, help="matmul weight bytes cycled (> L2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 32768])
    ap.add_argument("--experts", type=int, default=0, help="also time d_expert_ffn of this many experts")
    ap.add_argument("--hidden", type=int, default=4096, help="experts' hidden size H (--experts)")
    ap.add_argument("--width", type=int, default=1536, help="experts' width I (--experts)")
    ap.add_argument("--fmt", default="int4", help="experts' weight format (--experts)")
    ap.add_argument("--experts-only", action="store_true", help="with --experts: skip the op table")
    ap.add_argument("--descriptor-sets", action="store_true",
                    help="a descriptor set per dispatch even where the device can push descriptors")
    args = ap.parse_args(argv)
    cls = get_backend("vulkan")
    if cls.unavailable_reason():
        print(f"vulkan unavailable: {cls.unavailable_reason()}", file=sys.stderr)
        return 2
    cls.push_descriptors = not args.descriptor_sets
    with cls.open(args.device) as be:
        rows = run(be, args) if args.experts == 0 or not args.experts_only else []
        if args.experts:
            rows += expert_rows(be, args)
        result = {"device": be.device.name, "kind": be.device.kind, "driver": be.device.driver,
                  "push_descriptors": be._d.push, "ops": rows}
    print(f"{result['device']} ({result['driver']}), descriptors "
          f"{'pushed' if result['push_descriptors'] else 'in sets'}")
    print_op_table(rows)
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
