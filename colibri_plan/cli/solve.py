"""`colibri-plan solve`: budgets, optimal placement, plan file, per-engine answer, baselines (--compare),
what-if. What it prints is :mod:`colibri_plan.cli.solve_text`."""

from __future__ import annotations

from pathlib import Path

import click

from colibri_plan.cli.common import (
    Steps,
    collect_arg,
    emit,
    get_ctx,
    json_option,
    options_arg,
    progress,
    verbose_option,
    warn,
)
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
    from colibri_plan.formats.fields import whole_text

    n = whole_text(value)   # str.isdigit() takes "²", which int() then refuses with a traceback
    if value != "auto" and not (n is not None and 1 <= n <= 64):
        raise click.BadParameter(f"must be 'auto' or a whole number in 1..64, got {value!r}")
    return value


@click.command("solve")
@click.option("--profile", "profile_path", default=None,
              help="Profile file, or a shipped profile's name (`colibri-plan profile list`).")
@click.option("--machine", "machine", default=None, metavar="'gpu=24G ram=64G nvme=gen4 cpu=16'",
              help="Instead of --profile: the machine in one line, the `profile synth` flags as key=value "
                   "(figures not stated take published defaults, shown by `colibri-plan profile synth`).")
@click.option("--model", "model_name", required=True, help="Catalogue name, checkpoint folder, GGUF or spec.")
@click.option("--heat", default=None,
              help="Heat file (engine JSON, colibrì usage/STATS), 'synth' or 'uniform'.")
@click.option("--ram", default=D.ram, show_default=True,
              help="'auto' or the process RAM budget in GB (the machine's other memory stays the OS page "
                   "cache: to plan for a smaller machine, describe it with --machine).")
@click.option("--vram", default=D.vram, show_default=True,
              help="'auto' (each GPU's free memory) or each card's memory in GB (one figure, or a,b,c); "
                   "--vram-reserve is taken off either way and shown.")
@click.option("--headroom", default=D.headroom, help="OS + page-cache headroom in GB for --ram auto.")
@click.option("--vram-reserve", "vram_reserve_gb", default=D.vram_reserve_gb, show_default=True,
              type=click.FloatRange(0), callback=lambda _c, p, v: _finite(p, v),
              help="GB taken off each GPU's memory for the runtime (CUDA context, buffers, other programs).")
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
@click.option("--out", "out_path", default=None,
              help="Write the plan here, and colibrì's usage file beside it (PLAN with .coli_usage).")
@click.option("--gguf", "gguf", default=None, help="The model's GGUF file, for llama.cpp's command (-m).")
@click.option("--colibri-model", "colibri_model", default=None,
              help="colibrì's converted model folder, for its command (COLI_MODEL).")
@click.option("--target", type=click.Choice(["colibri-plan", "colibri", "llama.cpp"]), default=D.target,
              show_default=True,
              help="Engine the plan is for: ours, colibrì (reads at queue depth 1-2, 0.741 MiB of VRAM "
                   "overhead per expert), or llama.cpp (priced as it runs; the plan's llamacpp section "
                   "holds the placement it can express, or 'keep --fit').")
@click.option("--queue-depth", default=D.queue_depth, show_default=True, callback=_queue_depth,
              help="Expert reads the engine has in flight (1..64): the disk figure priced; 'auto': the "
                   "target engine's.")
@click.option("--keep-host-copies", is_flag=True, default=D.keep_host_copies,
              help="VRAM experts keep a host copy in RAM (colibrì CUDA_RELEASE_HOST=0): charged to --ram.")
@click.option("--reads", type=click.Choice(["auto", "o_direct", "buffered"]), default=D.reads,
              show_default=True,
              help="How our engine reads streamed experts: O_DIRECT, or buffered with the page cache kept "
                   "inside --ram (one LRU over all layers); 'auto': buffered when it beats O_DIRECT by more "
                   "than 5%, priced with a warm cache (the Reads: line).")
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
              show_default=True,
              help="The solver: 'exact' places every expert (a MILP, HiGHS), 'aggregate' solves counts and "
                   "probability mass per layer (an LP) then realises them, for models too large to place "
                   "expert by expert; 'auto' picks by the problem's size.")
@click.option("--time-limit", "time_limit_s", default=D.time_limit_s, show_default=True,
              type=click.FloatRange(0, min_open=True), callback=lambda _c, p, v: _finite(p, v),
              help="Solver seconds.")
@click.option("--seed", default=D.seed, show_default=True, type=click.IntRange(0, 2**32 - 1),
              help="Seed of synthesised heat.")
@click.option("--coefficients", "coef_path", default=None,
              help="Cost-model coefficients from `colibri-plan calibrate` (default: all 1.0); "
                   "recorded in the plan.")
