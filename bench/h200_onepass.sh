#!/usr/bin/env bash
# On a CUDA GPU host (issue 32's acceptance there): the one forward pass against the engine before it, and
# MLA on a device trunk against transformers on every GPU backend.
#
#   STEP=bench OUT=/tmp/out bash bench/h200_onepass.sh   # before/after decode + prefill (CUDA, all in VRAM)
#   STEP=tests OUT=/tmp/out bash bench/h200_onepass.sh   # GPU tests: MLA device trunk, trunk, oracle, CUDA
#
# Needs: this checkout installed for python3 (the H200 recipe's .carry/enter.sh does it) and, for STEP=bench,
# the earlier install's source in BASE_SRC (default .carry/base-src, e.g. `git archive <commit>`), which
# goes into a venv of its own that sees the machine's packages (CuPy, numba). The pack is
# bench/h200_trunk.py's fixture (Qwen3-30B-A3B widths: hidden 2048, 32 heads of 128, 4 kv heads, expert
# width 768; LAYERS layers, 32 experts top-8, int8 trunk and experts, vocab 32000).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-onepass}
WORK=${WORK:-/tmp/h200-onepass-work}
LAYERS=${LAYERS:-24}
PAIRS=${PAIRS:-6}
BASE_SRC=${BASE_SRC:-.carry/base-src}
mkdir -p "$OUT" "$WORK"
case "${STEP:-bench}" in
bench)
  # the earlier install in a folder of its own, first on the path (a venv would hide the user site's numpy)
  [ -x /tmp/vbase/bin/python ] || { python3 -m pip install -q --no-deps --no-build-isolation --no-index \
    --target /tmp/vbase/site "$BASE_SRC" && mkdir -p /tmp/vbase/bin &&
    printf '#!/bin/sh\nPYTHONPATH=/tmp/vbase/site${PYTHONPATH:+:$PYTHONPATH} exec python3 "$@"\n' \
      > /tmp/vbase/bin/python && chmod +x /tmp/vbase/bin/python; }
  [ -f "$WORK/fixture/pack.json" ] || python3 bench/h200_trunk.py fixture "$WORK/fixture" --layers "$LAYERS" \
    --experts 32 --width 768 --hidden 2048 --vocab 32000
  python3 bench/engine_before_after.py --before /tmp/vbase/bin/python --after python3 --backend cuda \
    --pack "$WORK/fixture" --pairs "$PAIRS" --prefill 16,512 --context 1024 --decode-tokens 32 \
    --out "$OUT/h200-before-after-cuda.json" 2>&1 | tee "$OUT/h200-before-after-cuda.txt"
  ;;
tests)
  { python3 -m pytest -q -p no:cacheprovider -rs tests/test_engine_mla.py -k device_trunk
    python3 -m pytest -q -p no:cacheprovider -rs tests/test_engine_trunk.py tests/test_engine_trunk_experts.py \
      tests/test_backends_device_ops.py tests/test_backends_oracle.py tests/test_backend_cuda.py \
      tests/test_backend_cuda_prefill.py tests/test_backend_opencl.py tests/test_backend_vulkan_device.py \
      tests/test_multi_device.py; } 2>&1 | tee "$OUT/h200-gpu-tests.txt" | grep -E "passed|failed|FAILED|Error" 
  ;;
esac
