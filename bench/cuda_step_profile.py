"""Where a CUDA decode step's GPU time goes: every kernel of a replayed (or op-by-op) step, by name.

On a CUDA host (not CI): opens a pack (``--pack``, e.g. bench/h200_trunk.py's fixture) with every expert in
VRAM and the trunk on ``cuda:0``, decodes ``--warm`` tokens, then records ``--tokens`` decode steps with
torch's profiler (CUPTI sees every kernel of the process, CuPy's included) and prints, per kernel name,
launches per token, GPU microseconds per token and the share of the step; plus the wall time per token and
the sum of kernel times (their difference: gaps between kernels, i.e. launch latency and host work).
``COLIBRI_CUDA_GRAPH=0`` in the environment profiles the op-by-op step instead. ``--plan PLAN`` takes the
placement of a plan (experts on the host too: a hybrid step) and ``--host-profile N`` also prints the N
host functions with the most own time over the recorded steps (cProfile). ``--prefill N`` also profiles
one warm prefill of N random token ids on a fresh cache (its own table, ``prefill`` in the JSON);
``--att-min-keys K`` / ``--att-captured MODE`` set backends/cuda/device.py's _ATT_MIN_KEYS / _ATT_CAPTURED
(attention slices) for an A/B of the decode attention split; ``--no-prologue`` runs each GQA layer's
q/k norms, RoPE and cache append as the unfused ops (the A/B of ``d_attention_prologue``).
``--mm-args-shape R,U`` sets the int8 dense GEMVs' tile (launch.py _GEMV_TUNE's "mm_args"). First it
times, unprofiled, the peer benchmark's decode (64 tokens after a 16-token prompt, recaptures included:
``decode64_tok_s``). Writes JSON with ``--out``.

    python3 bench/cuda_step_profile.py --pack /tmp/w/fixture --out /tmp/prof.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--host-profile", type=int, default=0)
    ap.add_argument("--prefill", type=int, default=0)
    ap.add_argument("--att-min-keys", type=int, default=0)
    ap.add_argument("--att-captured", choices=("bucket", "fill", "exact"), default=None)
    ap.add_argument("--no-prologue", action="store_true")
    ap.add_argument("--mm-args-shape", default=None, help="R,U of the int8 dense GEMVs (mm_args), an A/B")
    args = ap.parse_args()

    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from colibri_plan.backends import get_backend
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.placement import Placement
    from colibri_plan.engine.residency import ResidencyManager

    if args.att_min_keys:
        from colibri_plan.backends.cuda import device as cuda_device

        cuda_device._ATT_MIN_KEYS = args.att_min_keys
    if args.att_captured:
        from colibri_plan.backends.cuda import device as cuda_device

        cuda_device._ATT_CAPTURED = args.att_captured
    if args.mm_args_shape:
        from colibri_plan.backends.cuda import launch as cuda_launch

        r, u = (int(v) for v in args.mm_args_shape.split(","))
        cuda_launch._GEMV_TUNE["int8"] = {**cuda_launch._GEMV_TUNE["int8"], "mm_args": (r, u)}
    pack = open_pack(args.pack)
    a = pack.arch
    gpu = get_backend("cuda").open(0)
    cpu = get_backend("cpu").open(0)
    if args.plan:
        from colibri_plan.formats.plan import load_plan

        placement = Placement.from_plan(load_plan(args.plan))
    else:
        placement = Placement.all_resident(a.moe_layers, a.n_experts, "cuda:0")
    rm = ResidencyManager(pack, placement, cpu, devices={"cuda:0": gpu})
    model = Model(pack, experts=rm, trunk_backend=gpu, context_tokens=args.context)
    if args.no_prologue:  # before the first decode step: no graph has captured the fused op yet
        model.trunk._prologue, model.trunk.prologue_off = None, "--no-prologue"
    # the peer benchmark's decode: 64 tokens after a 16-token prompt, any recapture included (unprofiled)
    for _rep in range(2):  # the first compiles and captures (graphs are kept: see decode_graph._KEEP)
        c64 = model.new_cache(args.context)
        tok = int(np.argmax(model._last_logits(list(range(2, 18)), c64)))
        t0 = time.perf_counter()
        for _ in range(64):
            tok = int(np.argmax(model._last_logits([tok], c64)))
        decode64_tok_s = 64 / (time.perf_counter() - t0)
    print(f"decode 64 after 16 (unprofiled): {decode64_tok_s:.1f} tok/s")
    cache = model.new_cache(args.context)
    tok = int(np.argmax(model._last_logits([1, 2, 3, 4, 5, 6, 7, 8], cache)))
    for _ in range(args.warm):
        tok = int(np.argmax(model._last_logits([tok], cache)))
    torch.cuda.synchronize()
    if args.host_profile:
        import cProfile
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            tok = int(np.argmax(model._last_logits([tok], cache)))
        print(f"host-profiled: {(time.perf_counter() - t0) / args.tokens * 1e6:.0f} us/token")
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(args.host_profile)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            tok = int(np.argmax(model._last_logits([tok], cache)))
        wall = (time.perf_counter() - t0) / args.tokens
    rows, total, launches = _kernel_table(prof, args.tokens, "token")
    print(f"kernels {launches:.0f} per token, GPU busy {total:.0f} us/token, "
          f"wall {wall * 1e6:.0f} us/token ({1 / wall:.1f} tok/s), graph "
          f"{os.environ.get('COLIBRI_CUDA_GRAPH', '1')}")
    n = args.tokens
    doc = {"source": "bench/cuda_step_profile.py", "pack": args.pack, "layers": a.n_layers,
           "graph": os.environ.get("COLIBRI_CUDA_GRAPH", "1"), "tokens": n, "att_min_keys": args.att_min_keys,
           "att_captured": args.att_captured, "prologue": model.trunk._prologue is not None,
           "decode64_tok_s": decode64_tok_s,
           "wall_us_per_token": wall * 1e6, "kernel_us_per_token": total, "kernels": rows}
    if args.prefill:
        ids = [int(v) for v in np.random.default_rng(5).integers(2, a.vocab_size, args.prefill)]
        model._last_logits(ids, model.new_cache(args.context))  # warm: every T > 1 kernel compiled
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            model._last_logits(ids, model.new_cache(args.context))
            torch.cuda.synchronize()
            pwall = time.perf_counter() - t0
        if args.host_profile:  # where the prefill's host time goes (cProfile, one more call)
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            model._last_logits(ids, model.new_cache(args.context))
            torch.cuda.synchronize()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(args.host_profile)
        prows, ptotal, plaunch = _kernel_table(prof, 1, "prefill")
        print(f"prefill {args.prefill}: kernels {plaunch:.0f}, GPU busy {ptotal / 1e3:.1f} ms, wall "
              f"{pwall * 1e3:.1f} ms ({args.prefill / pwall:.0f} tok/s)")
        doc["prefill"] = {"tokens": args.prefill, "wall_ms": pwall * 1e3, "kernel_ms": ptotal / 1e3,
                          "kernels": prows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    model.close()
    rm.close()


def _kernel_table(prof, n: int, per_what: str) -> tuple[list, float, float]:
    """Print and return the CUDA kernels of a torch profile by name over ``n`` steps: rows (launches and
    GPU microseconds per step), the sum of kernel microseconds per step and launches per step."""
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        d = per[ev.name[:80]]
        d[0] += 1
        d[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    rows = sorted(({"kernel": k, "launches_per_token": c / n, "us_per_token": us / n}
                   for k, (c, us) in per.items()), key=lambda r: -r["us_per_token"])
    total = sum(r["us_per_token"] for r in rows) or 1e-9
    print(f"{'kernel':<60} {'n/' + per_what:>9} {'us/' + per_what:>11} {'share':>6}")
    for r in rows[:40]:
        print(f"{r['kernel'][:60]:<60} {r['launches_per_token']:>9.1f} {r['us_per_token']:>11.1f} "
              f"{r['us_per_token'] / total:>6.1%}")
    return rows, total, sum(r["launches_per_token"] for r in rows)


if __name__ == "__main__":
    main()
