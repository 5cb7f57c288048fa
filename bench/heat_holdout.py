"""How much of a decode's routing a plan's VRAM experts cover: in the heat it was solved on, and held out.

A plan places experts by the routing of one recorded run (the heat's trace); the run it serves routes other
tokens. colibri_plan/planner/holdout.py (what `solve` records as ``predicted.hit_rate_held_out``) splits
the heat's decode steps into two halves, picks per layer as many experts as the plan holds in VRAM there
by the counts of one half, and measures their share of the other half's selections, both ways; this runs
it on a plan solved before that field existed. In-sample share against held-out share is how
optimistic the plan's "served from VRAM" is (issue 25: the 2.5 GB plan of an H200 host said 99.6%, the
timed decode measured 93.3%). Prints a table and writes JSON with ``--out``.

    python3 bench/heat_holdout.py --plan bench/results/h200-llamacpp-r6/plan.json \
        --heat bench/results/h200-llamacpp-r6/heat.json
"""

from __future__ import annotations

import argparse
import json
import os

from colibri_plan.errors import ColibriError
from colibri_plan.formats.heat import load_heat
from colibri_plan.formats.plan import load_plan
from colibri_plan.planner.holdout import MIN_DECODE_STEPS, plan_held_out


def main(argv=None) -> dict:
    """Parse ``argv``, print the two shares, write JSON with ``--out``; returns the document. Bad input
    (a missing or malformed file, a plan of another model than the heat's) ends with a one-line error."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--heat", required=True, help="the heat the plan was solved on (with its trace)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.out and (os.path.isdir(a.out) or not os.path.isdir(os.path.dirname(os.path.abspath(a.out)))):
        ap.error(f"--out {a.out}: give a file path in an existing folder")
    try:
        plan, heat = load_plan(a.plan), load_heat(a.heat)
    except ColibriError as exc:
        raise SystemExit(f"error: {exc}") from None
    want = plan.doc["model"].get("fingerprint")
    if heat.model_fingerprint and want and heat.model_fingerprint != want:
        raise SystemExit(f"error: {a.heat} was recorded on model {heat.model_fingerprint}, {a.plan} is a "
                         f"plan of {want}: give the heat the plan was solved on")
    got = plan_held_out(heat.trace, plan.doc["layers"], heat.n_experts)
    if got is None:
        raise SystemExit(f"error: {a.heat}: no routing trace of {MIN_DECODE_STEPS} decode steps or more, or "
                         f"no VRAM expert in {a.plan}: record the heat with a trace (run --stats-out)")
    doc = {"source": "bench/heat_holdout.py", "plan": a.plan, "heat": a.heat, **got}
    print(f"{doc['decode_steps']} decode steps; VRAM share of their selections: in sample "
          f"{doc['in_sample'] * 100:.1f}%, held out (2 folds) {doc['held_out'] * 100:.1f}%")
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(a.out + ".tmp", a.out)
    return doc


if __name__ == "__main__":
    main()
