"""`colibri-plan verify` (run a plan, compare measured with predicted) and `calibrate` (refit the costs)."""

from __future__ import annotations

import re
from pathlib import Path

import click

from colibri_plan.cli.common import Steps, emit, json_option, options_arg, read_prompt, table, warn
from colibri_plan.errors import InputError
from colibri_plan.run_options import VERIFY_DEFAULTS as D
from colibri_plan.run_options import RunOptions

#: the engine's once-per-token progress message ("token 3/9: id 17 (12 ms)")
_TOKEN = re.compile(r"\btoken \d+/\d+")


def default_report_path(plan_path: str) -> Path:
    """``PLAN.verify.json`` beside the plan (``plan.json`` -> ``plan.verify.json``)."""
    p = Path(plan_path)
    return p.with_name(p.stem + ".verify.json")


@click.command("verify")
@click.option("--plan", "plan_path", required=True, type=click.Path(), help="Plan file (colibri-plan solve).")
@click.option("--model", "model_path", required=True, type=click.Path(), help="Expert pack folder.")
@click.option("--tokens", type=click.IntRange(1, 1_000_000), default=D.tokens, show_default=True,
              help="Decode steps to measure.")
@click.option("--prompt-ids", default=None, help="Prompt token ids (default: 8 seeded ids).")
@click.option("--prompt-file", default=None, type=click.Path(), help="File of prompt token ids.")
@click.option("--backend", default=D.backend, show_default=True,
              help="CPU backend for RAM-resident and streamed experts (cpu or numpy).")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="Also run the all-RAM CPU reference and check the tokens are identical.")
@click.option("--report", "report_path", type=click.Path(), default=None,
              help="Where to write the verify report (default: PLAN.verify.json beside the plan).")
@click.option("--strict", is_flag=True,
              help="Exit with status 3 when the verdict is FAIL (for scripts and CI gates).")
@json_option
@options_arg(RunOptions)
def verify(opts, plan_path, model_path, prompt_ids, prompt_file, reference, report_path, strict):
    """Run PLAN on the engine and compare the measured tok/s, time split, hit rates and disk bytes with
    the plan's predictions; check the tokens against the all-RAM CPU reference; give a verdict and write
    a report (kind verify-report)."""
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.runner import check_prompt
    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.pack_index import is_pack
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.formats.report import save_report
    from colibri_plan.verify import report_table, this_machine_fingerprint, verdict_line, verify_plan

    if opts.backend not in ("cpu", "numpy"):
        raise InputError(f"--backend {opts.backend}: RAM-resident and streamed experts run on a host backend "
                         "(cpu or numpy); GPU experts use the devices the plan names")
    plan = load_plan(plan_path)
    if report_path is None:  # "" is refused by check_output_path, not replaced by the default
        report_path = default_report_path(plan_path)
    check_output_path(report_path,  # before the runs, not after
                      (plan_path, model_path, prompt_file))
    if not is_pack(model_path):
        raise InputError(f"{model_path} is not an expert pack (no pack.json); build one with "
                         "`colibri-plan model pack` or `colibri-plan model fixture`")
    pack = open_pack(model_path)
    if prompt_ids is None and prompt_file is None:
        from colibri_plan.engine.fixture import fixture_prompt

        prompt = fixture_prompt(pack.arch.vocab_size, 8, seed=1)
    else:
        prompt = read_prompt(prompt_ids, prompt_file)
    check_prompt(prompt, pack.arch.vocab_size)
    try:  # the bar counts generated tokens over both runs (plan, then reference)
        with Steps("verify", total=(opts.tokens + 1) * (2 if reference else 1)) as bar:
            def on(m: str) -> None:
                bar.say(m, verbose_only=m.startswith("  "), advance=1 if _TOKEN.search(m) else 0)

            report = verify_plan(plan, pack, prompt, opts, plan_path=plan_path, reference=reference,
                                 machine_fp=this_machine_fingerprint(), progress=on, warn=warn)
    finally:
        pack.close()
    out = save_report(report, report_path)
    report["report_path"] = str(out)
    m = report["measured"]
    tb = m.get("trunk_bytes")

    def human() -> str:
        lines = [table(report_table(report), ["term", "predicted", "measured", "measured/predicted"]),
                 "",
                 f"tokens: {' '.join(map(str, m['tokens']))}",
                 f"trunk (dense, attention, KV cache) on {m.get('trunk_device') or 'cpu'}"
                 + (f"; KV cache {tb['kv'] / 1e6:.1f} MB, dense {tb['dense'] / 1e6:.1f} MB on the device"
                    if tb else ""),
                 f"peak RSS {m['peak_rss_bytes'] / 1e9:.2f} GB; O_DIRECT {'yes' if m['o_direct'] else 'no'}"
                 + (f" (the plan's buffered reads: page-cache hits {m['page_cache_hit_rate']:.1%} of the "
                    "disk uses)" if m.get("page_cache_hit_rate") is not None else "") + "; "
                 f"median decode {m['decode_s_median'] * 1e3:.0f} ms/token",
                 *([f"re-pins: {m['repins']} swaps, {(m.get('repin_bytes') or 0) / 1e6:.1f} MB read, "
                    f"{(m.get('repin_s') or 0.0) * 1e3:.1f} ms"] if m.get("repins") is not None else []),
                 verdict_line(report["verdict"]),
                 f"report: {out}"]
        return "\n".join(lines)

    emit(report, human)
    if strict and not report["verdict"]["ok"]:
        raise SystemExit(3)


