#!/usr/bin/env bash
# On a host with two (or more) CUDA GPUs: a plan that spreads the fixture's experts over two cards, solved
# by `colibri-plan solve --vram auto` and verified beside colibrì's hot-first least-loaded fill (issue 19).
#
#   bash bench/multi_gpu_verify.sh           # results under $OUT/results (default OUT=/tmp/multi-gpu-verify)
#   REPEATS=5 TOKENS=32 VRAM_FRACTION=0.6 OUT=/tmp/x bash bench/multi_gpu_verify.sh
#
# Steps: a per-device expert-FFN smoke test (main and worker thread, against numpy); the default fixture
# (`colibri-plan model fixture`: 3 MoE layers x 64 int4 experts of 18.9 MB, 3.63 GB of experts);
# `profile --quick --backends cpu,cuda` (every card, host links, GPU<->GPU peer links); a statistics run
# for heat; a --vram-reserve chosen from the profile so that `--vram auto` leaves each card VRAM_FRACTION
# (0.6) x the experts' bytes: they do not fit one card but fit two; `solve` (ours) and
# bench/baseline_plan.py hot-first with the same budgets; then `verify` REPEATS times each, interleaved
# (ours, hot-first, ours, ...; ours first with the all-RAM CPU reference for token-exactness); finally
# bench/multi_gpu_table.py: experts per device, tok/s median and min/max, predicted vs measured,
# per-device expert ms per MoE layer, token-exactness, paired per-repeat ratio ours / hot-first.
#
# Needs: >= 2 CUDA GPUs visible to CuPy, this checkout installed (colibri-plan on PATH), ~4 GB free disk
# under WORK and ~8 GB RAM. About 4-6 minutes on a two-H200 host (fixture ~1 min, profile ~1 min, each
# verify 10-20 s). The work folder (fixture, all reports) is WORK (default /tmp/multi-gpu-work, outside
# OUT); OUT/results gets the few files worth keeping: summary.json, table.txt, plan-ours.json,
# plan-hot-first.json, profile.json, smoke.txt and reports.tar.gz (every verify report and log, heat,
# solve output). A verify that fails is logged and the rest still runs; the exit status is then 1.
# REHEARSE=1 runs the same steps without GPUs (small fixture, two host backends standing in for GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/multi-gpu-verify}
WORK=${WORK:-/tmp/multi-gpu-work}
REPEATS=${REPEATS:-3}
TOKENS=${TOKENS:-32}
VRAM_FRACTION=${VRAM_FRACTION:-0.6}
REHEARSE=${REHEARSE:-0}
CP=${CP:-colibri-plan}
PY=${PY:-python3}
RES="$OUT/results"
say() { printf '\n=== %s\n' "$*" >&2; }
status=0

if [ "$REHEARSE" = 1 ]; then
  FIXTURE_ARGS=(--small); VOCAB=512; BACKENDS=cpu,numpy; SMOKE=(--backend numpy --devices 0 --hidden 256 --width 128)
else
  n=$($PY -P -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
  if [ "$n" -lt 2 ]; then
    echo "multi_gpu_verify.sh: needs at least 2 CUDA GPUs visible to CuPy; found $n. Nothing was run." >&2
    exit 2
  fi
  FIXTURE_ARGS=(); VOCAB=4096; BACKENDS=cpu,cuda; SMOKE=(--backend cuda --devices "$(seq -s, 0 $((n - 1)))")
fi

collect() {  # whatever exists is copied into OUT/results, also after a failure
  for f in summary.json table.txt plan-ours.json plan-hot-first.json profile.json smoke.txt; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$RES/"
  done
  (cd "$WORK" && ls verify-*.json verify-*.txt heat.json solve.txt budget.txt 2>/dev/null \
     | tar -czf "$RES/reports.tar.gz" -T - ) || true
  echo "results: $RES ($(ls "$RES" | tr '\n' ' '))" >&2
}
mkdir -p "$WORK" "$RES"
trap collect EXIT

$CP backends
say "smoke: one expert FFN per device, main and worker thread, against numpy"
$PY bench/multi_gpu_table.py smoke "${SMOKE[@]}" 2>&1 | tee "$WORK/smoke.txt" \
  || { status=1; echo "WARNING: the smoke test failed on a device (see above); going on" >&2; }

[ -f "$WORK/fixture/pack.json" ] || $CP model fixture ${FIXTURE_ARGS[@]+"${FIXTURE_ARGS[@]}"} "$WORK/fixture"
say "profile --quick --backends $BACKENDS (disk, RAM, host links, peer links, matmul)"
# one backend per physical device: an H200 also shows up under opencl and vulkan, and the solver treats
# every listed GPU as its own memory
$CP profile --quick --backends "$BACKENDS" --formats int4 --model "$WORK/fixture" --path "$WORK" \
  --out "$WORK/profile.json"
[ "$REHEARSE" = 1 ] && $PY bench/multi_gpu_table.py fake-gpus "$WORK/profile.json"

say "statistics run"
$PY -P -c "from colibri_plan.engine.fixture import fixture_prompt; print(*fixture_prompt($VOCAB, 256, seed=0))" \
  > "$WORK/prompt-stats.txt"
$CP run --model "$WORK/fixture" --backend cpu --prompt-file "$WORK/prompt-stats.txt" --tokens 4 \
  --stats-out "$WORK/heat.json"

say "budgets: each card VRAM_FRACTION=$VRAM_FRACTION x the experts' bytes"
read -r RESERVE PER_CARD EXPERTS NGPU < <($PY bench/multi_gpu_table.py budget --profile "$WORK/profile.json" \
  --model "$WORK/fixture" --fraction "$VRAM_FRACTION" 2> >(tee "$WORK/budget.txt" >&2))
echo "experts $EXPERTS GB on $NGPU GPUs: --vram auto --vram-reserve $RESERVE (about $PER_CARD GB per card)" \
  | tee -a "$WORK/budget.txt" >&2
common=(--profile "$WORK/profile.json" --model "$WORK/fixture" --heat "$WORK/heat.json" --ram auto
        --vram auto --vram-reserve "$RESERVE" --dense-format f32 --context 512)

say "solve (ours) and the hot-first plan with the same budgets"
$CP solve "${common[@]}" --out "$WORK/plan-ours.json" --compare 2>&1 | tee "$WORK/solve.txt"
$PY bench/baseline_plan.py "${common[@]}" --baseline hot-first --out "$WORK/plan-hot-first.json" \
  2>&1 | tee -a "$WORK/solve.txt"

for r in $(seq 1 "$REPEATS"); do
  for name in ours hot-first; do
    ref=--no-reference; [ "$r" = 1 ] && [ "$name" = ours ] && ref=--reference
    say "repeat $r: $name"
    $CP verify --plan "$WORK/plan-$name.json" --model "$WORK/fixture" --tokens "$TOKENS" $ref \
      --report "$WORK/verify-$name-r$r.json" 2>&1 | tee "$WORK/verify-$name-r$r.txt" \
      || { status=1; rm -f "$WORK/verify-$name-r$r.json"; echo "WARNING: verify $name r$r failed" >&2; }
  done
done

say "summary"
$PY bench/multi_gpu_table.py table "$WORK" --json "$WORK/summary.json" | tee "$WORK/table.txt"
exit "$status"
