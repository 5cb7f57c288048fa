"""Plan accuracy over a sweep of RAM budgets on the fixture: predicted vs measured, ours vs baselines.

For each RAM budget (from "everything streams" to "everything fits") the script solves our plan and builds
the baselines' plans (colibrì-style hot-first, llama.cpp ``--fit``-style whole layers) with the same
budgets and cost model, then runs every plan for real on the engine (``run_placement``), ``--repeats``
times, interleaved (repeat 1 of every plan, then repeat 2, ...) so that load drift on a shared machine hits
every plan alike. Plans with an identical placement are run once and share the measurement (the table says
so). Each repeat uses its own prompt (seed 1 + repeat; the statistics run used seed 0), so the measured
hit rate (mean over repeats) pools several prompts.

Measured tok/s of a run is 1 / its median decode step (robust to the stalls other processes cause on a
shared machine; the mean-based figure is kept in the JSON); a placement's figure is the median over
repeats. Noise: for every placement the spread of its repeats, ``(max - min) / median``; the noise of a
budget is the largest spread there. A budget's placements run back to back within a repeat (in a shuffled
order), so "paired min" is the smallest over baselines of the median over repeats of ours / baseline in
the same repeat; "ours OK" means that paired ratio is not below 1 by more than the noise.

Calibration (``--calibrate``, once): after the runs, the cost model's coefficients are fitted
(:func:`colibri_plan.planner.calibrate.fit_coefficients`, docs/calibration.md) on OUR plan at the lowest, the
second-highest and the highest budget only (``--calibrate-at``; per-term medians over the repeats,
measured in the same interleaved session: all-RAM fixes the CPU rate, the lowest the disk rate, the
middle one how much of the reads hide behind the compute), and
every plan at every budget is predicted again with them: the middle budgets and all baseline placements
are out of sample. The script also re-solves with the calibrated coefficients and says whether our
placement would change. ``--coefficients FILE`` instead solves and predicts with a file from the start.

    .venv/bin/python bench/plan_accuracy.py --fixture work-demo/fixture --profile work-demo/profile.json \\
        --heat work-demo/heat.json --calibrate --out bench/results/plan_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from colibri_plan.cli.common import table
from colibri_plan.engine.fixture import fixture_prompt
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.runner import generate
from colibri_plan.fileio import atomic_write_text, fingerprint
from colibri_plan.formats.coefficients import load_coefficients, save_coefficients
from colibri_plan.formats.heat import load_heat
from colibri_plan.formats.profile import load_profile
from colibri_plan.model import load_model_spec
from colibri_plan.planner.baselines import fit_layers, hot_first
from colibri_plan.planner.calibrate import fit_coefficients
from colibri_plan.planner.make import build_setup, cost_of, plan_document
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.solve import solve_placement, validate_placement
from colibri_plan.run_options import RunOptions
from colibri_plan.verify import compare

PLACEMENTS = {"ours": None, "hot-first": hot_first, "fit-layers": fit_layers}
CLI = [sys.executable, "-m", "colibri_plan"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plans_at(profile, spec, heat, ram_gb: float, coef, context: int) -> tuple:
    """(setup, {name: plan}) at one RAM budget: ours and the baselines, same setup for all."""
    setup = build_setup(profile, spec, heat, SolveOptions(ram=f"{ram_gb:g}", dense_fmt="f32",
                                                          context_tokens=context, coef=coef))
    sol = solve_placement(setup.problem)
    out = {"ours": plan_document(setup, profile, sol.tiers, sol.lru_slots,
                                 {"status": sol.status, "method": sol.method, "seconds": sol.seconds})}
    for name, fn in PLACEMENTS.items():
        if fn is None:
            continue
        tiers, slots = fn(setup.problem)
        validate_placement(setup.problem, tiers, slots)
        out[name] = plan_document(setup, profile, tiers, slots, {"status": "baseline", "method": name})
    return setup, out


def placement_key(plan) -> str:
    return fingerprint(plan.doc["layers"])


def measure(pack, plan, prompt, tokens: int) -> dict:
    # + the prefill token; reads with the plan's queue depth, as `run --plan` does
    return generate(pack, prompt, RunOptions(tokens=tokens + 1, backend="cpu"), plan=plan).to_dict()


def step_tok_s(run: dict) -> float:
    return 1.0 / run["decode_s_median"] if run["decode_s_median"] > 0 else 0.0


def summarise(runs: list[dict]) -> dict:
    """Medians over repeats (tok/s from the median decode step; terms per token), mean hit rate."""
    tok = [step_tok_s(r) for r in runs]
    med = statistics.median(tok)
    return {"tok_s_median": med, "tok_s_runs": tok, "spread": (max(tok) - min(tok)) / med if med else None,
            "tok_s_mean_based_runs": [r["tok_s"] for r in runs],
            "hit_rate_memory": statistics.mean(1.0 - r["hit_rate"]["disk"] for r in runs),
            "hit_rate": {k: statistics.mean(r["hit_rate"][k] for r in runs) for k in runs[0]["hit_rate"]},
            "disk_bytes_per_token": statistics.median(r["disk_bytes_per_token"] for r in runs),
            "terms": {**{k: statistics.median(r["terms"][k] for r in runs)
                         for k in ("dense_s", "disk_wait_s", "expert_layers_s")},
                      "expert_compute_s": {"cpu": statistics.median(r["terms"]["expert_compute_s"]["cpu"]
                                                                    for r in runs)}},
            "tokens": [r["tokens"] for r in runs]}


def report_of(plan, m: dict) -> dict:
    """A verify-report body (no reference run) from a placement's medians, for calibrate."""
    measured = {"tok_s": m["tok_s_median"], "decode_s_per_token": 1 / m["tok_s_median"],
                "terms": m["terms"], "hit_rate": m["hit_rate"],
                "disk_bytes_per_token": m["disk_bytes_per_token"]}
    return {"plan": {"coefficients": plan.doc.get("coefficients"), "n_decode_layers": len(plan.doc["layers"]),
                     "counts": plan.counts()},
            "predicted": plan.doc["predicted"], "measured": measured,
            "comparison": compare(plan.doc["predicted"], measured), "verdict": {}}


