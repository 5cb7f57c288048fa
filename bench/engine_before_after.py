"""Our engine against an earlier install of itself: decode and prefill, paired, same pack, same machine.

For a change of the engine's hot path (issue 32: one forward pass), the question is "no slower than
before". Two installs of colibri-plan (``--before PYTHON`` and ``--after PYTHON``, e.g. a worktree of the
old commit with its own venv, and this one) each run one warm worker process on the same pack; they are
asked in turn, the order inside each pair alternating (before, after / after, before), ``--pairs`` times:

- prefill of a ``--prefill`` token prompt (comma list; seconds to the last position's logits, a fresh
  cache), and greedy decode of ``--decode-tokens`` tokens after a 16-token prompt (tok/s);
- placement as `run` places it without a plan: a residency manager with every expert pinned in RAM and the
  CPU trunk (``--backend cpu``), or every expert in VRAM on ``<backend>:0`` with the trunk there
  (``--backend cuda|opencl|vulkan``); or a plan's placement (``--plan``: its VRAM experts on
  ``<backend>:0``, the rest pinned in RAM, the trunk on ``<backend>:0``).

The pack is a random Qwen3-MoE (``bench/peer_llamacpp.py``'s checkpoint: hidden 2048, 16/4 heads of 128,
32 experts top-8 of width 1024, vocab 8192; ``--layers``), experts and dense trunk in ``--format``, or
``--pack DIR`` (e.g. ``bench/h200_trunk.py fixture``'s Qwen3-30B-A3B widths).
Prints medians, spreads (min..max) and per-pair ratios after/before (decode tok/s; prefill before_s /
after_s: > 1 means the new install is faster), checks that both give the same greedy tokens, writes JSON
(``--out``).

    .venv/bin/python bench/engine_before_after.py --before ../wt-base/.venv/bin/python \\
        --out bench/results/engine-before-after-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, sys, time
import numpy as np
from colibri_plan.backends import get_backend
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import Placement
from colibri_plan.engine.residency import ResidencyManager

pack_dir, backend, context = sys.argv[1], sys.argv[2], int(sys.argv[3])
plan = sys.argv[4] if len(sys.argv) > 4 else ""
pack = open_pack(pack_dir)
a = pack.arch
cpu = get_backend("cpu").open(0)
devices, trunk = {}, None
if backend != "cpu":
    trunk = devices[f"{backend}:0"] = get_backend(backend).open(0)
if plan:  # a plan's placement (its VRAM experts on <backend>:0, the rest pinned in RAM), the trunk there
    from colibri_plan.formats.plan import load_plan
    placement = Placement.from_plan(load_plan(plan))
else:
    placement = Placement.all_resident(a.moe_layers, a.n_experts,
                                       None if backend == "cpu" else f"{backend}:0")
rm = ResidencyManager(pack, placement, cpu, devices=devices)
model = Model(pack, experts=rm, trunk_backend=trunk, context_tokens=context)
print(json.dumps({"ready": True, "engine": __import__("colibri_plan.engine", fromlist=["x"]).__file__}),
      flush=True)

def last(ids, cache):
    return int(np.argmax(model._last_logits(ids, cache)))

for line in sys.stdin:
    req, res = json.loads(line), {}
    for p in req["prefill"]:
        cache = model.new_cache(context)
        rm.reset_stats()
        t0 = time.perf_counter()
        res[f"prefill_{len(p)}_token"] = last(p, cache)
        res[f"prefill_{len(p)}_s"] = time.perf_counter() - t0
        st = rm.reset_stats()  # the prefill's tiers (and, where the install has it, its GPU offload)
        res[f"prefill_{len(p)}_stats"] = {"uses": st.uses, "cpu_compute_s": st.cpu_compute_s,
                                          **{k: getattr(st, k) for k in ("offloaded", "offload_h2d_bytes",
                                                                         "offload_h2d_s") if hasattr(st, k)}}
    cache = model.new_cache(context)
    tok = last(req["prompt"], cache)
    toks = [tok]
    t0 = time.perf_counter()
    for _ in range(req["decode"]):
        tok = last([tok], cache)
        toks.append(tok)
    res["decode_tok_s"] = req["decode"] / (time.perf_counter() - t0)
    res["tokens"] = toks
    g = getattr(model.trunk, "_step_graph", None) if model.trunk is not None else None
    res["graph"] = {"off": getattr(model.trunk, "graph_off", None),
                    **{k: getattr(g, k) for k in ("waits", "handoffs", "captures") if hasattr(g, k)}}
    print(json.dumps(res), flush=True)
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Worker:
    """One warm engine process of an install, answering one JSON request per line."""

    def __init__(self, python: str, pack: Path, backend: str, context: int, plan: str = ""):
        # cwd "/": each install imports its own colibri_plan, not the source tree's
        plan = str(Path(plan).resolve()) if plan else ""
        self.p = subprocess.Popen([python, "-c", WORKER, str(pack.resolve()), backend, str(context), plan],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        self.info = json.loads(self.p.stdout.readline())

    def ask(self, req: dict) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.info} died")
        return json.loads(line)

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


def build_pack(work: Path, layers: int, fmt: str, python: str) -> Path:
    """The random Qwen3-MoE checkpoint of bench/peer_llamacpp.py (``layers`` layers), packed with experts
    and dense trunk in ``fmt`` (cached in ``work``)."""
    ckpt, pack = work / f"qwen3moe-{layers}l", work / f"pack-{layers}l-{fmt}"
    if not (ckpt / "config.json").exists():
        code = ("import sys; sys.path.insert(0, 'bench'); from pathlib import Path; "
                f"import peer_llamacpp as p; p.SIZES['num_hidden_layers'] = {layers}; "
                f"p.build_checkpoint(Path({str(ckpt)!r}))")
        subprocess.run([python, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
    if not (pack / "pack.json").exists():
        subprocess.run([str(Path(python).with_name("colibri-plan")), "model", "pack", str(ckpt), str(pack),
                        "--quant", fmt, "--dense-quant", fmt], check=True)
    return pack


def _stat(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="python of the earlier install")
    ap.add_argument("--after", default=sys.executable, help="python of the new install (default: this one)")
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "opencl", "vulkan"))
    ap.add_argument("--format", default="int8")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prefill", default="16,64")
    ap.add_argument("--decode-prompt", type=int, default=16,
                    help="prompt tokens before the timed decode (the first of the first --prefill prompt)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--work", default="out/before-after")
    ap.add_argument("--pack", help="an existing pack to run instead (e.g. bench/h200_trunk.py fixture's)")
    ap.add_argument("--plan", default="", help="place experts as this plan does (its VRAM on <backend>:0, "
                    "the rest pinned in RAM; e.g. the 2.5 GB GPU plan) instead of all in one tier")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.pairs < 1 or a.decode_tokens < 1 or a.layers < 1 or a.decode_prompt < 1:
        ap.error("--pairs, --decode-tokens, --decode-prompt and --layers must be >= 1")
    prefill = [int(n) for n in a.prefill.split(",") if n]
    if any(n < 1 or n + 1 > a.context for n in prefill):
        ap.error("--prefill lengths must be >= 1 and below --context")
    if a.decode_prompt + a.decode_tokens > a.context:
        ap.error("--decode-prompt + --decode-tokens must fit in --context")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    pack = Path(a.pack) if a.pack else build_pack(work, a.layers, a.format, a.after)
    vocab = json.loads((pack / "pack.json").read_text())["arch"]["vocab_size"]
    rng = __import__("random").Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in prefill]
    n = a.decode_prompt  # the decode's prompt: the first n tokens of the first prefill prompt (same rng)
    head = prompts[0] if prompts and len(prompts[0]) >= n else [rng.randrange(vocab) for _ in range(n)]
    req = {"prefill": prompts, "prompt": head[:n], "decode": a.decode_tokens}
    workers = {k: Worker(py, pack, a.backend, a.context, a.plan)
               for k, py in (("before", a.before), ("after", a.after))}
    for w in workers.values():
        log(f"worker: {w.info}")
        w.ask(req)  # warm-up: compiled kernels, first-touch pages
    runs = {"before": [], "after": []}
    for i in range(a.pairs):
        order = ("before", "after") if i % 2 == 0 else ("after", "before")
        for k in order:
            runs[k].append(workers[k].ask(req))
        log(f"pair {i + 1}/{a.pairs}: decode before {runs['before'][-1]['decode_tok_s']:.1f} / after "
            f"{runs['after'][-1]['decode_tok_s']:.1f} tok/s")
    for w in workers.values():
        w.close()
    keys = ["decode_tok_s"] + [f"prefill_{n}_s" for n in prefill]
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "args": vars(a), "pack": str(pack),
              "engines": {k: w.info for k, w in workers.items()},
              "same_tokens": all(b["tokens"] == f["tokens"] for b, f in zip(runs["before"], runs["after"])),
              "tokens": {k: runs[k][0]["tokens"] for k in runs},
              # each prefill's greedy token, per run, and the prefill's tier statistics (the last run)
              "prefill_tokens": {k: [[r[f"prefill_{n}_token"] for n in prefill] for r in runs[k]]
                                 for k in runs},
              "prefill_stats": {k: {n: runs[k][-1].get(f"prefill_{n}_stats") for n in prefill} for k in runs},
              "graph": {k: runs[k][-1].get("graph") for k in runs}, "metrics": {}}
    print(f"{'metric':<16} {'before':>22} {'after':>22} {'after/before (faster > 1)':>28}")
    for key in keys:
        b, f = [r[key] for r in runs["before"]], [r[key] for r in runs["after"]]
        ratios = [y / x for x, y in zip(b, f)] if key == "decode_tok_s" else [x / y for x, y in zip(b, f)]
        result["metrics"][key] = {"before": _stat(b), "after": _stat(f), "ratio": _stat(ratios)}
        unit = "tok/s" if key == "decode_tok_s" else "ms"
        scale = 1.0 if key == "decode_tok_s" else 1e3

        def fmt(s, scale=scale, unit=unit):
            return f"{s['median'] * scale:.1f} ({s['min'] * scale:.1f}-{s['max'] * scale:.1f}) {unit}"
        r = result["metrics"][key]["ratio"]
        print(f"{key:<16} {fmt(_stat(b)):>22} {fmt(_stat(f)):>22} "
              f"{r['median']:>10.3f} ({r['min']:.3f}-{r['max']:.3f})")
    print(f"same greedy tokens: {result['same_tokens']}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
