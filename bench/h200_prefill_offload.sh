#!/usr/bin/env bash
# On a CUDA GPU host (issue 25, prefill at the 2.5 GB budget): the 2.5 GB GPU plan (24 of 32 experts a layer
# in VRAM, the rest pinned in RAM) prefilling a 512-token prompt with the host experts computed by the host
# CPU (COLIBRI_PREFILL_OFFLOAD=0) against the same engine copying them to the GPU and computing them there
# (=1, engine/offload.py), in counterbalanced pairs; the greedy tokens after a 64-token prompt (>= the
# offload threshold, so the offload is on there too) against the CPU engine's; first the tests of the change
# on the real and the simulated GPU.
#
#   OUT=/tmp/h200-offload bash bench/h200_prefill_offload.sh
#   PAIRS=4 TOKENS=32 OUT=/tmp/x bash bench/h200_prefill_offload.sh
#   PLAN=/path/plan-gpu.json ...        # another GPU plan of the same fixture (bench/h200_trunk.sh PLANS=gpu)
#
# The pack is bench/h200_trunk.py's fixture (Qwen3-30B-A3B widths: hidden 2048, 32 heads of 128, 4 kv heads,
# expert width 768, 24 layers, 32 experts top-8, int8 trunk and experts, vocab 32000) in WORK; the plan by
# default is the committed 2.5 GB GPU-trunk plan of that fixture (bench/results/h200-gpuroute/
# plan-gpu-2.5gb.json: its placement only is read). Files under OUT: tests.txt, h200-offload-gpu.json/.txt
# (off/on pairs), h200-offload-cpu.json/.txt (the CPU reference at a 64-token prefill), summary.json,
# summary.txt. Needs: this checkout installed for python3 (`source .carry/enter.sh`), CuPy with a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-offload}
WORK=${WORK:-/tmp/h200-offload-work}
PAIRS=${PAIRS:-2}
TOKENS=${TOKENS:-16}
PREFILL=${PREFILL:-512}
PROMPT=${PROMPT:-64}
PLAN=${PLAN:-bench/results/h200-gpuroute/plan-gpu-2.5gb.json}
PY=${PY:-python3}
TESTS=${TESTS:-1}
mkdir -p "$OUT" "$WORK"
if [ "$TESTS" = 1 ]; then  # the simulated and the real GPU (the cuda-param tests skip without one)
  $PY -P -m pytest -x -q tests/test_engine_prefill_offload.py tests/test_planner_prefill.py 2>&1 | tail -5 \
    | tee "$OUT/tests.txt"
fi
PYABS=$(command -v "$PY")
for mode in 0 1; do  # a python that runs with the switch set (engine_before_after.py takes pythons)
  printf '#!/bin/sh\nCOLIBRI_PREFILL_OFFLOAD=%s exec %s "$@"\n' "$mode" "$PYABS" > "$WORK/py-offload$mode"
  chmod +x "$WORK/py-offload$mode"
done
[ -f "$WORK/fixture/pack.json" ] || $PY bench/h200_trunk.py fixture "$WORK/fixture" --layers 24 \
  --experts 32 --width 768 --hidden 2048 --vocab 32000
$PY bench/engine_before_after.py --before "$WORK/py-offload0" --after "$WORK/py-offload1" --backend cuda \
  --pack "$WORK/fixture" --plan "$PLAN" --pairs "$PAIRS" --prefill "$PREFILL" --decode-prompt "$PROMPT" \
  --context 1024 --decode-tokens "$TOKENS" --out "$OUT/h200-offload-gpu.json" 2>&1 \
  | tee "$OUT/h200-offload-gpu.txt"
# the CPU engine (every expert pinned in RAM, the CPU trunk) at the 64-token prompt only: its 512-token
# prefill would take most of a minute per call
$PY bench/engine_before_after.py --before "$PY" --after "$PY" --backend cpu --pack "$WORK/fixture" --pairs 1 \
  --prefill "$PROMPT" --decode-prompt "$PROMPT" --context 1024 --decode-tokens "$TOKENS" \
  --out "$OUT/h200-offload-cpu.json" 2>&1 | tee "$OUT/h200-offload-cpu.txt"
$PY - "$OUT" "$PLAN" "$PREFILL" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[3])
gpu, cpu = (json.loads((out / f"h200-offload-{k}.json").read_text()) for k in ("gpu", "cpu"))
ref = cpu["tokens"]["after"]
m = gpu["metrics"][f"prefill_{n}_s"]
tok_s = {k: n / m[k]["median"] for k in ("before", "after")}
LLAMA_FIT = 2468.0  # llama.cpp --fit's 512-token prefill with the same VRAM, measured on an H200 (issue 25)
pt = gpu["prefill_tokens"]
summary = {"source": "bench/h200_prefill_offload.sh", "plan": sys.argv[2], "pack": gpu["pack"],
           "pairs": gpu["args"]["pairs"], "prefill_tokens": n, "decode_prompt": gpu["args"]["decode_prompt"],
           "decode_tokens": gpu["args"]["decode_tokens"],
           "token_exact_vs_cpu": {"off": gpu["tokens"]["before"] == ref, "on": gpu["tokens"]["after"] == ref},
           "same_tokens_off_vs_on": gpu["same_tokens"],
           "same_prefill_token_off_vs_on": all(x == pt["before"][0] for x in pt["before"] + pt["after"]),
           "prefill_s": {"off": m["before"], "on": m["after"]},
           "prefill_tok_s": {"off": tok_s["before"], "on": tok_s["after"]},
           "on_over_off": m["ratio"],
           "prefill_stats": {"off": gpu["prefill_stats"]["before"][str(n)],
                             "on": gpu["prefill_stats"]["after"][str(n)]},
           "llamacpp_fit_prefill_tok_s_issue25": LLAMA_FIT,
           "on_over_llamacpp_fit": tok_s["after"] / LLAMA_FIT}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
p = summary["prefill_tok_s"]
print(f"{'case':<30} {'offload off':>12} {'offload on':>12}")
print(f"{f'prefill {n} tok/s (median)':<30} {p['off']:>12.1f} {p['on']:>12.1f}")
r = summary["on_over_off"]
print(f"on / off: {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) over {summary['pairs']} pairs")
print(f"on / llama.cpp --fit ({LLAMA_FIT:.0f} tok/s, issue 25): {summary['on_over_llamacpp_fit']:.2f} (goal >= 0.8)")
t = summary["token_exact_vs_cpu"]
print(f"{'tokens = CPU reference':<30} {str(t['off']):>12} {str(t['on']):>12}")
print(f"same prefill token off/on: {summary['same_prefill_token_off_vs_on']}")
print(f"prefill stats: {json.dumps(summary['prefill_stats'])}")
PYEOF
