"""CUDA 1-token expert FFN: the integer tensor-core decode kernels (shaders/cuda/decode_imma.cu) against the
GEMV kernels (matmul.cu), at GLM-5.2 shapes, in one run.

For each of ``--formats`` (per-row int4 / int8: the formats decode_imma.cu takes) one pool of experts is
uploaded, then ``--rounds`` rounds time every variant in turn (interleaved, so drift and clock changes
fall on all of them): ``gemv`` (``_IMMA_FORMATS`` emptied: matmul.cu's mm / gate_up with their
``_GEMV_TUNE`` settings) and each ``_VARIANTS`` setting: ``_IMMA_SHAPE`` (16-row subtiles per block tile
and warps per block, gate/up and down), ``_IMMA_MIN_BLOCKS`` (launch bounds), ``_IMMA_STAGES`` (steps of
each warp's weight ring), ``_IMMA_OPS`` (one kernel on decode_imma.cu, the other on GEMV: how the pair's
time splits) and read-only builds (the loads without the sums). Kernel time is
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
check_out = _ffn.check_out
H, I = _ffn.H, _ffn.I  # hidden size, routed expert width

# label -> overrides of the module's settings: "gate_up" / "mm" (R16, warps) of _IMMA_SHAPE, "mb"
# _IMMA_MIN_BLOCKS, "st" _IMMA_STAGES, "ops" _IMMA_OPS (the kernels that take decode_imma.cu; the others
# keep GEMV), "imma" False: the GEMV kernels only, "read_only": loads, staging and barriers without the
# sums (COLIBRI_READ_ONLY, wrong results: the memory side alone)
_VARIANTS = {
    "gemv": {"imma": False},
    "default": {},
    "st2": {"st": 2},
    "st3": {"st": 3},
    "st2 mb3": {"st": 2, "mb": 3},
    "st2 mm2x4": {"st": 2, "mm": (2, 4)},
    "mm2x4": {"mm": (2, 4)},
    "mm1x4": {"mm": (1, 4)},
    "gu2x8": {"gate_up": (2, 8)},
    "gate_up only": {"ops": ("gate_up",)},
    "down only": {"ops": ("mm", "mm_args")},
    "read-only": {"read_only": True},
    "gemv read-only": {"imma": False, "read_only": True},
}


def apply(mod, over: dict, base: dict) -> None:
    """Set the module's decode kernels to ``base`` updated with ``over`` (a _VARIANTS entry)."""
    v = {**base, **over}
    mod._NVRTC_OPTIONS = tuple(o for o in mod._NVRTC_OPTIONS if o != "-DCOLIBRI_READ_ONLY") + (
        ("-DCOLIBRI_READ_ONLY",) if v.get("read_only") else ())
    mod._IMMA_FORMATS = v["formats"] if v.get("imma", True) else frozenset()
    mod._IMMA_SHAPE = {"gate_up": v["gate_up"], "mm": v["mm"]}
    mod._IMMA_MIN_BLOCKS, mod._IMMA_STAGES, mod._IMMA_OPS = v["mb"], v["st"], frozenset(v["ops"])


def speedup_vs_gemv(gemv: dict[int, float], mine: list[dict]) -> float | None:
    """Median over rounds of gemv's kernel seconds / this variant's (``mine``: rows with "round" and
    "kernel_s"); rounds whose gemv run failed (absent from ``gemv``) are left out; None without any."""
    vs = [gemv[r["round"]] / r["kernel_s"] for r in mine if r["round"] in gemv]
    return statistics.median(vs) if vs else None


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
        p.error(f"--formats: {', '.join(map(repr, bad))}: decode_imma.cu takes per-row int4 and int8 only")
    labels = args.variants.split(",")
    if bad := [v for v in labels if v not in _VARIANTS]:
        p.error(f"--variants: unknown {', '.join(map(repr, bad))} (known: {', '.join(_VARIANTS)})")
    if min(args.experts, args.pool, args.calls, args.rounds) < 1:
        p.error("--experts, --pool, --calls and --rounds must be >= 1")
    check_out(p, args.out)
    cls = get_backend("cuda")
    if (reason := cls.unavailable_reason()) is not None:
        print(f"cuda unavailable: {reason}", file=sys.stderr)
        return 1
    from colibri_plan.backends.cuda import launch as mod

    kept = mod._IMMA_FORMATS
    base = {"formats": frozenset({"int4", "int8"}), "gate_up": mod._IMMA_SHAPE["gate_up"],
            "mm": mod._IMMA_SHAPE["mm"], "mb": mod._IMMA_MIN_BLOCKS, "st": mod._IMMA_STAGES,
            "ops": mod._IMMA_OPS}
    be = cls.open(0)
    be.timing = True
    import cupy as cp

    copy = copy_gbps(cp)
    rng = np.random.default_rng(0)
    rows, failed = [], {}
    for fmt in args.formats.split(","):
        experts = upload_pool(be, fmt, args, rng)
        for rnd in range(args.rounds):
            for label in labels:
                apply(mod, _VARIANTS[label], base)
                be._launchers.clear()  # launch shapes and captured graphs of the previous setting
                be._graphs.clear()
                t0 = time.perf_counter()
                try:
                    (r,) = ffn_rows(be, fmt, [1], args, rng, experts)
                except Exception as exc:  # noqa: BLE001 - a variant the GPU refuses: say so, run the rest
                    print(f"{fmt} round {rnd} {label}: failed: {exc}", file=sys.stderr, flush=True)
                    failed.setdefault(label, str(exc))
                    continue
                launch = be._launcher("gate_up", fmt, args.experts, I, I, H, I, 1)  # what ffn_rows ran
                rows.append({**r, "variant": label, "round": rnd, "setting": _VARIANTS[label],
                             "gate_up_kernel": launch[0].__name__, "gate_up_grid": list(launch[1]),
                             "seconds": time.perf_counter() - t0})
                print(f"{fmt} round {rnd} {label:18} kern {r['kernel_s'] * 1e6:6.1f} us "
                      f"{r['kernel_gbps'] / copy:.2f} of copy", file=sys.stderr, flush=True)
        free_pool(be, experts)
    apply(mod, {}, base)
    mod._IMMA_FORMATS = kept
    print(f"device-to-device copy: {copy:.0f} GB/s")
    print(f"{'fmt':5} {'variant':18} {'kern us':>8} {'of copy':>8} {'vs gemv':>8}")
    summary = []
    for fmt in args.formats.split(","):
        gemv = {r["round"]: r["kernel_s"] for r in rows if r["fmt"] == fmt and r["variant"] == "gemv"}
        for label in labels:
            mine = [r for r in rows if r["fmt"] == fmt and r["variant"] == label]
            if not mine:
                print(f"{fmt:5} {label:18} failed: {failed.get(label)}")
                continue
            k_s = statistics.median(r["kernel_s"] for r in mine)
            ratio = speedup_vs_gemv(gemv, mine)
            gbps = mine[0]["kernel_gbps"] * mine[0]["kernel_s"] / k_s
            summary.append({"fmt": fmt, "variant": label, "kernel_s": k_s, "of_copy": gbps / copy,
                            "speedup_vs_gemv": ratio})
            print(f"{fmt:5} {label:18} {k_s * 1e6:8.1f} {gbps / copy:8.2f} "
                  f"{'' if ratio is None else f'{ratio:8.2f}'}")
    if args.out:
        doc = {"device": be.device.to_dict(), "copy_gbps": copy, "summary": summary, "failed": failed,
               "rows": rows}
        atomic_write_text(args.out, json.dumps(doc, indent=1))
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
