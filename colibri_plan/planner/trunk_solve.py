"""The trunk as a decision of the solver: for each trunk option, the budgets it leaves, the expert
placement solved under them, and the fastest (``--trunk auto``) or the forced one.

For an option on a discrete GPU d, d's expert budget loses the trunk's bytes and the KV cache's
(:class:`~colibri_plan.planner.trunk.TrunkOption`: ``vram_bytes``) and the RAM budget gets back what it
charged for them (``ram_freed_bytes``); the expert placement is then solved as before and the option's
trunk seconds added. GPU options that are the same problem up to a renaming of identical devices (same
figures, same budget) are solved once (``same_as``). Options that cannot fit are not solved; their
reason is reported. The report (``solve`` prints it as the VRAM trade) lists every option.
"""

from __future__ import annotations

import dataclasses
import shlex

from colibri_plan.errors import BudgetError, ColibriError, InputError
from colibri_plan.formats.plan_trunk import (
    CPU,
    PAGE_TOKENS,
    TrunkPlacement,
    check_trunk_budgets,
    device_kv_bytes_per_token,
    kv_bytes,
    parse_trunk,
)
from colibri_plan.planner.budgets import fmt_gb, ram_kv_bytes_per_token
from colibri_plan.planner.compute import choose_compute, mapped_candidates, pinned_alternative
from colibri_plan.planner.trunk import device_figures, trunk_options
from colibri_plan.planner.trunk_step import replays_step

AUTO = "auto"


def check_trunk_choice(choice: str, keys: list[str]) -> None:
    """InputError when ``choice`` is not "auto", "cpu", "split" or one of ``keys`` (the profile's GPUs)."""
    if choice in (AUTO, CPU, "split") or choice in keys:
        return
    q = shlex.quote(choice)     # as typed on a shell: an empty value reads ''
    raise InputError(f"--trunk {q}: the profile has no device {q}; choose auto, cpu"
                     + "".join(f", {k}" for k in keys) + (", split" if len(keys) > 1 else ""))


def _kv_message(key: str, ctx: int, kv: int, have: int) -> str:
    return (f"trunk on {key}: the KV cache of --context {ctx} tokens needs {kv} B ({fmt_gb(kv)} GB) there "
            f"and {key} has {have} B ({fmt_gb(have)} GB) after its reserve; give a smaller --context, "
            "--trunk cpu, or more VRAM for the plan (a larger --vram or a smaller --vram-reserve)")


def _no_split_message(opts, vram_budget: dict, choices: list[str], spec_kv_bytes_per_token: int) -> str:
    """Why ``--trunk split`` is not an option: fewer than two discrete GPUs, one GPU that holds the
    trunk and KV cache alone, or GPUs whose budgets together cannot hold them (bytes asked and held;
    a split's cache at ``spec_kv_bytes_per_token``, the model spec's figure)."""
    gpus = [o for o in opts if o.vram_bytes and not o.split]     # the discrete GPUs' single-device options
    alt = f"choose {', '.join(choices)}"
    if len(gpus) < 2:
        return (f"--trunk split: no layer split to choose: it needs at least two discrete GPUs and the "
                f"profile has {len(gpus)}; {alt}")
    # a split holds the cache at the spec's figure (an export for llama.cpp's 16-bit cache), a single GPU
    # at the engine's float32 one: the same paged tokens
    tokens = gpus[0].kv_bytes // max(1, gpus[0].kv_bytes_per_token)
    need = gpus[0].dense_bytes + tokens * int(spec_kv_bytes_per_token)
    have = sum(int(vram_budget.get(o.device, 0)) for o in gpus)
    if have < need:
        return (f"--trunk split: no layer split fits: the dense trunk and KV cache need {need} B "
                f"({fmt_gb(need)} GB) and the {len(gpus)} GPUs' budgets together hold {have} B "
                f"({fmt_gb(have)} GB); give a smaller --context or --dense-format, or {alt}")
    return f"--trunk split: one GPU holds the trunk and KV cache, so there is no layer split to choose; {alt}"


