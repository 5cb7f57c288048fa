"""Export a plan for the colibrì C engine (usage file + environment line) or llama.cpp (``-ot`` patterns).

colibrì (facts from its docs, see DESIGN.md §8 reference notes): ``PIN=<file>`` loads a history in the
usage format, sorts its records by raw count (descending) and takes a popularity-ranked prefix: first
the VRAM tier (``CUDA_EXPERT_GB``, decimal GB over all devices of ``COLI_GPUS``, each expert whole to the
least-loaded device), then — with ``CUDA_RELEASE_HOST=1`` — the disjoint RAM suffix up to ``PIN_GB``;
``RAM_GB`` is the whole process budget (dense + slack + pins + LRU); ``CAP`` is the LRU slots per layer
(``CAP_RAISE=0`` keeps it). The exported usage file therefore carries *synthetic* counts: the plan's
VRAM experts first, then its pinned experts, then the rest, each group hottest first, with strictly
decreasing counts so that colibrì's sort reproduces exactly this order. Approximations: colibrì chooses
the device of each VRAM expert itself (least-loaded), so the per-device split of the plan is not
reproduced, only the VRAM set; the budgets carry half an expert of slack (plus colibrì's measured 0.741
MiB allocation overhead per VRAM expert) so the ranked prefix stops exactly where the plan's tier ends.

llama.cpp stores a layer's experts as merged 3-D tensors ``blk.N.ffn_{gate,up,down}_exps``, so it cannot
place single experts: each layer goes whole to the device holding most of that layer's experts in the
plan (ties and CPU-majority layers stay on the CPU). The export states how many experts moved tier.
"""

from __future__ import annotations

import os

import numpy as np

from colibri_plan.errors import UnsupportedError
from colibri_plan.fileio import atomic_write_text
from colibri_plan.heat import fnv1a32  # noqa: F401 - re-exported for callers
from colibri_plan.plan import TIER_DISK, TIER_RAM, Plan, layer_probabilities

VRAM_OVERHEAD_BYTES = int(0.741 * 2**20)   # colibrì's measured per-expert VRAM allocation overhead
COLIBRI_SLACK_BYTES = int(1.2e9 + 2.5e9)    # colibrì reserves 1.2 GB activations + 2.5 GB page cache
LLAMA_DEVICE = {"cuda": "CUDA", "vulkan": "Vulkan", "opencl": "OpenCL", "metal": "Metal"}


def colibri_ranking(plan: Plan, heat_probs: np.ndarray | None = None) -> list[tuple[int, int]]:
    """(layer, expert) pairs in export order: VRAM, then RAM pinned, then the rest; hottest first within
    each group by ``heat_probs`` ``[rows, E]`` (default: the plan's own ``p``; id order without)."""
    tiers = plan.tiers()
    layer_ids = plan.layer_ids
    if heat_probs is None:
        heat_probs = layer_probabilities(plan)
    hot = np.zeros(tiers.shape) if heat_probs is None else np.asarray(heat_probs, dtype=np.float64)
    groups = [tiers >= 0, tiers == TIER_RAM, tiers == TIER_DISK]
    out = []
    for mask in groups:
        rr, ee = np.nonzero(mask)
        order = np.argsort(-hot[rr, ee], kind="stable")
        out.extend((layer_ids[rr[i]], int(ee[i])) for i in order)
    return out


