"""Predicted against measured prefill (time to first token) on the bundled fixture model.

    .venv/bin/python bench/prefill_accuracy.py [--dir work-demo/prefill] [--fixture work-demo/fixture]
        [--prompts 16,64,256] [--ram auto,1.5] [--repeats 3] [--out bench/results/prefill-accuracy.json]

The chain of ``scripts/demo.sh``: the fixture (made with ``model fixture`` unless ``--fixture`` names one),
one ``profile --quick`` (reused when ``DIR/profile.json`` exists: it is the slow step), the routing heat
of a 256-token statistics run (reused too), then per RAM budget one ``solve`` (``--dense-format f32``, the
fixture's trunk) and per prompt length the plan's own prefill model at that length
(``planner.prefill.prefill_for_plan``: the figures ``solve --prompt-tokens`` records) against the engine's
measured prefill (``RunReport.prefill_s``, the prompt's forward pass = time to first token): one
discarded warm-up run per budget, then the median of ``--repeats`` runs of each length. Prints a table
(predicted, measured median and min, measured/predicted of each, ``experts``: the routed experts' wall
time measured (median) over predicted, the 1-minute load average during the runs, the terms) and writes
the JSON to ``--out``. On a shared machine other work on the cores inflates the measured figures (the
dense trunk's BLAS calls most: look at ``experts`` and the load column); the residency manager's prefill
statistics (experts' wall, CPU compute, disk wait, reads) are snapshotted per run (the engine resets
them when the prefill's token comes out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "colibri_plan"]


def _cli(*args: str) -> None:
    subprocess.run([*CLI, *args], check=True, cwd=ROOT)


def inputs(d: Path, fixture: Path | None) -> tuple[Path, Path, Path]:
    """(fixture, profile, heat) under ``d``, made when missing (the fixture only without ``fixture``)."""
    d.mkdir(parents=True, exist_ok=True)
    fx = fixture or (ROOT / "work-demo/fixture" if (ROOT / "work-demo/fixture/pack.json").exists()
                     else d / "fixture")   # the demo's fixture when there is one (3.6 GB)
    if not (fx / "pack.json").exists():
        _cli("model", "fixture", str(fx))
    prof = d / "profile.json"
    if not prof.exists():
        _cli("profile", "--quick", "--out", str(prof))
    heat = d / "heat.json"
    if not heat.exists():
        from colibri_plan.engine.fixture import fixture_prompt
        from colibri_plan.engine.pack import open_pack
        from colibri_plan.fileio import atomic_write_text

        ids = fixture_prompt(open_pack(fx).arch.vocab_size, 256, seed=0)
        stats = atomic_write_text(d / "prompt-stats.txt", " ".join(map(str, ids)))
        _cli("run", "--model", str(fx), "--backend", "cpu", "--prompt-file", str(stats), "--tokens", "8",
             "--stats-out", str(heat))
    return fx, prof, heat


def solve(d: Path, fx: Path, prof: Path, heat: Path, ram: str, prompt_tokens: int, context: int) -> Path:
    out = d / f"plan-{ram}.json"
    _cli("solve", "--profile", str(prof), "--model", str(fx), "--heat", str(heat), "--dense-format", "f32",
         "--context", str(context), "--ram", ram, "--prompt-tokens", str(prompt_tokens), "--out", str(out))
    return out


#: the residency manager's statistics of the prefill, as :func:`measure` snapshots them
PREFILL_STATS = ("layer_wall_s", "cpu_compute_s", "disk_wait_s", "disk_busy_s", "disk_read_s", "disk_bytes")


def measure(pack, plan, prompt: list[int], repeats: int) -> list[dict]:
    """``repeats`` runs of ``prompt`` under ``plan`` (one new token each): per run {"prefill_s", "load1"
    (the 1-minute load average after it: other work on the cores), and the residency manager's prefill
    statistics (:data:`PREFILL_STATS`; the engine resets them when the prefill's token comes out, so
    they are snapshotted at that reset)}."""
    from colibri_plan.engine import residency
    from colibri_plan.engine.runner import generate
    from colibri_plan.run_options import RunOptions

    seen: list = []
    reset = residency.ResidencyManager.reset_stats

    def snapshot(self):
        old = reset(self)
        seen.append(old)
        return old

    out = []
    residency.ResidencyManager.reset_stats = snapshot
    try:
        for _ in range(repeats):
            seen.clear()
            run = generate(pack, prompt, RunOptions(tokens=1, backend="cpu"), plan=plan)
            st = seen[0] if seen else None
            out.append({"prefill_s": float(run.prefill_s), "load1": os.getloadavg()[0],
                        **{k: (float(getattr(st, k)) if st is not None else None) for k in PREFILL_STATS}})
    finally:
        residency.ResidencyManager.reset_stats = reset
    return out


def _commit() -> str | None:
    """HEAD of this checkout (the engine's kernels change between commits), None outside git."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _lengths(text: str) -> list[int]:
    """--prompts: comma-separated whole numbers >= 1 (argparse turns the ValueError into a usage error)."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or not all(x.isdigit() and int(x) >= 1 for x in out):
        raise argparse.ArgumentTypeError(f"expected prompt lengths >= 1, comma-separated (16,64,256), "
                                         f"got {text!r}")
    return [int(x) for x in out]


def _budgets(text: str) -> list[str]:
    """--ram: comma-separated GB figures > 0 or ``auto`` (what ``solve --ram`` takes)."""
    out = [x.strip() for x in text.split(",") if x.strip()]

    def ok(x: str) -> bool:
        try:
            return x == "auto" or 0 < float(x) < float("inf")
        except ValueError:
            return False

    if not out or not all(ok(x) for x in out):
        raise argparse.ArgumentTypeError(f"expected RAM budgets in GB (> 0) or auto, comma-separated "
                                         f"(auto,1.5), got {text!r}")
    return out


def _at_least_1(text: str) -> int:
    """--repeats: a whole number >= 1 (0 runs leave no median)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="work-demo/prefill", help="working folder (profile, heat, plans)")
    ap.add_argument("--fixture", default=None,
                    help="a fixture pack folder (default: work-demo/fixture when there, else DIR/fixture, "
                         "made when missing)")
    ap.add_argument("--prompts", type=_lengths, default="16,64,256", help="prompt lengths, comma-separated")
    ap.add_argument("--ram", type=_budgets, default="auto,1.5",
                    help="RAM budgets (GB or auto), comma-separated")
    ap.add_argument("--repeats", type=_at_least_1, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/prefill-accuracy.json"))
    ap.add_argument("--json", action="store_true", help="print the result document instead of the table")
    a = ap.parse_args(argv)
    if a.fixture and not (Path(a.fixture) / "pack.json").exists():   # never build 3.6 GB where one was named
        ap.error(f"--fixture {a.fixture} is not a pack (no pack.json): name a folder made by `colibri-plan "
                 "model fixture`, or leave --fixture out to use work-demo/fixture or build DIR/fixture")
    from colibri_plan.engine.fixture import fixture_prompt
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.fileio import atomic_write_text
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.planner.prefill import prefill_for_plan

    d = Path(a.dir)
    fx, prof, heat = inputs(d, Path(a.fixture) if a.fixture else None)
    lengths = a.prompts
    pack = open_pack(fx)
    rows = []
    t0 = time.time()
    for ram in a.ram:
        plan_path = solve(d, fx, prof, heat, ram, lengths[0], max(512, max(lengths) + 8))
        plan = load_plan(plan_path)
        measure(pack, plan, fixture_prompt(pack.arch.vocab_size, lengths[0], seed=1), 1)   # warm-up
        for n in lengths:
            pred = prefill_for_plan(plan.doc, n)
            runs = measure(pack, plan, fixture_prompt(pack.arch.vocab_size, n, seed=1), a.repeats)
            meas = [r["prefill_s"] for r in runs]
            med = statistics.median(meas)
            mid = runs[meas.index(med)] if med in meas else runs[0]   # the median run's breakdown
            rows.append({"ram": ram, "prompt_tokens": n, "predicted_s": pred["prefill_s"], "measured_s": med,
                         "measured_min_s": min(meas), "measured_runs_s": meas,
                         "ratio": med / pred["prefill_s"],
                         "ratio_min": min(meas) / pred["prefill_s"], "runs": runs,
                         "load1_median": statistics.median(r["load1"] for r in runs),
                         "experts_ratio": (statistics.median(r["layer_wall_s"] for r in runs)
                                           / pred["terms"]["experts_s"]
                                           if runs[0]["layer_wall_s"] is not None else None),
                         "measured_median_run": {"experts_s": mid["layer_wall_s"],
                                                 "outside_experts_s": (mid["prefill_s"] - mid["layer_wall_s"]
                                                                       if mid["layer_wall_s"] is not None
                                                                       else None),
                                                 **{k: mid[k] for k in PREFILL_STATS[1:]}},
                         "predicted_terms": {k: v for k, v in pred["terms"].items()},
                         "hit_rate": plan.doc["predicted"]["hit_rate"], "plan": str(plan_path)})
    doc = {"kind": "prefill-accuracy", "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": " ".join(["python bench/prefill_accuracy.py", *(argv or sys.argv[1:])]),
           "model": str(fx), "profile": str(prof), "repeats": a.repeats, "seconds": time.time() - t0,
           "cores": os.cpu_count(), "commit": _commit(),
           "figures": rows[0]["predicted_terms"] and json.loads(
               json.dumps(prefill_for_plan(load_plan(rows[0]["plan"]).doc, lengths[0])["figures"])),
           "rows": rows}
    atomic_write_text(a.out, json.dumps(doc, indent=1) + "\n")
    if a.json:
        print(json.dumps(doc, indent=1))
        return 0
    print(f"{'ram':>5} {'prompt':>6} {'pred s':>8} {'meas s':>8} {'min s':>8} {'meas/pred':>9} "
          f"{'min/pred':>8} {'experts':>7} {'load':>4}  experts pred/meas ms, rest pred/meas ms; "
          "predicted terms (ms)")
    for r in rows:
        t, m = r["predicted_terms"], r["measured_median_run"]
        names = ("dense_s", "lm_head_s", "attention_s", "handoff_s", "disk_read_s", "verify_s")
        terms = ", ".join(f"{k[:-2]} {t[k] * 1e3:.1f}" for k in names if k in t)
        rest = r["predicted_s"] - t["experts_s"]
        me = "-" if m["experts_s"] is None else f"{m['experts_s'] * 1e3:.0f}"
        mr = "-" if m["outside_experts_s"] is None else f"{m['outside_experts_s'] * 1e3:.0f}"
        print(f"{r['ram']:>5} {r['prompt_tokens']:>6} {r['predicted_s']:>8.3f} {r['measured_s']:>8.3f} "
              f"{r['measured_min_s']:>8.3f} {r['ratio']:>9.2f} {r['ratio_min']:>8.2f} "
              f"{r['experts_ratio'] or float('nan'):>7.2f} {r['load1_median']:>4.1f}  "
              f"{t['experts_s'] * 1e3:.0f}/{me}, {rest * 1e3:.0f}/{mr}; {terms}, "
              f"distinct {t['distinct_experts_per_layer']:.1f}/layer")
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
