#!/usr/bin/env bash
# On a CUDA GPU host (issue 25, Build 1): decode and prefill with the router's top-k on the device against
# the same engine routing on the host, everything in VRAM, and both against the CPU reference's tokens.
#
#   OUT=/tmp/h200-gpuroute bash bench/h200_gpuroute.sh
#   LAYERS=24 PAIRS=6 OUT=/tmp/x bash bench/h200_gpuroute.sh
#
# The pack is bench/h200_trunk.py's fixture (Qwen3-30B-A3B widths: hidden 2048, 32 heads of 128, 4 kv
# heads, expert width 768; LAYERS layers, 32 experts top-8, int8 trunk and experts, vocab 32000) in WORK.
# One install, two switches of engine/device_route.py: COLIBRI_DEVICE_ROUTING=0 ("before": x comes down
# and the host routes, as before issue 25) and =1 ("after": d_router_topk on the GPU, ids and weights come
# down), paired by bench/engine_before_after.py (--backend cuda: every expert in VRAM, the trunk there).
# Then the CPU engine (--backend cpu) on the same prompt for the reference tokens.
# Files under OUT: h200-gpuroute-gpu.json/.txt (before/after), h200-gpuroute-cpu.json/.txt (reference),
# summary.json, summary.txt. Needs: this checkout installed for python3, CuPy with a visible GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-gpuroute}
WORK=${WORK:-/tmp/h200-gpuroute-work}
LAYERS=${LAYERS:-24}
PAIRS=${PAIRS:-6}
TOKENS=${TOKENS:-32}
PREFILL=${PREFILL:-16,512}
PY=${PY:-python3}
BACKEND=${BACKEND:-cuda}           # opencl / vulkan run the same flow (informational)
mkdir -p "$OUT" "$WORK"
PYABS=$(command -v "$PY")
for mode in 0 1; do  # a python that runs with the switch set (engine_before_after.py takes pythons)
  printf '#!/bin/sh\nCOLIBRI_DEVICE_ROUTING=%s exec %s "$@"\n' "$mode" "$PYABS" > "$WORK/py-route$mode"
  chmod +x "$WORK/py-route$mode"
done
[ -f "$WORK/fixture/pack.json" ] || $PY bench/h200_trunk.py fixture "$WORK/fixture" --layers "$LAYERS" \
  --experts 32 --width 768 --hidden 2048 --vocab 32000
$PY bench/engine_before_after.py --before "$WORK/py-route0" --after "$WORK/py-route1" --backend "$BACKEND" \
  --pack "$WORK/fixture" --pairs "$PAIRS" --prefill "$PREFILL" --context 1024 --decode-tokens "$TOKENS" \
  --out "$OUT/h200-gpuroute-gpu.json" 2>&1 | tee "$OUT/h200-gpuroute-gpu.txt"
$PY bench/engine_before_after.py --before "$PY" --after "$PY" --backend cpu --pack "$WORK/fixture" --pairs 1 \
  --prefill "$PREFILL" --context 1024 --decode-tokens "$TOKENS" --out "$OUT/h200-gpuroute-cpu.json" \
  2>&1 | tee "$OUT/h200-gpuroute-cpu.txt"
$PY - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
gpu, cpu = (json.loads((out / f"h200-gpuroute-{k}.json").read_text()) for k in ("gpu", "cpu"))
ref = cpu["tokens"]["after"]
m = gpu["metrics"]
summary = {"source": "bench/h200_gpuroute.sh", "backend": gpu["args"]["backend"], "pack": gpu["pack"], "pairs": gpu["args"]["pairs"],
           "token_exact_vs_cpu": {"host_routing": gpu["tokens"]["before"] == ref,
                                  "device_routing": gpu["tokens"]["after"] == ref},
           "same_tokens_host_vs_device_routing": gpu["same_tokens"],
           "decode_tok_s": {k: m["decode_tok_s"][side]["median"] for k, side in
                            (("host_routing", "before"), ("device_routing", "after"))},
           "prefill_tok_s": {key.split("_")[1]: {k: int(key.split("_")[1]) / m[key][side]["median"] for k, side in
                                                 (("host_routing", "before"), ("device_routing", "after"))}
                             for key in m if key.startswith("prefill_")}}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"{'case':<22} {'host routing':>14} {'device routing':>16}")
d = summary["decode_tok_s"]
print(f"{'decode tok/s':<22} {d['host_routing']:>14.1f} {d['device_routing']:>16.1f}")
for n, p in summary["prefill_tok_s"].items():
    print(f"{'prefill ' + n + ' tok/s':<22} {p['host_routing']:>14.0f} {p['device_routing']:>16.0f}")
t = summary["token_exact_vs_cpu"]
print(f"{'tokens = CPU reference':<22} {str(t['host_routing']):>14} {str(t['device_routing']):>16}")
PYEOF
