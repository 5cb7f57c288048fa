#!/usr/bin/env bash
# On a CUDA GPU host (the H200): llama.cpp against our engine (issue 25, Build 6) and llama.cpp's
# placements under a VRAM budget with its cost model calibrated on them (issue 27, Build 1/2 on the GPU).
#
#   source .carry/enter.sh && STEP=prep   OUT=$OUT bash bench/h200_llamacpp.sh   # ~6-7 min
#   source .carry/enter.sh && STEP=peer   OUT=$OUT bash bench/h200_llamacpp.sh   # ~3-4 min
#   source .carry/enter.sh && STEP=replay OUT=$OUT bash bench/h200_llamacpp.sh   # ~4-6 min
#   (STEP=all: the three in one call.) Each step skips what WORK / LLAMA already hold, so a step re-run on
#   a fresh machine redoes only what it lacks (peer and replay need prep's files: they run it first).
#
# prep: unpacks .carry/llama.cpp-src.tar.xz (../shared/gpu/llamacpp-src.sh) into LLAMA and builds
# llama-bench, llama-fit-params, llama-completion, llama-quantize with CUDA for sm_90 in the background
# (setsid nohup; its log LLAMA/build.log), while bench/peer_llamacpp_gpu.py prepare writes the random
# Qwen3-MoE (bench/qwen3_numpy.py: LAYERS layers, hidden 2048, 32/4 heads of 128, 32 experts top-8 of
# width 768, vocab 32000, bf16, seed 0), converts it with llama.cpp's converter (f16) and packs ours
# (int8 experts + int8 dense) beside it; then, once the build is done, llama-quantize --pure Q8_0; then
# our profile of this machine (cpu + cuda, after the build so nothing competes), routing heat of the
# decode the bench times (random ids after the bench's 16-token prompt, HEAT_CONTEXT: `peer_llamacpp_gpu.py
# heat`) and
# `solve --vram VRAM_GB --vram-reserve 0 --trunk cuda:0` (OUT/plan.json).
# peer: bench/peer_llamacpp_gpu.py bench: PAIRS counterbalanced pairs, all in VRAM and at the budget
# (llama.cpp through llama-fit-params --fit-target), tokens against our CPU engine -> OUT/peer-gpu.json.
# replay: with COEF (an earlier replay's coefficients) first `solve --target llama.cpp` -> OUT/plan-pick.json,
# then bench/replay_llamacpp.py gpu-placements (fit at the same self bytes, fit-device, the pick, our export,
# -ngl N, -ngl N/2, --n-cpu-moe M, --cpu-moe, a down split; REPEATS rounds) -> OUT/replay-gpu.json, priced
# with COEF (out of sample: OUT/check-gpu.txt); `calibrate --engine llama.cpp` on it
# -> OUT/llamacpp-coefficients-h200.json (predicted vs measured per placement, OUT/calibrate.txt), and
# `solve --target llama.cpp --llama-coefficients` at the same budget (OUT/solve-llamacpp.txt).
# Needs: CUDA (nvcc in /usr/local/cuda/bin), cmake + ninja, python3 with torch + transformers (the
# converter), this checkout installed (.carry/enter.sh does it).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-llamacpp}
WORK=${WORK:-/tmp/h200-llw}           # checkpoint (8.4 GB), GGUF (4.5 GB), pack (4.5 GB): kept out of OUT
LLAMA=${LLAMA:-/tmp/llama-cuda}
LAYERS=${LAYERS:-24}
VRAM_GB=${VRAM_GB:-2.5}
# the heat's prompt: the bench's own (its decode ids are others), or another prompt (bench/routing_context.py:
# on this random checkpoint the prompt decides the hot experts; r3-r5 used another prompt)
HEAT_CONTEXT=${HEAT_CONTEXT:-bench}
# the heat's traffic: HEAT_CONVERSATIONS runs of the 16-token prompt + HEAT_TOKENS random-id steps (the
# timed decode is 64 steps after a prompt; r6's one 256-step run over-weighted routing after it settles)
HEAT_TOKENS=${HEAT_TOKENS:-64}
HEAT_CONVERSATIONS=${HEAT_CONVERSATIONS:-4}
PAIRS=${PAIRS:-4}
REPEATS=${REPEATS:-3}
SRC_TAR=${SRC_TAR:-.carry/llama.cpp-src.tar.xz}
COEF=${COEF:-bench/results/h200-llamacpp/llamacpp-coefficients-h200.json}   # replay: out-of-sample
PY=${PY:-python3}
CP=${CP:-colibri-plan}
BIN=$LLAMA/llama.cpp/build/bin
CPABS=$(command -v "$CP")
export PATH=/usr/local/cuda/bin:$PATH
mkdir -p "$OUT" "$WORK" "$LLAMA"
say() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)" | tee -a "$OUT/log.txt" >&2; }

