"""From profile + model + heat to a plan: budgets, the placement problem, the solve, the plan document."""

from __future__ import annotations

import dataclasses
import datetime as _dt

import numpy as np

from colibri_plan import quant
from colibri_plan.errors import BudgetError, ColibriError, InputError
from colibri_plan.formats.heat import Heat
from colibri_plan.formats.heat_align import align_heat, uniform_heat
from colibri_plan.formats.plan import Plan, layers_from_tiers, validate_plan
from colibri_plan.heatsynth import synth_heat
from colibri_plan.planner.budgets import (
    Budgets,
    parse_gb,
    ram_budget,
    ram_kv_bytes_per_token,
    resources_from_profile,
    vram_budgets,
)
from colibri_plan.planner.cache_model import TraceHits
from colibri_plan.planner.compute import choose_compute, colibri_unified_compute, compute_section
from colibri_plan.planner.costmodel import Coefficients, Resources, attention_seconds, dense_seconds
from colibri_plan.planner.knobs import (
    COLIBRI_VRAM_OVERHEAD_BYTES,
    check_target,
    choose_queue_depth,
    knobs_section,
    lru_slot_candidates,
    repin_section,
    search_lru_slots,
)
from colibri_plan.planner.options import DEFAULTS, SolveOptions
from colibri_plan.planner.page_cache import page_cache_pool
from colibri_plan.planner.solve import Problem, Solution, evaluate, solve_placement

#: share of the expert RAM budget the automatic LRU reserve may take when experts must stream
LRU_AUTO_SHARE = 0.10


def heat_for(spec, heat: Heat | str | None, seed: int = 0) -> Heat:
    """The heat to plan with, aligned to ``spec``: a Heat, "uniform", "synth" / None (synthesised from real
    OLMoE routing, with a warning in ``heat.warnings``).

    Raises:
        MismatchError: the heat belongs to another model.
    """
    if heat is None or heat == "synth":
        h = synth_heat(spec, seed=seed)
        # h.source already says "synthesised from real olmoe routing (...)": not repeated here
        h.warnings.append(f"no routing statistics given (--heat omitted or 'synth'): heat {h.source}. "
                          "Record real statistics (`colibri-plan run --stats-out`) and pass --heat for "
                          "a better plan")
        return h
    if heat == "uniform":
        return uniform_heat(spec)[0]
    out = align_heat(heat, spec)
    out.trace = getattr(heat, "trace", None)   # keyed by layer id: alignment keeps the MoE layer ids
    return out


def dense_read_bytes(spec, dense_fmt: str) -> int:
    """Dense bytes a decode token reads: the trunk minus the embedding table (one row is looked up)."""
    embed = spec.vocab_size * spec.hidden_size * quant.bits(dense_fmt) // 8
    return max(0, spec.dense_bytes(dense_fmt) - embed)


