"""Predicted against measured decode terms of verify reports: where a plan's tok/s prediction goes wrong.

    python bench/trunk_accuracy.py OUT/verify-cpu.json OUT/verify-gpu.json [more ...] [--json]

One row per report: the trunk device, tok/s (predicted, measured, measured/predicted), then per term
(decode, dense, attention, expert layers, each processor's expert compute) predicted and measured ms and
their ratio. ``dense`` is everything outside the routed experts (attention included when the run does not
time it apart: a CPU trunk). The context the prediction is priced at (the plan's KV context) and the
context the run decodes at (prompt + half the decode steps, on average) are shown, since attention grows
with it: a short verify run measures attention at a far shorter context than a plan made for 512 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ms(v) -> float | None:
    return None if v is None else float(v) * 1e3


def rows_of(report: dict, name: str) -> dict:
    """The terms of one verify report: {name, trunk, context_plan, context_run, tok_s: (p, m),
    terms: {term: (predicted ms, measured ms)}}."""
    pred, meas = report["predicted"], report["measured"]
    pt, mt = pred.get("terms", {}), meas.get("terms", {})
    trunk = pred.get("trunk") or {}
    terms = {
        "decode": (_ms(pred.get("decode_s_per_token")), _ms(meas.get("decode_s_per_token"))),
        "dense": (_ms(pt.get("dense_s")), _ms(mt.get("dense_s"))),
        "attention": (_ms(pt.get("attention_s")), _ms(mt.get("attention_s"))),
        "expert layers": (_ms(pt.get("expert_layers_s")), _ms(mt.get("expert_layers_s"))),
        "host hand-off": (_ms(trunk.get("host_roundtrip_s_per_token")), None),
    }
    for dev in sorted(set(pt.get("expert_compute_s", {})) | set(mt.get("expert_compute_s", {}))):
        terms[f"experts {dev}"] = (_ms(pt.get("expert_compute_s", {}).get(dev)),
                                   _ms(mt.get("expert_compute_s", {}).get(dev)))
    if mt.get("attention_s") is None and pt.get("attention_s") is not None:   # the run times them together
        terms["dense + attention"] = (_ms(pt.get("dense_s", 0) + pt["attention_s"]), _ms(mt.get("dense_s")))
    settings = report.get("settings", {})
    run_ctx = len(settings.get("prompt_ids", [])) + int(meas.get("decode_steps", 0)) / 2
    return {"name": name, "trunk": meas.get("trunk_device") or trunk.get("device", "cpu"),
            "context_plan": _plan_context(report.get("plan", {}).get("path")),
            "context_run": run_ctx, "tok_s": (pred.get("tok_s"), meas.get("tok_s")), "terms": terms}


def _plan_context(path: str | None) -> int | None:
    """The KV context the plan was priced at (its trunk section), when its file is at hand."""
    try:
        return int(json.loads(Path(path).read_text(encoding="utf-8"))["trunk"]["kv"]["context_tokens"])
    except (OSError, TypeError, KeyError, ValueError):
        return None


def _ratio(p, m) -> str:
    return f"x{m / p:.2f}" if p and m is not None else "-"


def render(rows: list[dict]) -> str:
    out = []
    for r in rows:
        p, m = r["tok_s"]
        out.append(f"{r['name']}: trunk {r['trunk']}; tok/s predicted {p:.2f}, measured {m:.2f} "
                   f"({_ratio(p, m)}); context: plan {r['context_plan'] or '?'}, "
                   f"the run ~{r['context_run']:.0f}")
        out.append(f"  {'term':<22} {'predicted ms':>13} {'measured ms':>12} {'meas/pred':>10}")
        for term, (pv, mv) in r["terms"].items():
            fp = "-" if pv is None else f"{pv:.2f}"
            fm = "-" if mv is None else f"{mv:.2f}"
            out.append(f"  {term:<22} {fp:>13} {fm:>12} {_ratio(pv, mv):>10}")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="verify reports (colibri-plan verify --report)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args(argv)
    rows = [rows_of(json.loads(Path(p).read_text(encoding="utf-8")), Path(p).stem) for p in args.reports]
    print(json.dumps(rows, indent=1) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