build_bg() {   # the CUDA build, in the background; LLAMA/built marks it done
  [ -f "$LLAMA/built" ] && return 0
  [ -f "$LLAMA/building" ] && return 0
  [ -f "$SRC_TAR" ] || { echo "no $SRC_TAR: run ../shared/gpu/llamacpp-src.sh here and carry .carry" >&2; exit 1; }
  tar xJf "$SRC_TAR" -C "$LLAMA"
  touch "$LLAMA/building"
  setsid nohup bash -c "cd '$LLAMA/llama.cpp' && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF && \
    ninja -C build -j$(nproc) llama-bench llama-fit-params llama-completion llama-quantize && \
    touch '$LLAMA/built' || touch '$LLAMA/failed'" > "$LLAMA/build.log" 2>&1 < /dev/null &
}

prep() {
  $PY -c "import torch, transformers, tokenizers" 2>/dev/null || {
    echo "llama.cpp's converter needs torch + transformers in $PY; carry their wheels (see the report)" >&2; exit 1; }
  say "llama.cpp CUDA build (background) + checkpoint, GGUF f16, our pack"
  build_bg
  $PY bench/peer_llamacpp_gpu.py prepare --work "$WORK" --llama-bin "$BIN" --llama-src "$LLAMA/llama.cpp" \
    --layers "$LAYERS" --wait-for "$LLAMA/built" --colibri "$CPABS" 2>&1 | grep -v '^\[ *[0-9]*/ *[0-9]*\]\|converting to\|^INFO' \
    | tail -20 | tee -a "$OUT/log.txt"
  [ -f "$LLAMA/failed" ] && { tail -30 "$LLAMA/build.log"; exit 1; }
  [ -f "$WORK/model-Q8_0.gguf" ] || { echo "no GGUF"; tail -30 "$LLAMA/build.log"; exit 1; }
  cp "$WORK/prepare-times.json" "$OUT/"
  "$BIN/llama-bench" --version > "$OUT/llama-version.txt" 2>&1 || true
  if [ ! -f "$OUT/profile.json" ]; then
    # PROFILE_AFTER=FILE: wait for FILE first (work of another bench on this host, e.g. the CPU peer's
    # packing, would share the cores and the RAM bandwidth the profile measures)
    if [ -n "${PROFILE_AFTER:-}" ]; then
      say "profile waits for $PROFILE_AFTER"
      while [ ! -e "$PROFILE_AFTER" ]; do sleep 3; done
    fi
    say "profile --quick (cpu, cuda)"
    $CP profile --quick --backends cpu,cuda --formats int8 --dense-formats int8,f32 --model "$WORK/pack-int8" \
      --path "$WORK" --out "$OUT/profile.json" >> "$OUT/log.txt" 2>&1
  fi
  HEAT_FILE="$WORK/heat-decode-$HEAT_CONTEXT-${HEAT_CONVERSATIONS}x$HEAT_TOKENS.json"
  if [ ! -f "$HEAT_FILE" ]; then
    # the traffic the bench times: a 16-token prompt (HEAT_CONTEXT bench: the bench's own; other: another
    # one), then random ids (llama-bench's tg, other ids than the bench's), all in VRAM
    say "routing heat ($HEAT_CONVERSATIONS x $HEAT_CONTEXT 16-token prompt + $HEAT_TOKENS random-id steps, all in VRAM)"
    $PY bench/peer_llamacpp_gpu.py heat --pack "$WORK/pack-int8" --backend cuda --depth 16 \
      --tokens "$HEAT_TOKENS" --conversations "$HEAT_CONVERSATIONS" --context "$HEAT_CONTEXT" \
      --out "$HEAT_FILE" >> "$OUT/log.txt" 2>&1
  fi
  cp "$HEAT_FILE" "$WORK/heat.json"
  cp "$WORK/heat.json" "$OUT/heat.json"
  say "solve at $VRAM_GB GB of VRAM"
  $CP solve --profile "$OUT/profile.json" --model "$WORK/pack-int8" --heat "$WORK/heat.json" --ram auto \
    --context 1024 --prompt-tokens 512 --vram "$VRAM_GB" --vram-reserve 0 --trunk cuda:0 \
    --gguf "$WORK/model-Q8_0.gguf" --out "$OUT/plan.json" 2>&1 | tee "$OUT/solve.txt" | tail -8
  # the predictions to hold the timed decode against: priced at its context (16 prompt + 64 decode tokens,
  # rounded up), not the 1024 the run's plan budgets its KV cache for; the budget case and all in VRAM
  for v in "$VRAM_GB" 100; do
    $CP solve --profile "$OUT/profile.json" --model "$WORK/pack-int8" --heat "$WORK/heat.json" --ram auto \
      --context 96 --prompt-tokens 512 --vram "$v" --vram-reserve 0 --trunk cuda:0 \
      --out "$OUT/predict-ctx96-vram$v.json" > "$OUT/predict-ctx96-vram$v.txt" 2>&1 || true
  done
}

