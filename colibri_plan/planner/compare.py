"""``solve --compare``: our placement beside what other engines would do, each priced as that engine runs.

Every row is a placement evaluated by the one cost model, under the knobs of the engine that would run
it (:mod:`colibri_plan.planner.knobs`), and carries those knobs so they can be printed:

* ``colibri-plan (optimised)`` — the solved plan on our engine (O_DIRECT, the plan's queue depth).
* ``colibri hot-first`` — colibrì's PIN fill (:func:`~colibri_plan.planner.baselines.hot_first`) as
  colibrì runs it with ``DIRECT=1`` (what our export sets): 0.741 MiB of VRAM overhead per expert (fewer
  fit), reads at queue depth 1–2, no checksums, the LRU raised with leftover RAM.
* ``colibri hot-first (DIRECT=0)`` — the same with colibrì's default buffered reads: the OS page cache is
  a second-level cache, sized by the memory-pressure model of :mod:`colibri_plan.planner.page_cache`
  *inside the same budget* (``--ram``'s expert bytes less the row's pins and twice its LRU slots), as
  every other row is. When the machine has memory beyond the budget, the same fill with the page cache
  over all of it follows the baselines as ``colibri DIRECT=0 (beyond --ram)``
  (``outside_budget``: true, with a note; it is never the "best baseline": it uses memory the others
  were not given, and it is why more ``--ram`` can be slower for colibrì).
* ``colibri hot-first (CUDA_DENSE=1 COLI_CUDA_ATTN=1)`` — the same fill (``DIRECT=1``) with the dense
  trunk and attention on the GPU, priced with the GPU trunk option the solve priced (its VRAM out of the
  experts' budget, :mod:`colibri_plan.planner.trunk`); present when such an option fitted. colibrì spreads
  the dense tensors round-robin over its GPUs; the row prices them on the option's device. The two rows
  above always have the trunk on the CPU (colibrì's default ``CUDA_DENSE=0``).
* ``llama.cpp --fit layers`` — llama.cpp's ``--fit`` priced as llama.cpp runs it
  (:mod:`colibri_plan.planner.llamacpp_compare`: its own cost model and coefficients, ``calibrated_on``);
  its our-engine column is whole layers to the GPUs (:func:`~colibri_plan.planner.baselines.fit_layers`).
  ``llama.cpp (colibri-plan choice)`` follows when the llama.cpp pick beats ``--fit``.
* ``uniform`` — the heat-blind split on our engine.
* ``colibri-plan (host copies kept)`` / ``(host copies released)`` — the plan re-solved with the other
  ``--keep-host-copies`` setting, when a discrete GPU holds experts: what keeping them costs.

Each row's ``knobs.compute`` says which processor computes its host tiers (pinned, LRU hits, streamed:
the CPU or a unified GPU, as the plan's ``compute`` section) and ``knobs.unified_experts`` how many experts
it pins on each unified GPU (hot-first deals RAM pins to them).

Every row says where its trunk is priced (``trunk``: "cpu" or the option's name); llama.cpp, uniform
and the host-copy rows share the plan's trunk.

``tok_s_our_engine`` is each placement on our engine's knobs (placement differences only);
``vs_best_baseline`` compares as-run figures, ``vs_best_baseline_our_engine`` placements alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from colibri_plan.formats.plan import TIER_DISK, TIER_RAM
from colibri_plan.planner.baselines import fit_layers, hot_first, uniform
from colibri_plan.planner.compute import HOST_TIERS
from colibri_plan.planner.knobs import COLIBRI_QUEUE_DEPTH, COLIBRI_VRAM_OVERHEAD_BYTES
from colibri_plan.planner.options import DEFAULTS

#: colibrì's knobs that put the dense trunk (round-robin over its GPUs) and attention on the GPU
GPU_TRUNK_KNOBS = "CUDA_DENSE=1 COLI_CUDA_ATTN=1"
#: colibrì's DIRECT=0 fill with the machine's whole page cache, beyond the budget (shown apart)
OUTSIDE_ROW = "colibri DIRECT=0 (beyond --ram)"
#: llama.cpp reads CPU-layer experts by page faults on its mmap: one read in flight per faulting thread
LLAMA_QUEUE_DEPTH = 1


def _engine_setup(setup, *, depth: int | None = None, page_cache: bool = False, overhead: int = 0,
                  checksums: bool = True, pool_bytes: int | None = None):
    """A copy of ``setup`` whose problem prices placements as another engine runs them; ``pool_bytes``:
    the page cache's pool (default: the machine's, beyond the budget)."""
    res = setup.res if depth is None else setup.res.at_queue_depth(depth)
    pool = int(setup.knobs.get("page_cache_pool_bytes", 0)) if pool_bytes is None else int(pool_bytes)
    res = dataclasses.replace(res, page_cache_pool_bytes=pool if page_cache else 0,
                              checksum_gbps=res.checksum_gbps if checksums else None)
    pr = dataclasses.replace(setup.problem, res=res, vram_overhead_bytes=overhead)
    return dataclasses.replace(setup, res=res, problem=pr)


def row(name: str, setup, tiers: np.ndarray, slots: np.ndarray, engine: str, ours=None) -> dict:
    """One compare row: the cost of (tiers, slots) under ``setup`` and the knobs it was priced with."""
    from colibri_plan.planner.make import cost_of

    cost = cost_of(setup, tiers, slots)
    pr, res = setup.problem, setup.res
    decode = pr.weights > 0
    out = {"placement": name, "engine": engine, "_trunk": setup.trunk.name if setup.trunk else "cpu",
           **{k: cost[k] for k in ("tok_s", "decode_s_per_token", "hit_rate", "disk_bytes_per_token")},
           "knobs": {"queue_depth": int(res.disk_queue_depth), "disk_read_gbps": res.disk_read_gbps,
                     "o_direct": res.page_cache_pool_bytes == 0,
                     "page_cache_hit_rate": cost["page_cache"]["hit_rate"],
                     "page_cache_bytes": int(cost["page_cache"]["capacity_experts"]) * pr.expert_bytes,
                     "pinned_experts": int(np.sum(tiers == TIER_RAM)),
                     "lru_slots_max": int(slots[decode].max()) if decode.any() and slots.size else 0,
                     "vram_overhead_bytes_per_expert": int(pr.vram_overhead_bytes),
                     "keep_host_copies": bool(pr.keep_host_copies),
                     "host_copy_bytes": int(pr.host_copies(tiers) * pr.expert_bytes),
                     "cache_model": cost.get("cache_model", "che"),
                     # which processor computes each host tier (the plan's compute vocabulary; all on the
                     # CPU when absent) and the experts pinned on unified-memory GPUs (hot-first deals them)
                     "compute": {t: dict(res.compute).get(t, "cpu") for t in HOST_TIERS},
                     "unified_experts": {g.key: int(np.sum(tiers == d)) for d, g in enumerate(res.gpus)
                                         if g.unified}}}
    if ours is not None:
        out["tok_s_our_engine"] = cost_of(ours, tiers, slots)["tok_s"]
    return out


def trunk_setups(setup):
    """(setup with the trunk on the CPU, setup with it on a GPU or None) among ``setup`` and the trunk
    options the solve priced (``setup.trunk_alternatives``): the fastest GPU one."""
    alts = dict(getattr(setup, "trunk_alternatives", None) or {})
    name = setup.trunk.name if setup.trunk is not None else "cpu"
    alts[name] = setup
    gpu = [s for k, s in alts.items() if k != "cpu"]
    best = min(gpu, key=lambda s: s.trunk.seconds) if gpu else None
    if "split" in alts and setup.knobs.get("target") == "colibri":   # colibrì's CUDA_DENSE over COLI_GPUS
        best = alts["split"]
    return alts.get("cpu", setup), best


def compare_placements(setup, sol, *, host_copy_toggle: bool = True,
                       time_limit_s: float = DEFAULTS.time_limit_s, llama: dict | None = None,
                       calibrated_on: str = "uncalibrated") -> list:
    """Rows for ``solve --compare`` (module docstring): ours first, then the baselines, then (with a
    discrete GPU holding experts) ours with the other host-copy setting, the llama.cpp pick and the
    page-cache row outside the budget; each row has ``vs_best_baseline`` (tok/s over the fastest
    baseline's) and ``calibrated_on`` (our rows: ``calibrated_on``; llama.cpp's: its coefficients').
    ``llama``: the plan's ``llamacpp`` section (:func:`~.llamacpp_inputs.section`; default: priced here
    from the setup, uncalibrated)."""
    rows = [row("colibri-plan (optimised)", setup, sol.tiers, sol.lru_slots, "colibri-plan")]
    cpu_trunk, gpu_trunk = trunk_setups(setup)
    budget = int(setup.problem.ram_budget_bytes)
    for direct in (True, False):   # DIRECT=0: the page cache inside the same budget as every row
        colibri = _engine_setup(cpu_trunk, depth=COLIBRI_QUEUE_DEPTH, page_cache=not direct,
                                overhead=COLIBRI_VRAM_OVERHEAD_BYTES, checksums=False, pool_bytes=budget)
        rows.append(row("colibri hot-first" + ("" if direct else " (DIRECT=0)"), colibri,
                        *hot_first(colibri.problem), f"colibri (DIRECT={int(direct)})", cpu_trunk))
    if gpu_trunk is not None:     # the same with the trunk and attention on the GPU (colibrì's knobs)
        colibri = _engine_setup(gpu_trunk, depth=COLIBRI_QUEUE_DEPTH, overhead=COLIBRI_VRAM_OVERHEAD_BYTES,
                                checksums=False)
        rows.append(row(f"colibri hot-first ({GPU_TRUNK_KNOBS})", colibri, *hot_first(colibri.problem),
                        f"colibri (DIRECT=1 {GPU_TRUNK_KNOBS})", gpu_trunk))
    mmap = _engine_setup(setup, depth=LLAMA_QUEUE_DEPTH, page_cache=True, checksums=False, pool_bytes=budget)
    t, _ = fit_layers(setup.problem)
    t = np.where(t == TIER_RAM, TIER_DISK, t)       # mmap: CPU layers are page-cache pages, not pins
    rows.append(row("llama.cpp --fit layers", mmap, t, np.zeros(len(t), dtype=np.int64), "llama.cpp (mmap)",
                    setup))
    rows.append(row("uniform", setup, *uniform(setup.problem), "colibri-plan", setup))
    n_base = len(rows)
    discrete = [d for d, g in enumerate(setup.res.gpus) if not g.unified]
    if host_copy_toggle and any(np.any(sol.tiers == d) for d in discrete):
        from colibri_plan.planner.solve import solve_placement

        keep = not setup.problem.keep_host_copies
        other = dataclasses.replace(setup, problem=dataclasses.replace(setup.problem, keep_host_copies=keep))
        alt = solve_placement(other.problem, time_limit_s=time_limit_s)
        rows.append(row(f"colibri-plan (host copies {'kept' if keep else 'released'})", other, alt.tiers,
                        alt.lru_slots, "colibri-plan"))
    rows[0]["tok_s_our_engine"] = rows[0]["tok_s"]
    for r in rows[n_base:]:
        r["tok_s_our_engine"] = r["tok_s"]
    _outside_budget_row(rows, cpu_trunk, budget)
    for r in rows:
        r["trunk"] = r.pop("_trunk")
        r.setdefault("calibrated_on", calibrated_on)
    from colibri_plan.planner import llamacpp_compare, llamacpp_inputs

    llama = llama or llamacpp_inputs.section(setup)
    llamacpp_compare.apply(rows, llama, llamacpp_inputs.from_setup(setup)["geometry"])
    best = max(r["tok_s"] for r in rows[1:n_base])
    same = max(r["tok_s_our_engine"] for r in rows[1:n_base])
    for r in rows:   # a row beyond the budget is not comparable: no ratio
        off = r.get("outside_budget") or r.get("not_comparable")
        r["vs_best_baseline"] = r["tok_s"] / best if best > 0 and not off else None
        r["vs_best_baseline_our_engine"] = (r["tok_s_our_engine"] / same if same > 0 and not off else None)
    return rows


def _outside_budget_row(rows: list, cpu_trunk, budget: int) -> None:
    """Append colibrì's DIRECT=0 fill with the machine's whole page cache (beyond ``--ram``), apart and
    explained, when the machine has more than the budget for it."""
    pool = int(cpu_trunk.knobs.get("page_cache_pool_bytes", 0))
    if pool <= budget:
        return
    colibri = _engine_setup(cpu_trunk, depth=COLIBRI_QUEUE_DEPTH, page_cache=True,
                            overhead=COLIBRI_VRAM_OVERHEAD_BYTES, checksums=False)
    r = row(OUTSIDE_ROW, colibri, *hot_first(colibri.problem),
            "colibri (DIRECT=0)", cpu_trunk)
    r["tok_s_our_engine"] = r["tok_s"]
    r["outside_budget"] = True
    r["note"] = (f"uses up to {(pool - budget) / 1e9:.2f} GB of page cache beyond the {budget / 1e9:.2f} GB "
                 "expert budget every other row keeps to: not comparable, shown apart")
    rows.append(r)


def colibri_ram_sweep(setup, ram_bytes: list[int], pin_bytes: int) -> list[dict]:
    """colibrì with buffered reads (``DIRECT=0``) as ``RAM_GB`` grows with ``PIN_GB`` fixed: the pins stay,
    the extra RAM goes to LRU slots (its cap auto-raise), and every slot takes page cache twice
    (:mod:`colibri_plan.planner.page_cache`), so past some budget more RAM is slower.

    Args:
        ram_bytes: expert RAM budgets to try (the plan's ``ram_budget_bytes`` scale; the page-cache pool
            is the machine's and stays). pin_bytes: colibrì's ``PIN_GB`` in bytes.

    Returns:
        rows {"ram_budget_bytes", "tok_s", "lru_slots", "pinned_experts", "page_cache_bytes",
        "page_cache_hit_rate", "lru_hit_rate"}.
    """
    from colibri_plan.planner.baselines import _finish

    colibri = _engine_setup(setup, depth=COLIBRI_QUEUE_DEPTH, page_cache=True,
                            overhead=COLIBRI_VRAM_OVERHEAD_BYTES, checksums=False)
    out = []
    for ram in ram_bytes:
        pr = dataclasses.replace(colibri.problem, ram_budget_bytes=int(ram))
        capped = dataclasses.replace(pr, ram_budget_bytes=min(int(ram), int(pin_bytes)
                                                              + int(pr.lru_slots.sum()) * pr.expert_bytes))
        tiers, _ = hot_first(capped)                       # PIN_GB bounds the pins ...
        tiers, slots = _finish(pr, tiers)                  # ... and CAP_RAISE fills the rest with slots
        r = row("colibri hot-first (DIRECT=0)", dataclasses.replace(colibri, problem=pr), tiers, slots,
                "colibri (DIRECT=0)")
        h = r["hit_rate"]
        out.append({"ram_budget_bytes": int(ram), "tok_s": r["tok_s"],
                    "lru_slots": r["knobs"]["lru_slots_max"], "pinned_experts": r["knobs"]["pinned_experts"],
                    "page_cache_bytes": r["knobs"]["page_cache_bytes"],
                    "page_cache_hit_rate": r["knobs"]["page_cache_hit_rate"],
                    "lru_hit_rate": h["lru"] / (h["lru"] + h["disk"]) if h["lru"] + h["disk"] else 0.0})
    return out


# ---- the answer `solve` prints first: one row per engine a user may deploy -------------------------------

@dataclass(frozen=True)
class DeployPaths:
    """Where the files each engine's command names live (absolute paths), or None for a placeholder.

    Attributes:
        plan: the plan file; usage: colibrì's usage file beside it; written: whether both exist now.
        pack: our engine's expert pack folder; gguf: llama.cpp's GGUF file; colibri_model: colibrì's
            converted model folder (COLI_MODEL).
    """

    plan: str
    usage: str
    written: bool = False
    pack: str | None = None
    gguf: str | None = None
    colibri_model: str | None = None


def _prefill_at(plan, tiers: np.ndarray, fig_change: dict) -> float | None:
    """Seconds to the first token of the plan's predicted prompt with ``tiers`` [rows, E] and the plan's
    prefill figures changed by ``fig_change`` (another engine's disk rate); None without figures."""
    from colibri_plan.formats.plan import layer_probabilities
    from colibri_plan.planner.prefill import predict_prefill

    pre = plan.doc["predicted"].get("prefill")
    probs = layer_probabilities(plan)
    if not isinstance(pre, dict) or not isinstance(pre.get("figures"), dict) or probs is None:
        return None
    n_layers = int(plan.doc["model"].get("n_layers") or max(plan.layer_ids) + 1)
    decode = np.array([lid < n_layers for lid in plan.layer_ids])
    return predict_prefill(probs, tiers, decode, int(pre["prompt_tokens"]),
                           {**pre["figures"], **fig_change})["ttft_s"]


def _our_row(plan, paths: DeployPaths, unsupported: str | None) -> dict:
    from colibri_plan.planner.exports import colibri_plan_command

    p, name = plan.doc["predicted"], plan.doc["model"].get("name", "model")
    pack = paths.pack or f"/path/to/{name}-pack"
    notes = [] if paths.pack else ["pack the checkpoint first: colibri-plan model pack "
                                   f"/path/to/{name}-checkpoint {pack}"]
    return {"engine": "colibri-plan", "what": "this plan on the bundled engine", "tok_s": p["tok_s"],
            "ttft_s": (p.get("prefill") or {}).get("ttft_s"), "command": None if unsupported else
            colibri_plan_command(paths.plan, pack), "why_not": unsupported, "notes": notes}


def _colibri_row(setup, plan, paths: DeployPaths) -> dict:
    from colibri_plan.errors import ColibriError
    from colibri_plan.planner.exports import colibri_command, colibri_env, colibri_tiers
    from colibri_plan.planner.solve import evaluate

    row = {"engine": "colibri", "what": "the plan exported (PIN usage file, DIRECT=1)"}
    try:
        data = colibri_env(plan, paths.usage)
    except ColibriError as exc:
        return {**row, "tok_s": None, "ttft_s": None, "command": None, "why_not": str(exc), "notes": []}
    tiers, slots = colibri_tiers(plan, data)
    colibri = _engine_setup(setup, depth=COLIBRI_QUEUE_DEPTH, overhead=COLIBRI_VRAM_OVERHEAD_BYTES,
                            checksums=False)
    cost = evaluate(colibri.problem, tiers, slots)
    name = plan.doc["model"].get("name", "model")
    model_dir = paths.colibri_model or f"/path/to/{name}-colibri"
    notes = [] if paths.colibri_model else [f"COLI_MODEL: colibrì's converted model folder (replace "
                                            f"{model_dir})"]
    notes.append(f"priced at colibrì's read depth {colibri.res.disk_queue_depth} (the plan: "
                 f"{setup.res.disk_queue_depth}), without checksums")
    return {**row, "tok_s": cost["tok_s"], "ttft_s": _prefill_at(plan, tiers, {
        "disk_gbps": colibri.res.disk_read_gbps, "checksum_gbps": None}),
            "command": colibri_command(data, model_dir), "why_not": None, "notes": notes + data["notes"]}


def _llama_row(setup, plan, paths: DeployPaths) -> dict:
    from colibri_plan.planner.exports_llama import llama_candidates, llama_command, llama_tiers
    from colibri_plan.planner.exports_llama import placeholder_gguf as placeholder
    from colibri_plan.planner.solve import evaluate

    sec = plan.doc.get("llamacpp")
    if isinstance(sec, dict) and isinstance(sec.get("chosen"), dict):   # --target llama.cpp: its own pick
        return _llama_pick_row(plan, paths, sec)
    layout = llama_candidates(plan)[0]          # issue 27: price every candidate, keep the fastest
    tiers, slots = llama_tiers(plan, layout)
    llama = _engine_setup(setup, depth=LLAMA_QUEUE_DEPTH, page_cache=True, checksums=False)
    cost = evaluate(llama.problem, tiers, slots)
    disk = cost["hit_rate"]["disk"]
    cached = cost["page_cache"]["hit_rate"] / disk if disk > 0 else 0.0   # of the CPU layers' reads
    res = llama.res
    gbps = (min(res.ram_read_gbps, res.disk_read_gbps / max(1e-3, 1.0 - cached)) if res.disk_read_gbps
            else None)
    gguf = paths.gguf or placeholder(plan)
    gpu_layers = sum(len(v) for k, v in layout.layers.items() if k != "CPU")
    notes = ([] if paths.gguf else [f"-m: the model's GGUF file (replace {gguf}, or solve --gguf FILE)"]) + [
        "time to first token: our prefill model at this placement and llama.cpp's reads; llama.cpp's own "
        "batched prompt path (it copies CPU-held weights to the GPU for large batches) is not modelled",
        *layout.notes]
    if cached > 0:  # mmap keeps to no budget: say so, with the figure inside it (as --compare's rows price)
        inside = evaluate(_engine_setup(setup, depth=LLAMA_QUEUE_DEPTH, page_cache=True, checksums=False,
                                        pool_bytes=int(setup.problem.ram_budget_bytes)).problem, tiers, slots)
        pool = int(llama.res.page_cache_pool_bytes)
        notes.append(f"priced with the OS page cache its mmap takes beyond the plan's RAM budget (up to "
                     f"{pool / 1e9:.1f} GB here: {cached:.0%} of its CPU layers' reads); keeping to the "
                     f"budget, as --compare's rows do: {inside['tok_s']:.3g} tok/s")
    return {"engine": "llama.cpp", "what": f"whole layers: {gpu_layers} of {len(tiers)} on the GPUs, the "
            "rest read through mmap", "tok_s": cost["tok_s"],
            "ttft_s": _prefill_at(plan, tiers, {"disk_gbps": gbps, "checksum_gbps": None}),
            "command": llama_command(layout, gguf), "why_not": None, "notes": notes}


def _llama_pick_row(plan, paths: DeployPaths, sec: dict) -> dict:
    """The llama.cpp row of a plan solved with ``--target llama.cpp``: the placement its cost model picked
    (planner/llamacpp_choice), at its predicted speed and with the arguments ``export --to llama.cpp``
    prints, not our engine's model of a whole-layer export (which prices the CPU layers at our kernels'
    rates: 10.2 tok/s beside 113 measured on an H200 host, bench/results/h200-llamacpp/)."""
    from colibri_plan.planner.exports_llama import export_llama_cpp

    c, ex = sec["chosen"], export_llama_cpp(plan, paths.gguf)
    n = (plan.doc["predicted"].get("prefill") or {}).get("prompt_tokens")
    pre = c.get("prefill_tok_s")
    return {"engine": "llama.cpp", "what": f"{sec['verdict']}: its own placement, priced by its cost model "
            f"({sec.get('calibrated_on') or 'uncalibrated'})", "tok_s": c["decode_tok_s"],
            "ttft_s": n / pre if n and pre else None, "command": ex["command"], "why_not": None,
            "notes": list(ex.get("notes", []))}


def engine_rows(setup, plan, paths: DeployPaths, ours_unsupported: str | None = None) -> list[dict]:
    """One row per engine a user may deploy the plan with: ours, colibrì and llama.cpp, each priced as
    that engine runs the exact arguments its command carries (:func:`row`'s knobs: colibrì reads at depth
    1-2 without checksums; llama.cpp runs whole layers, the rest through mmap and the page cache).

    Args:
        setup: the solve's :class:`~colibri_plan.planner.make.Setup`, or one rebuilt from the plan alone
            (:func:`colibri_plan.planner.whatif.setup_from_plan`). plan: the solved Plan.
        paths: the files the commands name. ours_unsupported: why the bundled engine cannot run this
            model family (None: it can); its row then has no command.

    Returns:
        [{"engine", "what", "tok_s", "ttft_s" (time to first token of ``predicted.prefill``'s prompt, s;
        None without prefill figures), "command" (None when the engine cannot run it), "why_not",
        "notes"}].
    """
    if "page_cache_pool_bytes" not in (setup.knobs or {}):   # a setup rebuilt from the plan alone
        pool = ((plan.doc.get("knobs") or {}).get("page_cache") or {}).get("pool_bytes", 0)
        setup = dataclasses.replace(setup, knobs={**(setup.knobs or {}), "page_cache_pool_bytes": int(pool)})
    return [_our_row(plan, paths, ours_unsupported), _colibri_row(setup, plan, paths),
            _llama_row(setup, plan, paths)]
