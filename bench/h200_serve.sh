#!/usr/bin/env bash
# On a CUDA GPU host (issue 28's acceptance): `colibri-plan serve` with the GPU plan of bench/h200_trunk.sh
# (24-layer Qwen3-30B-A3B-width fixture, 2.5 GB of VRAM, the rest in RAM) streams to the openai client at the
# engine's measured decode rate (verify's tok_s), within 10%.
#
#   OUT=/tmp/out bash bench/h200_serve.sh     # writes $OUT/h200-serve-openai.json and $OUT/trunk/*
#
# Needs: this checkout installed (with fastapi, uvicorn and openai), CuPy with a visible GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-serve}
WORK=${WORK:-/tmp/h200-trunk-work}
PORT=${PORT:-8011}
mkdir -p "$OUT"
PLANS=gpu LAYERS=${LAYERS:-24} VRAM_GB=${VRAM_GB-2.5} TOKENS=${TOKENS:-32} OUT="$OUT/trunk" WORK="$WORK" \
  bash bench/h200_trunk.sh
colibri-plan serve --model "$WORK/fixture" --plan "$OUT/trunk/plan-gpu.json" --backend cpu --port "$PORT" \
  > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health')" 2>/dev/null && break
  sleep 1
done
python3 bench/serve_openai.py --url "http://127.0.0.1:$PORT/v1" --tokens "${TOKENS:-32}" --requests 5 \
  --verify-report "$OUT/trunk/verify-gpu.json" --out "$OUT/h200-serve-openai.json"
