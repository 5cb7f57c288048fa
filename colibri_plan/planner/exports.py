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
place single experts: each GPU takes whole layers, those the plan serves most from VRAM first, as many as
fit its VRAM budget; the other layers stay on the CPU. The export states how many experts moved tier and
the share of selections served from GPU, exported versus planned.

The plan's trunk (its ``trunk`` section): on a GPU, colibrì gets ``CUDA_DENSE=1 COLI_CUDA_ATTN=1`` (the
trunk's devices joined to ``COLI_GPUS``) and llama.cpp ``-ngl <all layers>`` with ``--tensor-split``
putting the trunk's layers where the plan does (one device, or the plan's layer split), the ``-ot`` rules
still keeping the CPU/disk experts on the CPU. A CPU trunk (or a plan without the section) exports as
before.
"""

from __future__ import annotations

import os

import numpy as np

from colibri_plan.errors import UnsupportedError
from colibri_plan.fileio import atomic_write_text
from colibri_plan.formats.heat import fnv1a32  # noqa: F401 - re-exported for callers
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM, Plan, layer_probabilities
from colibri_plan.formats.plan_trunk import parse_trunk
from colibri_plan.planner.knobs import COLIBRI_QUEUE_DEPTH
from colibri_plan.planner.knobs import COLIBRI_VRAM_OVERHEAD_BYTES as VRAM_OVERHEAD_BYTES
from colibri_plan.planner.options import DEFAULTS
from colibri_plan.planner.page_cache import page_cache_hit_rates

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
    knobs = plan.doc.get("knobs") or {}
    # colibrì's RAM_GB covers dense + its own slack (1.2 GB activations, 2.5 GB page-cache reserve, a
    # 64-expert working set, KV) + pins + LRU: give it the plan's expert RAM on top of those terms
    slack = COLIBRI_SLACK_BYTES + 64 * b
    ram_gb = (budgets["ram_budget_bytes"] + budgets.get("dense_bytes", 0) + budgets.get("kv_bytes", 0)
              + slack) / 1e9
    slots = plan.lru_slots()
    vram_rank = list(ranking[:n_vram])
    pin_rank = ranking[n_vram:n_vram + counts["ram_pinned"]]
    size = _sizer(plan)                       # bytes colibrì stores each (layer, expert) in (MTP: int8)
    keep_host = bool(knobs.get("keep_host_copies"))
    env = {}
    late_notes: list[str] = []
    if n_vram:
        env["COLI_CUDA"] = "1"
        env["COLI_GPUS"] = ",".join(k.split(":")[1] for k in gpu_keys)
        per = [size(x) + VRAM_OVERHEAD_BYTES for x in vram_rank]
        have = sum(int(v) for k, v in budgets.get("vram_budget_bytes", {}).items() if k in gpu_keys)
        fit = len(per) if not have else int(np.searchsorted(np.cumsum(per), have, side="right"))
        if fit < n_vram:     # colibrì's allocation overhead does not fit the plan's VRAM budget
            lost = vram_rank[fit:]
            room = budgets["ram_budget_bytes"] - (counts["ram_pinned"] + counts["lru_slots"]) * b
            # with host copies kept, the pushed-out experts' RAM is in the plan already
            extra = len(lost) if keep_host else int(max(0, min(len(lost), room // b)))
            displaced = pin_rank[len(pin_rank) - (len(lost) - extra):] if len(lost) > extra else []
            late_notes.append(_pushed_out_note(len(lost), extra, lost, displaced))
            pin_rank = lost + pin_rank[:len(pin_rank) - len(displaced)]
            vram_rank = vram_rank[:fit]
        need = sum(size(x) + VRAM_OVERHEAD_BYTES for x in vram_rank) + b // 2
        need = min(need, have) if have else need      # capped at the plan's VRAM budget
        env["CUDA_EXPERT_GB"] = f"{need / 1e9:.3f}"
        env["CUDA_RELEASE_HOST"] = "0" if keep_host else "1"
    late_notes += _colibri_trunk(plan, env)
    pinned = sum(size(x) for x in pin_rank) + (sum(size(x) for x in vram_rank) if keep_host else 0)
    env["PIN"] = str(usage_path)
    env["PIN_GB"] = f"{(pinned + b // 2) / 1e9:.3f}"
    env["RAM_GB"] = f"{ram_gb:.2f}"
    env["CAP"] = str(int(slots.max()) if slots.size and slots.max() > 0 else 1)
    env["CAP_RAISE"] = "0"
    env["CTX"] = str(budgets.get("context_tokens", DEFAULTS.context_tokens))   # older plans lack it
    if knobs.get("o_direct", True):
        env["DIRECT"] = "1"
    notes = [f"{n_vram} VRAM experts and {counts['ram_pinned']} pinned RAM experts rank first in "
             f"{usage_path} "
             "(synthetic counts that fix colibrì's ranking; they are not routing statistics)",
             "colibrì assigns each VRAM expert to the least-loaded device itself: the plan's per-device "
             "split is not reproduced, only its VRAM set",
             f"RAM_GB = the plan's expert RAM + dense + KV + colibrì's own slack ({slack / 1e9:.2f} GB); "
             "colibrì clamps it to the memory available", *_knob_notes(plan, knobs, keep_host)]
    if slots.size and len(set(slots[slots > 0].tolist())) > 1:
        notes.append("the plan's LRU slots differ per layer; colibrì's CAP is one figure: the largest is "
                     "used")
    notes += late_notes
    return {"env": " ".join(f"{k}={v}" for k, v in env.items()), "vars": env, "usage_file": str(usage_path),
            "notes": notes}


def plan_trunk(plan: Plan):
    """The plan's trunk placement (a CPU trunk for plans without the section)."""
    return parse_trunk(plan.doc, plan.device_keys, plan.doc["model"].get("n_layers"))