def option_fit(setup, opt) -> None:
    """Raise BudgetError when ``opt`` does not fit the devices' budgets (bytes asked and available), or
    keeps the trunk in a RAM budget that cannot hold it (forced GPU trunk: build_setup's trunk_to_vram)."""
    ctx = setup.budgets.context_tokens
    ram = int(setup.budgets.ram_budget_bytes) + int(opt.ram_freed_bytes)
    if ram < 0:
        raise BudgetError(f"trunk on {opt.name}: the RAM budget is {-ram} B ({fmt_gb(-ram)} GB) short of "
                          f"the dense trunk and the KV cache of --context {ctx} tokens it keeps in RAM; give "
                          "more --ram, a smaller --context, or the trunk a GPU (--trunk)")
    for key, need in opt.vram_bytes.items():
        have = int(setup.budgets.vram_budget_bytes.get(key, 0))
        share = need / max(1, opt.dense_bytes + opt.kv_bytes)
        kv = int(opt.kv_bytes * share)
        if kv > have:
            raise BudgetError(_kv_message(key, ctx, kv, have))
        if need > have:
            raise BudgetError(f"trunk on {key}: the dense trunk and KV cache need {need} B ({fmt_gb(need)} "
                              f"GB) there and {key} has {have} B ({fmt_gb(have)} GB), which would leave "
                              f"{fmt_gb(have - need)} GB for experts; use --trunk cpu or auto, a smaller "
                              "--context, or a smaller --dense-format")


def segmented_step(opt, spec) -> bool:
    """Whether the engine replays ``opt``'s decode step as graph segments (its trunk on one CUDA GPU, a
    family the capture takes): the cost model then prices a hand-off per hybrid layer
    (:func:`~colibri_plan.planner.costmodel.segmented_layer_seconds`) instead of the trunk's round trip
    at every MoE layer and a host launch per expert."""
    return replays_step(opt.name, opt.split, spec)


def option_setup(setup, opt, spec, lru_slots_fn):
    """A copy of ``setup`` with ``opt``'s trunk: budgets, resources, LRU reserve (``lru_slots_fn``:
    planner.make.auto_lru_slots, passed in as make imports this module) and fixed seconds."""
    b = setup.budgets
    vram = {k: int(v) - int(opt.vram_bytes.get(k, 0)) if not opt.expert_devices or k in opt.expert_devices
            else 0 for k, v in b.vram_budget_bytes.items()}   # colibrì's one device list: no experts there
    ram = int(b.ram_budget_bytes) + int(opt.ram_freed_bytes)
    explain = list(b.explain)
    for key in [k for k in b.vram_budget_bytes if opt.expert_devices and k not in opt.expert_devices]:
        explain.append({"what": f"{key}: no experts (colibrì's COLI_GPU={opt.device.split(':')[1]} names "
                                "one device for trunk and experts)", "bytes": 0})
    for key, n in opt.vram_bytes.items():
        explain.append({"what": f"{key}: dense trunk + KV cache placed on it", "bytes": -n})
        explain.append({"what": f"{key}: left for experts", "bytes": vram[key]})
    if opt.ram_freed_bytes:
        explain.append({"what": f"RAM given back (dense trunk and KV cache on {opt.device})",
                        "bytes": int(opt.ram_freed_bytes)})
        explain.append({"what": "RAM for experts with the trunk on the GPU", "bytes": ram})
    moved = bool(opt.ram_freed_bytes)
    budgets = dataclasses.replace(
        b, ram_budget_bytes=ram, vram_budget_bytes=vram, explain=explain, trunk_device=opt.device,
        trunk_vram_bytes=dict(opt.vram_bytes), dense_bytes=b.dense_bytes - opt.dense_bytes if moved
        else b.dense_bytes, kv_bytes=0 if moved else b.kv_bytes)
    # the trunk's own GPU: its experts need no transfer, and the host launches each of them, or (a
    # segmented step) the launches are captured and the round trip is a hand-off at hybrid layers only
    seg = segmented_step(opt, spec)
    n_moe = max(1, sum(1 for lid in spec.moe_layers if lid < spec.n_layers))  # as the trunk's round trip
    res = dataclasses.replace(setup.res, gpus=tuple(
        dataclasses.replace(g, budget_bytes=vram[g.key], holds_trunk=(mine := not opt.split
                                                                      and g.key == opt.device),
                            expert_call_s=opt.expert_call_s if mine and not seg else 0.0,
                            segmented=mine and seg,
                            handoff_s=opt.roundtrip_s / n_moe if mine and seg else 0.0,
                            # the replayed step's in-graph rates (0: the eager figures)
                            step_expert_gbps=opt.step_expert_gbps if mine and seg else 0.0,
                            step_mapped_gbps=opt.step_mapped_gbps if mine and seg else 0.0)
        for g in setup.res.gpus))
    if setup.knobs.get("target", "colibri-plan") == "colibri-plan" and mapped_candidates(res):
        res = choose_compute(res, spec.expert_bytes(), setup.problem.coef)[0]   # zero-copy pins, per expert
    pr = setup.problem
    knobs = dict(setup.knobs)
    req = "auto" if knobs.get("lru_slots_mode") == "auto" else int(pr.lru_slots.max(initial=0))
    slots = lru_slots_fn(spec, res, ram, pr.weights, pr.probs, req)
    if seg:  # the round trip moves into the expert layers, as a hand-off where the placement has one
        opt = dataclasses.replace(opt, dense_s=opt.dense_s - opt.roundtrip_s, roundtrip_s=0.0)
    problem = dataclasses.replace(pr, res=res, ram_budget_bytes=ram, lru_slots=slots,
                                  fixed_cost_s=opt.seconds)
    return dataclasses.replace(setup, budgets=budgets, res=res, problem=problem, knobs=knobs, trunk=opt)


