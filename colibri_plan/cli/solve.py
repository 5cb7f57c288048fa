"""`colibri-plan solve`: budgets, optimal placement, plan file, baselines (--compare), what-if."""

from __future__ import annotations

from pathlib import Path

import click

from colibri_plan.cli.common import Steps, emit, json_option, knob_lines, options_arg, progress, table, warn
from colibri_plan.planner.options import DEFAULT_PROMPT_TOKENS, SolveOptions, default_prompt_tokens
from colibri_plan.planner.options import DEFAULTS as D

GB = 1e9


def _finite(param, value: float) -> float:
    """Option callback: FloatRange lets NaN and Infinity through (no comparison fails on NaN)."""
    import math

    from colibri_plan.errors import InputError

    if value is not None and not math.isfinite(value):
        raise InputError(f"{param.opts[0]} must be a finite number, got {value}")
    return value


def _gb(x) -> str:
    return f"{x / GB:,.2f} GB"


def _queue_depth(_ctx, _param, value: str) -> str:
    """Option callback: 'auto' or a whole number in 1..64 (a usage error otherwise, like --lru-slots)."""
    if value != "auto" and not (value.isdigit() and 1 <= int(value) <= 64):
        raise click.BadParameter(f"must be 'auto' or a whole number in 1..64, got {value!r}")
    return value


@click.command("solve")
@click.option("--profile", "profile_path", required=True, help="Profile file (or a shipped profile name).")
@click.option("--model", "model_name", required=True, help="Catalogue name, checkpoint folder, GGUF or spec.")
@click.option("--heat", default=None,
              help="Heat file (engine JSON, colibrì usage/STATS), 'synth' or 'uniform'.")
@click.option("--ram", default=D.ram, show_default=True, help="'auto' or the process RAM budget in GB.")
@click.option("--vram", default=D.vram, show_default=True, help="'auto', or GB per GPU (one, or a,b,c).")
@click.option("--headroom", default=D.headroom, help="OS + page-cache headroom in GB for --ram auto.")
@click.option("--vram-reserve", "vram_reserve_gb", default=D.vram_reserve_gb, show_default=True,
              type=click.FloatRange(0), callback=lambda _c, p, v: _finite(p, v), help="GB kept free per GPU.")
@click.option("--context", "context_tokens", default=D.context_tokens, show_default=True,
              type=click.IntRange(0, 10_000_000), help="Context tokens (KV cache).")
@click.option("--quant", default=None, help="Expert quant format (default: the model's).")
@click.option("--dense-format", "dense_fmt", default=D.dense_fmt,
              help="Dense trunk format (default: as a pack stores it, else the expert format).")
@click.option("--trunk", default=D.trunk, show_default=True,
              help="Where the dense trunk, attention and KV cache run: 'auto' (the solver picks by predicted "
                   "decode time; their VRAM comes out of the experts'), 'cpu', a device key (cuda:0), or "
                   "'split' (layers over the GPUs when none holds them alone).")
@click.option("--prompt-tokens", default=D.prompt_tokens, type=click.IntRange(1, 10_000_000),
              help="Prompt length the plan predicts the prefill (time to first token) at. [default: "
                   f"{DEFAULT_PROMPT_TOKENS}, or --context when that is shorter]")
@click.option("--lru-slots", default=D.lru_slots, show_default=True, help="'auto' or LRU slots per layer.")
@click.option("--out", "out_path", default=None, help="Write the plan here.")
@click.option("--target", type=click.Choice(["colibri-plan", "colibri"]), default=D.target,
              show_default=True,
              help="Engine the plan is for: ours, or colibrì (reads at queue depth 1-2, 0.741 MiB of VRAM "
                   "overhead per expert).")
@click.option("--queue-depth", default=D.queue_depth, show_default=True, callback=_queue_depth,
              help="Expert reads the engine has in flight (1..64): the disk figure priced; 'auto': the "
                   "target engine's.")
@click.option("--keep-host-copies", is_flag=True, default=D.keep_host_copies,
              help="VRAM experts keep a host copy in RAM (colibrì CUDA_RELEASE_HOST=0): charged to --ram.")
@click.option("--repin-every", default=D.repin_every, show_default=True, type=click.IntRange(0, 1_000_000),
              help="Live re-pinning: every N decode tokens the engine swaps cold pins/VRAM experts for hot "
                   "streamed ones when it pays (the plan's repin section); 0: off.")
@click.option("--repin-window", default=D.repin_window, type=click.IntRange(1, 1_000_000),
              help="Tokens of routing the re-pinning estimate remembers and the horizon of its saving "
                   "(default 4 x --repin-every).")
@click.option("--compare", is_flag=True,
              help="Also evaluate colibrì hot-first (DIRECT=1 and 0), llama.cpp --fit layers and uniform, "
                   "each with its engine's knobs.")
