#!/usr/bin/env bash
# On a CUDA GPU host (issue 25, Builds 2-3): decode steps replayed from a captured CUDA graph (experts
# indexed on the device, no host synchronisation inside a step) against the same engine launching every op
# from Python, everything in VRAM, and both against the CPU reference's tokens.
#
#   OUT=/tmp/h200-graph bash bench/h200_graph.sh
#   LAYERS=24 PAIRS=6 OUT=/tmp/x bash bench/h200_graph.sh
#
# The pack is bench/h200_trunk.py's fixture (Qwen3-30B-A3B widths: hidden 2048, 32 heads of 128, 4 kv
# heads, expert width 768; LAYERS layers, 32 experts top-8, int8 trunk and experts, vocab 32000) in WORK.
# One install, two switches of engine/decode_graph.py: COLIBRI_CUDA_GRAPH=0 ("before": every op launched
# from Python, ids and weights brought down per MoE layer) and =1 ("after": one graph replay a token),
# paired by bench/engine_before_after.py (--backend cuda: every expert in VRAM, the trunk there; device
# routing on in both). Then the CPU engine (--backend cpu) on the same prompt for the reference tokens.
# Files under OUT: h200-graph-gpu.json/.txt (before/after), h200-graph-cpu.json/.txt (reference),
# summary.json, summary.txt. Needs: this checkout installed for python3, CuPy with a visible GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-graph}
WORK=${WORK:-/tmp/h200-graph-work}
LAYERS=${LAYERS:-24}
PAIRS=${PAIRS:-6}
TOKENS=${TOKENS:-64}
PREFILL=${PREFILL:-16,512}
PY=${PY:-python3}
BACKEND=${BACKEND:-cuda}           # opencl / vulkan run the same flow (informational)
mkdir -p "$OUT" "$WORK"
PYABS=$(command -v "$PY")
for mode in 0 1; do  # a python that runs with the switch set (engine_before_after.py takes pythons)
  printf '#!/bin/sh\nCOLIBRI_CUDA_GRAPH=%s exec %s "$@"\n' "$mode" "$PYABS" > "$WORK/py-graph$mode"
  chmod +x "$WORK/py-graph$mode"
done
[ -f "$WORK/fixture/pack.json" ] || $PY bench/h200_trunk.py fixture "$WORK/fixture" --layers "$LAYERS" \
  --experts 32 --width 768 --hidden 2048 --vocab 32000
$PY bench/engine_before_after.py --before "$WORK/py-graph0" --after "$WORK/py-graph1" --backend "$BACKEND" \
  --pack "$WORK/fixture" --pairs "$PAIRS" --prefill "$PREFILL" --context 1024 --decode-tokens "$TOKENS" \
  --out "$OUT/h200-graph-gpu.json" 2>&1 | tee "$OUT/h200-graph-gpu.txt"
$PY bench/engine_before_after.py --before "$PY" --after "$PY" --backend cpu --pack "$WORK/fixture" --pairs 1 \
  --prefill 16 --context 1024 --decode-tokens "$TOKENS" --out "$OUT/h200-graph-cpu.json" \
  2>&1 | tee "$OUT/h200-graph-cpu.txt"
$PY - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
gpu, cpu = (json.loads((out / f"h200-graph-{k}.json").read_text()) for k in ("gpu", "cpu"))
ref = cpu["tokens"]["after"]
m = gpu["metrics"]
summary = {"source": "bench/h200_graph.sh", "backend": gpu["args"]["backend"], "pack": gpu["pack"], "pairs": gpu["args"]["pairs"],
           "token_exact_vs_cpu": {"eager": gpu["tokens"]["before"] == ref,
                                  "graph": gpu["tokens"]["after"] == ref},
           "same_tokens_eager_vs_graph": gpu["same_tokens"],
           "decode_tok_s": {k: m["decode_tok_s"][side]["median"] for k, side in
                            (("eager", "before"), ("graph", "after"))},
           "prefill_tok_s": {key.split("_")[1]: {k: int(key.split("_")[1]) / m[key][side]["median"] for k, side in
                                                 (("eager", "before"), ("graph", "after"))}
                             for key in m if key.startswith("prefill_")}}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"{'case':<22} {'eager':>14} {'graph':>16}")
d = summary["decode_tok_s"]
print(f"{'decode tok/s':<22} {d['eager']:>14.1f} {d['graph']:>16.1f}")
for n, p in summary["prefill_tok_s"].items():
    print(f"{'prefill ' + n + ' tok/s':<22} {p['eager']:>14.0f} {p['graph']:>16.0f}")
t = summary["token_exact_vs_cpu"]
print(f"{'tokens = CPU reference':<22} {str(t['eager']):>14} {str(t['graph']):>16}")
PYEOF
