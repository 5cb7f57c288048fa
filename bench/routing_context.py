"""Does a decode's prompt decide which experts it selects? Heat of one prompt against a decode after another.

Runs our engine (``--backend``, every expert resident) on a pack three times, each a ``--depth``-token
prompt then random-id decode steps (llama-bench's ``tg`` kind of input), recording the decode's routing:

- ``bench``: the peer bench's own prompt and decode ids (bench/peer_llamacpp_gpu.py ``bench_prompts``,
  random.Random(1), ``--decode`` steps): the traffic a plan is judged on;
- ``same_prompt``: the bench's prompt, other decode ids (seed 3, ``--tokens`` steps);
- ``other_prompt``: another prompt and other ids (seed 2, ``--tokens`` steps; ``peer_llamacpp_gpu.py heat
  --context other``, the heat of runs r3-r5).

Per MoE layer it prints the share of the bench decode's selections that fall on the hottest half of the
experts of each heat (what a plan pinning that half in VRAM would serve from VRAM), then replays the bench
decode's routing through engine/promote.py's MappedPromoter from the other prompt's half (the share it
would serve from VRAM, and its exchanges), and writes JSON.

    .venv/bin/python bench/routing_context.py --pack /tmp/hx/pack-int8 --backend cpu --out ctx.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_llamacpp_gpu import bench_prompts  # noqa: E402


def decode_routing(pack: str, backend: str, prompt: list[int], ids: list[int]
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The prompt's selections per (MoE layer, expert), float [L, E], and the top-k ids of each decode step
    of ``ids`` after it, int64 [L, len(ids), K]."""
    from colibri_plan.engine import runner
    from colibri_plan.engine.moe import RoutingRecorder
    from colibri_plan.engine.session import EngineSession

    weights = runner.open_weights(pack, None)
    rec, ctx = RoutingRecorder(weights.arch), len(prompt) + len(ids) + 1
    s = EngineSession(weights, runner.placement_for(weights, None, backend, 0), cpu_backend="cpu",
                      trunk=runner.trunk_placement(weights, None, None, backend, 0), context_tokens=ctx,
                      recorder=rec)
    with s:
        cache = s.model.new_cache(ctx)
        s.model._last_logits(prompt, cache)
        prompt_counts = rec.counts.astype(float)
        rec.reset()  # the decode's routing alone
        for t in ids:
            np.asarray(s.model._last_logits([t], cache))
    return prompt_counts, np.stack([rec.topk_ids(layer) for layer in rec.layers])


def counts_of(steps: np.ndarray, n_experts: int) -> np.ndarray:
    """Selections per (layer, expert) of top-k ids [L, T, K]: float [L, E]."""
    return np.stack([np.bincount(x.ravel(), minlength=n_experts) for x in steps]).astype(float)