def trunk_devices(trunk) -> list[str]:
    """Device keys the trunk occupies: its split's devices, else its device (none on the CPU)."""
    if trunk.split:
        return list(dict.fromkeys(k for _, _, k in trunk.split))
    return [trunk.device] if trunk.on_device else []


def _colibri_trunk(plan: Plan, env: dict) -> list[str]:
    """With the plan's trunk on a GPU: ``CUDA_DENSE=1`` (dense tensors on the GPU) and ``COLI_CUDA_ATTN=1``
    (attention there, next to its KV cache), the trunk's devices in ``COLI_GPUS``; the notes."""
    devs = trunk_devices(plan_trunk(plan))
    if not devs:
        return []
    bad = [k for k in devs if not k.startswith("cuda:")]
    if bad:
        raise UnsupportedError(f"colibrì runs a dense trunk on CUDA devices only (CUDA_DENSE); the plan puts "
                               f"it on {', '.join(bad)}; solve with --trunk cpu or for a CUDA device")
    gpus = [g for g in env.get("COLI_GPUS", "").split(",") if g]
    env["COLI_CUDA"] = "1"
    env["COLI_GPUS"] = ",".join(sorted(set(gpus) | {k.split(":")[1] for k in devs}, key=int))
    env["CUDA_DENSE"] = "1"
    env["COLI_CUDA_ATTN"] = "1"
    return ["CUDA_DENSE=1 COLI_CUDA_ATTN=1: the plan runs the dense trunk and attention on "
            f"{', '.join(devs)}; colibrì spreads the dense tensors round-robin over COLI_GPUS (the plan's "
            "device split is not reproduced) and counts them against each device's expert room"]


def _sizer(plan: Plan):
    """``fn((layer, expert)) -> bytes`` as colibrì stores the expert: the plan's expert bytes, and
    ``model.mtp_expert_bytes`` (int8) for an MTP head row (layer >= model.n_layers)."""
    model = plan.doc["model"]
    b, mtp = plan.expert_bytes, int(model.get("mtp_expert_bytes") or plan.expert_bytes)
    n_layers = int(model.get("n_layers") or max(plan.layer_ids) + 1)
    return lambda x: mtp if x[0] >= n_layers else b