def export_colibri(plan: Plan, usage_path: str | os.PathLike, heat_probs: np.ndarray | None = None,
                   family: str | None = None) -> dict:
    """Write the usage file (atomically) and return {"env": "<VAR=value ...>", "vars": {...}, "notes"}.

    Raises:
        UnsupportedError: the plan places experts on a device colibrì cannot drive (not CUDA).
    """
    ranking = colibri_ranking(plan, heat_probs)
    n = len(ranking)
    model = plan.doc["model"]
    engine_id = fnv1a32(family or model.get("family", ""))
    lines = [f"-1 {model.get('n_layers', max(plan.layer_ids))} {plan.n_experts}", f"-2 1 {engine_id}"]
    rows = sorted(((layer, e, n - i) for i, (layer, e) in enumerate(ranking)))  # layer-major, id order
    lines += [f"{layer} {e} {c}" for layer, e, c in rows]
    atomic_write_text(usage_path, "\n".join(lines) + "\n")
    counts = plan.counts()
    b = plan.expert_bytes
    gpu_keys = [k for k in plan.device_keys if counts[k] > 0]
    bad = [k for k in gpu_keys if not k.startswith("cuda:")]
    if bad:
        raise UnsupportedError(f"colibrì's VRAM tier here is CUDA (COLI_GPUS); the plan uses {bad}; "
                               "export a plan solved for CUDA devices")
    n_vram = sum(counts[k] for k in gpu_keys)
    budgets = plan.doc["budgets"]
    # colibrì's RAM_GB covers dense + its own slack (1.2 GB activations, 2.5 GB page-cache reserve, a
    # 64-expert working set, KV) + pins + LRU: give it the plan's expert RAM on top of those terms
    slack = COLIBRI_SLACK_BYTES + 64 * b
    ram_gb = (budgets["ram_budget_bytes"] + budgets.get("dense_bytes", 0) + budgets.get("kv_bytes", 0)
              + slack) / 1e9
    slots = plan.lru_slots()
    env = {}
    late_notes: list[str] = []
    extra_pins = 0
    if n_vram:
        env["COLI_CUDA"] = "1"
        env["COLI_GPUS"] = ",".join(k.split(":")[1] for k in gpu_keys)
        need = n_vram * (b + VRAM_OVERHEAD_BYTES) + b // 2
        budgets_vram = plan.doc["budgets"].get("vram_budget_bytes", {})
        have = sum(int(v) for k, v in budgets_vram.items() if k in gpu_keys)
        if have and need > have:     # colibrì's allocation overhead does not fit the plan's VRAM budget
            lost = -(-(need - have) // (b + VRAM_OVERHEAD_BYTES))
            room = plan.doc["budgets"]["ram_budget_bytes"] - (counts["ram_pinned"] + counts["lru_slots"]) * b
            extra_pins = int(max(0, min(lost, room // b)))
            late_notes.append(f"with colibrì's {VRAM_OVERHEAD_BYTES / 2**20:.3f} MiB allocation overhead per "
                              f"VRAM expert, about {lost} of the plan's VRAM experts do not fit its VRAM "
                              f"budget: CUDA_EXPERT_GB is capped at the budget and PIN_GB grows by "
                              f"{extra_pins} experts so they stay in RAM")
            need = have
        env["CUDA_EXPERT_GB"] = f"{need / 1e9:.3f}"
        env["CUDA_RELEASE_HOST"] = "1"
    env["PIN"] = str(usage_path)
    env["PIN_GB"] = f"{((counts['ram_pinned'] + extra_pins) * b + b // 2) / 1e9:.3f}"
    env["RAM_GB"] = f"{ram_gb:.2f}"
    env["CAP"] = str(int(slots.max()) if slots.size and slots.max() > 0 else 1)
    env["CAP_RAISE"] = "0"
    env["CTX"] = str(budgets.get("context_tokens", 4096))
    notes = [f"{n_vram} VRAM experts and {counts['ram_pinned']} pinned RAM experts rank first in "
             f"{usage_path} "
             "(synthetic counts that fix colibrì's ranking; they are not routing statistics)",
             "colibrì assigns each VRAM expert to the least-loaded device itself: the plan's per-device "
             "split is not reproduced, only its VRAM set",
             f"RAM_GB = the plan's expert RAM + dense + KV + colibrì's own slack ({slack / 1e9:.2f} GB); "
             "colibrì clamps it to the memory available", *late_notes]
    if slots.size and len(set(slots[slots > 0].tolist())) > 1:
        notes.append("the plan's LRU slots differ per layer; colibrì's CAP is one figure: the largest is "
                     "used")
    return {"env": " ".join(f"{k}={v}" for k, v in env.items()), "vars": env, "usage_file": str(usage_path),
            "notes": notes}


def export_llama_cpp(plan: Plan) -> dict:
    """Whole-layer ``-ot`` override patterns (see module docstring).

    Returns:
        {"args": "-ot ... ", "patterns": [...], "layers": {device: [layer ids]}, "moved_experts": n, "notes"}
    """
    tiers = plan.tiers()
    keys = plan.device_keys
    n_layers = plan.doc["model"].get("n_layers", max(plan.layer_ids) + 1)
    by_dev: dict[str, list[int]] = {}
    moved = 0
    for lid, row in zip(plan.layer_ids, tiers):
        if lid >= n_layers:
            continue                                    # MTP rows have no blk.N expert tensors to place
        counts = [(int(np.sum(row == d)), d) for d in range(len(keys))]
        best = max(counts, default=(0, -1))
        if best[0] * 2 > len(row):
            dev = keys[best[1]]
            backend, idx = dev.split(":")
            name = f"{LLAMA_DEVICE.get(backend, backend.upper())}{idx}"
            moved += len(row) - best[0]
        else:
            name = "CPU"
            moved += int(np.sum(row >= 0))
        by_dev.setdefault(name, []).append(lid)
    patterns = [f"blk\\.({'|'.join(str(x) for x in ids)})\\.ffn_(gate|up|down)_exps={dev}"
                for dev, ids in sorted(by_dev.items())]
    notes = ["llama.cpp keeps each layer's experts in merged 3-D tensors blk.N.ffn_{gate,up,down}_exps: "
             f"per-expert placement is not expressible; whole layers follow their majority device, "
             f"{moved} experts change tier against the plan",
             "CPU layers are read through mmap: the OS page cache, not the plan's pins, decides what stays "
             "in RAM"]
    args = " ".join(f'-ot "{p}"' for p in patterns)
    return {"args": args, "patterns": patterns, "layers": by_dev, "moved_experts": moved, "notes": notes}