def promoted_share(heat: np.ndarray, prompt_counts: np.ndarray, steps: np.ndarray
                   ) -> tuple[float, float, int]:
    """Replay of the decode ``steps`` [L, T, K] with VRAM holding each layer's hottest half of ``heat``
    [L, E], the rest mapped: (VRAM share of its selections with the tiers held, with engine/promote.py's
    MappedPromoter run on them as a decode runs it, exchanges made). The promoter sees the prompt's
    routing first; each token is served by the tiers as they were, then counted, then a round may run."""
    from types import SimpleNamespace as NS

    from colibri_plan.engine.promote import MappedPromoter

    L, E = heat.shape
    hot = np.argsort(-heat, axis=1, kind="stable")[:, : E // 2]
    vram = [set(h.tolist()) for h in hot]

    class RM:  # the residency manager's side of the promoter, over the sets above
        pack = NS(arch=NS(moe_layers=list(range(L)), n_experts=E, top_k=steps.shape[2]))
        observers: list = []

        def tiers_on(self, be, layer):
            return sorted(vram[layer]), sorted(set(range(E)) - vram[layer])

        def held_weights(self, layer, e):
            return (NS(nbytes=1),) * 3

        def swap_tiers(self, layer, h, c):
            vram[layer].discard(c)
            vram[layer].add(h)

    be = NS(d_expert_exchange=lambda *a: None)
    p = MappedPromoter(RM(), be, "cuda:0", {i: NS(absent=0) for i in range(L)})
    for i in range(L):
        nz = np.flatnonzero(prompt_counts[i])
        p.observe(i, nz, prompt_counts[i][nz])
    static = sum(int(np.isin(steps[i], hot[i]).sum()) for i in range(L)) / steps.size
    served = 0
    for t in range(steps.shape[1]):
        for i in range(L):
            served += sum(int(e) in vram[i] for e in steps[i, t])
            p.observe(i, steps[i, t])
        p.step()
    return static, served / steps.size, p.swaps


def hot_half_share(heat: np.ndarray, test: np.ndarray) -> np.ndarray:
    """Per layer, the share of ``test``'s selections on the ``E // 2`` experts ``heat`` selects most: [L]."""
    hot = np.argsort(-heat, axis=1, kind="stable")[:, : heat.shape[1] // 2]  # [L, E/2]
    return np.take_along_axis(test, hot, axis=1).sum(1) / test.sum(1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--depth", type=int, default=16, help="prompt tokens (the bench's --depth)")
    ap.add_argument("--prefill", type=int, default=512, help="the bench's --prefill (its prompt follows it)")
    ap.add_argument("--decode", type=int, default=64, help="the bench's timed decode steps")
    ap.add_argument("--tokens", type=int, default=256, help="decode steps of each heat")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    vocab = json.loads((Path(a.pack) / "pack.json").read_text())["arch"]["vocab_size"]
    rnd = random.Random(1)
    prompt = bench_prompts(rnd, vocab, a.prefill, a.depth)["prompt"]
    bench_ids = [rnd.randrange(2, vocab) for _ in range(a.decode)]
    r3, r2 = random.Random(3), random.Random(2)
    other_prompt = [r2.randrange(2, vocab) for _ in range(a.depth)]
    runs = {"bench": (prompt, bench_ids),
            "same_prompt": (prompt, [r3.randrange(2, vocab) for _ in range(a.tokens)]),
            "other_prompt": (other_prompt, [r2.randrange(2, vocab) for _ in range(a.tokens)])}
    routing = {k: decode_routing(a.pack, a.backend, p, ids) for k, (p, ids) in runs.items()}
    E = json.loads((Path(a.pack) / "pack.json").read_text())["arch"]["n_experts"]
    counts = {k: counts_of(steps, E) for k, (_, steps) in routing.items()}
    same = hot_half_share(counts["same_prompt"], counts["bench"])
    other = hot_half_share(counts["other_prompt"], counts["bench"])
    static, promoted, swaps = promoted_share(counts["other_prompt"], *routing["bench"])
    print(f"{'layer':>5}  {'heat: bench prompt, other ids':>29}  {'heat: another prompt':>20}")
    for i, (x, y) in enumerate(zip(same, other)):
        print(f"{i:>5}  {x:>29.3f}  {y:>20.3f}")
    print(f"{'mean':>5}  {same.mean():>29.3f}  {other.mean():>20.3f}")
    print(f"the bench decode with VRAM holding the other prompt's hot half: {static:.3f} from VRAM with the "
          f"tiers held, {promoted:.3f} with engine/promote.py's exchanges ({swaps} of them)")
    doc = {"source": "bench/routing_context.py", "pack": a.pack, "backend": a.backend, "depth": a.depth,
           "prefill": a.prefill, "decode": a.decode, "tokens": a.tokens,
           "what": "share of the bench decode's selections on each heat's hottest half of the experts",
           "same_prompt_share": same.round(4).tolist(), "other_prompt_share": other.round(4).tolist(),
           "same_prompt_mean": round(float(same.mean()), 4),
           "other_prompt_mean": round(float(other.mean()), 4),
           "other_prompt_plan_vram_share": {"held": round(static, 4), "promoted": round(promoted, 4),
                                            "exchanges": swaps},
           "counts": {k: v.astype(int).tolist() for k, v in counts.items()}}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
