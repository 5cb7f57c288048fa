"""Solver speed and quality at full model scale: GLM-5.2 (19,456 experts) on the published 6x RTX 5090 +
251 GiB host profile, and variants with fewer GPUs / less RAM (experts then stream from disk).

Prints a table (median of --repeats runs: wall and process CPU seconds, certified gap, predicted tok/s,
the hot-first baseline's tok/s) and writes JSON.

    .venv/bin/python bench/solver_scale.py --repeats 3 --out /tmp/solver_scale.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np

from colibri_plan.cli.common import table
from colibri_plan.formats.profile import resolve_profile
from colibri_plan.model import load_model_spec
from colibri_plan.planner.baselines import hot_first
from colibri_plan.planner.make import auto_lru_slots, build_setup
from colibri_plan.planner.solve import evaluate, solve_placement


def cases(setup):
    """(name, problem) variants of the base setup."""
    pr = setup.problem
    yield "6 GPUs, RAM auto (all fits)", pr
    one = dataclasses.replace(pr.res, gpus=pr.res.gpus[:1])
    yield "1 GPU, RAM auto", dataclasses.replace(pr, res=one)
    ram = 120_000_000_000
    two = dataclasses.replace(pr.res, gpus=pr.res.gpus[:2])
    slots = auto_lru_slots(setup.spec, two, ram, pr.weights, pr.probs)
    yield "2 GPUs, 120 GB RAM (streams, LRU)", dataclasses.replace(pr, res=two, ram_budget_bytes=ram,
                                                                  lru_slots=slots)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="/tmp/solver_scale.json")
    args = ap.parse_args()
    profile, _ = resolve_profile("published-6x-rtx5090")
    spec = load_model_spec("glm-5.2")
    setup = build_setup(profile, spec, None)
    rows, out = [], []
    for name, pr in cases(setup):
        walls, cpus, sol = [], [], None
        for _ in range(args.repeats):
            w0, c0 = time.perf_counter(), time.process_time()
            sol = solve_placement(pr)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        base = evaluate(pr, *hot_first(pr))
        rec = {"case": name, "wall_s_median": statistics.median(walls),
               "cpu_s_median": statistics.median(cpus),
               "gap": sol.gap, "tok_s": sol.cost["tok_s"], "hot_first_tok_s": base["tok_s"],
               "disk_experts": int(np.sum(sol.tiers == -2)), "method": sol.method}
        out.append(rec)
        rows.append([name, f"{rec['wall_s_median']:.2f}", f"{rec['cpu_s_median']:.2f}",
                     "n/a" if sol.gap is None else f"{sol.gap * 100:.2f}%", f"{rec['tok_s']:.3f}",
                     f"{rec['hot_first_tok_s']:.3f}", rec["disk_experts"]])
    print(table(rows, ["case", "wall s", "cpu s", "gap", "tok/s", "hot-first tok/s", "disk experts"]))
    with open(args.out, "w") as f:
        json.dump({"model": spec.name, "experts": spec.n_routed_experts, "repeats": args.repeats,
                   "cases": out}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
