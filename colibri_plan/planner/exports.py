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

llama.cpp (``-ot`` patterns, ``-ngl``, the full ``llama-server`` line) is :mod:`colibri_plan.planner.
exports_llama`; :func:`export_llama_cpp` is re-exported here.

The plan's trunk (its ``trunk`` section): on a GPU, colibrì gets ``CUDA_DENSE=1 COLI_CUDA_ATTN=1`` (the
trunk's devices joined to ``COLI_GPUS``). A plan solved for colibrì carries the solver's GPU split
(``trunk_gpus``, planner/trunk_gpus.py): one GPU exports ``COLI_GPU=i``, a spread ``COLI_GPUS`` over its
GPUs. A CPU trunk (or a plan without the section) exports as before.

:func:`colibri_env` builds the environment line without writing anything (``PIN`` is the usage file's
absolute path), :func:`export_colibri` also writes the usage file, :func:`colibri_command` is the line to
paste (``COLI_MODEL=DIR <env> ./coli chat``), and :func:`colibri_tiers` is the placement colibrì ends up
with from that line (what `solve` prices as colibrì runs it).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import numpy as np

from colibri_plan.errors import UnsupportedError
from colibri_plan.fileio import atomic_write_text
from colibri_plan.formats.heat import fnv1a32  # noqa: F401 - re-exported for callers
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM, Plan, layer_probabilities
from colibri_plan.planner.exports_llama import export_llama_cpp, plan_trunk  # noqa: F401 - re-exported
from colibri_plan.planner.knobs import COLIBRI_QUEUE_DEPTH
from colibri_plan.planner.knobs import COLIBRI_VRAM_OVERHEAD_BYTES as VRAM_OVERHEAD_BYTES
from colibri_plan.planner.options import DEFAULTS

COLIBRI_SLACK_BYTES = int(1.2e9 + 2.5e9)    # colibrì reserves 1.2 GB activations + 2.5 GB page cache
#: how colibrì is started (its README: `./coli chat`, the model folder in COLI_MODEL), from its checkout
COLIBRI_LAUNCH = "./coli chat"


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


def usage_lines(plan: Plan, ranking: list[tuple[int, int]], family: str | None = None) -> list[str]:
    """The usage file's lines: header, engine id, then ``layer expert count`` rows with strictly decreasing
    synthetic counts in ``ranking`` order (colibrì's sort then reproduces it), layer-major in the file."""
    n = len(ranking)
    model = plan.doc["model"]
    engine_id = fnv1a32(family or model.get("family", ""))
    lines = [f"-1 {model.get('n_layers', max(plan.layer_ids))} {plan.n_experts}", f"-2 1 {engine_id}"]
    rows = sorted(((layer, e, n - i) for i, (layer, e) in enumerate(ranking)))  # layer-major, id order
    return lines + [f"{layer} {e} {c}" for layer, e, c in rows]


def export_colibri(plan: Plan, usage_path: str | os.PathLike, heat_probs: np.ndarray | None = None,
                   family: str | None = None) -> dict:
    """Write the usage file (atomically) and return :func:`colibri_env`'s dict.

    Raises:
        UnsupportedError: the plan places experts on a device colibrì cannot drive (not CUDA); nothing is
            written then.
    """
    data = colibri_env(plan, usage_path, heat_probs)
    atomic_write_text(usage_path, "\n".join(usage_lines(plan, colibri_ranking(plan, heat_probs), family))
                      + "\n")
    return data


def colibri_env(plan: Plan, usage_path: str | os.PathLike, heat_probs: np.ndarray | None = None) -> dict:
    """colibrì's environment for the plan, with ``PIN`` the absolute path of ``usage_path`` (not written).

    Returns:
        {"env": "<VAR=value ...>", "vars": {...}, "usage_file": absolute path, "notes": [...],
        "vram_experts": [(layer, expert)], "pinned_experts": [(layer, expert)]: the sets colibrì loads
        (:func:`colibri_tiers`)}.

    Raises:
        UnsupportedError: the plan places experts on a device colibrì cannot drive (not CUDA).
    """
    usage_path = str(Path(usage_path).expanduser().resolve())
    ranking = colibri_ranking(plan, heat_probs)
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
    env["PIN"] = usage_path
    env["PIN_GB"] = f"{(pinned + b // 2) / 1e9:.3f}"
    env["RAM_GB"] = f"{ram_gb:.2f}"
    env["CAP"] = str(int(slots.max()) if slots.size and slots.max() > 0 else 1)
    env["CAP_RAISE"] = "0"
    env["CTX"] = str(budgets.get("context_tokens", DEFAULTS.context_tokens))   # older plans lack it
    if _colibri_direct(knobs):
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
    return {"env": " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), "vars": env,
            "usage_file": usage_path, "notes": notes, "vram_experts": vram_rank, "pinned_experts": pin_rank}


