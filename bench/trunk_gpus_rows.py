"""Before/after of the trunk's GPU split (issue 27 Build 6): GLM-5.2 on the shipped published 6x RTX 5090
profile, ``solve --target colibri --trunk auto --compare`` at several ``--ram``, each source tree given
(``--tree LABEL=DIR``: DIR holds a ``colibri_plan`` package, e.g. ``git archive <commit> colibri_plan
profiles | tar -x -C DIR`` for a tree before the change). Per row: our predicted tok/s, the colibrì
hot-first rows (trunk on the CPU, DIRECT=0, CUDA_DENSE=1), ours over the best of them, the trunk's GPU
split and the experts per GPU. Not CI (each solve takes about 20 s of CPU).

    flock /tmp/colibri-cpu.lock .venv/bin/python bench/trunk_gpus_rows.py --tree before=/tmp/h27before \
        --tree after=. --out bench/results/trunk-gpus-6x5090.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

RAMS = ("16", "32", "64", "128", "auto")


def solve(tree: str, ram: str) -> dict:
    cmd = [sys.executable, "-m", "colibri_plan", "solve", "--profile", "published-6x-rtx5090", "--model",
           "glm-5.2", "--target", "colibri", "--trunk", "auto", "--compare", "--ram", ram, "--json"]
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def row(d: dict) -> dict:
    col = {r["placement"]: r["tok_s"] for r in d["compare"] if r["placement"].startswith("colibri hot-first")}
    ours = d["predicted"]["tok_s"]
    tg = d.get("trunk_gpus") or {}
    return {"tok_s": ours, "colibri_hot_first": col, "vs_best_hot_first": ours / max(col.values()),
            "trunk_device": d["trunk"].get("device"),
            "trunk_split_layers": len(d["trunk"].get("split") or []),
            "trunk_gpus": tg.get("chosen"), "trunk_env": tg.get("env"),
            "experts_per_gpu": {k: v for k, v in d["counts"].items() if k.startswith("cuda:")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, help="LABEL=DIR (repeatable)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = {"profile": "published-6x-rtx5090", "model": "glm-5.2",
           "command": "solve --target colibri --trunk auto --compare --ram R --json", "rows": {}}
    for spec in a.tree:
        label, _, tree = spec.partition("=")
        out["rows"][label] = {ram: row(solve(tree, ram)) for ram in RAMS}
        for ram, r in out["rows"][label].items():
            print(f"{label} --ram {ram}: {r['tok_s']:.3f} tok/s, {r['vs_best_hot_first']:.3f}x hot-first, "
                  f"trunk {r['trunk_gpus'] or r['trunk_device']}")
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