def _names(pairs, most: int = 6) -> str:
    shown = ", ".join(f"L{layer}/E{e}" for layer, e in pairs[:most])
    return shown + (f" and {len(pairs) - most} more" if len(pairs) > most else "")


def _pushed_out_note(n_lost: int, extra: int, lost: list, displaced: list) -> str:
    """The note for VRAM experts colibrì's allocation overhead pushes out: which ones, and which of the
    plan's RAM pins they displace (the coldest: the ranked prefix stops at PIN_GB)."""
    text = (f"with colibrì's {VRAM_OVERHEAD_BYTES / 2**20:.3f} MiB allocation overhead per VRAM expert, "
            f"{n_lost} of the plan's VRAM experts do not fit its VRAM budget ({_names(lost)}, the coldest "
            "of the VRAM set); they rank first among the RAM pins")
    if displaced:
        text += (f" and displace the plan's {len(displaced)} coldest pins ({_names(displaced)}), which go to "
                 "the LRU/disk")
    return text + (f"; CUDA_EXPERT_GB is capped at the budget and PIN_GB grows by {extra} experts so they "
                   "stay in RAM (solve with target colibri to count the overhead in the plan itself)")


def _knob_notes(plan: Plan, knobs: dict, keep_host: bool) -> list[str]:
    """Notes on the knobs the line sets: DIRECT, host copies, MTP widths, colibrì's queue depth."""
    notes = []
    if knobs.get("o_direct", True):
        notes.append("DIRECT=1: the plan assumes O_DIRECT reads (the page cache is not counted as a tier)")
    if keep_host:
        notes.append(f"CUDA_RELEASE_HOST=0: the plan keeps a host copy of every VRAM expert "
                     f"({knobs.get('host_copy_bytes', 0) / 1e9:.2f} GB of RAM, inside PIN_GB)")
    model = plan.doc["model"]
    if model.get("mtp_expert_bytes"):
        notes.append(f"MTP-layer experts are counted at colibrì's int8 width "
                     f"({model['mtp_expert_bytes'] / 1e6:.2f} MB, not {plan.expert_bytes / 1e6:.2f} MB) in "
                     "PIN_GB and CUDA_EXPERT_GB")
    res = plan.doc.get("resources") or {}
    table = sorted((int(q), float(g)) for q, g in res.get("disk_depth_gbps") or ())
    q = int(res.get("disk_queue_depth") or 0)
    shallow = [r for r in table if r[0] <= COLIBRI_QUEUE_DEPTH] or table[:1]
    if table and q > shallow[-1][0]:
        here = dict(table).get(q)
        notes.append(f"colibrì reads at queue depth 1-{COLIBRI_QUEUE_DEPTH}: this disk gives "
                     f"{shallow[-1][1]:.2f} GB/s at depth {shallow[-1][0]} against "
                     f"{here if here is not None else float('nan'):.2f} GB/s at the plan's depth {q}; solve "
                     "with target colibri for colibrì's figure")
    return notes