def colibri_command(data: dict, model_dir: str) -> str:
    """The line to paste (from colibrì's checkout): ``COLI_MODEL=DIR <env> ./coli chat`` for
    :func:`colibri_env`'s ``data`` and colibrì's converted model folder ``model_dir``."""
    return f"COLI_MODEL={shlex.quote(model_dir)} {data['env']} {COLIBRI_LAUNCH}"


def colibri_tiers(plan: Plan, data: dict) -> tuple[np.ndarray, np.ndarray]:
    """(tiers [rows, E], LRU slots [rows]) colibrì runs from :func:`colibri_env`'s ``data``: its VRAM set on
    the plan's devices (colibrì picks the device itself; the set is what counts), its pins in RAM, the
    rest streamed through ``CAP`` LRU slots per decode layer."""
    tiers = np.full(plan.tiers().shape, TIER_DISK, dtype=np.int64)
    row = {lid: i for i, lid in enumerate(plan.layer_ids)}
    planned = plan.tiers()
    gpus = [d for d, k in enumerate(plan.device_keys) if k.startswith("cuda:")]
    for layer, e in data["vram_experts"]:
        d = planned[row[layer], e]
        tiers[row[layer], e] = d if d >= 0 else (gpus[0] if gpus else TIER_RAM)
    for layer, e in data["pinned_experts"]:
        tiers[row[layer], e] = TIER_RAM
    n_layers = int(plan.doc["model"].get("n_layers") or max(plan.layer_ids) + 1)
    cap = int(data["vars"]["CAP"])
    slots = np.array([cap if lid < n_layers else 0 for lid in plan.layer_ids], dtype=np.int64)
    return tiers, slots


def colibri_plan_command(plan_path: str, pack: str) -> str:
    """The line that runs the plan on the bundled engine: ``colibri-plan run --plan PLAN --model PACK``
    with a chat prompt as text (the pack's tokenizer files, which `model pack` copies from the checkpoint;
    `colibri-plan serve` takes the same --model and --plan for the OpenAI API), or with token ids when
    ``pack`` is a pack without tokenizer files (a fixture: a text prompt would be refused)."""
    prompt = "--prompt-ids 1,2,3,4" if _pack_without_text(pack) else "--chat --prompt Hello"
    return (f"colibri-plan run --plan {shlex.quote(plan_path)} --model {shlex.quote(pack)} {prompt} "
            "--tokens 64")


def _pack_without_text(pack: str) -> bool:
    """Whether ``pack`` is a readable pack whose index has no tokenizer section (engine/pack_text.py)."""
    import json
    from pathlib import Path

    try:
        return "tokenizer" not in json.loads((Path(pack) / "pack.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


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
    split = plan.doc.get("trunk_gpus") or {}
    if split.get("target") == "colibri" and split.get("chosen") in ("one", "spread"):
        # the solver's GPU split decision (planner/trunk_gpus.py): the device list colibrì reads
        if split["chosen"] == "one" and env["COLI_GPUS"] == devs[0].split(":")[1]:
            env["COLI_GPU"] = env.pop("COLI_GPUS")
        how = ("one GPU: COLI_GPU names it for trunk and experts" if split["chosen"] == "one" else
               f"spread by layers over COLI_GPUS as priced ({split.get('handoffs', 0)} hand-offs)")
        return [f"CUDA_DENSE=1 COLI_CUDA_ATTN=1: the dense trunk and attention on {', '.join(devs)}, {how}"]
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


def _colibri_direct(knobs: dict) -> bool:
    """colibrì's line sets DIRECT=1 unless a colibrì plan assumed buffered reads: our engine's buffered reads
    keep the page cache inside --ram (planner/reads.py), colibrì's DIRECT=0 does not, so a plan of ours
    always exports O_DIRECT to it."""
    return bool(knobs.get("o_direct", True)) or knobs.get("target", "colibri-plan") != "colibri"


def _knob_notes(plan: Plan, knobs: dict, keep_host: bool) -> list[str]:
    """Notes on the knobs the line sets: DIRECT, host copies, MTP widths, colibrì's queue depth."""
    notes = []
    if _colibri_direct(knobs):
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
