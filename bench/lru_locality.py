"""LRU hit rate with temporal locality: the trace model and Che against the engine's measurement.

Issue #16: the cost model priced LRU slots with Che's independent-request approximation, which cannot see
temporal locality. This benchmark runs the engine on a prompt sequence *with* locality and compares, for
the experts that stream (all but the P hottest of each layer, which are pinned), the LRU hit rate

* **measured** by the engine's residency manager (engine/residency.py ``TierStats.lru_hit_rate()``:
  ``uses["lru"] / (uses["lru"] + uses["disk"])``), token by token, with pins and ``S`` LRU slots per layer;
* **predicted, trace model**: stack distances (colibri_plan/planner/cache_model.py) of the routing trace
  a *statistics run* recorded on another prompt sequence of the same kind (written by the same code as
  `run --stats-out` into a heat JSON and read back), through the cost model (``decode_cost`` with
  ``TraceHits``) — the figure a plan solved from that heat predicts;
* **predicted, trace of the same run**: the same model on the measured run's own routing (model fidelity:
  what is left is the admission order inside one call);
* **predicted, Che**: the independent-request approximation from the same heat's counts.

The prompt sequence: topics of a few tokens each, visited in segments of 15–40 tokens, topics recurring
(as a conversation returns to its subjects); every token is one engine forward call (a decode-like call of
one row), so the fixture's router sees the locality of the text. Model: the synthetic fixture (`colibri-plan
model fixture --small`), built in a temporary folder.

    .venv/bin/python bench/lru_locality.py --out bench/results/lru_locality.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from colibri_plan.backends import get_backend
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.moe import RoutingRecorder
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.residency import ResidencyManager
from colibri_plan.engine.runner import write_stats
from colibri_plan.formats.heat import load_heat
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM
from colibri_plan.planner.cache_model import TraceHits, call_unions, stack_distances
from colibri_plan.planner.costmodel import Resources, decode_cost

#: figures that only price time (hit rates do not depend on them)
_RES = Resources(cpu_matmul_gbps=10.0, ram_read_gbps=20.0, disk_read_gbps=2.0)


def topic_stream(vocab: int, n: int, seed: int, topics: int = 6, words: int = 10,
                 segment: tuple[int, int] = (15, 40)) -> list[int]:
    """``n`` token ids: segments of ``segment`` tokens, each drawn from one of ``topics`` fixed sets of
    ``words`` ids (the sets are the same for every seed; the order of topics and tokens depends on it)."""
    sets = np.random.default_rng(12345).permutation(vocab)[:topics * words].reshape(topics, words)
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        t = int(rng.integers(topics))
        out += [int(x) for x in rng.choice(sets[t], int(rng.integers(*segment)))]
    return out[:n]


def run_tokens(pack, placement: Placement, tokens: list[int]):
    """Feed ``tokens`` one forward call each through the engine with ``placement``; returns (TierStats,
    RoutingRecorder)."""
    cpu_cls = get_backend("cpu")
    cpu = cpu_cls.open(0) if cpu_cls.is_available() else get_backend("numpy").open(0)
    rm = ResidencyManager(pack, placement, cpu, read_threads=pack.arch.top_k)
    rec = RoutingRecorder(pack.arch)
    try:
        model = Model(pack, experts=rm, recorder=rec)
        cache = model.new_cache(len(tokens))
        for t in tokens:
            model.hidden_states([t], cache)
        return rm.stats, rec
    finally:
        rm.close()
        cpu.close()


def _same_run_rate(rec, pins: dict, slots: int, n_experts: int) -> float:
    hits = req = 0
    tr = rec.trace()
    for layer in tr.layers:
        members = np.ones(n_experts, dtype=bool)
        members[pins[layer]] = False
        _, _, d = stack_distances(call_unions(tr.rows(layer), tr.steps), members)
        hits += int(np.sum(d < slots))
        req += d.size
    return hits / req if req else 0.0


def _lru_share(cost: dict) -> float:
    h = cost["hit_rate"]
    return h["lru"] / (h["lru"] + h["disk"]) if h["lru"] + h["disk"] > 0 else 0.0


def locality_rows(fixture: Path, slots: list[int], pins: int, tokens: int, work: Path) -> dict:
    """Record a statistics run, then measure and predict each slot count (module docstring)."""
    pack = open_pack(fixture)
    arch = pack.arch
    try:
        stats_tokens = topic_stream(arch.vocab_size, tokens, seed=1)
        run_tokens_ = topic_stream(arch.vocab_size, tokens, seed=2)
        everything = Placement.all_resident(arch.moe_layers, arch.n_experts, None)
        _, rec = run_tokens(pack, everything, stats_tokens)
        heat_path = work / "stats.heat.json"
        write_stats(rec, pack, str(heat_path), None)          # what `run --stats-out` writes
        heat = load_heat(heat_path)
        probs = heat.probabilities()
        rows = list(heat.layers)
        hot = {layer: [int(e) for e in np.argsort(-heat.counts[i], kind="stable")[:pins]]
               for i, layer in enumerate(rows)}
        tiers = np.full(probs.shape, TIER_DISK, dtype=np.int64)
        for i, layer in enumerate(rows):
            tiers[i, hot[layer]] = TIER_RAM
        hits = TraceHits(heat.trace, rows)
        out = []
        for s in slots:
            placement = Placement({layer: LayerPlacement(ram_pinned=hot[layer], lru_slots=int(s))
                                   for layer in arch.moe_layers})
            t0 = time.perf_counter()
            st, rec_b = run_tokens(pack, placement, run_tokens_)
            seconds = time.perf_counter() - t0
            slot_arr = np.full(len(rows), int(s))
            trace_pred = _lru_share(decode_cost(probs, tiers, slot_arr, pack.spec().expert_bytes(), _RES,
                                                trace_hits=hits))
            che_pred = _lru_share(decode_cost(probs, tiers, slot_arr, pack.spec().expert_bytes(), _RES))
            same = _same_run_rate(rec_b, hot, int(s), arch.n_experts)
            measured = st.lru_hit_rate()
            out.append({"slots": int(s), "pinned_per_layer": pins, "measured": measured,
                        "trace_model": trace_pred, "trace_model_same_run": same, "che": che_pred,
                        "trace_error_points": 100 * (trace_pred - measured),
                        "che_error_points": 100 * (che_pred - measured),
                        "lru_uses": st.uses["lru"], "disk_uses": st.uses["disk"], "run_s": seconds})
        return {"model": {"layers": len(arch.moe_layers), "experts": arch.n_experts, "top_k": arch.top_k,
                          "expert_bytes": pack.spec().expert_bytes()},
                "tokens": tokens, "trace_calls": len(heat.trace.steps), "rows": out}
    finally:
        pack.close()


def build(work: Path, experts: int, top_k: int, layers: int) -> Path:
    """The small synthetic fixture in ``work``."""
    out = work / "fixture"
    build_fixture(out, FixtureConfig.small(experts=experts, top_k=top_k, layers=layers), overwrite=True)
    return out


def table(result: dict) -> str:
    head = ["slots", "pinned", "measured %", "trace model %", "trace same run %", "Che %", "trace err pts",
            "Che err pts"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in result["rows"]:
        lines.append(" | ".join([str(r["slots"]), str(r["pinned_per_layer"]), f"{100 * r['measured']:.1f}",
                                 f"{100 * r['trace_model']:.1f}", f"{100 * r['trace_model_same_run']:.1f}",
                                 f"{100 * r['che']:.1f}", f"{r['trace_error_points']:+.1f}",
                                 f"{r['che_error_points']:+.1f}"]))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--pins", type=int, default=8, help="hottest experts pinned per layer")
    ap.add_argument("--slots", default="4,8,16,24,32")
    ap.add_argument("--out", default=None, help="write the JSON here (e.g. bench/results/lru_locality.json)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fixture = build(work, a.experts, a.top_k, a.layers)
        result = locality_rows(fixture, [int(x) for x in a.slots.split(",")], a.pins, a.tokens, work)
    print(table(result))
    worst = max(abs(r["trace_error_points"]) for r in result["rows"])
    print(f"\nworst trace-model error {worst:.1f} points (acceptance: <= 3); Che worst "
          f"{max(abs(r['che_error_points']) for r in result['rows']):.1f} points")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
