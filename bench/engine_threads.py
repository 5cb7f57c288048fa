"""Decode time of one plan under the current thread settings: the thread-oversubscription check.

The engine runs dense matmuls through numpy's BLAS and CPU experts through numba's OpenMP pool in the
same process, while a device thread drives the GPU experts. Run this under different environments
(OPENBLAS_NUM_THREADS, OMP_WAIT_POLICY) to see whether the pools fight over the cores:

    python bench/engine_threads.py --model FIXTURE --plan PLAN [--tokens 16] [--repeats 3]

Prints one line (median decode ms/token, CPU expert ms, device ms, dense ms) and the environment.
"""

from __future__ import annotations

import argparse
import os
import statistics

from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import Placement
from colibri_plan.engine.session import run_placement
from colibri_plan.plan import load_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    plan = load_plan(args.plan)
    runs = []
    with open_pack(args.model) as pack:
        for r in range(args.repeats):
            placement = Placement.from_layers(plan.doc["layers"])
            rep = run_placement(pack, placement, [1 + r, 2, 3, 4], args.tokens)
            runs.append(rep)
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    env = {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                                          "NUMBA_NUM_THREADS")}
    print(f"{os.path.basename(args.plan)}: decode {med(lambda r: r.decode_s_median) * 1e3:.1f} ms/token "
          f"(cpu experts {med(lambda r: r.terms['expert_cpu_s']) * 1e3:.1f} ms, devices "
          f"{med(lambda r: sum(r.terms['device_s'].values())) * 1e3:.1f} ms, dense "
          f"{med(lambda r: r.terms['dense_s']) * 1e3:.1f} ms) env {env}")


if __name__ == "__main__":
    main()
