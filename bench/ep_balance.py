"""Expert-parallel placement against DeepSeek's eplb: balancedness, cross-node sends and solve time.

Heat: the real OLMoE and Mixtral routing counts (every recorded domain and layer, one row each) and
synthetic GLM-5.2 and DeepSeek-V3 heat (heatsynth, seed 0; decode MoE layers only). Deployments: 8, 16
and 64 GPUs in nodes of 8, with 0, 32 and 64 redundant slots per layer; a deployment with more GPUs than
slots is listed as refused. eplb gets the same GPUs and slots (its extension to uneven slot counts where
the GPUs do not divide the slots, see planner/ep_eplb.py). Prints a table and the acceptance checks of
issue 31, writes JSON.

    .venv/bin/python bench/ep_balance.py --out bench/results/ep_balance.json
    .venv/bin/python bench/ep_balance.py --eplb-reference /path/to/EPLB/eplb.py   # + check the baseline

``--eplb-reference`` runs DeepSeek's own eplb.py (needs torch) on every case with equal slots per GPU
and reports whether it gives the same replica counts and the same per-layer max GPU load as ours.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import numpy as np

from colibri_plan.cli.common import table
from colibri_plan.errors import InputError
from colibri_plan.heatsynth import real_domains, real_heat, synth_heat
from colibri_plan.model import load_model_spec
from colibri_plan.planner.ep import EpTopology, solve_ep
from colibri_plan.planner.ep_cost import EpCostModel, balancedness, gpu_loads
from colibri_plan.planner.ep_eplb import eplb_rebalance

GPUS = (8, 16, 64)
REDUNDANT = (0, 32, 64)
GPUS_PER_NODE = 8


def heats():
    """(name, spec, weight [rows, E], n_group, topk_group) of every heat of the benchmark."""
    for key, cat in (("olmoe", "olmoe-1b-7b"), ("mixtral", "mixtral-8x7b")):
        spec = load_model_spec(cat)
        rows = [real_heat(key, d).probabilities() for d in real_domains(key)]
        yield f"{key} (real counts)", spec, np.concatenate(rows), 1, 1
    for name, groups in (("glm-5.2", (1, 1)), ("deepseek-v3", (8, 4))):
        spec = load_model_spec(name)
        h = synth_heat(spec, seed=0)
        keep = [i for i, layer in enumerate(h.layers) if layer < spec.n_layers]
        yield f"{name} (synthetic)", spec, h.probabilities()[keep], *groups


def run_case(spec, weight, n_group, topk_group, gpus, redundant, reference=None) -> dict:
    nodes = max(1, gpus // GPUS_PER_NODE)
    rec = {"gpus": gpus, "nodes": nodes, "redundant": redundant, "layers": int(weight.shape[0])}
    try:
        topo = EpTopology.make(spec.n_experts, gpus, nodes, redundant)
    except InputError as exc:
        return {**rec, "refused": str(exc)}
    cost = EpCostModel.for_model(spec.hidden_size, spec.moe_intermediate_size, gpus)
    t0 = time.perf_counter()
    eplb_rebalance(weight, topo.n_slots, n_group, nodes, gpus, np.asarray(topo.gpu_slots))
    eplb_s = time.perf_counter() - t0
    sol = solve_ep(weight, topo, cost, top_k=spec.top_k, n_group=n_group, topk_group=topk_group)
    ours, base = balancedness(sol.loads), balancedness(sol.eplb["loads"])
    grouped = n_group > 1 and nodes > 1
    rec.update({"slots_per_gpu": sorted(set(topo.gpu_slots)), "grouped_routing_cross_node": grouped,
                "eplb_policy": sol.eplb["policy"],
                "ours": {"balancedness": ours["balancedness"], "layer_mean": ours["layer_mean"],
                         "sends_per_token": float(sol.sends.mean()),
                         "moe_us_per_token": float(sol.layer_s.sum() * 1e6), "seconds": sol.seconds,
                         "methods": {m: sol.method.count(m) for m in sorted(set(sol.method))}},
                "eplb": {"balancedness": base["balancedness"], "layer_mean": base["layer_mean"],
                         "sends_per_token": float(sol.eplb["sends"].mean()),
                         "moe_us_per_token": float(sol.eplb["layer_s"].sum() * 1e6), "seconds": eplb_s,
                         "same_gpu_duplicates": _duplicates(sol.eplb["phy2log"], topo)}})
    if reference is not None and topo.even:
        rec["eplb_reference_match"] = _reference_match(reference, weight, topo, n_group)
    return rec


def _duplicates(phy2log, topo) -> int:
    """Slots holding a second copy of an expert on the same GPU while the expert has fewer replicas than
    there are GPUs (memory that adds no balance)."""
    g = topo.slot_gpu()
    out = 0
    for row in phy2log:
        pairs = row * topo.n_gpus + g
        uniq, n = np.unique(pairs, return_counts=True)
        count = np.bincount(row, minlength=topo.n_experts)
        out += int(sum(c - 1 for u, c in zip(uniq, n) if c > 1 and count[u // topo.n_gpus] <= topo.n_gpus))
    return out


def _reference_match(ref, weight, topo, n_group) -> bool:
    import torch

    p2l, _, cnt = ref.rebalance_experts(torch.tensor(weight), topo.n_slots, n_group, topo.n_nodes,
                                        topo.n_gpus)
    mine, _, my_cnt = eplb_rebalance(weight, topo.n_slots, n_group, topo.n_nodes, topo.n_gpus)
    g = topo.slot_gpu()
    a = gpu_loads(p2l.numpy(), weight, g, topo.n_gpus).max(axis=1)
    b = gpu_loads(mine, weight, g, topo.n_gpus).max(axis=1)
    return bool(np.array_equal(cnt.numpy(), my_cnt) and np.allclose(a, b, rtol=1e-5))


def acceptance(results) -> list[tuple[str, bool]]:
    ran = [r for r in results if "refused" not in r]
    ge = all(r["ours"]["balancedness"] >= r["eplb"]["balancedness"] - 1e-12
             and r["ours"]["layer_mean"] >= r["eplb"]["layer_mean"] - 1e-12 for r in ran)
    grouped = [r for r in ran if r["grouped_routing_cross_node"]]
    strict = bool(grouped) and all(r["ours"]["balancedness"] > r["eplb"]["balancedness"] for r in grouped)
    big = [r for r in ran if r["model"].startswith("deepseek-v3") and (r["gpus"], r["redundant"]) == (64, 32)]
    fast = bool(big) and all(r["ours"]["seconds"] < 10 for r in big)
    return [(f"balancedness >= eplb's on all {len(ran)} cases (both averages)", ge),
            (f"strictly better on the {len(grouped)} grouped-routing cross-node cases", strict),
            ("DeepSeek-V3 58 layers x 256 experts, 64 GPUs, 32 redundant solved in < 10 s", fast)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/ep_balance.json")
    ap.add_argument("--eplb-reference", default=None, help="path of DeepSeek's eplb.py to check against")
    args = ap.parse_args(argv)
    reference = None
    if args.eplb_reference:
        path = Path(args.eplb_reference)
        if not path.is_file():
            ap.error(f"--eplb-reference: {path} is not a file")
        spec_ = importlib.util.spec_from_file_location("eplb_reference", path)
        reference = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(reference)
    results = []
    for name, spec, weight, ng, tg in heats():
        for gpus in GPUS:
            for red in REDUNDANT:
                results.append({"model": name, **run_case(spec, weight, ng, tg, gpus, red, reference)})
    rows = []
    for r in results:
        head = [r["model"], r["gpus"], r["nodes"], r["redundant"]]
        if "refused" in r:
            rows.append(head + ["refused", "", "", "", "", "", ""])
            continue
        o, e = r["ours"], r["eplb"]
        rows.append(head + [f"{e['balancedness']:.4f}", f"{o['balancedness']:.4f}",
                            f"{e['layer_mean']:.4f}", f"{o['layer_mean']:.4f}",
                            f"{e['sends_per_token']:.2f} / {o['sends_per_token']:.2f}",
                            f"{e['seconds']:.2f} / {o['seconds']:.2f}", e["same_gpu_duplicates"]])
    print(table(rows, ["heat", "GPUs", "nodes", "redundant", "eplb bal.", "ours bal.", "eplb layer mean",
                       "ours layer mean", "sends/token eplb / ours", "solve s eplb / ours",
                       "eplb same-GPU copies"], right=tuple(range(1, 11))))
    checks = acceptance(results)
    for text, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    Path(args.out).write_text(json.dumps({"cases": results, "acceptance": dict(checks),
                                          "gpus_per_node": GPUS_PER_NODE}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