@click.command("calibrate")
@click.argument("reports", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out_path", required=True, type=click.Path(), help="Coefficients file to write.")
@click.option("--base", "base_path", type=click.Path(), default=None,
              help="Start from these coefficients (terms without data keep them); default all 1.0.")
@click.option("--engine", type=click.Choice(["colibri-plan", "llama.cpp"]), default="colibri-plan",
              show_default=True, help="Whose cost model: ours (REPORTS are verify reports) or llama.cpp's "
                                      "(REPORTS are bench/replay_llamacpp.py replay JSON).")
@click.option("--profile", "profiles", multiple=True, type=click.Path(),
              help="llama.cpp: the profile of the replay's machine (once, or once per replay; default: "
                   "the replay's own).")
@click.option("--model", "models", multiple=True,
              help="llama.cpp: the replayed model (GGUF, checkpoint, spec file; once or once per replay; "
                   "default: the replay's GGUF).")
@json_option
def calibrate(reports, out_path, base_path, engine, profiles, models):
    """Refit the cost model's per-term coefficients from verify REPORTS and write them to --out: least
    squares on the CPU path (cpu_expert, disk, and overlap when a report has compute and reads in one
    layer), ratio of sums for dense and GPU terms, GPU time beyond the kernel rate as gpu_call_s
    (docs/calibration.md). Use them with `colibri-plan solve --coefficients FILE`. With --engine
    llama.cpp: llama.cpp's own coefficients from replay JSON (docs/planner.md), for `solve
    --llama-coefficients FILE`."""
    from colibri_plan.fileio import check_output_path

    if engine == "llama.cpp":
        return _calibrate_llama(reports, out_path, base_path, profiles, models)
    from colibri_plan.formats.coefficients import load_coefficients, save_coefficients
    from colibri_plan.formats.report import load_report
    from colibri_plan.planner.calibrate import fit_coefficients

    check_output_path(out_path, (*reports, base_path))  # before reading and fitting
    docs = [load_report(r) for r in reports]
    base = load_coefficients(base_path) if base_path else None
    coef, detail = fit_coefficients(docs, base=base, names=list(reports))
    for w in detail.get("warnings", []):
        warn(w)
    path = save_coefficients(coef, out_path, detail, sources=list(reports))
    doc = {"coefficients": coef.to_dict(), "detail": detail, "out": str(path), "reports": list(reports)}

    def human() -> str:
        rows = []
        for t in ("cpu_expert", "disk", "overlap", "dense", "gpu_expert"):
            d = detail[t]
            if not d["fitted"] and t == "overlap":
                how = ("not determined by these reports (base value kept): it needs a report with "
                       "resident compute and reads in a layer, beyond one report per other coefficient")
            elif not d["fitted"]:
                how = "no data (base value kept)"
            elif t in ("cpu_expert", "disk", "overlap"):
                how = f"least squares on the CPU path over {detail['cpu_path']['reports']} report(s)"
            else:
                how = (f"ratio of sums {d['measured_sum_s'] * 1e3:.1f} / {d['raw_sum_s'] * 1e3:.1f} ms "
                       f"({d['reports']} report(s))")
            if t == "gpu_expert" and "gpu_call_s" in detail:
                how = "base value kept: the GPU time beyond it is per-call overhead (gpu_call_s)"
            rows.append([t, f"{d['value']:.3f}", how])
        if "gpu_call_s" in detail:
            d = detail["gpu_call_s"]
            rows.append(["gpu_call_s", f"{d['value'] * 1e3:.3f} ms",
                         f"({d['measured_sum_s'] * 1e3:.1f} - {d['raw_sum_s'] * 1e3:.1f} ms) / "
                         f"{d['calls_sum']:.0f} GPU layer calls"])
        return "\n".join([table(rows, ["term", "coefficient", "fitted by"]),
                          f"wrote {path}; use it with: colibri-plan solve ... --coefficients {path}"])

    emit(doc, human)


def _calibrate_llama(replays, out_path, base_path, profiles, models) -> None:
    """``calibrate --engine llama.cpp``: fit, write, print the rows predicted beside measured."""
    from colibri_plan.fileio import check_output_path
    from colibri_plan.planner import llamacpp_calibrate as lc

    check_output_path(out_path, (*replays, base_path, *profiles))
    base = lc.load(base_path) if base_path else None
    from colibri_plan.model import load_model_spec

    coef, detail = lc.calibrate_replays(list(replays), list(profiles), list(models), load_model_spec, base)
    path = lc.save(coef, out_path, detail, list(replays))
    doc = {"engine": "llama.cpp", "coefficients": coef.to_dict(), "detail": detail, "out": str(path),
           "replays": list(replays)}

    def human() -> str:
        def tok(d):
            return "-" if d["measured"] is None else f"{d['measured']:.1f} / {d['predicted']:.1f}"
        rows = [[r["file"].rsplit("/", 1)[-1], r["placement"], tok(r["decode_tok_s"]),
                 tok(r["prefill_tok_s"])] for r in detail["rows"]]
        c = coef.to_dict()
        err = detail["max_rel_error"]
        return "\n".join([
            "llama.cpp coefficients: " + ", ".join(f"{k} {v:.3g}" for k, v in c.items() if k != "fitted_on"),
            table(rows, ["replay", "placement", "decode tok/s measured / predicted",
                         "prefill tok/s measured / predicted"]),
            "largest error: " + ", ".join(f"{k} {v:.0%}" for k, v in err.items() if v is not None),
            f"wrote {path}; use it with: colibri-plan solve ... --target llama.cpp "
            f"--llama-coefficients {path}"])

    emit(doc, human)
