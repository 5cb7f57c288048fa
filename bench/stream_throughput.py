"""Disk throughput the engine achieves while decoding, against the profiler's O_DIRECT figure.

A quarter of each layer's experts (the hottest, by the fixture's routing) is pinned in RAM, the rest
streams from disk with ``--slots`` LRU slots per layer. The engine's streaming throughput is disk bytes
over the time each wave of concurrent reads was in flight; the yardstick is the profile's random-read
GB/s at the same block size and the queue depth nearest to the engine's mean reads per wave. Both are
measured in the same run (the profile is re-measured first unless ``--profile`` is given).

    python bench/stream_throughput.py --model work-demo/fixture [--tokens 24] [--repeats 3] [--out R.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.session import run_placement
from colibri_plan.fileio import atomic_write_text
from colibri_plan.formats.profile import load_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="expert pack (e.g. the demo fixture)")
    ap.add_argument("--profile", help="profile to compare with (default: measure one now, --quick)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    with open_pack(args.model) as pack:
        arch = pack.arch
        bias = {l: pack.dense.get(f"layers.{l}.router_bias") for l in arch.moe_layers}
        quarter = arch.n_experts // 4
        layers = {}
        for l in arch.moe_layers:  # the fixture's router bias ranks its experts by heat
            order = np.argsort(-bias[l]) if bias[l] is not None else np.arange(arch.n_experts)
            layers[l] = LayerPlacement(ram_pinned=[int(e) for e in order[:quarter]], lru_slots=args.slots)
        placement = Placement(layers)
        if args.profile:
            profile_path = args.profile
        else:
            profile_path = tempfile.mktemp(suffix=".json")
            subprocess.run([sys.executable, "-m", "colibri_plan", "profile", "--quick", "--backends", "cpu",
                            "--model", args.model, "--out", profile_path], check=True,
                           stdout=subprocess.DEVNULL)
        runs = [run_placement(pack, placement, [3 + r, 1, 4, 1, 5], args.tokens + 1)  # + the prefill token
                for r in range(args.repeats)]
    prof = load_profile(profile_path)
    engine_gbps = statistics.median(r.disk_read_gbps for r in runs)
    reads_per_token = statistics.median(r.disk_bytes_per_token for r in runs) / pack.expert_location(
        arch.moe_layers[0], 0)[1]
    per_wave = reads_per_token / len(arch.moe_layers)
    qds = sorted(e["queue_depth"] for e in prof.doc["disk"]["random"])
    qd = min(qds, key=lambda q: abs(q - per_wave))
    probe_gbps = prof.disk_read_gbps(qd)
    doc = {"engine_disk_read_gbps": engine_gbps, "engine_runs_gbps": [r.disk_read_gbps for r in runs],
           "reads_per_wave": per_wave, "profile_queue_depth": qd, "profile_read_gbps": probe_gbps,
           "ratio": engine_gbps / probe_gbps, "block_bytes": prof.disk_block_bytes(),
           "o_direct": runs[0].o_direct, "tok_s": [r.tok_s for r in runs],
           "hit_rate": runs[0].hit_rate}
    each = ", ".join(f"{r.disk_read_gbps:.2f}" for r in runs)
    print(f"engine streaming {engine_gbps:.2f} GB/s (runs {each}; "
          f"{per_wave:.1f} reads per wave, O_DIRECT {runs[0].o_direct}); profiler O_DIRECT at QD{qd}: "
          f"{probe_gbps:.2f} GB/s; ratio {doc['ratio']:.2f}")
    if args.out:
        atomic_write_text(args.out, json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