def _signature(setup, opt, figs):
    """Options equal up to renaming identical GPUs: the device's figures, resource and budget."""
    if opt.name in (CPU, "split"):
        return None
    f = figs[opt.name]
    g = next(g for g in setup.res.gpus if g.key == opt.name)
    return (f.dense_gbps, f.op_s, f.roundtrip_s, f.kv_gbps, f.discrete, g.matmul_gbps, g.h2d_gbps,
            g.d2h_gbps, g.unified, g.budget_bytes, g.link_latency_s, g.mapped_gbps, f.step)


def _row(opt, setup, chosen=False) -> dict:
    vram = setup.budgets.vram_budget_bytes
    return {"option": opt.name, "device": opt.device,
            "split": [{"first_layer": a, "last_layer": b, "device": k} for a, b, k in opt.split],
            "dense_s": opt.dense_s, "attention_s": opt.attention_s, "roundtrip_s": opt.roundtrip_s,
            "dense_bytes": opt.dense_bytes, "kv_bytes": opt.kv_bytes,
            "vram_trunk_bytes": dict(opt.vram_bytes),
            "vram_expert_budget_bytes": {k: int(vram.get(k, 0)) - int(opt.vram_bytes.get(k, 0))
                                         if not opt.expert_devices or k in opt.expert_devices else 0
                                         for k in vram},
            "handoff_s": opt.handoff_s,
            "ram_budget_bytes": int(setup.budgets.ram_budget_bytes) + int(opt.ram_freed_bytes),
            "feasible": True, "why": None, "solved": False, "same_as": None, "tok_s": None,
            "decode_s_per_token": None, "chosen": chosen, "figures": opt.sources}


