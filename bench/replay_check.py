"""Out-of-sample check of llama.cpp's cost model: replay JSON priced with coefficients fitted on OTHER
replays (``calibrate --engine llama.cpp`` writes them), nothing refitted. Prints a table and writes JSON.

    python bench/replay_check.py REPLAY.json --coefficients COEF.json [--profile P] [--model GGUF] \
        --out OUT.json

Each row: measured decode / prefill tok/s (llama-bench), predicted with COEF, their ratio; the largest
errors. The acceptance of issue 27 asks for +-20% on >= 5 placements.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("replays", nargs="+")
    ap.add_argument("--coefficients", required=True, help="llamacpp-coefficients JSON fitted elsewhere")
    ap.add_argument("--profile", action="append", default=[])
    ap.add_argument("--model", action="append", default=[])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    from colibri_plan.errors import ColibriError
    from colibri_plan.fileio import atomic_write_text, check_output_path
    from colibri_plan.model import load_model_spec
    from colibri_plan.planner import llamacpp_calibrate as lc

    try:  # the output is none of the inputs, its folder exists: checked before any work
        check_output_path(a.out, (*a.replays, a.coefficients, *a.profile, *a.model), kind=None)
        coef = lc.load(a.coefficients)
        detail = lc.check_replays(a.replays, a.profile, a.model, load_model_spec, coef)
    except ColibriError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    doc = {"kind": "llamacpp-check", "source": "bench/replay_check.py", "replays": a.replays,
           "coefficients": a.coefficients, **detail}
    within = {k: sum(1 for r in detail["rows"] if r[k]["measured"] and r[k]["predicted"]
                     and abs(r[k]["predicted"] / r[k]["measured"] - 1) <= 0.20)
              for k in ("decode_tok_s", "prefill_tok_s")}
    doc["within_20pct"] = within
    head = f"{'meas':>11} {'pred':>8} {'x':>5}"
    print(f"{'placement':<16} {head}  {head}   (decode, prefill tok/s)")
    for r in detail["rows"]:
        cells: list[str] = []
        for k in ("decode_tok_s", "prefill_tok_s"):
            m, p = r[k]["measured"], r[k]["predicted"]
            cells.append(f"{m or 0:>11.1f} {p or 0:>8.1f} {(p / m if m and p else 0):>5.2f}")
        print(f"{r['placement']:<16} {cells[0]}  {cells[1]}")
    print(f"within 20%: decode {within['decode_tok_s']}/{detail['decode_rows']}, "
          f"prefill {within['prefill_tok_s']}/{detail['prefill_rows']} (coefficients: {a.coefficients})")
    atomic_write_text(a.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