ready() { [ -f "$LLAMA/built" ] && [ -f "$WORK/model-Q8_0.gguf" ] && [ -f "$WORK/pack-int8/pack.json" ] \
          && [ -f "$OUT/plan.json" ] && [ -f "$OUT/profile.json" ]; }

peer() {
  ready || prep
  say "peer: $PAIRS pairs, all in VRAM and at $VRAM_GB GB"
  $PY bench/peer_llamacpp_gpu.py bench --work "$WORK" --llama-bin "$BIN" --backend cuda --pairs "$PAIRS" \
    --vram-gb "$VRAM_GB" --plan "$OUT/plan.json" --out "$OUT/peer-gpu.json" 2>&1 | tee "$OUT/peer-gpu.txt"
}

replay() {
  ready || prep
  pick=()
  if [ -f "$COEF" ]; then   # coefficients of an EARLIER replay: the pick and an out-of-sample check
    say "solve --target llama.cpp with $COEF (fitted on an earlier replay)"
    $CP solve --profile "$OUT/profile.json" --model "$WORK/pack-int8" --heat "$WORK/heat.json" --ram auto \
      --context 576 --prompt-tokens 512 --vram "$VRAM_GB" --vram-reserve 0 --trunk cuda:0 --target llama.cpp \
      --llama-coefficients "$COEF" --gguf "$WORK/model-Q8_0.gguf" \
      --out "$OUT/plan-pick.json" -v 2>&1 | tee "$OUT/solve-pick.txt" | tail -8 && pick=(--pick "$OUT/plan-pick.json")
  fi
  say "replay: llama.cpp placements at $VRAM_GB GB of VRAM, $REPEATS rounds"
  $PY bench/replay_llamacpp.py gpu-placements --llama-bin "$BIN" --gguf "$WORK/model-Q8_0.gguf" \
    --vram-gb "$VRAM_GB" --plan "$OUT/plan.json" --profile "$OUT/profile.json" --repeats "$REPEATS" \
    --colibri "$CPABS" "${pick[@]}" \
    --out "$OUT/replay-gpu.json" 2>&1 | tee "$OUT/replay-gpu.txt"
  if [ -f "$COEF" ]; then
    say "out-of-sample: the replay priced with $COEF"
    $PY bench/replay_check.py "$OUT/replay-gpu.json" --coefficients "$COEF" --profile "$OUT/profile.json" \
      --model "$WORK/model-Q8_0.gguf" --out "$OUT/check-gpu.json" 2>&1 | tee "$OUT/check-gpu.txt"
  fi
  say "calibrate --engine llama.cpp"
  $CP calibrate --engine llama.cpp "$OUT/replay-gpu.json" --profile "$OUT/profile.json" \
    --model "$WORK/model-Q8_0.gguf" --out "$OUT/llamacpp-coefficients-h200.json" 2>&1 | tee "$OUT/calibrate.txt"
  say "solve --target llama.cpp with those coefficients"
  $CP solve --profile "$OUT/profile.json" --model "$WORK/pack-int8" --heat "$WORK/heat.json" --ram auto \
    --context 576 --prompt-tokens 512 --vram "$VRAM_GB" --vram-reserve 0 --trunk cuda:0 --target llama.cpp \
    --llama-coefficients "$OUT/llamacpp-coefficients-h200.json" --gguf "$WORK/model-Q8_0.gguf" \
    --out "$OUT/plan-llamacpp.json" -v 2>&1 | tee "$OUT/solve-llamacpp.txt" | tail -25 || true
}

case "${STEP:-all}" in
  prep) prep ;;
  peer) peer ;;
  replay) replay ;;
  all) prep; peer; replay ;;
  *) echo "STEP must be prep, peer, replay or all" >&2; exit 2 ;;
esac
say "done: $(ls "$OUT" | tr '\n' ' ')"
