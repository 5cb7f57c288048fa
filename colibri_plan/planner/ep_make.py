"""From a model spec, heat and a topology to the placement document (:mod:`colibri_plan.formats.
ep_placement`): the expert memory a GPU has for slots, the solve, and every figure ``ep show`` prints."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.formats.ep_placement import EpPlacement
from colibri_plan.planner import ep_cost
from colibri_plan.planner.ep import EpTopology, solve_ep


def decode_rows(spec, heat) -> tuple[list[int], np.ndarray]:
    """The MoE layers a decode step runs (MTP rows left out: SGLang and vLLM place the draft head's
    experts on their own) and their selection probabilities ``[layers, E]`` from a heat already aligned
    to ``spec`` (:func:`~colibri_plan.formats.heat_align.align_heat`)."""
    p = heat.probabilities(spec.top_k)
    rows = [i for i, layer in enumerate(heat.layers) if layer < spec.n_layers]
    return [heat.layers[i] for i in rows], p[rows]


def slot_memory(spec, n_moe_layers: int, gpu_expert_memory_bytes: int | None, source: str) -> dict:
    """The memory section: one slot's bytes over every MoE layer, and how many fit a GPU.

    Raises:
        InputError: the GPU's expert memory does not hold one slot.
    """
    slot_bytes = int(spec.expert_bytes()) * n_moe_layers
    out = {"slot_bytes": slot_bytes, "gpu_expert_memory_bytes": gpu_expert_memory_bytes,
           "max_slots_per_gpu": None, "source": source}
    if gpu_expert_memory_bytes is not None:
        fit = int(gpu_expert_memory_bytes // slot_bytes)
        if fit < 1:
            raise InputError(f"a GPU has {gpu_expert_memory_bytes / 1e9:.2f} GB for experts but one slot of "
                             f"{spec.name} ({spec.expert_format}, {n_moe_layers} MoE layers) takes "
                             f"{slot_bytes / 1e9:.2f} GB; use a smaller --quant or GPUs with more memory")
        out["max_slots_per_gpu"] = fit
    return out


@dataclass(frozen=True)
class EpSettings:
    """What an expert-parallel placement is solved for.

    Attributes:
        n_gpus, n_nodes, n_redundant: the deployment (GPUs, nodes, redundant slots per layer).
        n_group, topk_group: the model's routing groups (1, 1: ungrouped).
        gpu_tflops, internode_gbps: the cost model's rates (effective TFLOP/s a GPU, GB/s a GPU between
            nodes). trace_tokens, seed: sampled routing traces where the heat has none.
    """

    n_gpus: int
    n_nodes: int
    n_redundant: int
    n_group: int = 1
    topk_group: int = 1
    gpu_tflops: float = ep_cost.DEFAULT_GPU_TFLOPS
    internode_gbps: float = ep_cost.DEFAULT_INTERNODE_GBPS
    trace_tokens: int = 1024
    seed: int = 0


def build_placement(spec, heat, settings: EpSettings, memory: dict, progress=None) -> EpPlacement:
    """Solve the placement of ``spec``'s decode MoE layers and build its document.

    Args:
        spec: ModelSpec; heat: Heat aligned to it; settings: the deployment, routing groups and rates;
        memory: :func:`slot_memory`'s section. progress: optional ``fn(done, total)`` per layer.

    Raises:
        InputError: bad counts (see :meth:`EpTopology.make`) or too little expert memory.
    """
    n_gpus, n_nodes, n_redundant = settings.n_gpus, settings.n_nodes, settings.n_redundant
    n_group, topk_group, trace_tokens, seed = (settings.n_group, settings.topk_group, settings.trace_tokens,
                                               settings.seed)
    gpu_tflops, internode_gbps = settings.gpu_tflops, settings.internode_gbps
    layers, weight = decode_rows(spec, heat)
    topo = EpTopology.make(spec.n_experts, n_gpus, n_nodes, n_redundant, memory.get("max_slots_per_gpu"))
    cost = ep_cost.EpCostModel.for_model(spec.hidden_size, spec.moe_intermediate_size, n_gpus,
                                         gpu_tflops, internode_gbps)
    traces, kind = None, "none needed (one node)"
    if n_nodes > 1:
        tr = heat.trace
        traces = [tr.rows(layer) if tr is not None else None for layer in layers]
        real = sum(t is not None for t in traces)
        kind = (f"the heat's routing trace for {real} of {len(layers)} layers" if real else "") + \
            ("; " if real and real < len(layers) else "") + \
            (f"sampled ({trace_tokens} tokens per layer, seed {seed}"
             + (f", group-limited top-{spec.top_k} over {topk_group} of {n_group} groups)" if n_group > 1
                else f", top-{spec.top_k})") if real < len(layers) else "")
    sol = solve_ep(weight, topo, cost, top_k=spec.top_k, n_group=n_group, topk_group=topk_group,
                   traces=traces, trace_tokens=trace_tokens, seed=seed, progress=progress)
    ours, base = ep_cost.balancedness(sol.loads), ep_cost.balancedness(sol.eplb["loads"])
    entries = []
    for i, layer in enumerate(layers):
        e_load = sol.eplb["loads"][i]
        entries.append({
            "layer": int(layer), "load": [float(x) for x in weight[i]],
            "physical_to_logical": sol.phy2log[i].tolist(),
            "replicas": np.bincount(sol.phy2log[i], minlength=spec.n_experts).tolist(),
            "gpu_loads": [float(x) for x in sol.loads[i]], "balancedness": float(ours["per_layer"][i]),
            "max_load": float(sol.loads[i].max()), "sends_per_token": float(sol.sends[i]),
            "layer_s": float(sol.layer_s[i]), "method": sol.method[i], "candidates": sol.candidates[i],
            "eplb": {"physical_to_logical": sol.eplb["phy2log"][i].tolist(),
                     "balancedness": float(base["per_layer"][i]), "max_load": float(e_load.max()),
                     "sends_per_token": float(sol.eplb["sends"][i]),
                     "layer_s": float(sol.eplb["layer_s"][i])}})
    doc = {
        "model": {"name": spec.name, "fingerprint": spec.fingerprint(), "family": spec.family,
                  "n_layers": spec.n_layers, "moe_layers": list(layers), "n_experts": spec.n_experts,
                  "top_k": spec.top_k, "n_group": n_group, "topk_group": topk_group,
                  "hidden_size": spec.hidden_size, "moe_intermediate_size": spec.moe_intermediate_size,
                  "expert_format": spec.expert_format, "expert_bytes": int(spec.expert_bytes())},
        "heat": {"source": heat.source, "fingerprint": heat.fingerprint(), "tokens": heat.tokens},
        "topology": {"gpus": n_gpus, "nodes": n_nodes, "gpus_per_node": topo.gpus_per_node,
                     "redundant": n_redundant, "slots": topo.n_slots, "gpu_slots": list(topo.gpu_slots)},
        "memory": memory, "cost_model": cost.to_dict(), "layers": entries,
        "summary": {"balancedness": ours["balancedness"], "balancedness_layer_mean": ours["layer_mean"],
                    "sends_per_token": float(sol.sends.mean()), "moe_s_per_token": float(sol.layer_s.sum()),
                    "methods": dict(Counter(sol.method)),
                    "eplb": {"policy": sol.eplb["policy"], "balancedness": base["balancedness"],
                             "balancedness_layer_mean": base["layer_mean"],
                             "sends_per_token": float(sol.eplb["sends"].mean()),
                             "moe_s_per_token": float(sol.eplb["layer_s"].sum())}},
        "solver": {"seconds": round(sol.seconds, 3), "trace": kind,
                   "method": "per layer the cheapest candidate by the cost model among those no less "
                             "balanced than DeepSeek eplb (docs/ep.md)"},
    }
    return EpPlacement(doc)