def choose_trunk(profile, setup, spec, choice: str, solve, lru_slots_fn):
    """Solve the expert placement for each trunk option and keep the fastest, or the forced one.

    Args:
        setup: :class:`~colibri_plan.planner.make.Setup` with the trunk on the CPU (build_setup's).
        choice: "auto", "cpu", "split" or a device key. solve: ``fn(setup) -> Solution``.
        lru_slots_fn: planner.make.auto_lru_slots.

    Returns:
        (setup, solution, report): the chosen option's setup (``setup.trunk`` set) and placement, and
        ``{"mode", "chosen", "options": [...]}`` (one row per option, see :func:`_row`).

    Raises:
        InputError: an unknown device; BudgetError: a forced option that does not fit (KV cache or the
        trunk over the device's budget); and as ``solve`` when no option can be solved.
    """
    keys = [g.key for g in setup.res.gpus]
    check_trunk_choice(choice, keys)
    figs = device_figures(profile, setup.res, spec, setup.dense_fmt, setup.problem.coef)
    target = setup.knobs.get("target", "colibri-plan")
    opts = trunk_options(figs, spec, setup.dense_fmt, setup.budgets.context_tokens,
                         setup.budgets.vram_budget_bytes, setup.problem.coef,
                         host_kv_bytes_per_token=ram_kv_bytes_per_token(spec, target), target=target)
    names = [o.name for o in opts]
    if choice not in (AUTO, *names):
        raise InputError(_no_split_message(opts, setup.budgets.vram_budget_bytes, [AUTO, *names],
                                           spec.kv_bytes_per_token))
    if choice != AUTO:                          # refuse a forced option that cannot fit before solving
        option_fit(setup, opts[names.index(choice)])
    rows = [_row(o, setup, o.name == choice) for o in opts]
    wanted = [i for i, o in enumerate(opts) if choice == AUTO or o.name in (choice, CPU)]
    solved, seen, best, last_exc = {}, {}, None, None
    for i in wanted:
        opt, r = opts[i], rows[i]
        try:
            option_fit(setup, opt)
        except BudgetError as exc:
            r.update(feasible=False, why=str(exc))
            continue
        sig = _signature(setup, opt, figs)
        if sig is not None and sig in seen and choice == AUTO:
            r.update(same_as=seen[sig], **{k: rows[names.index(seen[sig])][k]
                                           for k in ("tok_s", "decode_s_per_token")})
            continue
        s = option_setup(setup, opt, spec, lru_slots_fn)
        try:
            s, sol = _pinned_by_cost(s, solve)
        except ColibriError as exc:
            if choice != AUTO and opt.name == choice:
                raise
            r.update(feasible=False, why=str(exc))
            last_exc = exc
            continue
        if sig is not None:
            seen[sig] = opt.name
        d = sol.cost["decode_s_per_token"]
        r.update(solved=True, decode_s_per_token=d, tok_s=sol.cost["tok_s"])
        solved[opt.name] = (s, sol)
        if (choice == AUTO and (best is None or d < solved[best][1].cost["decode_s_per_token"])) \
                or opt.name == choice:
            best = opt.name
    if best is None:
        raise last_exc if last_exc is not None else BudgetError(
            "no trunk option fits the budgets: " + "; ".join(r["why"] for r in rows if r["why"]))
    for r in rows:
        r["chosen"] = r["option"] == best
    s, sol = solved[best]
    s.trunk_alternatives = {k: v[0] for k, v in solved.items()}   # solve --compare prices both trunks
    return s, sol, {"mode": choice, "chosen": best, "options": rows}


def _pinned_by_cost(s, solve):
    """(setup, solution) of ``s``, whose pinned tier may be computed zero-copy by its trunk GPU
    (planner.compute): the placement is solved with that choice and with the best other processor, and
    the faster whole placement kept; ``s.pinned_decode_s`` records both ({processor: decode s/token})."""
    sol = solve(s)
    alt_res = pinned_alternative(s.res, s.spec.expert_bytes(), s.problem.coef)
    if alt_res is None:
        return s, sol
    alt = dataclasses.replace(s, res=alt_res, problem=dataclasses.replace(s.problem, res=alt_res))
    try:
        alt_sol = solve(alt)
    except ColibriError:     # the other choice cannot be solved: the zero-copy one stands
        return s, sol
    mine, other = dict(s.res.compute)["ram_pinned"], dict(alt_res.compute)["ram_pinned"]
    secs = {mine: sol.cost["decode_s_per_token"], other: alt_sol.cost["decode_s_per_token"]}
    best = (s, sol) if secs[mine] <= secs[other] else (alt, alt_sol)
    best[0].pinned_decode_s = secs
    return best


