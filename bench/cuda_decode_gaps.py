"""Where a replayed CUDA decode token's wall time goes besides its kernels (issue 25: all in VRAM, 0.84x).

On a CUDA host (not CI): opens ``--pack`` with every expert in VRAM and the trunk on ``cuda:0``, decodes
``--tokens`` random ids after a 16-token prompt (the peer benchmark's decode) and times every step, telling
apart the replayed ones, the eager timed samples (engine/decode_graph.py ``EAGER_EVERY``) and the
captures. Then, on the last captured step at the last position (a row of the cache rewritten, nothing
decoded after): ``--reps`` back-to-back :meth:`CapturedStep.run` (launch, wait, outputs copied: no engine
host work between them) and ``--reps`` launches queued with one wait at the end (the GPU's own time per
graph, launch latency between its kernels included). Their differences split a token's wall time into
engine host work between replays (step - run), the launch and wait round trip (run - queued) and the
graph on the GPU (queued; ``bench/cuda_step_profile.py``'s kernel sum beside it gives the gaps inside).
Prints a table and writes JSON with ``--out``.

    python3 bench/cuda_decode_gaps.py --pack /tmp/h200-llw/pack-int8 --out /tmp/o/gaps.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _us(xs: list[float]) -> dict:
    """Median, min and max of seconds ``xs`` in microseconds, and their count."""
    xs = sorted(xs)
    return {"median_us": statistics.median(xs) * 1e6, "min_us": xs[0] * 1e6, "max_us": xs[-1] * 1e6,
            "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--tokens", type=int, default=192, help="decode steps timed (after a warm 64)")
    ap.add_argument("--reps", type=int, default=200, help="pure replays and queued launches")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import numpy as np

    from colibri_plan.backends import get_backend
    from colibri_plan.engine.decode_graph import _cache_arrays
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.placement import Placement
    from colibri_plan.engine.residency import ResidencyManager

    pack = open_pack(a.pack)
    arch = pack.arch
    gpu, cpu = get_backend("cuda").open(0), get_backend("cpu").open(0)
    rm = ResidencyManager(pack, Placement.all_resident(arch.moe_layers, arch.n_experts, "cuda:0"), cpu,
                          devices={"cuda:0": gpu})
    model = Model(pack, experts=rm, trunk_backend=gpu, context_tokens=a.context)
    rng = np.random.default_rng(2)
    ids = [int(v) for v in rng.integers(2, arch.vocab_size, 64 + a.tokens)]
    cache = model.new_cache(a.context)
    model._last_logits(list(range(2, 18)), cache)
    for t in ids[:64]:  # warm: compiles, first captures
        model._last_logits([t], cache)
    g = model.trunk._step_graph
    if g is None:
        raise SystemExit(f"no captured decode step: {model.trunk.graph_off}")
    kinds: dict[str, list[float]] = {"replay": [], "eager": [], "capture": []}
    argmax_s = []
    for t in ids[64:]:
        s0, c0 = g._sampled, g.captures
        t0 = time.perf_counter()
        logits = model._last_logits([t], cache)
        t1 = time.perf_counter()
        int(np.argmax(logits))
        argmax_s.append(time.perf_counter() - t1)
        kind = "capture" if g.captures > c0 else "eager" if g._sampled > s0 else "replay"
        kinds[kind].append(t1 - t0)
    cg = list(g._graphs.values())[-1]  # the most recent capture: the one the last replays used
    x = np.asarray(model.dense["embed"][ids[-1]], np.float32)
    pos, slots = cache.length - 1, _cache_arrays(cache)
    run_s = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        cg.run(x, pos, slots)
        run_s.append(time.perf_counter() - t0)
    cg.stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.reps):
        cg.graph.launch(stream=cg.stream)
    cg.stream.synchronize()
    queued_us = (time.perf_counter() - t0) / a.reps * 1e6
    doc = {"source": "bench/cuda_decode_gaps.py", "pack": a.pack, "layers": arch.n_layers,
           "eager_every": g.eager_every,  # the one in force (COLIBRI_EAGER_EVERY or the default)
           "steps": {k: _us(v) for k, v in kinds.items() if v},
           "argmax": _us(argmax_s), "run": _us(run_s), "queued_us_per_graph": queued_us,
           "mean_step_us": sum(sum(v) for v in kinds.values()) / a.tokens * 1e6}
    rep, run = doc["steps"]["replay"]["median_us"], doc["run"]["median_us"]
    doc["split_us"] = {"engine_host_between_replays": rep - run, "launch_wait_copy": run - queued_us,
                       "graph_on_gpu": queued_us, "argmax": doc["argmax"]["median_us"]}
    print(f"{'part':34} {'us/token':>10}")
    for k, v in doc["split_us"].items():
        print(f"{k:34} {v:10.1f}")
    for k, v in doc["steps"].items():
        print(f"step {k:29} {v['median_us']:10.1f}  (n {v['n']}, {v['min_us']:.0f}..{v['max_us']:.0f})")
    mean = doc["mean_step_us"]
    print(f"{'mean step (all kinds)':34} {mean:10.1f}  -> {1e6 / mean:.1f} tok/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
