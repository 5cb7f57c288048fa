"""Vulkan device-activation ops (``d_*``, backends/vulkan_device.py): host time per op, wall time per op
in a chain, matmul weight bandwidth and attention KV bandwidth, each checked once against numpy.

The op table and its figures are those of ``bench/opencl_device_ops.py`` (same shapes, same chains; see
its docstring), run on a Vulkan device. For Vulkan, ``host_us`` is the time to record one op into the
open command buffer (nothing is submitted), ``wall_us`` adds the chain's one submission and fence wait
(``synchronize``) shared out over the chain. On a CPU device (lavapipe) the figures say nothing of a GPU.
Descriptors are pushed where the device has VK_KHR_push_descriptor; ``--descriptor-sets`` measures the
fallback (a descriptor set per dispatch) for comparison.

    python bench/vulkan_device_ops.py --device 0 --out /tmp/vulkan_device_ops.json
    python bench/vulkan_device_ops.py --device 0 --descriptor-sets --out /tmp/vulkan_device_ops_sets.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from colibri_plan.backends import get_backend
from colibri_plan.fileio import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from opencl_device_ops import run  # noqa: E402 - the backend-neutral op table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", type=int, default=0, help="Vulkan device index (colibri-plan backends)")
    ap.add_argument("--calls", type=int, default=200, help="calls per chain")
    ap.add_argument("--repeats", type=int, default=5, help="chains per op (the median is reported)")
    ap.add_argument("--pool-bytes", type=int, default=512 << 20, help="matmul weight bytes cycled (> L2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 32768])
    ap.add_argument("--descriptor-sets", action="store_true",
                    help="a descriptor set per dispatch even where the device can push descriptors")
    args = ap.parse_args(argv)
    cls = get_backend("vulkan")
    if cls.unavailable_reason():
        print(f"vulkan unavailable: {cls.unavailable_reason()}", file=sys.stderr)
        return 2
    cls.push_descriptors = not args.descriptor_sets
    with cls.open(args.device) as be:
        rows = run(be, args)
        result = {"device": be.device.name, "kind": be.device.kind, "driver": be.device.driver,
                  "push_descriptors": be._d.push, "ops": rows}
    print(f"{result['device']} ({result['driver']}), descriptors "
          f"{'pushed' if result['push_descriptors'] else 'in sets'}")
    print(f"{'op':<38} {'host us':>8} {'wall us':>8} {'GB/s':>7} {'max err':>9}")
    for r in rows:
        bw = r.get("weight_gbps", r.get("kv_gbps"))
        print(f"{r['op']:<38} {r['host_us']:>8.1f} {r['wall_us']:>8.1f} "
              f"{'' if bw is None else f'{bw:.0f}':>7} "
              f"{'' if 'max_err' not in r else format(r['max_err'], '.1e'):>9}")
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