def trunk_section(setup) -> dict:
    """The plan's ``trunk`` section for ``setup.trunk`` (formats/plan_trunk.py)."""
    opt, b = setup.trunk, setup.budgets
    bpt = int(opt.kv_bytes_per_token or setup.spec.kv_bytes_per_token)
    return TrunkPlacement(
        device=opt.device, dense_format=setup.dense_fmt, dense_bytes=int(opt.dense_bytes),
        kv_device=opt.device, context_tokens=int(b.context_tokens), page_tokens=PAGE_TOKENS,
        kv_bytes_per_token=bpt, kv_bytes=kv_bytes(b.context_tokens, bpt), split=tuple(opt.split)).to_dict()


def predicted_trunk(setup) -> dict:
    """``predicted.trunk`` (seconds per decode token; dense_s_per_token includes the round trip)."""
    opt = setup.trunk
    return {"device": opt.device, "dense_s_per_token": opt.dense_s,
            "attention_s_per_token": opt.attention_s, "host_roundtrip_s_per_token": opt.roundtrip_s,
            "kv_bytes": kv_bytes(setup.budgets.context_tokens,
                                 int(opt.kv_bytes_per_token or setup.spec.kv_bytes_per_token))}


def check_forced_kv(profile, spec, choice: str, context_tokens: int, vram: str, reserve_bytes: int) -> None:
    """Before any budget is worked out: refuse a trunk forced onto a discrete GPU (``choice`` a device
    key) or split over the discrete GPUs (``choice`` "split") whose budgets (free - reserve, or ``--vram``;
    for a split all of them together) cannot hold the KV cache of ``context_tokens`` (the RAM budget would
    otherwise refuse the context first, though the cache would not live there). Other choices, and a
    split with fewer than two discrete GPUs (``choose_trunk`` says why there is no split), pass.

    Raises:
        BudgetError: with the bytes asked and available.
    """
    from colibri_plan.planner.budgets import vram_budgets

    gpus = {f"{g['backend']}:{g['index']}": g for g in profile.gpus()}
    discrete = [k for k, g in gpus.items() if not g.get("unified_memory")]
    if choice not in discrete and not (choice == "split" and len(discrete) > 1):
        return
    budgets = vram_budgets(profile.gpus(), vram, reserve_bytes)[0]
    kv = kv_bytes(context_tokens, spec.kv_bytes_per_token)
    if choice != "split":
        kv = kv_bytes(context_tokens, device_kv_bytes_per_token(spec.kv_bytes_per_token, spec.source))
        if kv > budgets[choice]:
            raise BudgetError(_kv_message(choice, context_tokens, kv, budgets[choice]))
        return
    have = sum(int(budgets[k]) for k in discrete)     # a split spreads the cache's layers over them all
    if kv > have:
        raise BudgetError(f"--trunk split: the KV cache of --context {context_tokens} tokens needs {kv} B "
                          f"({fmt_gb(kv)} GB) and the {len(discrete)} GPUs' budgets together hold {have} B "
                          f"({fmt_gb(have)} GB) after their reserves; give a smaller --context, --trunk cpu, "
                          "or more VRAM for the plan (a larger --vram or a smaller --vram-reserve)")


def validate_trunk(doc: dict) -> None:
    """Re-check a plan's trunk against its budgets, independently of the solver: the section parses (a
    known device, KV bytes = whole pages, a split covering the layers), a GPU trunk's bytes were taken
    out of the expert budgets (at least dense + KV bytes), and no device's expert budget went negative
    (:func:`~colibri_plan.formats.plan_trunk.check_trunk_budgets`, which loading a plan runs too).
    ``validate_plan`` then checks the experts against those budgets.

    Raises:
        FormatError: naming the device and the bytes.
    """
    keys = [d["key"] for d in doc["devices"]]
    check_trunk_budgets(doc, parse_trunk(doc, keys, doc["model"].get("n_layers")))
