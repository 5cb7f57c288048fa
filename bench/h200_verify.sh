#!/usr/bin/env bash
# On a CUDA GPU host: plans with a VRAM tier smaller than the experts, so GPU-resident and CPU-resident
# experts share every MoE layer, verified against their predictions and beside colibrì's hot-first fill.
#
#   bash bench/h200_verify.sh        # outputs under $OUT (default /tmp/h200-verify)
#   VRAM_GBS="1.0 3.3" REPEATS=3 TOKENS=16 OUT=/tmp/x bash bench/h200_verify.sh
#
# For each VRAM budget: solve ours, write the hot-first plan with the same budgets, then verify both
# REPEATS times, alternating (ours with the all-RAM reference on its first run, for token-exactness).
# 1.0 GB holds 52 of the fixture's 192 experts (the CPU path dominates every layer); 3.3 GB holds 174,
# where the GPU's share of a layer starts to matter next to the CPU's. Then `calibrate` on our reports of
# the first budget, and one more verify of a plan solved with those coefficients at the last budget.
# Needs: this checkout installed (colibri-plan on PATH), CuPy with a visible GPU. About 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-verify}
VRAM_GBS=${VRAM_GBS:-"1.0 3.3"}
REPEATS=${REPEATS:-3}
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
$PY -P -c "from colibri_plan.engine.fixture import fixture_prompt; print(*fixture_prompt(4096, 256, seed=0))" \
  > "$OUT/prompt-stats.txt"
$CP run --model "$OUT/fixture" --backend cpu --prompt-file "$OUT/prompt-stats.txt" --tokens 4 \
  --stats-out "$OUT/heat.json"

first=""
for V in $VRAM_GBS; do
  common=(--profile "$OUT/profile.json" --model "$OUT/fixture" --heat "$OUT/heat.json" --ram auto
          --vram "$V" --dense-format f32 --context 512)
  say "solve: VRAM $V GB for experts, the rest in RAM"
  $CP solve "${common[@]}" --out "$OUT/plan-ours-${V}.json" --compare
  $PY bench/baseline_plan.py "${common[@]}" --baseline hot-first --out "$OUT/plan-hot-first-${V}.json"
  for r in $(seq 1 "$REPEATS"); do
    ref=--no-reference; [ "$r" = 1 ] && ref=--reference
    say "VRAM $V GB, repeat $r: ours"
    $CP verify --plan "$OUT/plan-ours-${V}.json" --model "$OUT/fixture" --tokens "$TOKENS" $ref \
      --report "$OUT/verify-ours-${V}-r${r}.json" | tee "$OUT/verify-ours-${V}-r${r}.txt"
    say "VRAM $V GB, repeat $r: hot-first"
    $CP verify --plan "$OUT/plan-hot-first-${V}.json" --model "$OUT/fixture" --tokens "$TOKENS" \
      --no-reference --report "$OUT/verify-hot-first-${V}-r${r}.json" \
      | tee "$OUT/verify-hot-first-${V}-r${r}.txt"
  done
  [ -n "$first" ] || first=$V
done

say "calibrate on our reports at VRAM $first GB, then verify a calibrated plan at VRAM $V GB"
$CP calibrate "$OUT"/verify-ours-"$first"-r*.json --out "$OUT/coefficients.json"
$CP solve "${common[@]}" --coefficients "$OUT/coefficients.json" --out "$OUT/plan-ours-${V}-calibrated.json"
$CP verify --plan "$OUT/plan-ours-${V}-calibrated.json" --model "$OUT/fixture" --tokens "$TOKENS" \
  --no-reference --report "$OUT/verify-ours-${V}-calibrated.json" | tee "$OUT/verify-ours-${V}-calibrated.txt"

say "summary (medians over repeats)"
$PY -P - "$OUT" "$VRAM_GBS" <<'PYEOF'
import glob, json, statistics, sys
from colibri_plan.formats.plan import load_plan
d, budgets = sys.argv[1], sys.argv[2].split()
print(f"{'VRAM GB':8s} {'plan':10s} {'(layer, vram, ram)':34s} {'pred tok/s':>10s} {'meas tok/s':>10s} "
      f"{'runs':24s} {'cpu ms':>7s} {'gpu ms':>7s} {'exact':>6s}")
for v in budgets:
    for name in ("ours", "hot-first"):
        p = load_plan(f"{d}/plan-{name}-{v}.json")
        split = [(e["layer"], sum(len(x) for x in e["vram"].values()), len(e["ram_pinned"])) for e in p.doc["layers"]]
        reps = [json.load(open(f)) for f in sorted(glob.glob(f"{d}/verify-{name}-{v}-r*.json"))]
        tok = [1 / r["measured"]["decode_s_median"] for r in reps]
        comp = [r["measured"]["terms"]["expert_compute_s"] for r in reps]
        cpu = statistics.median(c.get("cpu", 0.0) for c in comp) * 1e3
        gpu = statistics.median(sum(v for k, v in c.items() if k != "cpu") for c in comp) * 1e3
        exact = {True: "yes", False: "NO", None: "-"}[reps[0]["verdict"]["token_exact"]]
        print(f"{v:8s} {name:10s} {str(split):34s} {p.doc['predicted']['tok_s']:10.2f} {statistics.median(tok):10.2f} "
              f"{str([round(t, 1) for t in tok]):24s} {cpu:7.1f} {gpu:7.1f} {exact:>6s}")
for f in sorted(glob.glob(f"{d}/verify-ours-*-calibrated.json")):
    r = json.load(open(f))
    print(f"calibrated: {f}: predicted {r['predicted']['tok_s']:.2f}, measured {r['measured']['tok_s']:.2f} tok/s, "
          f"ratio {r['verdict']['tok_s_ratio']:.2f}")
PYEOF
echo "files: $OUT" >&2
