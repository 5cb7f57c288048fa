"""Write a baseline's placement as a plan file (same budgets and cost model as `colibri-plan solve`).

    .venv/bin/python bench/baseline_plan.py --profile P --model PACK --heat H --ram auto --vram 1.0 \\
        --baseline hot-first --out plan-hot-first.json [--dense-format f32] [--context 512] \\
        [--vram auto --vram-reserve GB]

Baselines (colibri_plan/planner/baselines.py): ``hot-first`` (colibrì's global hot-first fill: VRAM, then
RAM pins), ``fit-layers`` (llama.cpp --fit-style whole layers), ``uniform``. The plan's ``predicted``
section is the cost model's figure for that placement, so ``colibri-plan verify`` compares it like ours.
"""

from __future__ import annotations

import argparse
import sys

from colibri_plan.formats.coefficients import load_coefficients
from colibri_plan.formats.heat_align import load_heat_arg
from colibri_plan.formats.plan import save_plan
from colibri_plan.formats.profile import resolve_profile
from colibri_plan.model import load_model_spec
from colibri_plan.planner.baselines import fit_layers, hot_first, uniform
from colibri_plan.planner.make import build_setup, plan_document
from colibri_plan.planner.options import DEFAULTS, SolveOptions
from colibri_plan.planner.solve import validate_placement

BASELINES = {"hot-first": hot_first, "fit-layers": fit_layers, "uniform": uniform}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--heat", default=None)
    ap.add_argument("--ram", default=DEFAULTS.ram)
    ap.add_argument("--vram", default=DEFAULTS.vram)
    ap.add_argument("--vram-reserve", type=float, default=DEFAULTS.vram_reserve_gb,
                    help="GB kept free per GPU under --vram auto (as `colibri-plan solve --vram-reserve`)")
    ap.add_argument("--dense-format", default=None)
    ap.add_argument("--context", type=int, default=DEFAULTS.context_tokens)
    ap.add_argument("--coefficients", default=None)
    ap.add_argument("--baseline", choices=sorted(BASELINES), default="hot-first")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    profile, source = resolve_profile(a.profile)
    spec = load_model_spec(a.model)
    coef = load_coefficients(a.coefficients) if a.coefficients else None
    opts = SolveOptions(ram=a.ram, vram=a.vram, context_tokens=a.context, dense_fmt=a.dense_format, coef=coef,
                        vram_reserve_gb=a.vram_reserve)
    setup = build_setup(profile, spec, load_heat_arg(a.heat), opts)
    tiers, slots = BASELINES[a.baseline](setup.problem)
    validate_placement(setup.problem, tiers, slots)
    plan = plan_document(setup, profile, tiers, slots, {"status": "baseline", "method": a.baseline},
                         profile_source=source)
    save_plan(plan, a.out)
    p = plan.doc["predicted"]
    print(f"{a.baseline}: {plan.counts()} predicted {p['tok_s']:.3f} tok/s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
