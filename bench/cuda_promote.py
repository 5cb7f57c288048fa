"""Promotion (engine/promote.py) on a CUDA GPU: VRAM holds another prompt's hot half, the rest is mapped.

For a pack: the heat of a decode after prompt A (every expert in VRAM), then a placement as a plan made from
that heat would hold it (per MoE layer the ``--vram-share`` hottest experts in VRAM, the rest in mapped
pinned host memory that the GPU computes: ``compute.ram_pinned``), then the timed decode after prompt B
(random ids, as llama-bench's tg feeds), with the promoter off (the plan's tiers) and on, in ``--pairs``
counterbalanced pairs. Prints tok/s, the share of selections served from VRAM, exchanges and their
seconds, and whether both decodes chose the same argmax tokens; writes JSON.

    python3 bench/cuda_promote.py --pack /tmp/fx --tokens 64 --pairs 2 --out promote.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import numpy as np


def _model(pack, be, placement, recorder, context: int):
    from colibri_plan.backends import get_backend
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.residency import ResidencyManager

    cpu = get_backend("numpy").open(0)
    rm = ResidencyManager(pack, placement, cpu, devices={"cuda:0": be})
    return Model(pack, experts=rm, recorder=recorder, trunk_backend=be, context_tokens=context), rm, cpu


def decode(pack, be, placement, prompt: list[int], ids: list[int], promote: bool, recorder=None) -> dict:
    """Prefill ``prompt``, then one decode step per id of ``ids`` (timed): {"tok_s", "uses", "swaps",
    "swap_s", "tokens" (argmax of each step)}; ``promote`` sets engine/promote.py's switch."""
    from colibri_plan.engine.promote import ENV

    os.environ[ENV] = "1" if promote else "0"
    model, rm, cpu = _model(pack, be, placement, recorder, len(prompt) + len(ids) + 1)
    try:
        with model:
            cache = model.new_cache()
            model.trunk.last_logits(np.array(prompt), cache)
            rm.reset_stats()
            toks, t0 = [], time.perf_counter()
            for t in ids:
                toks.append(int(np.argmax(model.trunk.last_logits(np.array([t]), cache))))
            seconds = time.perf_counter() - t0
            g = model.trunk._step_graph
            p = g.promoter if g is not None else None
            return {"tok_s": len(ids) / seconds, "uses": dict(rm.stats.uses), "swaps": p.swaps if p else 0,
                    "swap_s": p.swap_s if p else 0.0, "tokens": toks,
                    "graph_off": model.trunk.graph_off}
    finally:
        rm.close()
        cpu.close()


def placement_from(counts: np.ndarray, layers, n_experts: int, vram_share: float, pick: str = "hot"):
    """Per MoE layer the round(vram_share * E) most (``pick`` "hot") or least ("cold": the worst plan)
    selected experts of ``counts`` [L, E] in VRAM on cuda:0, the rest in mapped pinned memory that cuda:0
    computes."""
    from colibri_plan.engine.placement import LayerPlacement, Placement

    n_vram = max(1, min(n_experts - 1, round(vram_share * n_experts)))
    out = {}
    for r, layer in enumerate(layers):
        order = np.argsort(-counts[r] if pick == "hot" else counts[r], kind="stable")
        hot = order[:n_vram].tolist()
        rest = [e for e in range(n_experts) if e not in hot]
        out[layer] = LayerPlacement(vram={"cuda:0": hot}, ram_pinned=rest)
    return Placement(out, compute={"ram_pinned": "cuda:0"})


def run(pack_path: str, tokens: int, pairs: int, vram_share: float, be, pick: str = "hot") -> dict:
    from colibri_plan.engine.moe import RoutingRecorder
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.placement import Placement

    with open_pack(pack_path) as pack:
        a = pack.arch
        r_a, r_b = random.Random(2), random.Random(1)
        prompt_a = [r_a.randrange(2, a.vocab_size) for _ in range(16)]
        prompt_b = [r_b.randrange(2, a.vocab_size) for _ in range(16)]
        ids_a = [r_a.randrange(2, a.vocab_size) for _ in range(tokens)]
        ids_b = [r_b.randrange(2, a.vocab_size) for _ in range(tokens)]
        rec = RoutingRecorder(a)
        every = Placement.all_resident(a.moe_layers, a.n_experts, "cuda:0")
        decode(pack, be, every, prompt_a, ids_a, False, rec)
        placement = placement_from(rec.counts, a.moe_layers, a.n_experts, vram_share, pick)
        runs: dict = {"off": [], "on": []}
        for i in range(pairs):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                runs[mode].append(decode(pack, be, placement, prompt_b, ids_b, mode == "on"))
    doc = {"source": "bench/cuda_promote.py", "pack": str(pack_path), "tokens": tokens, "pairs": pairs,
           "vram_share": vram_share, "pick": pick, "device": getattr(be, "device", None) and str(be.device),
           "heat": "16-token prompt A (seed 2) + random ids, every expert in VRAM",
           "timed": "16-token prompt B (seed 1) + random ids, the heat's hottest share in VRAM, rest mapped"}
    for mode, rs in runs.items():
        uses = rs[-1]["uses"]
        doc[mode] = {"tok_s": [r["tok_s"] for r in rs],
                     "tok_s_median": statistics.median(r["tok_s"] for r in rs),
                     "vram_share_of_selections": uses.get("vram", 0) / max(1, sum(uses.values())),
                     "uses": uses, "swaps": [r["swaps"] for r in rs], "swap_s": [r["swap_s"] for r in rs],
                     "graph_off": rs[-1]["graph_off"]}
    doc["same_tokens"] = all(r["tokens"] == runs["off"][0]["tokens"] for rs in runs.values() for r in rs)
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--vram-share", type=float, default=0.5, help="experts of a layer in VRAM")
    ap.add_argument("--pick", choices=("hot", "cold"), default="hot",
                    help="VRAM holds the heat's hottest share (as a plan would) or its coldest (the worst)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from colibri_plan.backends import get_backend

    be = get_backend("cuda").open(0)
    try:
        doc = run(a.pack, a.tokens, a.pairs, a.vram_share, be, a.pick)
    finally:
        be.close()
    print(f"{'promoter':>8}  {'decode tok/s (runs)':>28}  {'from VRAM':>9}  {'exchanges':>9}  {'their s':>8}")
    for mode in ("off", "on"):
        d = doc[mode]
        runs = " ".join(f"{x:.1f}" for x in d["tok_s"])
        print(f"{mode:>8}  {d['tok_s_median']:>8.1f} ({runs:>17})  {d['vram_share_of_selections']:>9.3f}  "
              f"{d['swaps'][-1]:>9}  {d['swap_s'][-1]:>8.4f}")
    print(f"same tokens: {doc['same_tokens']}")
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