@click.option("--what-if", "what_if_kind", type=click.Choice(["ram", "vram", "nvme"]), default=None,
              help="Predicted tok/s as one resource varies.")
@click.option("--png", "png_path", default=None, help="With --what-if: write the plot here.")
@click.option("--method", type=click.Choice(["auto", "exact", "aggregate"]), default=D.method,
              show_default=True)
@click.option("--time-limit", "time_limit_s", default=D.time_limit_s, show_default=True,
              type=click.FloatRange(0, min_open=True), callback=lambda _c, p, v: _finite(p, v),
              help="Solver seconds.")
@click.option("--seed", default=D.seed, show_default=True, type=click.IntRange(0, 2**32 - 1),
              help="Seed of synthesised heat.")
@click.option("--coefficients", "coef_path", default=None,
              help="Cost-model coefficients from `colibri-plan calibrate` (default: all 1.0); "
                   "recorded in the plan.")
@json_option
@options_arg(SolveOptions)
def solve(opts, profile_path, model_name, heat, quant, out_path, compare, what_if_kind, png_path, coef_path):
    """Solve where every expert lives (VRAM per GPU, pinned RAM, LRU cache, disk) to minimise predicted
    decode time per token within the memory budgets; write a plan file."""
    import dataclasses

    from colibri_plan.errors import InputError
    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.plan import save_plan
    from colibri_plan.model import load_model_spec
    from colibri_plan.planner.make import make_plan

    if png_path and not what_if_kind:
        raise InputError("--png needs --what-if ram|vram|nvme")
    inputs = [p for p in (profile_path, model_name, heat, coef_path) if p and Path(p).exists()]
    for p in (out_path, png_path):  # before the solve, not after it
        if p is not None:
            check_output_path(p, inputs)
    from colibri_plan.errors import ColibriError
    from colibri_plan.planner.make import check_options

    try:  # bad option values are usage errors (exit 2), like --time-limit 0
        check_options(opts)
    except ColibriError as exc:
        raise click.BadParameter(str(exc)) from None
    from colibri_plan.formats.profile import resolve_profile

    profile, source = resolve_profile(profile_path)
    spec = load_model_spec(model_name, quant=quant)
    from colibri_plan.formats.heat_align import load_heat_arg

    heat_obj = load_heat_arg(heat)
    if coef_path:  # calibrated coefficients are only ever used when asked for (docs/calibration.md)
        opts = dataclasses.replace(opts, coef=_coefficients(coef_path, profile))
    given_prompt = opts.prompt_tokens is not None
    if not given_prompt:  # a prompt the plan's KV budget holds
        opts = dataclasses.replace(opts, prompt_tokens=default_prompt_tokens(opts.context_tokens))
    progress(f"solving {spec.name}: {spec.n_routed_experts} experts of {spec.expert_bytes() / 1e6:.2f} MB "
             f"on {source}")
    with Steps("solving", counted=False):  # a spinner on a terminal; nothing more in a log
        plan, sol, setup = make_plan(profile, spec, heat_obj, opts, profile_source=source)
    context, prompt_tokens = opts.context_tokens, opts.prompt_tokens
    if given_prompt and prompt_tokens > context:
        # the engine grows the KV cache past the plan's context: a prompt this long overruns the budget
        setup.warnings.append(f"--prompt-tokens {prompt_tokens} is longer than --context {context}: the plan "
                              f"budgets a KV cache of {context} tokens, so a prompt this long outgrows it; "
                              f"solve with --context {prompt_tokens} or more")
    for w in setup.warnings:
        warn(w)
    if out_path:
        save_plan(plan, out_path)
    result = {"plan_file": out_path, "model": spec.name, "profile": source,
              "budgets": plan.doc["budgets"], "counts": plan.counts(), "predicted": plan.doc["predicted"],
              "solver": plan.doc["solver"], "knobs": plan.doc.get("knobs"),
              "compute": plan.doc.get("compute"), "compute_explain": plan.doc.get("compute_explain"),
              "repin": plan.doc.get("repin"), "trunk": {**plan.doc["trunk"], **plan.doc["solver"]["trunk"]},
              "warnings": setup.warnings}
    if compare:
        from colibri_plan.planner.compare import compare_placements

        with Steps("comparing with other engines' placements", counted=False):
            try:
                result["compare"] = compare_placements(setup, sol, time_limit_s=opts.time_limit_s)
            except ColibriError as exc:   # the re-solve with the other host-copy setting failed
                warn(f"--compare: no row with the other --keep-host-copies setting ({exc})")
                result["compare"] = compare_placements(setup, sol, host_copy_toggle=False)
    if what_if_kind:
        from colibri_plan.planner.whatif import plot, what_if

        with Steps(f"what-if {what_if_kind}") as bar:
            rows = what_if(setup, what_if_kind, time_limit_s=opts.time_limit_s, progress=bar.say)
        result["what_if"] = {"kind": what_if_kind, "rows": rows, "png": png_path}
        if png_path:
            plot(rows, what_if_kind, png_path, title=f"{spec.name} on {source}")
    emit(result, lambda: _human(result, plan))


