"""Plans' predicted decode against our engine running them on the peer benchmark's traffic (no peer).

For each ``--plan NAME=PLAN`` (plans of one ``--pack``, e.g. solved from different heats): one warm worker
of bench/peer_llamacpp_gpu.py (``worker`` mode, ``--backend``), one warm-up request, then ``--requests``
requests of the peer's decode (its 16-token prompt, then ``--decode-tokens`` seeded random ids: the ids
bench/peer_llamacpp_gpu.py's ``bench`` times, drawn the same way). Per plan: the predicted tok/s and VRAM
share (and the held-out share when the plan has one: planner/holdout.py), the measured decode tok/s
(median, spread) and the share of selections VRAM served, and measured / predicted. The engine keeps its
state across requests (the promoter's exchanges go on), as in the peer benchmark. Prints a table and
writes JSON with ``--out``.

    python3 bench/plan_vs_run.py --pack /tmp/w8/pack --plan conv=/tmp/o/plan-4x64.json \
        --plan long=/tmp/o/plan-1x256.json --out /tmp/o/plan-vs-run.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_llamacpp as peer  # noqa: E402
from peer_llamacpp_gpu import bench_prompts  # noqa: E402


def _share(uses: dict) -> float:
    total = sum(uses.values())
    return uses.get("vram", 0) / total if total else 0.0


def run_plan(pack: str, plan_path: str, a, req: dict) -> dict:
    """One worker on ``plan_path``: a warm-up and ``a.requests`` timed requests -> the plan's row."""
    plan = json.loads(Path(plan_path).read_text())
    pred = plan["predicted"]
    argv = [sys.executable, str(Path(__file__).resolve().with_name("peer_llamacpp_gpu.py")), "worker",
            "--pack", pack, "--backend", a.backend, "--plan", plan_path, "--context", str(a.context)]
    w = peer.Worker(argv, dict(os.environ))
    try:
        w.ask(req)  # warm-up: compiles, captures, the promoter's first window
        runs = [w.ask(req) for _ in range(a.requests)]
    finally:
        w.close()
    tok = [r["decode_tok_s"] for r in runs]
    shares = [_share(r["decode_uses"]) for r in runs]
    ho = pred.get("hit_rate_held_out") or {}
    med = statistics.median(tok)
    return {"plan": plan_path, "predicted_tok_s": pred["tok_s"], "predicted_vram": pred["hit_rate"]["vram"],
            "held_out_vram": ho.get("held_out"), "in_sample_vram": ho.get("in_sample"),
            "measured_tok_s": {"median": med, "min": min(tok), "max": max(tok), "runs": tok},
            "measured_vram": statistics.median(shares), "measured_over_predicted": med / pred["tok_s"],
            "graph": runs[-1].get("graph")}


def _check_inputs(pack: str, plans: dict) -> int:
    """The pack's vocabulary size, once its index reads and every plan loads and was made for it (before
    any worker starts; the index alone: the worker loads the dense tensors); else a one-line error."""
    from colibri_plan.errors import ColibriError
    from colibri_plan.formats.pack_index import read_index
    from colibri_plan.formats.plan import load_plan

    try:
        index = read_index(pack)
        fp, vocab = index["model"].get("fingerprint"), int(index["arch"]["vocab_size"])
        for name, path in plans.items():
            got = load_plan(path).doc["model"].get("fingerprint")
            if fp and got and got != fp:
                raise SystemExit(f"error: --plan {name}={path} is a plan of model {got}, {pack} is {fp}: "
                                 "solve a plan for this pack")
    except ColibriError as exc:
        raise SystemExit(f"error: {exc}") from None
    return vocab


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pack", required=True)
    ap.add_argument("--plan", action="append", required=True, help="NAME=PLAN (repeat)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=512, help="the peer's --prefill (its ids come first)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    pairs = [p.split("=", 1) for p in a.plan]
    if any(len(p) != 2 or not p[0] for p in pairs) or len({p[0] for p in pairs}) != len(pairs):
        ap.error("--plan NAME=PLAN, each NAME given once")
    if a.requests < 1 or a.decode_tokens < 1 or a.depth < 1 or a.prefill < 0:
        ap.error("--requests, --decode-tokens and --depth must be >= 1, --prefill >= 0")
    if a.out and (Path(a.out).is_dir() or not Path(a.out).resolve().parent.is_dir()):
        ap.error(f"--out {a.out}: give a file path in an existing folder")
    plans = dict(pairs)
    vocab = _check_inputs(a.pack, plans)
    rnd = random.Random(1)  # the peer benchmark's draws: its prompts, then its decode ids
    prompts = bench_prompts(rnd, vocab, a.prefill, a.depth)
    feed = [rnd.randrange(2, vocab) for _ in range(a.decode_tokens)]
    req = {"prefill": [], "prompt": prompts["prompt"], "decode": a.decode_tokens, "decode_ids": feed}
    rows = {n: run_plan(a.pack, p, a, req) for n, p in plans.items()}
    doc = {"source": "bench/plan_vs_run.py", "pack": a.pack, "backend": a.backend, "requests": a.requests,
           "decode_tokens": a.decode_tokens, "rows": rows}
    print(f"{'plan':10} {'predicted':>10} {'VRAM %':>7} {'held out %':>10} {'measured':>10} {'VRAM %':>7} "
          f"{'meas/pred':>9}")
    for n, r in doc["rows"].items():
        ho = "-" if r["held_out_vram"] is None else f"{r['held_out_vram'] * 100:.1f}"
        print(f"{n:10} {r['predicted_tok_s']:10.1f} {r['predicted_vram'] * 100:7.1f} {ho:>10} "
              f"{r['measured_tok_s']['median']:10.1f} {r['measured_vram'] * 100:7.1f} "
              f"{r['measured_over_predicted']:9.2f}")
    if a.out:
        Path(a.out + ".tmp").write_text(json.dumps(doc, indent=1))
        os.replace(a.out + ".tmp", a.out)
    return doc


if __name__ == "__main__":
    main()