@click.option("--llama-coefficients", default=None, expose_value=False,
              callback=lambda c, _p, v: c.meta.__setitem__("llama_coef_path", v),
              help="llama.cpp's coefficients from `colibri-plan calibrate --engine llama.cpp` (default: "
                   "uncalibrated).")
@json_option
@verbose_option
@options_arg(SolveOptions)
@collect_arg({"out_path", "png_path", "gguf", "colibri_model"}, "files", dict)
def solve(opts, profile_path, machine, model_name, heat, quant, files, compare, what_if_kind, coef_path):
    """Solve where every expert lives (VRAM per GPU, pinned RAM, LRU cache, disk) to minimise predicted
    decode time per token within the memory budgets. Prints, per engine you may deploy (the bundled
    colibri-plan engine, colibrì, llama.cpp), the predicted tok/s, time to first token and the command to
    paste; -v adds the details; --out keeps the plan.

    Example: colibri-plan solve --model qwen3-235b-a22b --machine 'gpu=24G ram=64G nvme=gen4 cpu=16'
    """
    import dataclasses

    out_path, png_path = files.get("out_path"), files.get("png_path")

    from colibri_plan.errors import InputError
    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.plan import save_plan
    from colibri_plan.model import load_model_spec
    from colibri_plan.planner.make import make_plan

    llama_coef_path = click.get_current_context().meta.get("llama_coef_path")   # --llama-coefficients
    if png_path and not what_if_kind:
        raise InputError("--png needs --what-if ram|vram|nvme")
    if profile_path is not None and machine is not None:
        raise click.UsageError("--profile and --machine both describe the machine: give one of them "
                               "(a measured or shipped profile, or a one-line statement)")
    if profile_path is None and machine is None:
        from colibri_plan.formats.profile import shipped_profile_names

        raise click.UsageError("give the machine: --profile FILE|NAME (shipped: "
                               f"{', '.join(shipped_profile_names())}) or --machine 'gpu=24G ram=64G "
                               "nvme=gen4 cpu=16' (one of the two)")
    inputs = [p for p in (profile_path, model_name, heat, coef_path, llama_coef_path)
              if p and Path(p).exists()]
    usage = str(Path(out_path).with_suffix(".coli_usage")) if out_path else None
    if usage is not None and Path(usage) == Path(out_path):   # the plan and colibrì's usage file collide
        raise InputError(f"--out {out_path}: the plan would overwrite colibrì's usage file of the same name "
                         "(the plan's name with .coli_usage); give the plan a .json name")
    for p in (out_path, usage, png_path):  # before the solve, not after it
        if p is not None:
            check_output_path(p, inputs)
    from colibri_plan.errors import ColibriError
    from colibri_plan.planner.make import check_options

    try:  # bad option values are usage errors (exit 2), like --time-limit 0
        check_options(opts)
    except ColibriError as exc:
        raise click.BadParameter(str(exc)) from None
    from colibri_plan.formats.profile import resolve_profile

    if machine is not None:
        from colibri_plan.profiler.synth import parse_machine, synth_profile

        stated = parse_machine(machine)
        profile, source = synth_profile(stated), f"a stated machine: {stated.summary()}"
    else:
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
    llama = _llama_section(setup, profile, opts, llama_coef_path, quant) if (
        opts.target == "llama.cpp" or compare) else None
    if opts.target == "llama.cpp":
        plan.doc["llamacpp"] = llama
    for w in setup.warnings:
        warn(w)
    paths = _deploy_paths(out_path, model_name, files.get("gguf"), files.get("colibri_model"))
    if out_path:
        save_plan(plan, out_path)
    result = {"plan_file": paths.plan, "plan_written": bool(out_path), "usage_path": paths.usage,
              "model": spec.name, "profile": source,
              "budgets": plan.doc["budgets"], "counts": plan.counts(), "predicted": plan.doc["predicted"],
              "solver": plan.doc["solver"], "knobs": plan.doc.get("knobs"),
              "compute": plan.doc.get("compute"), "compute_explain": plan.doc.get("compute_explain"),
              "repin": plan.doc.get("repin"), "trunk": {**plan.doc["trunk"], **plan.doc["solver"]["trunk"]},
              "warnings": setup.warnings, **({"llamacpp": llama} if opts.target == "llama.cpp" else {}),
              **({"reads": plan.doc["reads"]} if "reads" in plan.doc else {}),
              "trunk_gpus": plan.doc.get("trunk_gpus")}
    from colibri_plan.planner.compare import engine_rows

    result["engines"] = engine_rows(setup, plan, paths, _engine_refusal(spec))
    if out_path and result["engines"][1]["command"] is not None:   # the usage file the colibrì line reads
        from colibri_plan.planner.exports import export_colibri

        result["usage_file"] = export_colibri(plan, paths.usage)["usage_file"]
    if compare:
        from colibri_plan.planner.compare import compare_placements

        ours_on = f"--coefficients {coef_path}" if coef_path else "uncalibrated"

        with Steps("comparing with other engines' placements", counted=False):
            try:
                result["compare"] = compare_placements(setup, sol, time_limit_s=opts.time_limit_s,
                                                       llama=llama, calibrated_on=ours_on)
            except ColibriError as exc:   # the re-solve with the other host-copy setting failed
                warn(f"--compare: no row with the other --keep-host-copies setting ({exc})")
                result["compare"] = compare_placements(setup, sol, host_copy_toggle=False, llama=llama,
                                                       calibrated_on=ours_on)
    if what_if_kind:
        from colibri_plan.planner.whatif import plot, what_if

        with Steps(f"what-if {what_if_kind}") as bar:
            rows = what_if(setup, what_if_kind, time_limit_s=opts.time_limit_s, progress=bar.say)
        result["what_if"] = {"kind": what_if_kind, "rows": rows, "png": png_path}
        if png_path:
            plot(rows, what_if_kind, png_path, title=f"{spec.name} on {source}")
    emit(result, lambda: _human(result))


