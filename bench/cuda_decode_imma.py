"""CUDA 1-token expert FFN: the integer tensor-core decode kernels (shaders/cuda/decode_imma.cu) against the
GEMV kernels (matmul.cu), at GLM-5.2 shapes, in one run.

For each of ``--formats`` (per-row int4 / int8: the formats decode_imma.cu takes) one pool of experts is
uploaded, then ``--rounds`` rounds time every variant in turn (interleaved, so drift and clock changes
fall on all of them): ``gemv`` (``_IMMA_FORMATS`` emptied: matmul.cu's mm / gate_up with their
``_GEMV_TUNE`` settings) and each ``_VARIANTS`` setting of ``_IMMA_SHAPE`` (16-row subtiles per block tile
and warps per block, gate/up and down), ``_IMMA_MIN_BLOCKS`` (launch bounds) and ``_IMMA_STAGES`` (steps
of each warp's weight ring). Kernel time is
bench/cuda_expert_ffn.py's: the op with its kernels run twice, less once. Prints a table (median over
rounds of the kernels' µs, fraction of the device-to-device copy rate, and the ratio to gemv of the
same round); ``--out`` writes JSON.

    python3 -P bench/cuda_decode_imma.py --formats int4,int8 --out /tmp/imma.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from colibri_plan.backends import get_backend
from colibri_plan.fileio import atomic_write_text

# the expert pool and the timed calls of bench/cuda_expert_ffn.py (run with -P: this folder is not on the
# path)
_spec = importlib.util.spec_from_file_location("cuda_expert_ffn",
                                               Path(__file__).with_name("cuda_expert_ffn.py"))
_ffn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_ffn)
copy_gbps, ffn_rows, free_pool, upload_pool = _ffn.copy_gbps, _ffn.ffn_rows, _ffn.free_pool, _ffn.upload_pool

# label -> (gate_up (R16, warps), mm (R16, warps), min blocks of 8 warps per SM, ring stages); None: the
# GEMV kernels
_VARIANTS = {
    "gemv": None,
    "default": None,  # filled from the module's own settings at start
    "st3": ((1, 8), (2, 8), 2, 3),
    "st6": ((1, 8), (2, 8), 2, 6),
    "gu1x4 mm2x4": ((1, 4), (2, 4), 2, 4),
    "gu1x4 mm2x4 st6": ((1, 4), (2, 4), 2, 6),
    "gu1x4 mm1x4 st8": ((1, 4), (1, 4), 2, 8),
    "gu1x8 mm1x8": ((1, 8), (1, 8), 2, 4),
    "read-only": None,  # the default's loads, staging and barriers without the sums (wrong results)
}


def apply(mod, setting, imma_formats) -> None:
    """Set the module's decode kernels to ``setting`` (None: GEMV only)."""
    mod._NVRTC_OPTIONS = tuple(o for o in mod._NVRTC_OPTIONS if o != "-DCOLIBRI_READ_ONLY")
    if setting is None:
        mod._IMMA_FORMATS = frozenset()
        return
    if setting[0] == "read-only":  # ("read-only", the setting it runs)
        mod._NVRTC_OPTIONS += ("-DCOLIBRI_READ_ONLY",)
        setting = setting[1]
    (gu, mm, mb, st) = setting
    mod._IMMA_FORMATS = imma_formats
    mod._IMMA_SHAPE = {"gate_up": gu, "mm": mm}
    mod._IMMA_MIN_BLOCKS, mod._IMMA_STAGES = mb, st


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="int4,int8")
    p.add_argument("--experts", type=int, default=8, help="experts per call (top-k)")
    p.add_argument("--pool", type=int, default=64, help="distinct experts cycled (> L2 cache)")
    p.add_argument("--calls", type=int, default=100, help="calls per variant per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(_VARIANTS), help="comma-separated labels of _VARIANTS")
    p.add_argument("--out")
    args = p.parse_args()
    if bad := [f for f in args.formats.split(",") if f not in ("int4", "int8")]:
        p.error(f"--formats: {', '.join(bad)}: decode_imma.cu takes per-row int4 and int8 only")
    labels = args.variants.split(",")
    if bad := [v for v in labels if v not in _VARIANTS]:
        p.error(f"--variants: unknown {', '.join(bad)} (known: {', '.join(_VARIANTS)})")
    if min(args.experts, args.pool, args.calls, args.rounds) < 1:
        p.error("--experts, --pool, --calls and --rounds must be >= 1")
    cls = get_backend("cuda")
    if (reason := cls.unavailable_reason()) is not None:
        print(f"cuda unavailable: {reason}", file=sys.stderr)
        return 1
    from colibri_plan.backends import cuda as mod

    imma = mod._IMMA_FORMATS
    default = (mod._IMMA_SHAPE["gate_up"], mod._IMMA_SHAPE["mm"], mod._IMMA_MIN_BLOCKS, mod._IMMA_STAGES)
    settings = dict(_VARIANTS, default=default)
    settings["read-only"] = ("read-only", default)
    be = cls.open(0)
    be.timing = True
    import cupy as cp

    copy = copy_gbps(cp)
    rng = np.random.default_rng(0)
    rows = []
    for fmt in args.formats.split(","):
        experts = upload_pool(be, fmt, args, rng)
        for rnd in range(args.rounds):
            for label in labels:
                apply(mod, settings[label], imma)
                be._launchers.clear()  # launch shapes and captured graphs of the previous setting
                be._graphs.clear()
                t0 = time.perf_counter()
                (r,) = ffn_rows(be, fmt, [1], args, rng, experts)
                launch = be._launcher("gate_up", fmt, args.experts, 2048, 2048, 6144, 2048, 1)
                rows.append({**r, "variant": label, "round": rnd, "setting": settings[label],
                             "gate_up_kernel": launch[0].__name__, "gate_up_grid": list(launch[1]),
                             "seconds": time.perf_counter() - t0})
                print(f"{fmt} round {rnd} {label:18} kern {r['kernel_s'] * 1e6:6.1f} us "
                      f"{r['kernel_gbps'] / copy:.2f} of copy", file=sys.stderr, flush=True)
        free_pool(be, experts)
    apply(mod, settings["default"], imma)
    print(f"device-to-device copy: {copy:.0f} GB/s")
    print(f"{'fmt':5} {'variant':18} {'kern us':>8} {'of copy':>8} {'vs gemv':>8}")
    summary = []
    for fmt in args.formats.split(","):
        gemv = {r["round"]: r["kernel_s"] for r in rows if r["fmt"] == fmt and r["variant"] == "gemv"}
        for label in labels:
            mine = [r for r in rows if r["fmt"] == fmt and r["variant"] == label]
            k_s = statistics.median(r["kernel_s"] for r in mine)
            ratio = statistics.median(gemv[r["round"]] / r["kernel_s"] for r in mine) if gemv else None
            gbps = mine[0]["kernel_gbps"] * mine[0]["kernel_s"] / k_s
            summary.append({"fmt": fmt, "variant": label, "kernel_s": k_s, "of_copy": gbps / copy,
                            "speedup_vs_gemv": ratio})
            print(f"{fmt:5} {label:18} {k_s * 1e6:8.1f} {gbps / copy:8.2f} "
                  f"{'' if ratio is None else f'{ratio:8.2f}'}")
    if args.out:
        atomic_write_text(args.out, json.dumps({"device": be.device.to_dict(), "copy_gbps": copy,
                                                "summary": summary, "rows": rows}, indent=1))
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
