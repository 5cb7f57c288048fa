#!/usr/bin/env bash
# On a CUDA GPU host: a plan with a VRAM tier smaller than the experts, so GPU-resident and CPU-resident
# experts share every MoE layer, verified against its predictions and beside colibrì's hot-first fill.
#
#   source .carry/enter.sh && bash bench/h200_verify.sh          # outputs under $OUT (default /tmp/h200-verify)
#   VRAM_GB=1.0 TOKENS=16 OUT=/tmp/x bash bench/h200_verify.sh
#
# Needs: this checkout installed (colibri-plan on PATH), CuPy with a visible GPU. About 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-verify}
VRAM_GB=${VRAM_GB:-1.0}       # about 52 of the fixture's 192 experts (18.9 MB each)
TOKENS=${TOKENS:-16}
CP=${CP:-colibri-plan}
PY=${PY:-python3}
mkdir -p "$OUT"
say() { printf '\n=== %s\n' "$*" >&2; }

$CP backends
[ -f "$OUT/fixture/pack.json" ] || $CP model fixture "$OUT/fixture"
say "profile --quick (disk, RAM, links, matmul on cpu and cuda)"
# one backend per physical device: the H200 also shows up under opencl and vulkan, and the solver treats
# every listed GPU as its own memory
$CP profile --quick --backends cpu,cuda --formats int4 --model "$OUT/fixture" --out "$OUT/profile.json"
say "statistics run"
$PY -c "from colibri_plan.engine.fixture import fixture_prompt; print(*fixture_prompt(4096, 256, seed=0))" \
  > "$OUT/prompt-stats.txt"
$CP run --model "$OUT/fixture" --backend cpu --prompt-file "$OUT/prompt-stats.txt" --tokens 4 \
  --stats-out "$OUT/heat.json"
common=(--profile "$OUT/profile.json" --model "$OUT/fixture" --heat "$OUT/heat.json" --ram auto
        --vram "$VRAM_GB" --dense-format f32 --context 512)
say "solve: VRAM $VRAM_GB GB for experts, the rest in RAM"
$CP solve "${common[@]}" --out "$OUT/plan-ours.json" --compare
$PY bench/baseline_plan.py "${common[@]}" --baseline hot-first --out "$OUT/plan-hot-first.json"
$PY - "$OUT" <<'PYEOF'
import sys
from colibri_plan.plan import load_plan
for name in ("plan-ours.json", "plan-hot-first.json"):
    p = load_plan(f"{sys.argv[1]}/{name}")
    shared = sum(1 for e in p.doc["layers"] if any(e["vram"].values()) and e["ram_pinned"])
    per = [(e["layer"], sum(len(v) for v in e["vram"].values()), len(e["ram_pinned"])) for e in p.doc["layers"]]
    print(f"{name}: {p.counts()}; layers with both VRAM and RAM experts: {shared}; (layer, vram, ram) {per}")
PYEOF
say "verify our plan"
$CP verify --plan "$OUT/plan-ours.json" --model "$OUT/fixture" --tokens "$TOKENS" \
  --report "$OUT/verify-ours.json" | tee "$OUT/verify-ours.txt"
say "verify the hot-first baseline"
$CP verify --plan "$OUT/plan-hot-first.json" --model "$OUT/fixture" --tokens "$TOKENS" --no-reference \
  --report "$OUT/verify-hot-first.json" | tee "$OUT/verify-hot-first.txt"
say "summary"
$PY - "$OUT" <<'PYEOF'
import json, sys
d = sys.argv[1]
for name in ("ours", "hot-first"):
    r = json.load(open(f"{d}/verify-{name}.json"))
    m, p, v = r["measured"], r["predicted"], r["verdict"]
    print(f"{name:9s} predicted {p['tok_s']:.2f} tok/s, measured {m['tok_s']:.2f} (median step "
          f"{m['decode_s_median'] * 1e3:.1f} ms), ratio {v['tok_s_ratio']:.2f}, hit-rate diff "
          f"{v['hit_rate_diff_points']:+.1f} pts, token-exact {v['token_exact']}, cpu "
          f"{m['terms']['expert_cpu_s'] * 1e3:.1f} ms, devices "
          f"{ {k: round(s * 1e3, 1) for k, s in m['terms']['device_s'].items()} } ms/token")
PYEOF
echo "files: $OUT" >&2
