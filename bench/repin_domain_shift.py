"""Live re-pinning on a domain shift: a static plan vs the same plan with re-pinning (issue #16 B).

The fixture has one recorded routing domain (OLMoE on tulu), so the shift is made the way a new domain
looks to a plan: the pins come from the heat of another "domain" — the same skew laid on another
permutation of the expert ids (the fixture config with another seed, ``target_probabilities``) — while
the pack routes by its own. The plan pins that heat's hottest experts per layer (and streams the rest
through a small LRU); the run decodes ``--tokens`` tokens, and the hit rates of the first and the second
half are reported apart (re-pinning needs a few windows of routing before it has moved the pins).

Each variant runs ``--repeats`` times, interleaved (static, repin, static, repin, ...); the table shows
medians. Tokens must be identical in every run (re-pinning never changes tokens); the script stops
otherwise. Writes JSON to ``bench/results/repin-domain-shift.json`` (``--out``).

    python bench/repin_domain_shift.py [--tokens 64] [--repeats 3] [--pins 8] [--every 8] [--window 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import colibri_plan  # noqa: F401 - before numpy: OpenBLAS idle threads sleep (docs/engine.md)
from colibri_plan.engine.fixture import FixtureConfig, build_fixture, fixture_prompt, target_probabilities
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.repin import RepinPolicy
from colibri_plan.engine.residency import ResidencyManager

ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(layers=3, experts=32, top_k=4)


def shifted_placement(cfg: FixtureConfig, pins: int, slots: int, policy: RepinPolicy | None) -> Placement:
    """Pins = the ``pins`` hottest experts per layer of the *other* domain's heat (seed + 1)."""
    other = target_probabilities(FixtureConfig.small(**{**CONFIG, "seed": cfg.seed + 1}))
    layers = {l: LayerPlacement(ram_pinned=np.argsort(-other[l], kind="stable")[:pins].tolist(),
                                lru_slots=slots) for l in range(cfg.layers)}
    return Placement(layers, repin=policy)


def run_once(pack, placement: Placement, prompt: list[int], n_tokens: int) -> dict:
    """Decode ``n_tokens`` (after the prompt's prefill) and measure each half of the decode apart."""
    from colibri_plan.backends import get_backend

    cpu = get_backend("cpu").open(0) if get_backend("cpu").is_available() else get_backend("numpy").open(0)
    rm = ResidencyManager(pack, placement, cpu, read_threads=4)
    halves: list[dict] = []
    marks = {"t": 0.0, "steps": 0}
    half = n_tokens // 2

    def close_half(now: float) -> None:
        st = rm.reset_stats()
        halves.append({"tok_s": marks["steps"] / (now - marks["t"]) if now > marks["t"] else 0.0,
                       "hit_rate": st.hit_rates(), "lru_hit_rate": st.lru_hit_rate(), "repins": st.repins,
                       "repin_bytes": st.repin_bytes, "repin_s": st.repin_s})
        marks["t"], marks["steps"] = now, 0

    def on_token(step: int, tok: int, seconds: float) -> None:
        now = time.perf_counter()
        if step == 0:
            rm.reset_stats()
            marks["t"] = now
            return
        marks["steps"] += 1
        if step in (half, n_tokens):
            close_half(now)

    try:
        tokens = Model(pack, experts=rm).generate(prompt, n_tokens + 1, on_token=on_token)
    finally:
        rm.close()
        cpu.close()
    return {"tokens": tokens, "first": halves[0], "second": halves[1],
            "repins": halves[0]["repins"] + halves[1]["repins"],
            "repin_bytes": halves[0]["repin_bytes"] + halves[1]["repin_bytes"],
            "repin_s": halves[0]["repin_s"] + halves[1]["repin_s"]}


def bench(fixture: Path, tokens: int, repeats: int, pins: int, slots: int, every: int, window: int) -> dict:
    cfg = FixtureConfig.small(**CONFIG)
    policy = RepinPolicy(enabled=True, every_tokens=every, window_tokens=window)
    prompt = fixture_prompt(cfg.vocab, 16, seed=3)
    runs: dict[str, list[dict]] = {"static": [], "repin": []}
    with open_pack(fixture) as pack:
        for _ in range(repeats):
            for name, pol in (("static", None), ("repin", policy)):
                runs[name].append(run_once(pack, shifted_placement(cfg, pins, slots, pol), prompt, tokens))
    ref = runs["static"][0]["tokens"]
    exact = all(r["tokens"] == ref for rs in runs.values() for r in rs)

    def med(rs, *path):
        vals = []
        for r in rs:
            v = r
            for p in path:
                v = v[p]
            vals.append(v)
        return statistics.median(vals)

    rows = []
    for name, rs in runs.items():
        rows.append({"variant": name, "tok_s": med(rs, "second", "tok_s"),
                     "tok_s_first": med(rs, "first", "tok_s"),
                     "pinned_first": med(rs, "first", "hit_rate", "ram_pinned"),
                     "pinned_second": med(rs, "second", "hit_rate", "ram_pinned"),
                     "disk_second": med(rs, "second", "hit_rate", "disk"),
                     "lru_second": med(rs, "second", "hit_rate", "lru"),
                     "repins": med(rs, "repins"), "repin_bytes": med(rs, "repin_bytes"),
                     "repin_s": med(rs, "repin_s")})
    return {"config": {**CONFIG, "hidden": cfg.hidden, "width": cfg.width, "quant": cfg.quant,
                       "tokens": tokens, "repeats": repeats, "pins_per_layer": pins, "lru_slots": slots,
                       "every_tokens": every, "window_tokens": window, "disk_gbps": policy.disk_gbps},
            "token_exact": exact, "rows": rows, "runs": runs}


def table(result: dict) -> str:
    head = ("| variant | tok/s (2nd half) | tok/s (1st half) | pinned hit 1st | pinned hit 2nd | disk 2nd | "
            "re-pins | re-pin MB | re-pin s |")
    lines = [head, "|" + "---|" * 9]
    for r in result["rows"]:
        lines.append(f"| {r['variant']} | {r['tok_s']:.1f} | {r['tok_s_first']:.1f} | "
                     f"{r['pinned_first']:.3f} | "
                     f"{r['pinned_second']:.3f} | {r['disk_second']:.3f} | {r['repins']:.0f} | "
                     f"{r['repin_bytes'] / 1e6:.2f} | {r['repin_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pins", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--every", type=int, default=8)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "repin-domain-shift.json"))
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=str(ROOT)) as tmp:   # on the repo's disk: O_DIRECT works there
        fx = Path(tmp) / "fx"
        build_fixture(fx, FixtureConfig.small(**CONFIG))
        result = bench(fx, a.tokens, a.repeats, a.pins, a.slots, a.every, a.window)
    print(table(result))
    print(f"token-exact: {result['token_exact']}")
    out = {k: v for k, v in result.items() if k != "runs"}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if result["token_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
