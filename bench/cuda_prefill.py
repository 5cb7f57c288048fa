"""Prefill on a CUDA device trunk against the CPU trunk: time to first token of a P-token prompt.

Builds (once, in ``--work``) an int8 fixture with a real trunk (bench/h200_trunk.py's widths: hidden
2048, 32 heads of 128, 4 kv heads, expert width 768, top-8) and runs the same greedy generation four ways:

- ``cpu``: the CPU trunk, experts from RAM on the cpu backend (the engine's verify reference);
- ``device``: trunk, attention and KV on cuda:0, every expert in VRAM on cuda:0; the prefill's routed
  experts on the device x (``d_expert_ffn_rows``), T > 1 matmuls on the tensor-core kernels;
- ``device-gemv``: the same with T > 1 on the GEMV kernels (``_TC_FORMATS`` emptied: the kernels before);
- ``device-host-experts``: the same with the prefill's experts through the residency manager's host
  path (x down, each expert's batch staged up and down: the engine before ``d_expert_ffn_rows``).

Per way: ``prefill_s`` (step 0 of ``generate``: the prompt's forward and its last logits; the median of
``--repeats`` runs after one warm-up), ``decode_s_per_token`` (median of the later steps) and the
tokens, which must equal the CPU trunk's. Prints a table; ``--out`` writes JSON.

    python3 -P bench/cuda_prefill.py --work /tmp/prefill-work --prompt 128 --out /tmp/prefill.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from colibri_plan.fileio import atomic_write_text


def _fixture(args) -> str:
    from pathlib import Path

    from colibri_plan.engine.fixture import FixtureConfig, build_fixture

    path = Path(args.work) / "fixture"
    if not (path / "pack.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        cfg = FixtureConfig(layers=args.layers, experts=args.experts, top_k=8, hidden=args.hidden,
                            width=args.width, vocab=args.vocab, heads=32, kv_heads=4, head_dim=128,
                            quant="int8", dense_format="int8")
        build_fixture(path, cfg)
    return str(path)


def _generate(model, prompt, n_tokens: int) -> tuple[list[int], float, float]:
    steps: list[float] = []
    tokens = model.generate(prompt, n_tokens, on_token=lambda step, tok, s: steps.append(s))
    return tokens, steps[0], float(np.median(steps[1:])) if len(steps) > 1 else 0.0


def run_way(way: str, pack, prompt, args) -> dict:
    from colibri_plan.backends import get_backend
    from colibri_plan.backends.cuda import launch as cuda_mod
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.placement import LayerPlacement, Placement
    from colibri_plan.engine.residency import ResidencyManager

    saved = cuda_mod._TC_FORMATS
    runs = []
    if way == "cpu":
        with Model(pack, backend_name="cpu") as model:
            for _ in range(args.repeats + 1):
                runs.append(_generate(model, prompt, args.tokens))
    else:
        be, cpu = get_backend("cuda").open(0), get_backend("cpu").open(0)
        if way == "device-gemv":
            cuda_mod._TC_FORMATS = frozenset()
        if way == "device-host-experts":
            be.d_expert_ffn_rows = None  # the trunk then takes the host path at T > 1
        a = pack.arch
        placement = Placement({l: LayerPlacement(vram={"cuda:0": list(range(a.n_experts))})
                               for l in a.moe_layers})
        rm = ResidencyManager(pack, placement, cpu, devices={"cuda:0": be})
        try:
            with Model(pack, experts=rm, trunk_backend=be,
                       context_tokens=len(prompt) + args.tokens) as model:
                for _ in range(args.repeats + 1):
                    runs.append(_generate(model, prompt, args.tokens))
        finally:
            cuda_mod._TC_FORMATS = saved
            rm.close()
            be.close()
            cpu.close()
    runs = runs[1:]  # the first compiles kernels and warms caches
    return {"way": way, "tokens": runs[0][0], "prefill_s": float(np.median([r[1] for r in runs])),
            "prefill_runs_s": [r[1] for r in runs],
            "decode_s_per_token": float(np.median([r[2] for r in runs]))}


def _at_least_1(text: str) -> int:
    """A count argument: a whole number >= 1 (argparse reports anything else as a usage error)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/cuda-prefill-work", help="where the fixture is built (kept)")
    p.add_argument("--layers", type=_at_least_1, default=8)
    p.add_argument("--experts", type=_at_least_1, default=32)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=_at_least_1, default=128, help="prompt tokens")
    p.add_argument("--tokens", type=_at_least_1, default=8, help="greedy tokens (the first: the prefill's)")
    p.add_argument("--repeats", type=_at_least_1, default=3)
    p.add_argument("--ways", default="cpu,device,device-gemv,device-host-experts")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from colibri_plan.engine.fixture import fixture_prompt
    from colibri_plan.engine.pack import open_pack

    t0 = time.perf_counter()
    folder = _fixture(args)
    build_s = time.perf_counter() - t0
    prompt = [int(t) for t in fixture_prompt(args.vocab, args.prompt, seed=0)]
    rows = []
    with open_pack(folder) as pack:
        for way in args.ways.split(","):
            rows.append(run_way(way, pack, prompt, args))
            r = rows[-1]
            print(f"{way:20} prefill {r['prefill_s'] * 1e3:9.1f} ms ({args.prompt} tokens)  decode "
                  f"{r['decode_s_per_token'] * 1e3:7.2f} ms/token", flush=True)
    ref = next((r for r in rows if r["way"] == "cpu"), None)
    for r in rows:
        r["token_exact"] = None if ref is None else r["tokens"] == ref["tokens"]
        r["prefill_speedup_vs_cpu"] = None if ref is None else ref["prefill_s"] / r["prefill_s"]
    print("token-exact vs cpu:", {r["way"]: r["token_exact"] for r in rows})
    print("prefill speed-up vs cpu:", {r["way"]: round(r["prefill_speedup_vs_cpu"] or 0, 2) for r in rows})
    if args.out:
        atomic_write_text(args.out, json.dumps({"prompt_tokens": args.prompt, "layers": args.layers,
                                                "experts": args.experts, "hidden": args.hidden,
                                                "width": args.width, "fixture_build_s": build_s,
                                                "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