def _human(result: dict) -> str:
    from colibri_plan.cli.solve_text import answer_lines, compare_tables, detail_lines, what_if_lines

    verbose = get_ctx().verbose
    out = answer_lines(result, verbose)
    if verbose:
        out += ["", *detail_lines(result)]
        if result.get("reads"):  # our engine's reads, priced (planner/reads.py)
            from colibri_plan.planner.reads import reads_line

            out.append(reads_line(result["reads"]))
        if result.get("trunk_gpus"):  # the trunk's GPU split, priced (planner/trunk_gpus.py)
            from colibri_plan.planner.trunk_gpus import gpu_split_line

            out.append(gpu_split_line(result["trunk_gpus"]))
    if result.get("llamacpp"):  # --target llama.cpp: its pick or "keep --fit"
        from colibri_plan.planner.llamacpp_report import llama_lines

        out += ["", *llama_lines(result["llamacpp"])]
    if "compare" in result:
        from colibri_plan.planner.llamacpp_report import compare_notes

        out += ["", *compare_tables(result["compare"]), *compare_notes(result["compare"])]
    if "what_if" in result:
        out += ["", *what_if_lines(result["what_if"])]
    return "\n".join(out)


def _deploy_paths(out_path, model_name, gguf, colibri_model):
    """The files the engines' commands name, absolute: the plan (``--out``, else ./plan.json, which
    ``--out plan.json`` would write), its usage file, and the model's pack, GGUF file or colibrì folder
    where ``--model``, ``--gguf`` and ``--colibri-model`` name them."""
    from colibri_plan.planner.compare import DeployPaths

    plan = Path(out_path or "plan.json").expanduser().resolve()
    model = Path(model_name).expanduser()
    pack = str(model.resolve()) if (model / "pack.json").is_file() else None
    if gguf is None and model.suffix == ".gguf" and model.is_file():
        gguf = str(model)
    def absolute(p):
        return str(Path(p).expanduser().resolve()) if p else None

    return DeployPaths(plan=str(plan), usage=str(plan.with_suffix(".coli_usage")), written=bool(out_path),
                       pack=pack, gguf=absolute(gguf), colibri_model=absolute(colibri_model))


def _engine_refusal(spec) -> str | None:
    """Why the bundled engine cannot run ``spec``'s family (`colibri-plan model support`), None if it can."""
    from colibri_plan.families import ENGINE_FAMILIES, FAMILIES

    if spec.family in ENGINE_FAMILIES or spec.family not in FAMILIES:
        return None
    why = FAMILIES[spec.family].REFUSE
    why = why.get(spec.family) if isinstance(why, dict) else why
    return f"the bundled engine plans {spec.family} but cannot run it yet ({why})"


def _llama_section(setup, profile, opts, coef_path: str | None, quant: str | None) -> dict:
    """The plan's ``llamacpp`` section (planner/llamacpp_inputs.py), with llama.cpp's coefficients."""
    from colibri_plan.planner import llamacpp_calibrate, llamacpp_inputs

    coef = llamacpp_calibrate.load(coef_path) if coef_path else None
    if coef is not None:
        progress(f"llama.cpp coefficients from {coef_path}: fitted on {coef.calibrated_on}")
    q = quant if quant and quant.upper() in llamacpp_inputs.GGUF_BITS else None
    return llamacpp_inputs.section(setup, profile, coef, q)


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