def auto_lru_slots(spec, res: Resources, ram_bytes: int, weights: np.ndarray, probs: np.ndarray,
                   requested: str | int = "auto") -> np.ndarray:
    """LRU slots per row. "auto": 0 when every selectable expert of the decode rows fits in VRAM + RAM;
    else min(top-k, what LRU_AUTO_SHARE of the RAM budget buys), at least 1 (if RAM holds a slot per row),
    on decode rows.

    Under the independent-reference model the heat describes, pinning a row's hottest streamed experts
    never does worse than an LRU of the same size, so the optimiser spends RAM on pins; the LRU reserve is
    for what heat cannot see (temporal locality, prompt shifts) and for the engine's promotions.
    """
    b = spec.expert_bytes()
    decode = weights > 0
    if requested != "auto":
        n = int(requested)
        if n < 0:
            raise BudgetError(f"--lru-slots must be >= 0, got {n}")
        return np.where(decode, n, 0)
    need = int(np.sum((probs > 0) & decode[:, None]))
    cap = ram_bytes // b + sum(g.budget_bytes // b for g in res.gpus if not g.unified)
    if need <= cap:
        return np.zeros(len(weights), dtype=np.int64)
    rows = max(1, int(decode.sum()))
    per_row = int(LRU_AUTO_SHARE * ram_bytes // (rows * b))
    fit = int(ram_bytes // (rows * b))                 # never more than the RAM can hold
    return np.where(decode, min(max(1, min(spec.top_k, per_row)), fit), 0)


def check_options(opts: SolveOptions) -> dict | None:
    """Check ``opts`` before any work: the budget values (``ram``, ``vram``, ``headroom``: 'auto' or a
    finite GB figure >= 0; ``lru_slots``: 'auto' or a whole number), the re-pinning values, the target
    engine and the VRAM reserve. Returns the plan's ``repin`` section (None: re-pinning off).

    Raises:
        InputError / BudgetError: naming the option (the CLI turns them into usage errors).
    """
    if str(opts.ram) != "auto":
        parse_gb(opts.ram, "--ram")
    if str(opts.vram) != "auto":
        for v in str(opts.vram).split(","):
            parse_gb(v, "--vram")
    if opts.headroom is not None:
        parse_gb(opts.headroom, "--headroom")
    if str(opts.lru_slots) != "auto" and not str(opts.lru_slots).isdigit():
        raise InputError(f"--lru-slots must be 'auto' or a whole number, got {opts.lru_slots!r}")
    repin = repin_section(opts.repin_every, opts.repin_window)
    check_target(opts.target)
    from colibri_plan.planner.reads import READ_CHOICES

    if opts.reads not in READ_CHOICES:
        raise InputError(f"--reads {opts.reads!r}: use one of {', '.join(READ_CHOICES)}")
    if opts.reads == "buffered" and opts.target != "colibri-plan":
        raise InputError(f"--reads buffered is our engine's choice; --target {opts.target} reads as that "
                         "engine does")
    if opts.vram_reserve_gb < 0:
        raise BudgetError(f"--vram-reserve cannot be negative ({opts.vram_reserve_gb} GB)")
    return repin


def _option_notes(profile, ram, vram, headroom) -> list[str]:
    """Warnings for options that do not apply; raises InputError for a --vram with no VRAM to give it to.

    ``--vram`` with numbers on a profile without a discrete GPU is refused whatever the count of figures
    (one figure used to be ignored silently while two were refused); 0 is accepted (no VRAM tier).
    """
    notes = []
    if headroom is not None and str(ram) != "auto":
        notes.append(f"--headroom {headroom} does not apply with --ram {ram}: an explicit --ram is the whole "
                     "process budget (headroom is only subtracted from --ram auto); ignored")
    discrete = [g for g in profile.gpus() if not g.get("unified_memory")]
    if str(vram) != "auto" and not discrete:
        if any(parse_gb(v, "--vram") > 0 for v in str(vram).split(",")):
            what = "only unified-memory GPUs (their experts share the RAM budget)" if profile.gpus() \
                else "no GPU"
            raise InputError(f"--vram {vram}: the profile has {what}, so there is no VRAM to budget; leave "
                             "--vram out, or profile a machine with a discrete GPU (--backends cuda ...)")
    return notes


@dataclasses.dataclass
class Setup:
    """Everything a placement is evaluated against (shared by solve, baselines and what-if)."""

    spec: object
    heat: Heat
    budgets: Budgets
    res: Resources
    problem: Problem
    dense_fmt: str
    warnings: list
    knobs: dict = dataclasses.field(default_factory=dict)
    trunk: object = None   # the chosen planner.trunk.TrunkOption (None: priced as a CPU trunk)
    trunk_alternatives: dict = dataclasses.field(default_factory=dict)   # option name -> its solved Setup
    pinned_decode_s: dict = dataclasses.field(default_factory=dict)   # zero-copy pins vs not (trunk_solve)


def build_setup(profile, spec, heat=None, opts: SolveOptions = DEFAULTS, *,
                trunk_to_vram: bool = False) -> Setup:
    """Budgets, resources and the placement problem for ``spec`` on ``profile`` under ``opts``.

    ``opts.dense_fmt`` None: the format the model stores its dense trunk in when known
    (``spec.dense_format``, e.g. f32 for an expert pack), else the expert format. ``opts.target``,
    ``queue_depth`` and ``keep_host_copies`` are the engine knobs of :mod:`colibri_plan.planner.knobs`
    (``setup.knobs`` records them); a routing trace in the heat switches the LRU model to stack distances.
    ``opts.trunk`` is not read here (:func:`make_plan` places the trunk). ``trunk_to_vram``: the trunk is
    forced onto discrete GPUs, so the RAM budget refuses only what stays in RAM
    (``budgets.ram_budget``'s ``moved_bytes``; the budget may be negative until the option gives its
    bytes back).

    Raises:
        BudgetError: negative or too-small budgets; InputError: bad option values, missing profile
        figures; MismatchError: heat for another model.
    """
    check_options(opts)
    o = opts
    dense_fmt = o.dense_fmt or getattr(spec, "dense_format", None) or spec.expert_format
    coef = o.coef or Coefficients()
    notes = _option_notes(profile, o.ram, o.vram, o.headroom)
    h = heat_for(spec, heat, o.seed)
    warnings = list(h.warnings) + notes
    kv_bpt = ram_kv_bytes_per_token(spec, o.target)   # ours: the float32 host cache, as the engine holds it
    moved = dense_read_bytes(spec, dense_fmt) + o.context_tokens * kv_bpt if trunk_to_vram else 0
    ram_bytes, ram_explain, parts = ram_budget(spec, profile.ram_available_bytes(), o.ram, o.headroom,
                                               o.context_tokens, dense_fmt, moved, kv_bpt)
    ram_warnings = parts.pop("warnings", [])
    warnings += ram_warnings
    vram_b, vram_explain = vram_budgets(profile.gpus(), o.vram, o.vram_reserve_bytes)
    res, depth_source = choose_queue_depth(resources_from_profile(profile, spec, vram_b), spec.top_k,
                                           o.queue_depth, o.target)
    if o.target == "colibri-plan" and any(g.unified for g in res.gpus):   # ours computes host tiers there
        res = choose_compute(res, spec.expert_bytes(), coef)[0]
    elif o.target == "colibri" and any(g.unified for g in res.gpus):     # colibrì's GPU serves them all
        res = colibri_unified_compute(res)
    budgets = Budgets(ram_budget_bytes=ram_bytes, vram_budget_bytes=vram_b,
                      explain=ram_explain + vram_explain, context_tokens=o.context_tokens,
                      ram_mode=str(o.ram), vram_mode=str(o.vram), **parts)
    probs = h.probabilities()
    weights = np.array([1.0 if lid < spec.n_layers else 0.0 for lid in h.layers])
    slots = auto_lru_slots(spec, res, max(0, ram_bytes), weights, probs, o.lru_slots)
    fixed = (dense_seconds(dense_read_bytes(spec, dense_fmt), res, coef)
             + attention_seconds(o.context_tokens, kv_bpt, res, coef))
    trace = getattr(h, "trace", None)
    hits = TraceHits(trace, h.layers, o.time_limit_s) if trace is not None and trace.steps else None
    problem = Problem(probs=probs, weights=weights, expert_bytes=spec.expert_bytes(), res=res,
                      ram_budget_bytes=max(0, ram_bytes), lru_slots=slots, coef=coef,
                      activation_bytes=spec.hidden_size * 4, fixed_cost_s=fixed,
                      trace_hits=hits if hits is not None and hits.rows_covered() else None,
                      keep_host_copies=bool(o.keep_host_copies),
                      vram_overhead_bytes=COLIBRI_VRAM_OVERHEAD_BYTES if o.target == "colibri" else 0)
    if res.disk_read_gbps is None:
        warnings.append("the profile has no disk figure: the plan may not stream experts from disk")
    if trace is not None and problem.trace_hits is None:
        warnings.append("the heat's routing trace has no decode calls of this model's MoE layers: LRU hit "
                        "rates use Che's independent-request approximation")
    knobs = {"target": o.target, "queue_depth_source": depth_source, "o_direct": True,
             "lru_slots_mode": "auto" if str(o.lru_slots) == "auto" else "fixed",
             "page_cache_pool_bytes": page_cache_pool(profile.ram_available_bytes(), parts["dense_bytes"],
                                                      parts["kv_bytes"], parts["working_bytes"]),
             "ram_warnings": ram_warnings}
    return Setup(spec, h, budgets, res, problem, dense_fmt, warnings, knobs)


def cost_of(setup: Setup, tiers: np.ndarray, slots: np.ndarray) -> dict:
    """Full predicted cost of a placement under ``setup`` (fixed dense/attention terms filled in)."""
    c = evaluate(setup.problem, tiers, slots)
    if setup.trunk is not None:   # the trunk option's own terms (planner.trunk): they are the fixed cost
        c["terms"]["dense_s"], c["terms"]["attention_s"] = setup.trunk.dense_s, setup.trunk.attention_s
        return c
    c["terms"]["dense_s"] = dense_seconds(dense_read_bytes(setup.spec, setup.dense_fmt), setup.res,
                                          setup.problem.coef)
    kv_bpt = ram_kv_bytes_per_token(setup.spec, setup.knobs.get("target", "colibri-plan"))
    c["terms"]["attention_s"] = attention_seconds(setup.budgets.context_tokens, kv_bpt, setup.res,
                                                  setup.problem.coef)
    return c


def plan_document(setup: Setup, profile, tiers: np.ndarray, slots: np.ndarray, solver: dict,
                  profile_source: str = "") -> Plan:
    """Assemble the plan document for a placement (any placement: ours or a baseline's)."""
    spec, res = setup.spec, setup.res
    cost = cost_of(setup, tiers, slots)
    devices = []
    gpu_info = {f"{g['backend']}:{g['index']}": g for g in profile.gpus()}
    for g in res.gpus:
        info = gpu_info.get(g.key, {})
        devices.append({"key": g.key, "name": info.get("name", g.key), "unified": g.unified,
                        "matmul_gbps": g.matmul_gbps})
    doc = {
        "kind": "plan", "schema_version": 1,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "model": {"name": spec.name, "fingerprint": spec.fingerprint(), "family": spec.family,
                  "n_experts": spec.n_experts, "top_k": spec.top_k, "moe_layers": list(spec.moe_layers),
                  "n_layers": spec.n_layers, "expert_bytes": spec.expert_bytes(), "source": spec.source,
                  **_mtp_bytes(spec)},
        "profile": {"fingerprint": profile.fingerprint, "source": profile_source, **profile.summary()},
        "heat": {"fingerprint": setup.heat.fingerprint(), "source": setup.heat.source,
                 "warnings": list(setup.warnings)},
        "budgets": setup.budgets.to_dict(),
        "expert_format": spec.expert_format, "dense_format": setup.dense_fmt,
        "devices": devices,
        "layers": layers_from_tiers(spec.moe_layers, tiers, slots, [g.key for g in res.gpus],
                                    setup.problem.probs),
        "predicted": {k: v for k, v in cost.items()},
        "solver": solver,
        "resources": dataclasses.asdict(res),
        "coefficients": setup.problem.coef.to_dict(),
        "knobs": knobs_section(setup, tiers, slots, cost) if setup.knobs else None,
    }
    if doc["knobs"] is None:
        del doc["knobs"]
    if setup.trunk is not None:
        from colibri_plan.planner.trunk_solve import predicted_trunk, trunk_section

        doc["trunk"], doc["predicted"]["trunk"] = trunk_section(setup), predicted_trunk(setup)
    if res.compute:   # a unified GPU or zero-copy pins: who computes the host tiers, and the comparison
        doc["compute"], doc["compute_explain"] = compute_section(setup)
    return Plan(_jsonable(doc))


def _mtp_bytes(spec) -> dict:
    """``{"mtp_expert_bytes": n}`` when the model has an MTP head row (a MoE layer id >= n_layers):
    colibrì stores those experts at int8 (its MTP shards; 37.79 MB against 21.23 MB int4-g64 on GLM-5.2),
    which its export sizes them at; empty otherwise."""
    if not any(lid >= spec.n_layers for lid in spec.moe_layers):
        return {}
    try:
        return {"mtp_expert_bytes": int(spec.expert_bytes("int8"))}
    except Exception:  # noqa: BLE001 - a spec without the int8 arithmetic simply has no MTP figure
        return {}


def make_plan(profile, spec, heat=None, opts: SolveOptions = DEFAULTS,
              profile_source: str = "") -> tuple[Plan, Solution, Setup]:
    """Solve the placement under ``opts`` and return (plan, solution, setup).

    ``opts.repin_every`` / ``repin_window`` (tokens) write the plan's ``repin`` section
    (:func:`~colibri_plan.planner.knobs.repin_section`); ``opts.trunk`` ("auto", "cpu", "split" or a
    device key) places the dense trunk and KV cache (:func:`~colibri_plan.planner.trunk_solve.choose_trunk`:
    the report is ``plan.doc["solver"]["trunk"]``); ``opts.prompt_tokens`` (None: none) adds
    ``predicted.prefill``, the prefill / time to first token of a prompt that long
    (:mod:`colibri_plan.planner.prefill`); the rest goes to :func:`build_setup`. ``profile_source`` names
    the profile in the plan (a path or "shipped profile NAME").

    Raises:
        InputError: a bad option value (:func:`check_options`) or an unknown --trunk device (before any
        solving), and as :func:`build_setup`; BudgetError: a forced trunk that does not fit.
    """
    from colibri_plan.planner.trunk_solve import (
        check_forced_kv,
        check_trunk_choice,
        choose_trunk,
        validate_trunk,
    )

    repin = check_options(opts)
    trunk = opts.trunk
    if trunk not in ("auto", "cpu"):   # an unknown device, a KV cache past the VRAM: before the RAM budget
        check_trunk_choice(trunk, [f"{g['backend']}:{g['index']}" for g in profile.gpus()])
        check_forced_kv(profile, spec, trunk, opts.context_tokens, opts.vram, opts.vram_reserve_bytes)
    discrete = [f"{g['backend']}:{g['index']}" for g in profile.gpus() if not g.get("unified_memory")]
    setup = build_setup(profile, spec, heat, opts,
                        trunk_to_vram=trunk in discrete or (trunk == "split" and len(discrete) > 1))

    def solve(s):
        try:
            return _solve(s, spec, opts.method, opts.time_limit_s)
        except ColibriError as exc:
            if s.res.disk_read_gbps is None:   # without a disk, every expert must fit in memory
                kind = BudgetError if isinstance(exc, BudgetError) else InputError
                raise kind(no_disk_message(profile)) from exc
            raise

    setup, sol, report = choose_trunk(profile, setup, spec, trunk, solve, auto_lru_slots)
    th = setup.problem.trace_hits
    if th is not None and th.time_limited:   # said once, on stderr and in the plan's heat.warnings
        setup.warnings.append(f"--time-limit {opts.time_limit_s:g} s passed while the routing trace's LRU "
                              "model ran: the rest of the solve priced the LRU with Che's approximation; "
                              "give a longer --time-limit to use the whole trace")
    solver = {"status": sol.status, "gap": sol.gap, "seconds": round(sol.seconds, 3), "method": sol.method,
              "iterations": sol.iterations, "trunk": report}
    reads = None
    if opts.target == "colibri-plan":   # O_DIRECT or buffered reads, priced and chosen (planner/reads.py)
        from colibri_plan.planner.reads import choose_reads

        setup, reads = choose_reads(setup, sol.tiers, sol.lru_slots, cost_of, opts.reads)
    plan = plan_document(setup, profile, sol.tiers, sol.lru_slots, solver, profile_source)
    from colibri_plan.planner.holdout import plan_held_out

    held = plan_held_out(getattr(setup.heat, "trace", None), plan.doc["layers"], spec.n_experts)
    if held is not None:
        plan.doc["predicted"]["hit_rate_held_out"] = held
    from colibri_plan.planner.trunk_gpus import gpu_split_section

    plan.doc["trunk_gpus"] = _jsonable(gpu_split_section(setup, report))   # one GPU or spread, priced
    if reads is not None:
        plan.doc["reads"] = _jsonable(reads)
    if repin is not None:
        plan.doc["repin"] = repin
    if opts.prompt_tokens is not None:
        from colibri_plan.planner.prefill import prefill_section

        pre = prefill_section(profile, setup, sol.tiers, opts.prompt_tokens)
        plan.doc["predicted"]["prefill"] = _jsonable(pre)
    validate_plan(plan, "solved plan: budgets")   # the chosen plan, re-checked without the solver
    validate_trunk(plan.doc)
    return plan, sol, setup


def no_disk_message(profile) -> str:
    """Why a placement needs a disk figure the profile lacks, and how to get one."""
    disk = profile.doc.get("disk")
    why = disk.get("unavailable") if isinstance(disk, dict) else None
    return (f"the profile has no disk measurement ({why or 'not measured'}) and the experts do not all fit "
            "in RAM/VRAM; re-profile with `colibri-plan profile --path DIR` (DIR a writable folder on the "
            "disk that holds the pack), or give more --ram/--vram")


def _solve(setup: Setup, spec, method: str, time_limit_s: float) -> Solution:
    pr = setup.problem
    if pr.trace_hits is not None and setup.knobs["lru_slots_mode"] == "auto" and pr.lru_slots.any():
        # locality: a bigger LRU with fewer pins can win; try a few slot counts, keep the fastest
        decode = pr.weights > 0
        fit = int(pr.ram_budget_bytes // (max(1, int(decode.sum())) * pr.expert_bytes))
        cands = lru_slot_candidates(int(pr.lru_slots.max()), spec.top_k, spec.n_experts, fit)
        sol, pr, tries = search_lru_slots(
            pr, lambda p: solve_placement(p, time_limit_s=time_limit_s / len(cands), method=method), cands)
        setup.problem = pr
        setup.knobs["lru_slots_mode"] = "search (routing trace)"
        setup.knobs["lru_search"] = tries
    else:
        sol = solve_placement(pr, time_limit_s=time_limit_s, method=method)
    return sol


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, float) and not np.isfinite(x):
        raise InputError("a predicted figure is not finite; check the profile's figures")
    return x
