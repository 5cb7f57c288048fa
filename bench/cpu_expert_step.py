"""One decode step's routed experts on the ``cpu`` backend: ``expert_ffn_sum`` of 8 experts out of 32 a
layer, every layer of a pool larger than the last-level cache (so each step streams its experts from
RAM, as a decode token does), per format and expert width, before/after source trees interleaved.

Each (round, root) runs in a fresh process (``--roots NAME=DIR``: the package imported from DIR, as
``cpu_decode_overhead.py`` does). Per format it uploads ``--layers`` x 32 experts of random weights
(hidden 2048, width ``--width``), draws 64 steps of 8 distinct experts a layer, and times ``--repeats``
passes over them; the gate+up and down kernel calls are timed apart (the backend's parallel call
wrapped). GB/s = packed expert bytes (data + scales) a step / seconds a step. A checksum of one step's
output shows whether two roots give the same numbers.

    .venv/bin/python bench/cpu_expert_step.py [--formats int8,int4-g32h] [--width 1024] [--rounds 2]
        [--roots before=/tmp/before after=.] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN, EXPERTS, TOP_K, STEPS = 2048, 32, 8, 64


def worker(root: str, fmts: list[str], width: int, layers: int, repeats: int) -> dict:
    """One process: {fmt: {step_ms, gbps, kernel_ms, checksum, ...}} for the tree at ``root``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_decode_overhead import _use_root

    _use_root(root)
    import numpy as np

    from colibri_plan import quant
    from colibri_plan.backends import get_backend
    from colibri_plan.backends.cpu.experts import CpuExperts
    from colibri_plan.backends.handles import ExpertWeights

    be = get_backend("cpu").open(0)
    spent: dict[str, float] = {}
    on = [False]
    ce = next(v if isinstance(v, CpuExperts) else v.__self__ for v in vars(be).values()
              if isinstance(v, CpuExperts) or isinstance(getattr(v, "__self__", None), CpuExperts))
    par = ce._par

    def timed_par(steps, kernel, *args, chunks=64):
        t0 = time.perf_counter()
        par(steps, kernel, *args, chunks=chunks)
        if on[0]:
            name = getattr(kernel, "__name__", str(kernel))
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    ce._par = timed_par
    rng = np.random.default_rng(0)
    out = {}
    for fmt in fmts:
        base = [quant.quantize(rng.standard_normal(s, dtype=np.float32), fmt)
                for s in ((width, HIDDEN), (width, HIDDEN), (HIDDEN, width))]

        def upload(q):  # every expert its own memory
            s = None if q.scales is None else q.scales.copy()
            return be.upload(quant.QuantTensor(q.fmt, q.out_features, q.in_features, q.data.copy(), s))

        pool = [[ExpertWeights(*(upload(q) for q in base)) for _ in range(EXPERTS)] for _ in range(layers)]
        step_bytes = sum(q.nbytes for q in base) * TOP_K * layers
        x = rng.standard_normal((1, HIDDEN), dtype=np.float32)
        gates = np.full(TOP_K, 1.0 / TOP_K, np.float32)
        picks = [[rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(layers)] for _ in range(STEPS)]
        for li in range(layers):  # compile / warm
            be.expert_ffn_sum(x, [pool[li][i] for i in picks[0][li]], gates)
        passes = []
        spent.clear()
        on[0] = True
        for _ in range(repeats):
            t0 = time.perf_counter()
            for p in picks:
                for li in range(layers):
                    be.expert_ffn_sum(x, [pool[li][i] for i in p[li]], gates)
            passes.append((time.perf_counter() - t0) / STEPS)
        on[0] = False
        y = be.expert_ffn_sum(x, [pool[0][i] for i in range(TOP_K)], gates)
        t = statistics.median(passes)
        out[fmt] = {"step_ms": t * 1e3, "step_ms_runs": [s * 1e3 for s in passes],
                    "gbps": step_bytes / t / 1e9, "step_bytes": step_bytes,
                    "kernel_ms": {k: v / repeats / STEPS * 1e3 for k, v in spent.items()},
                    "checksum": float(np.abs(y.astype(np.float64)).sum())}
        for ly in pool:
            for e in ly:
                for w in e:
                    be.free(w)
    be.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,int4-g32h")
    ap.add_argument("--width", type=int, default=1024, help="expert width (peer checkpoint: 1024)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--roots", nargs="*", default=None, help="NAME=DIR source trees, interleaved")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    fmts = a.formats.split(",")
    if a.worker:
        print(json.dumps(worker(a.worker, fmts, a.width, a.layers, a.repeats)))
        return
    roots = dict(r.split("=", 1) for r in (a.roots or ["this=."]))
    env = {**os.environ, "NUMBA_NUM_THREADS": str(a.threads)}
    load0 = os.getloadavg()
    runs: dict[str, list] = {n: [] for n in roots}
    for rnd in range(a.rounds):
        order = list(roots) if rnd % 2 == 0 else list(roots)[::-1]  # counterbalanced
        for name in order:
            cmd = [sys.executable, __file__, "--worker", roots[name], "--formats", a.formats, "--width",
                   str(a.width), "--layers", str(a.layers), "--repeats", str(a.repeats)]
            r = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
                           .stdout.strip().splitlines()[-1])
            runs[name].append(r)
            print(name, {f: f"{v['step_ms']:.2f} ms {v['gbps']:.1f} GB/s" for f, v in r.items()}, flush=True)
    summary = {n: {f: {"step_ms_median": statistics.median(r[f]["step_ms"] for r in rs),
                       "gbps_median": statistics.median(r[f]["gbps"] for r in rs),
                       "checksums": sorted({r[f]["checksum"] for r in rs})} for f in fmts}
               for n, rs in runs.items()}
    print(json.dumps(summary, indent=1))
    if a.out:
        doc = {"kind": "cpu-expert-step", "command": " ".join(sys.argv), "cpus": os.cpu_count(),
               "load_before_after": [load0[0], os.getloadavg()[0]], "hidden": HIDDEN, "experts": EXPERTS,
               "top_k": TOP_K, "args": vars(a), "summary": summary, "runs": runs}
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
