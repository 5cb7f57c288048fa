#!/usr/bin/env bash
# On a CUDA GPU host (issue 25, Build 4): the 2.5 GB GPU plan (24 of 32 experts a layer in VRAM, the rest
# pinned in RAM and computed on the host CPU) decoded op by op (COLIBRI_CUDA_GRAPH=0) against the same
# engine replaying each step as graph segments cut at the layers with host experts (=1), in counterbalanced
# pairs, both against the CPU engine's tokens; first the real-GPU tests of the change.
#
#   OUT=/tmp/h200-hybrid bash bench/h200_hybrid.sh
#   PAIRS=6 TOKENS=128 OUT=/tmp/x bash bench/h200_hybrid.sh
#   PLAN=/path/plan-gpu.json ...        # another GPU plan of the same fixture (bench/h200_trunk.sh PLANS=gpu)
#
# The pack is bench/h200_trunk.py's fixture (Qwen3-30B-A3B widths: hidden 2048, 32 heads of 128, 4 kv heads,
# expert width 768, 24 layers, 32 experts top-8, int8 trunk and experts, vocab 32000) in WORK; the plan by
# default is the committed 2.5 GB GPU-trunk plan of that fixture (bench/results/h200-gpuroute/
# plan-gpu-2.5gb.json: its placement only is read). Files under OUT: tests.txt (the GPU tests),
# h200-hybrid-gpu.json/.txt (eager/segmented pairs), h200-hybrid-cpu.json/.txt (reference), summary.json,
# summary.txt. Needs: this checkout installed for python3 (`source .carry/enter.sh`), CuPy with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-hybrid}
WORK=${WORK:-/tmp/h200-hybrid-work}
PAIRS=${PAIRS:-4}
TOKENS=${TOKENS:-64}
PLAN=${PLAN:-bench/results/h200-gpuroute/plan-gpu-2.5gb.json}
PY=${PY:-python3}
TESTS=${TESTS:-1}
mkdir -p "$OUT" "$WORK"
if [ "$TESTS" = 1 ]; then  # the simulated and the real GPU (the cuda-param tests skip without one)
  $PY -P -m pytest -x -q tests/test_engine_decode_graph.py tests/test_backend_cuda_trunk_kernels.py \
    tests/test_costmodel_segmented.py 2>&1 | tail -5 | tee "$OUT/tests.txt"
fi
PYABS=$(command -v "$PY")
for mode in 0 1; do  # a python that runs with the switch set (engine_before_after.py takes pythons)
  printf '#!/bin/sh\nCOLIBRI_CUDA_GRAPH=%s exec %s "$@"\n' "$mode" "$PYABS" > "$WORK/py-graph$mode"
  chmod +x "$WORK/py-graph$mode"
done
[ -f "$WORK/fixture/pack.json" ] || $PY bench/h200_trunk.py fixture "$WORK/fixture" --layers 24 \
  --experts 32 --width 768 --hidden 2048 --vocab 32000
$PY bench/engine_before_after.py --before "$WORK/py-graph0" --after "$WORK/py-graph1" --backend cuda \
  --pack "$WORK/fixture" --plan "$PLAN" --pairs "$PAIRS" --prefill 16 --context 1024 --decode-tokens "$TOKENS" \
  --out "$OUT/h200-hybrid-gpu.json" 2>&1 | tee "$OUT/h200-hybrid-gpu.txt"
$PY bench/engine_before_after.py --before "$PY" --after "$PY" --backend cpu --pack "$WORK/fixture" --pairs 1 \
  --prefill 16 --context 1024 --decode-tokens "$TOKENS" --out "$OUT/h200-hybrid-cpu.json" \
  2>&1 | tee "$OUT/h200-hybrid-cpu.txt"
$PY - "$OUT" "$PLAN" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
gpu, cpu = (json.loads((out / f"h200-hybrid-{k}.json").read_text()) for k in ("gpu", "cpu"))
ref = cpu["tokens"]["after"]
m = gpu["metrics"]["decode_tok_s"]
LLAMA_FIT = 97.6  # llama.cpp --fit with the same VRAM: issue 25's table (re-measure with peer_llamacpp_gpu)
summary = {"source": "bench/h200_hybrid.sh", "plan": sys.argv[2], "pack": gpu["pack"], "pairs": gpu["args"]["pairs"],
           "decode_tokens": gpu["args"]["decode_tokens"],
           "token_exact_vs_cpu": {"eager": gpu["tokens"]["before"] == ref, "segmented": gpu["tokens"]["after"] == ref},
           "same_tokens_eager_vs_segmented": gpu["same_tokens"],
           "decode_tok_s": {"eager": m["before"], "segmented": m["after"]},
           "segmented_over_eager": m["ratio"],
           "graph": gpu.get("graph"),
           "llamacpp_fit_tok_s_issue25": LLAMA_FIT,
           "segmented_over_llamacpp_fit": m["after"]["median"] / LLAMA_FIT}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
d = summary["decode_tok_s"]
print(f"{'case':<26} {'eager':>12} {'segmented':>12}")
print(f"{'decode tok/s (median)':<26} {d['eager']['median']:>12.1f} {d['segmented']['median']:>12.1f}")
r = summary["segmented_over_eager"]
print(f"segmented / eager: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) over {summary['pairs']} pairs")
print(f"segmented / llama.cpp --fit (97.6, issue 25): {summary['segmented_over_llamacpp_fit']:.2f} (goal >= 1.5)")
t = summary["token_exact_vs_cpu"]
print(f"{'tokens = CPU reference':<26} {str(t['eager']):>12} {str(t['segmented']):>12}")
print(f"graph: {json.dumps(summary['graph'])}")
PYEOF