def _coefficients(coef_path: str, profile):
    """The cost-model coefficients of ``--coefficients FILE``, with the progress line and the warnings of
    a file that lacks some or was fitted on another machine."""
    from colibri_plan.formats.coefficients import read_coefficients

    missing: list[str] = []
    coef, coef_machines = read_coefficients(coef_path, missing)
    progress(f"cost-model coefficients from {coef_path}: "
             + ", ".join(f"{k} {v:.3g}" for k, v in coef.to_dict().items()))
    if missing:
        warn(f"{coef_path} lacks {', '.join(missing)}: "
             f"{'it takes its default value' if len(missing) == 1 else 'they take their default values'}"
             "; re-create the file with `colibri-plan calibrate`")
    if coef_machines and profile.fingerprint not in coef_machines:
        warn(f"{coef_path} was fitted on machine(s) {', '.join(coef_machines)}, but the profile is of "
             f"machine {profile.fingerprint}: the coefficients may not hold here; calibrate from "
             "verify reports measured on this machine")
    return coef


def _human(result: dict, plan) -> str:
    b = result["budgets"]
    out = ["Budgets:"]
    out.append(table([[e["what"], _gb(e["bytes"])] for e in b["explain"]], None, right=(1,), indent=2))
    out += trunk_lines(result["trunk"])
    c = result["counts"]
    out.append("Placement (experts): " + ", ".join(f"{k} {v}" for k, v in c.items()))
    p = result["predicted"]
    t = p["terms"]
    out.append(f"Predicted: {p['tok_s']:.3f} tok/s ({p['decode_s_per_token'] * 1e3:.1f} ms/token): dense "
               f"{t['dense_s'] * 1e3:.1f} ms, attention {t['attention_s'] * 1e3:.1f} ms, expert layers "
               f"{t['expert_layers_s'] * 1e3:.1f} ms (disk wait {t['disk_wait_s'] * 1e3:.1f} ms, transfers "
               f"{t['transfer_s'] * 1e3:.1f} ms)")
    from colibri_plan.planner.prefill import prefill_lines

    out += prefill_lines(p.get("prefill"))
    h = p["hit_rate"]
    out.append(f"Selections served from: VRAM {h['vram'] * 100:.1f}%, "
               f"pinned RAM {h['ram_pinned'] * 100:.1f}%, "
               f"LRU {h['lru'] * 100:.1f}%, disk {h['disk'] * 100:.1f}%; disk "
               f"{p['disk_bytes_per_token'] / 1e6:.1f} MB/token")
    s = result["solver"]
    gap = "n/a" if s["gap"] is None else f"{s['gap'] * 100:.3f}%"
    out.append(f"Solver: {s['method']}; {s['status']}; gap {gap}; {s['seconds']:.2f} s")
    out += knob_lines(result.get("knobs"), compute=result.get("compute"),
                      compute_explain=result.get("compute_explain"), repin=result.get("repin"))
    if result.get("plan_file"):
        out.append(f"Plan written to {result['plan_file']}")
    if "compare" in result:
        out += ["", *compare_tables(result["compare"])]
    if "what_if" in result:
        w = result["what_if"]
        rows = [[f"{r['value']:.3g} {r['unit']}", f"{r['tok_s']:.3f}", f"{r['hot_first_tok_s']:.3f}",
                 f"{r['vram'] * 100:.1f}", f"{r['ram_pinned'] * 100:.1f}", f"{r['disk'] * 100:.1f}"]
                for r in w["rows"]]
        out += ["", f"What-if {w['kind']}:", table(rows, [w["kind"], "tok/s (ours)", "tok/s (hot-first)",
                                                          "VRAM %", "pinned %", "disk %"])]
        if w.get("png"):
            out.append(f"Plot written to {w['png']}")
    return "\n".join(out)


