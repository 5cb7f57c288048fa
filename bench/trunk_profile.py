"""Where a decode step of the device trunk spends host time: cProfile of ``generate`` on a fixture.

    python bench/trunk_profile.py WORK_DIR [--backend cuda] [--layers 16] [--tokens 24] [--top 40]

Builds (once, in WORK_DIR) a fixture at Qwen3-30B-A3B trunk widths (hidden 2048, 32 heads of 128, 4 kv
heads, int8 trunk and experts, few experts so the build is quick), runs every expert resident on the
backend's device with the trunk there too, and prints the decode terms of the run and the functions with
the most own time (cProfile) over the whole generate call, prefill and load included.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    from colibri_plan.engine.fixture import FixtureConfig, build_fixture, fixture_prompt
    from colibri_plan.engine.runner import generate, open_weights
    from colibri_plan.run_options import RunOptions

    path = Path(args.work) / f"fixture-{args.layers}x{args.experts}"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path / "pack.json").exists():
        cfg = FixtureConfig(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=2048,
                            width=768, vocab=32000, heads=32, kv_heads=4, head_dim=128, quant="int8",
                            dense_format="int8")
        build_fixture(str(path), cfg)
    weights = open_weights(str(path))
    prompt = fixture_prompt(32000, 8)
    generate(weights, prompt, RunOptions(tokens=4, backend=args.backend, trunk="device"))  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    rep = generate(weights, prompt, RunOptions(tokens=args.tokens, backend=args.backend, trunk="device"))
    prof.disable()
    d = rep.to_dict() if hasattr(rep, "to_dict") else vars(rep)
    print({k: d.get(k) for k in ("tok_s", "decode_s_per_token", "terms")})
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
