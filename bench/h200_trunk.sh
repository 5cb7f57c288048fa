#!/usr/bin/env bash
# On a CUDA GPU host: the dense trunk, attention and the KV cache on the GPU against the same plan with the
# trunk on the CPU (issue 13's acceptance on an H200 host).
#
#   OUT=/tmp/h200-trunk bash bench/h200_trunk.sh
#   LAYERS=24 VRAM_GB=2.5 TOKENS=32 OUT=/tmp/x bash bench/h200_trunk.sh
#   PLANS=gpu ... bash bench/h200_trunk.sh    # the GPU-trunk plan alone (serve's acceptance, bench/h200_serve.sh)
#
# Makes a fixture whose trunk matters (bench/h200_trunk.py fixture: Qwen3-30B-A3B widths - hidden 2048, 32
# heads of 128, 4 kv heads, expert width 768 -, LAYERS layers, EXPERTS experts top-8, int8 trunk and
# experts, vocab 32000; about 2.4 GB) in WORK (kept out of OUT), profiles the machine (cpu and the trunk
# GPU's backend, trunk probes included), solves twice with the same budgets (--trunk cpu and
# --trunk $DEV, default cuda:0; VRAM_GB for the GPU is smaller than the experts, so experts are split
# VRAM/RAM, and on the GPU-trunk plan the trunk and KV come out of it), verifies both with the all-RAM CPU
# reference, and prints: token-exact yes/no, measured tok/s of both, the ratio, predicted vs measured
# (uncalibrated). Without a GPU, DEV=opencl:0 VRAM_GB= (empty) and small sizes run the same flow.
# Files under OUT (7, small): profile.json, plan-cpu.json, plan-gpu.json, verify-cpu.json,
# verify-gpu.json, log.txt, summary.txt. Needs: this checkout installed, CuPy with a visible GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-trunk}
WORK=${WORK:-/tmp/h200-trunk-work}
LAYERS=${LAYERS:-16}
EXPERTS=${EXPERTS:-32}
WIDTH=${WIDTH:-768}
HIDDEN=${HIDDEN:-2048}
VOCAB=${VOCAB:-32000}
DEV=${DEV:-cuda:0}                 # the GPU the trunk goes to (its backend is profiled beside cpu)
VRAM_GB=${VRAM_GB-2.0}
CONTEXT=${CONTEXT:-512}
TOKENS=${TOKENS:-32}
CP=${CP:-colibri-plan}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK"
LOG="$OUT/log.txt"
: > "$LOG"
say() { printf '\n=== %s\n' "$*" | tee -a "$LOG" >&2; }
run() { "$@" >> "$LOG" 2>&1; }

say "fixture: $LAYERS layers, $EXPERTS experts, width $WIDTH, int8 trunk and experts"
[ -f "$WORK/fixture/pack.json" ] || run $PY bench/h200_trunk.py fixture "$WORK/fixture" --layers "$LAYERS" \
  --experts "$EXPERTS" --width "$WIDTH" --hidden "$HIDDEN" --vocab "$VOCAB"
say "profile --quick (cpu and ${DEV%%:*}: disk, RAM, links, matmul, dense trunk)"
run $CP profile --quick --backends "cpu,${DEV%%:*}" --formats int8 --dense-formats int8,f32 --model "$WORK/fixture" \
  --path "$WORK" --out "$OUT/profile.json"
say "statistics run"
$PY -P -c "from colibri_plan.engine.fixture import fixture_prompt; print(*fixture_prompt($VOCAB, 128, seed=0))" \
  > "$WORK/prompt-stats.txt"
run $CP run --model "$WORK/fixture" --backend cpu --prompt-file "$WORK/prompt-stats.txt" --tokens 4 \
  --stats-out "$WORK/heat.json"

common=(--profile "$OUT/profile.json" --model "$WORK/fixture" --heat "$WORK/heat.json" --ram auto
        --context "$CONTEXT")
[ -z "$VRAM_GB" ] || common+=(--vram "$VRAM_GB" --vram-reserve 0)   # the budget itself; empty: a unified GPU
for T in ${PLANS:-cpu gpu}; do  # PLANS=gpu: the GPU-trunk plan alone (no summary)
  dev=cpu; [ "$T" = gpu ] && dev=$DEV
  say "solve --trunk $dev (VRAM ${VRAM_GB:-no} GB budget)"
  run $CP solve "${common[@]}" --trunk "$dev" --out "$OUT/plan-$T.json"
  say "verify plan-$T (with the all-RAM CPU reference)"
  run $CP verify --plan "$OUT/plan-$T.json" --model "$WORK/fixture" --tokens "$TOKENS" --backend cpu \
    --report "$OUT/verify-$T.json"
done

[ -f "$OUT/verify-cpu.json" ] || exit 0
say "summary"
$PY bench/h200_trunk.py summary "$OUT/verify-cpu.json" "$OUT/verify-gpu.json" | tee "$OUT/summary.txt"