def trunk_lines(tr: dict) -> list[str]:
    """The VRAM trade of the trunk: each option's seconds, VRAM taken, VRAM left for experts, RAM for
    experts and predicted tok/s (options identical to another up to the device's name are folded)."""
    chosen = next(r for r in tr["options"] if r["chosen"])
    how = "the least predicted decode time" if tr["mode"] == "auto" else f"--trunk {tr['mode']}"
    out = [f"Trunk (dense, attention, KV cache): on {tr['chosen']} ({how})"]
    rows, same = [], {}
    for r in tr["options"]:
        if r["same_as"]:
            same.setdefault(r["same_as"], []).append(r["option"])
            continue
        taken = ", ".join(f"{k} {_gb(v)}" for k, v in r["vram_trunk_bytes"].items()) or "none"
        left = ", ".join(f"{k} {_gb(r['vram_expert_budget_bytes'][k])}"   # the CPU row: the chosen's devices
                         for k in r["vram_trunk_bytes"] or chosen["vram_trunk_bytes"]) or "all"
        tok = f"{r['tok_s']:.3f}" if r["tok_s"] is not None else ("not solved" if r["feasible"] else "no fit")
        rows.append([r["option"] + (" *" if r["chosen"] else ""), f"{r['dense_s'] * 1e3:.1f}",
                     f"{r['attention_s'] * 1e3:.1f}", f"{r['roundtrip_s'] * 1e3:.1f}", taken, left,
                     _gb(r["ram_budget_bytes"]), tok])
    out.append(table(rows, ["option", "dense ms", "attention ms", "(round trip ms)", "VRAM for trunk+KV",
                            "VRAM left for experts", "RAM for experts", "tok/s"], indent=2))
    out += [f"  {', '.join(v)}: as {k} (same figures and budget)" for k, v in same.items()]
    out += [f"  {r['option']} does not fit: {r['why']}" for r in tr["options"] if not r["feasible"]]
    cpu = next((r for r in tr["options"] if r["option"] == "cpu"), None)
    if chosen["option"] != "cpu" and cpu is not None and cpu["tok_s"] is not None:
        n = sum(chosen["vram_trunk_bytes"].values())
        kv = f" + KV {_gb(chosen['kv_bytes'])}"
        out.append(f"  The trunk on {chosen['option']} takes {_gb(n)} of VRAM from experts (dense "
                   f"{_gb(chosen['dense_bytes'])}{kv}); predicted "
                   f"{chosen['tok_s']:.3f} tok/s against {cpu['tok_s']:.3f} with it on the CPU")
    return out


def _pct(x) -> str:
    return f"{x * 100:.1f}"


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _host_compute(compute: dict | None) -> str:
    """A compare row's host-tier processors, short: one name when they agree, else pinned/LRU/streamed."""
    if not compute:
        return "cpu"
    who = [compute.get(t, "cpu") for t in ("ram_pinned", "lru", "disk")]
    return who[0] if len(set(who)) == 1 else f"pin {who[0]}, LRU {who[1]}, miss {who[2]}"


def compare_tables(rows: list[dict]) -> list[str]:
    """`solve --compare` as three tables keyed by placement (one would be ~150 columns wide): what each
    placement predicts as its engine runs it, where its selections are served from, and the engine knobs
    it was priced with."""
    names = [r["placement"] for r in rows]
    pred = [[n, f"{r['tok_s']:.3f}", f"{r['decode_s_per_token'] * 1e3:.1f}",
             f"{r['disk_bytes_per_token'] / 1e6:.1f}", _ratio(r.get("vs_best_baseline")),
             _ratio(r.get("vs_best_baseline_our_engine"))] for n, r in zip(names, rows)]
    served = [[n, _pct(h["vram"]), _pct(h["ram_pinned"]), _pct(h["lru"]), _pct(h["disk"]),
               _pct(r.get("knobs", {}).get("page_cache_hit_rate", 0.0))]
              for n, r, h in zip(names, rows, (r["hit_rate"] for r in rows))]
    knobs = []
    for n, r in zip(names, rows):
        k = r.get("knobs", {})
        uni = sum((k.get("unified_experts") or {}).values())
        pins = f"{k.get('pinned_experts', '?')}" + (f" +{uni} unified" if uni else "")
        knobs.append([n, r.get("engine", "?"), k.get("queue_depth", "?"),
                      "O_DIRECT" if k.get("o_direct", True) else "buffered", pins,
                      k.get("lru_slots_max", "?"), f"{k.get('host_copy_bytes', 0) / 1e9:.2f} GB",
                      _host_compute(k.get("compute"))])
    heads = ["placement", "engine", "queue depth", "reads", "pins", "LRU slots", "host copies",
             "host tiers on"]
    on_cpu = all(row[-1] == "cpu" for row in knobs)
    if on_cpu:   # the usual case: one sentence instead of a column of "cpu"
        knobs, heads = [row[:-1] for row in knobs], heads[:-1]
    return [
        "Predicted as each engine runs it (vs best (our engine): the placements alone, all on our engine):",
        table(pred, ["placement", "tok/s", "ms/token", "disk MB/tok", "vs best baseline",
                     "vs best (our engine)"]),
        "", "Selections served from (%; page cache: the part of disk reads the OS page cache serves):",
        table(served, ["placement", "VRAM %", "pinned %", "LRU %", "disk %", "page cache %"]),
        "", "Engine knobs each row is priced with:",
        table(knobs, heads),
    ] + (["Host tiers (pinned, LRU hits, streamed) are computed on the CPU in every row."] if on_cpu else [])