def _mmap_notes(plan: Plan, probs: np.ndarray, cpu_rows: list[int]) -> list[str]:
    """What mmap implies for the exported layout: the CPU layers' experts are page-cache pages, no pins
    and no LRU; the page cache holds what llama.cpp and the OS leave (the plan's ``knobs.page_cache``
    pool) and serves a share predicted by :mod:`colibri_plan.planner.page_cache`."""
    text = ("CPU layers are read through mmap: the OS page cache, not the plan's pins or LRU, decides what "
            "stays in RAM; cold experts are page faults (queue depth 1)")
    pool = ((plan.doc.get("knobs") or {}).get("page_cache") or {}).get("pool_bytes")
    if not cpu_rows or pool is None:
        return [text]
    b = plan.expert_bytes
    q = probs[cpu_rows]
    hit = page_cache_hit_rates(q, int(pool) // b)
    share = float((q * hit).sum() / q.sum()) if q.sum() > 0 else 0.0
    return [text + f"; memory pressure: the page cache can hold about {int(pool) / 1e9:.2f} GB of the model "
            f"file (available memory - dense, KV, buffers and OS headroom), serving about {share:.0%} of the "
            "CPU layers' selections from RAM: anything else that takes memory (--mlock, other programs, "
            "a larger context) shrinks it and slows decoding"]


def llama_device_name(key: str) -> str:
    """llama.cpp's device name for a plan device key: ``cuda:1`` -> ``CUDA1``, ``vulkan:0`` -> ``Vulkan0``."""
    backend, _, idx = key.partition(":")
    return f"{LLAMA_DEVICE.get(backend, backend.upper())}{idx}"


def _whole_layer_assignment(plan: Plan, rows: list[int], gpu_mass: np.ndarray,
                            mass: np.ndarray) -> dict[int, int]:
    """Row index -> device position for the rows that go whole to a GPU (the rest stay on the CPU).

    Rows are ranked by the plan's VRAM-resident selection mass ``gpu_mass`` [rows] (then total ``mass``,
    then layer order); each device in plan order takes the highest-ranked remaining rows while one whole
    layer (``n_experts x expert_bytes``) still fits its budget: ``budgets.vram_budget_bytes[key]``, or for
    a unified device without one, the bytes of the plan's own experts there.
    """
    layer_bytes = plan.n_experts * plan.expert_bytes
    vram = plan.doc["budgets"].get("vram_budget_bytes", {})
    counts = plan.counts()
    ranked = sorted(rows, key=lambda i: (-gpu_mass[i], -mass[i], i))
    out: dict[int, int] = {}
    for d, key in enumerate(plan.device_keys):
        budget = int(vram.get(key, counts[key] * plan.expert_bytes))
        n_fit = budget // layer_bytes if layer_bytes > 0 else 0
        take = [i for i in ranked if i not in out][:max(0, int(n_fit))]
        out.update((i, d) for i in take)
    return out


def export_llama_cpp(plan: Plan) -> dict:
    """Whole-layer ``-ot`` override patterns that approximate the plan (see module docstring).

    llama.cpp places the merged expert tensors of a layer as a unit, so each GPU gets the whole layers the
    plan serves most from VRAM, as many as fit its VRAM budget (hottest VRAM share first, devices in plan
    order); every other layer goes to the CPU. The selection probabilities are the plan's ``p`` (uniform
    when the plan has none). MTP rows (layer >= model.n_layers) have no ``blk.N`` tensors and are skipped.

    Returns:
        {"args": "-ot ... ", "patterns": [...], "layers": {device: [layer ids]}, "moved_experts": n (experts
        that change tier VRAM <-> CPU against the plan), "moved_device_experts": n (VRAM experts that stay
        in VRAM on another GPU), "gpu_share": {"plan": f, "export": f} (share of routed selections served
        from a GPU), "notes": [...]}
    """
    tiers = plan.tiers()                                            # [rows, E] device position or < 0
    keys = plan.device_keys
    n_layers = plan.doc["model"].get("n_layers", max(plan.layer_ids) + 1)
    probs = layer_probabilities(plan)
    if probs is None:
        probs = np.full(tiers.shape, 1.0 / max(1, tiers.shape[1]))
    rows = [i for i, lid in enumerate(plan.layer_ids) if lid < n_layers]   # MTP rows have no blk.N experts
    on_gpu = tiers >= 0                                             # [rows, E]
    gpu_mass = np.sum(np.where(on_gpu, probs, 0.0), axis=1)         # [rows] VRAM-served selections per token
    mass = probs.sum(axis=1)                                        # [rows] ~ top-k
    assign = _whole_layer_assignment(plan, rows, gpu_mass, mass)
    by_dev: dict[str, list[int]] = {}
    moved = moved_dev = 0
    for i in rows:
        row = tiers[i]
        if i in assign:
            d = assign[i]
            name = llama_device_name(keys[d])
            moved += int(np.sum(row < 0))                           # RAM/disk experts promoted to VRAM
            moved_dev += int(np.sum((row >= 0) & (row != d)))       # VRAM experts of other GPUs
        else:
            name = "CPU"
            moved += int(np.sum(row >= 0))                          # VRAM experts demoted to the CPU
        by_dev.setdefault(name, []).append(plan.layer_ids[i])
    total = float(mass[rows].sum()) if rows else 0.0
    share_plan = float(gpu_mass[rows].sum()) / total if total > 0 else 0.0
    share_export = float(sum(mass[i] for i in assign)) / total if total > 0 else 0.0
    order = [llama_device_name(k) for k in keys] + ["CPU"]
    by_dev = {dev: sorted(by_dev[dev]) for dev in order if dev in by_dev}      # device order, ids ascending
    patterns = [f"blk\\.({'|'.join(str(x) for x in ids)})\\.ffn_(gate|up|down)_exps={dev}"
                for dev, ids in by_dev.items()]
    n_gpu_layers = ", ".join(f"{dev} {len(ids)}" for dev, ids in by_dev.items() if dev != "CPU")
    notes = ["llama.cpp keeps each layer's experts in merged 3-D tensors blk.N.ffn_{gate,up,down}_exps: "
             "per-expert placement is not expressible; whole layers go to the GPUs, hottest VRAM share "
             f"first, as many as fit each VRAM budget (layers: {n_gpu_layers or 'none'}), "
             "the rest to the CPU",
             f"{moved} experts change tier (VRAM <-> CPU) against the plan; {moved_dev} more stay in VRAM "
             "on another GPU",
             f"selections served from GPU: export {share_export:.1%}, plan {share_plan:.1%}",
             *_mmap_notes(plan, probs, [i for i in rows if i not in assign])]
    budgets = plan.doc["budgets"]
    trunk = int(budgets.get("dense_bytes", 0)) + int(budgets.get("kv_bytes", 0))
    head, ngl, split = _llama_trunk(plan, n_layers)
    if ngl:
        notes.append(f"-ngl {ngl} puts every layer's dense tensors and KV cache on the GPUs, --tensor-split "
                     f"{split} as the plan's trunk (its VRAM is in the plan's budgets); the -ot rules keep "
                     "the experts the plan leaves in RAM or on disk on the CPU")
    elif trunk and n_gpu_layers:
        notes.append(f"with -ngl 99 llama.cpp also puts the dense trunk and KV cache ({trunk / 1e9:.2f} GB, "
                     "split over the GPUs) in VRAM, which the plan's expert budgets do not count: if a GPU "
                     "runs out of memory, move its coldest layer to CPU (or solve with --trunk auto)")
    args = " ".join([*head, *(f'-ot "{p}"' for p in patterns)])
    return {"args": args, "patterns": patterns, "layers": by_dev, "moved_experts": moved, "ngl": ngl,
            "tensor_split": split,
            "moved_device_experts": moved_dev, "gpu_share": {"plan": share_plan, "export": share_export},
            "notes": notes}


def _llama_trunk(plan: Plan, n_layers: int) -> tuple[list[str], int | None, str | None]:
    """(leading args, -ngl, --tensor-split) for the plan's trunk: with it on the GPUs, every layer
    (``n_layers`` + the output layer) offloaded and the split in the plan's device order: the layers each
    device runs (a layer split), or all on the trunk's device. (no args, None, None) for a CPU trunk."""
    t = plan_trunk(plan)
    if not t.on_device:
        return [], None, None
    layers = {k: 0 for k in plan.device_keys}
    for a, b, k in t.split or ((0, n_layers - 1, t.device),):
        layers[k] += b - a + 1
    split = ",".join(str(layers[k]) for k in plan.device_keys)
    return [f"-ngl {n_layers + 1}", f"--tensor-split {split}"], n_layers + 1, split