def calibrate(plans: dict, meas: dict, budgets: list, out_dir: Path, tag: str = ""):
    """Fit coefficients on our plan at ``budgets``; write them and the reports they came from."""
    from colibri_plan.verify import save_report

    reports, names = [], []
    for gb in budgets:
        rep = report_of(plans[gb]["ours"], meas[gb]["ours"])
        names.append(str(save_report(rep, out_dir / f"calibration{tag}-{gb:g}gb.verify.json")))
        reports.append(rep)
    coef, detail = fit_coefficients(reports, names=names)
    path = save_coefficients(coef, out_dir / f"coefficients{tag}.json", detail, names)
    log(f"calibrated coefficients -> {path}: {coef.to_dict()}")
    return coef, str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixture", default="work-demo/fixture", help="fixture pack (built if missing)")
    ap.add_argument("--profile", default=None, help="profile (default: measure with profile --quick)")
    ap.add_argument("--heat", default=None, help="routing statistics (default: a statistics run)")
    ap.add_argument("--budgets", default="1.15,1.6,2.2,3.0,5.0", help="RAM budgets in GB")
    ap.add_argument("--tokens", type=int, default=16, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--calibrate", action="store_true", help="fit coefficients on ours at --calibrate-at")
    ap.add_argument("--calibrate-at", default=None,
                    help="budgets (GB) whose runs of our plan calibrate (default: lowest, second-highest, "
                         "highest)")
    ap.add_argument("--coefficients", default=None, help="use these coefficients (calibrate output)")
    ap.add_argument("--out", default="bench/results/plan_accuracy.json")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fx = Path(a.fixture)
    if not (fx / "pack.json").is_file():
        subprocess.run(CLI + ["model", "fixture", str(fx)], check=True)
    if a.profile is None:
        a.profile = str(out.with_name("profile.json"))
        subprocess.run(CLI + ["profile", "--quick", "--out", a.profile], check=True)
    if a.heat is None:
        a.heat = str(out.with_name("heat.json"))
        ids = " ".join(map(str, fixture_prompt(4096, 256, seed=0)))
        subprocess.run(CLI + ["run", "--model", str(fx), "--backend", "cpu", "--prompt-ids", ids,
                              "--tokens", "4", "--stats-out", a.heat], check=True)
    profile, spec, heat = load_profile(a.profile), load_model_spec(fx), load_heat(a.heat)
    budgets = sorted(float(x) for x in a.budgets.split(","))
    cal_at = (sorted(float(x) for x in a.calibrate_at.split(",")) if a.calibrate_at
              else sorted({budgets[0], budgets[max(0, len(budgets) - 2)], budgets[-1]}))
    if not set(cal_at) <= set(budgets):
        sys.exit(f"--calibrate-at {a.calibrate_at}: every value must be one of --budgets {a.budgets}")
    # repeat r uses prompt seed 1 + r (never the statistics run's seed 0): hit rates pool over prompts
    prompts = [fixture_prompt(spec.vocab_size, 8, seed=1 + r) for r in range(a.repeats)]
    pack = open_pack(fx)
    t0 = time.perf_counter()
    coef, coef_src = None, "none (raw cost model)"
    if a.coefficients:
        coef, coef_src = load_coefficients(a.coefficients), a.coefficients
    setups, plans, in_sample = {}, {}, {}
    for gb in budgets:
        setups[gb], plans[gb] = plans_at(profile, spec, heat, gb, coef, a.context)
    runs: dict[str, list] = {}
    for rep in range(a.repeats):          # interleaved: every distinct placement once per repeat
        order = np.random.default_rng([7, rep])
        for gb in budgets:
            # a budget's placements run back to back (paired ratios), in a shuffled order per repeat so
            # that no placement always follows the same one (disk and CPU load drift on a shared machine)
            names = list(plans[gb])
            for name in [names[i] for i in order.permutation(len(names))]:
                plan = plans[gb][name]
                key = placement_key(plan)
                if len(runs.get(key, [])) > rep:
                    continue
                log(f"rep {rep + 1}/{a.repeats}: {name} at {gb:g} GB ({time.perf_counter() - t0:.0f} s)")
                runs.setdefault(key, []).append(measure(pack, plan, prompts[rep], a.tokens))
    meas = {gb: {n: summarise(runs[placement_key(p)]) for n, p in plans[gb].items()} for gb in budgets}
    # predictions: the plans' own (raw or --coefficients), and after one calibration on ours at the ends
    pred = {gb: {n: p.doc["predicted"] for n, p in plans[gb].items()} for gb in budgets}
    cal_pred, moved = None, {}
    if a.calibrate and not a.coefficients:
        coef, coef_src = calibrate(plans, meas, cal_at, out.parent)
        # for comparison only: coefficients fitted on ours at every budget (in sample for ours)
        coef_all, _ = calibrate(plans, meas, budgets, out.parent, tag="-all-budgets")
        in_sample = {}
        for gb in budgets:
            setup_a, _ = plans_at(profile, spec, heat, gb, coef_all, a.context)
            in_sample[gb] = {n: cost_of(setup_a, p.tiers(), p.lru_slots())["tok_s"]
                             for n, p in plans[gb].items()}
        cal_pred = {}
        for gb in budgets:
            setup_c, plans_c = plans_at(profile, spec, heat, gb, coef, a.context)
            cal_pred[gb] = {n: cost_of(setup_c, p.tiers(), p.lru_slots()) for n, p in plans[gb].items()}
            moved[gb] = placement_key(plans_c["ours"]) != placement_key(plans[gb]["ours"])
    final = cal_pred or pred
    rows, result = [], []
    for gb in budgets:
        noise = max(m["spread"] for m in meas[gb].values())
        best_base = max(meas[gb][n]["tok_s_median"] for n in meas[gb] if n != "ours")
        ours_runs = meas[gb]["ours"]["tok_s_runs"]
        # ours / baseline within each repeat (the two ran back to back), median over repeats
        paired = {o: statistics.median(x / y for x, y in zip(ours_runs, meas[gb][o]["tok_s_runs"]))
                  for o in meas[gb] if o != "ours"}
        for n, p in plans[gb].items():
            pr, m = final[gb][n], meas[gb][n]
            same = [o for o in plans[gb] if o != n and placement_key(plans[gb][o]) == placement_key(p)]
            entry = {"ram_gb": gb, "placement": n, "counts": p.counts(), "same_placement_as": same,
                     "predicted_tok_s_plan": pred[gb][n]["tok_s"], "predicted_tok_s": pr["tok_s"],
                     "predicted_hit_rate": (1.0 - pr["hit_rate"]["disk"]), "predicted_terms": pr["terms"],
                     **m, "noise": noise,
                     "tok_s_ratio_measured_over_predicted": m["tok_s_median"] / pr["tok_s"],
                     "hit_rate_diff_points": 100 * (m["hit_rate_memory"] - (1.0 - pr["hit_rate"]["disk"])),
                     "vs_best_baseline": m["tok_s_median"] / best_base,
                     "calibration_input": bool(cal_pred) and n == "ours" and gb in cal_at,
                     "predicted_tok_s_all_budget_fit": in_sample[gb][n] if cal_pred else None}
            if n == "ours":
                entry["paired_ratio_vs_baselines"] = paired
                entry["ours_ok"] = all(r >= 1 - noise for r in paired.values())
                entry["placement_changes_after_calibration"] = moved.get(gb)
            result.append(entry)
            c = p.counts()
            rows.append([f"{gb:g}", n + ("*" if entry["calibration_input"] else "")
                         + (f" (= {', '.join(same)})" if same else ""),
                         f"{c['ram_pinned']}/{c['lru_slots']}/{c['disk']}", f"{pred[gb][n]['tok_s']:.3f}",
                         f"{pr['tok_s']:.3f}", f"{m['tok_s_median']:.3f}",
                         f"{entry['tok_s_ratio_measured_over_predicted']:.2f}",
                         f"{100 * entry['predicted_hit_rate']:.1f}", f"{100 * m['hit_rate_memory']:.1f}",
                         f"{entry['hit_rate_diff_points']:+.1f}", f"{entry['vs_best_baseline']:.2f}",
                         f"{min(paired.values()):.2f}" if n == "ours" else "",
                         f"{100 * noise:.0f}%", {True: "yes", False: "NO"}.get(entry.get("ours_ok"), "")])
    header = ["RAM GB", "placement", "pin/LRU/disk", "raw pred tok/s",
              "cal pred tok/s" if cal_pred else "pred tok/s", "meas tok/s", "meas/pred", "pred hit %",
              "meas hit %", "diff pts", "vs best base", "paired min", "noise", "ours OK"]
    text = table(rows, header)
    if cal_pred:
        text += (f"\n* calibration input (ours at {', '.join(f'{g:g}' for g in cal_at)} GB); every other row "
                 "is predicted out of sample")
    print(text)
    ours = [r for r in result if r["placement"] == "ours"]
    summary = {"tok_s_within_25pct_all": all(abs(r["tok_s_ratio_measured_over_predicted"] - 1) <= 0.25
                                             for r in result),
               "tok_s_ratio_range": [min(r["tok_s_ratio_measured_over_predicted"] for r in result),
                                     max(r["tok_s_ratio_measured_over_predicted"] for r in result)],
               "hit_rate_within_5pts_all": all(abs(r["hit_rate_diff_points"]) <= 5 for r in result),
               "hit_rate_diff_max_points": max(abs(r["hit_rate_diff_points"]) for r in result),
               "ours_never_below_baseline_beyond_noise": all(r["ours_ok"] for r in ours),
               "ours_vs_best_baseline": [round(r["vs_best_baseline"], 3) for r in ours],
               "ours_paired_ratio_min": [round(min(r["paired_ratio_vs_baselines"].values()), 3)
                                         for r in ours],
               "noise_median": statistics.median(r["noise"] for r in ours),
               "noise_max": max(r["noise"] for r in ours),
               "our_placement_changes_after_calibration": moved or None}
    if cal_pred:
        r_all = [r["tok_s_median"] / r["predicted_tok_s_all_budget_fit"] for r in result]
        summary["all_budget_fit"] = {"coefficients": coef_all.to_dict(),
                                     "tok_s_ratio_range": [min(r_all), max(r_all)],
                                     "tok_s_within_25pct_all": all(abs(x - 1) <= 0.25 for x in r_all)}
    print(json.dumps(summary, indent=1))
    doc = {"kind": "bench-plan-accuracy", "fixture": str(fx), "profile": a.profile, "heat": a.heat,
           "coefficients": coef.to_dict() if coef else None, "coefficients_source": coef_src,
           "tokens": a.tokens, "repeats": a.repeats, "prompts": prompts, "seconds": time.perf_counter() - t0,
           "rows": result, "summary": summary, "table": text}
    atomic_write_text(out, json.dumps(doc, indent=1, default=float) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
