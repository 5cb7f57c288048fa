"""CUDA batched expert FFN at GLM-5.2 shapes: host wall time vs GPU time, against copy bandwidth.

``bench/quant_kernels.py`` measures every backend by host wall clock (what decode pays). This script splits
the CUDA figure: the same ``expert_ffn`` calls timed on the host and by CUDA events
(``CUDABackend.last_device_seconds`` with ``timing = True``: the op's copies and kernels; the events
cost a few microseconds of host time, included in the wall figure here), the kernels' own GPU time (the
same calls with the kernels run twice, less the plain ones), and the device-to-device copy
bandwidth of the same GPU in the same run, so a shortfall can be put on the kernels or on host overhead.
Experts cycle through a pool larger than the GPU's L2 cache. Prints a table; ``--out`` writes JSON.
``--tune`` repeats the int4, 1-token case for several work shapes (rows per warp tile and words per
lane per step of the gate/up and down kernels, warps per block: ``_SHAPE`` and ``_WARPS`` of
backends/cuda.py). ``--gemv-sweep`` times each ``_SWEEP`` setting (``_GEMV_TUNE`` of backends/cuda.py:
register cap, activations by part, rows and words per step, warps, grid within one wave) at 1 token for
each of ``--formats`` in one run, on one uploaded pool per format, with each setting's launch shape.

    .venv/bin/python bench/cuda_expert_ffn.py --out /tmp/cuda_ffn.json
    .venv/bin/python bench/cuda_expert_ffn.py --tune
    .venv/bin/python bench/cuda_expert_ffn.py --formats int4,int4-g64,int8 --gemv-sweep --out /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import numpy as np

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.fileio import atomic_write_text

H, I = 6144, 2048  # GLM-5.2 hidden size and routed expert width


def copy_gbps(cp, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy, read + write bytes per second / 1e9 (median)."""
    a, b = cp.ones(nbytes // 4, cp.float32), cp.empty(nbytes // 4, cp.float32)
    rates = []
    for _ in range(repeats + 1):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        b[...] = a
        cp.cuda.Device().synchronize()
        rates.append(2 * nbytes / (time.perf_counter() - t0) / 1e9)
    return float(np.median(rates[1:]))


def upload_pool(be, fmt: str, args, rng) -> list:
    """``args.pool`` experts of ``fmt`` at GLM-5.2 shapes on the device (separate copies, same values)."""
    base = [quant.quantize(rng.standard_normal(s, dtype=np.float32) / 50, fmt)
            for s in ((I, H), (I, H), (H, I))]
    return [be.upload_expert(*base) for _ in range(args.pool)]


def free_pool(be, experts) -> None:
    for e in experts:
        for w in e:
            be.free(w)


def ffn_rows(be, fmt: str, tokens, args, rng, experts=None) -> list[dict]:
    """Median wall and GPU seconds per expert_ffn call of ``args.experts`` experts, per token count
    (``experts``: an uploaded pool, kept; else one is uploaded and freed)."""
    own = experts is None
    experts = upload_pool(be, fmt, args, rng) if own else experts
    ebytes = sum(w.nbytes for w in experts[0])
    rows = []
    for T in tokens:
        xs = [rng.standard_normal((T, H), dtype=np.float32) for _ in range(args.experts)]
        wall, dev, kern = [], [], []
        for passes, times in ((1, dev), (2, kern)):
            be.kernel_passes = passes
            for k in range(args.calls + 5):
                batch = [experts[(k * args.experts + j) % args.pool] for j in range(args.experts)]
                t0 = time.perf_counter()
                be.expert_ffn(xs, batch)
                if k >= 5:  # the first calls compile, capture graphs and warm caches
                    if passes == 1:
                        wall.append(time.perf_counter() - t0)
                    times.append(be.last_device_seconds)
        be.kernel_passes = 1
        nbytes, w_s, d_s = args.experts * ebytes, float(np.median(wall)), float(np.median(dev))
        k_s = float(np.median(kern)) - d_s  # kernels' own time: (copies + 2 passes) - (copies + 1 pass)
        rows.append({"op": "expert_ffn", "fmt": fmt, "experts": args.experts, "tokens": T, "wall_s": w_s,
                     "device_s": d_s, "kernel_s": k_s, "wall_gbps": nbytes / w_s / 1e9,
                     "device_gbps": nbytes / d_s / 1e9, "kernel_gbps": nbytes / k_s / 1e9})
    if own:
        free_pool(be, experts)
    return rows


# GEMV settings compared by --gemv-sweep: backends/cuda.py _GEMV_TUNE entries, applied to the family of
# each format run (int4 and int4-gG share one). Registers (nvcc 13, sm_90) of the int4 gate_up / down
# kernels: default 117 / 95 (2 blocks of 8 warps per SM), x_by_part 80 / 79 (3), max_regs 64: 4; int8
# down 78 (3 per SM: without fit_wave, 8 x 50 blocks are 4 more than one wave of 396).
_SWEEP = (
    ("default", {}),
    ("fit_wave", {"fit_wave": True}),
    ("x_by_part", {"x_by_part": True}),
    ("x_by_part+fit", {"x_by_part": True, "fit_wave": True}),
    ("x_by_part+regs64+fit", {"x_by_part": True, "max_regs": 64, "fit_wave": True}),
    ("regs80+fit", {"max_regs": 80, "fit_wave": True}),
    ("U2+fit", {"gate_up": (2, 2), "mm": (4, 2), "fit_wave": True}),
    ("U2+x_by_part+fit", {"gate_up": (2, 2), "mm": (4, 2), "x_by_part": True, "fit_wave": True}),
    ("R4/8+fit", {"gate_up": (4, 1), "mm": (8, 1), "fit_wave": True}),
    ("R2/6+x_by_part+fit", {"mm": (6, 1), "x_by_part": True, "fit_wave": True}),
    ("warps4+x_by_part+fit", {"warps": 4, "x_by_part": True, "fit_wave": True}),
    ("warps16+x_by_part+regs64+fit", {"warps": 16, "x_by_part": True, "max_regs": 64, "fit_wave": True}),
)


def launch_info(be, mod, fmt: str, args) -> dict:
    """The 1-token gate_up and down launches of ``fmt``: resident blocks per SM, grid blocks per expert,
    warps per block, registers, row tiles per warp (most and mean: the last round's fill)."""
    out = {}
    for name, rows, in_pad in (("gate_up", I, H), ("mm", H, I)):
        launch = be._launcher(name, fmt, args.experts, rows, rows, in_pad, rows, 1)  # T = 1
        fn, (blocks, _), (block,), smem, _ = launch
        warps, tiles = block // 32, -(-rows // mod._gemv_shape(name, fmt)[0])
        out[name] = {"resident_blocks": be._resident(fn, smem, warps), "blocks": blocks, "warps": warps,
                     "registers": int(getattr(fn, "num_regs", 0) or 0),
                     "tiles_per_warp_max": -(-tiles // (blocks * warps)),
                     "tiles_per_warp_mean": round(tiles / (blocks * warps), 2)}
    return out


def sweep(be, mod, args, rng) -> list[dict]:
    """Every _SWEEP setting for each of ``args.formats`` at 1 token, on one uploaded pool per format."""
    rows, saved, imma = [], dict(mod._GEMV_TUNE), mod._IMMA_FORMATS
    mod._IMMA_FORMATS = frozenset()  # GEMV kernels at 1 token (bench/cuda_decode_imma.py: the others)
    for fmt in args.formats.split(","):
        experts = upload_pool(be, fmt, args, rng)
        for label, tune in _SWEEP:
            mod._GEMV_TUNE = {**saved, mod._family(fmt): tune}
            be._launchers.clear()  # launch shapes and captured graphs of the previous setting
            be._graphs.clear()
            t0 = time.perf_counter()
            info = launch_info(be, mod, fmt, args)  # compiles the two kernels
            compile_s = time.perf_counter() - t0
            (r,) = ffn_rows(be, fmt, [1], args, rng, experts)
            rows.append({**r, "variant": label, "tune": {k: list(v) if isinstance(v, tuple) else v
                                                         for k, v in tune.items()},
                         "launch": info, "compile_s": compile_s})
            print(f"{fmt:9} {label:28} kern {r['kernel_s'] * 1e6:6.1f} us  kern/copy "
                  f"{r['kernel_gbps'] / args.copy_gbps:.2f}  op {r['device_s'] * 1e6:6.1f} us  "
                  f"gate_up {info['gate_up']['resident_blocks']}x{info['gate_up']['warps']}w "
                  f"{info['gate_up']['registers']}r  down {info['mm']['resident_blocks']}x"
                  f"{info['mm']['warps']}w {info['mm']['registers']}r", flush=True)
        free_pool(be, experts)
    mod._GEMV_TUNE, mod._IMMA_FORMATS = saved, imma
    be._launchers.clear()
    be._graphs.clear()
    return rows


def tune(cls, args, rng) -> list[dict]:
    from colibri_plan.backends.cuda import launch as mod

    rows, saved = [], (dict(mod._SHAPE), mod._WARPS, mod._IMMA_FORMATS)
    mod._IMMA_FORMATS = frozenset()  # the GEMV kernels' shapes: per-row int4 would take decode_imma.cu
    for gu, dn, warps in (((2, 1), (4, 1), 8), ((1, 1), (2, 1), 8), ((2, 2), (4, 1), 8), ((1, 2), (2, 2), 8),
                          ((2, 1), (4, 2), 8), ((2, 1), (4, 1), 4), ((1, 2), (2, 2), 4)):
        mod._SHAPE.update(gate_up=gu, mm=dn)
        mod._WARPS = warps
        be = cls.open(0)
        be.timing = True
        (r,) = ffn_rows(be, "int4", [1], args, rng)
        be.close()
        rows.append({**r, "gate_up_rows_words": list(gu), "down_rows_words": list(dn),
                     "warps": warps})
        print(f"gate-up R,U {gu}, down R,U {dn}, {warps} warps: kernels {r['kernel_gbps']:.0f} GB/s, "
              f"op {r['device_gbps']:.0f} GB/s, wall {r['wall_gbps']:.0f} GB/s", flush=True)
    mod._SHAPE.update(saved[0])
    mod._WARPS, mod._IMMA_FORMATS = saved[1:]
    return rows


def check_out(p: argparse.ArgumentParser, out: str | None) -> None:
    """A usage error, before the GPU runs, when ``--out`` cannot take the result (its folder missing, a
    folder given, ...): the figures would otherwise be lost at the end of the run."""
    from colibri_plan.errors import InputError
    from colibri_plan.fileio import check_output_path

    if out is not None:
        try:
            check_output_path(out)
        except InputError as exc:
            p.error(f"--out: {exc}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", default="int4,int4-g64,int8")
    p.add_argument("--experts", type=int, default=8, help="experts per call (top-k)")
    p.add_argument("--tokens", default="1,4,16")
    p.add_argument("--pool", type=int, default=64, help="distinct experts cycled (> L2 cache)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--tune", action="store_true", help="compare work shapes (int4, 1 token)")
    p.add_argument("--gemv-sweep", action="store_true",
                   help="1 token: each GEMV setting of _SWEEP (registers, rows and words per step, "
                        "warps) for each of --formats, per variant kernel us and fraction of the copy")
    p.add_argument("--read-only", action="store_true",
                   help="kernels compiled to load the weights without the arithmetic (memory side alone; "
                        "results are wrong on purpose)")
    p.add_argument("--gemv-prefill", action="store_true",
                   help="T > 1 on the GEMV kernels too (the kernels before the tensor-core ones)")
    p.add_argument("--tc-from", type=int, default=None,
                   help="fewest tokens that take the tensor-core kernels (1: decode too)")
    p.add_argument("--tc-rows", default=None,
                   help="16-row subtiles per warp tile of the tensor-core kernels, mm,gate_up (e.g. 2,1)")
    p.add_argument("--tc-warps", type=int, default=None, help="warps per block of the tensor-core kernels")
    p.add_argument("--out")
    args = p.parse_args()
    # refused here, before the GPU is opened, rather than as a traceback from inside the kernels' set-up
    if bad := [f for f in args.formats.split(",") if f not in quant.FORMATS]:
        p.error(f"--formats: {', '.join(bad)} not a quant format ({', '.join(quant.FORMATS)})")
    if not all(re.fullmatch(r"\s*[0-9]+\s*", t) and int(t) >= 1 for t in args.tokens.split(",")):
        p.error(f"--tokens: expected token counts >= 1, comma-separated (1,4,16), got {args.tokens!r}")
    if args.tc_rows and not re.fullmatch(r"[1-9]\d*,[1-9]\d*", args.tc_rows):
        p.error(f"--tc-rows: expected two counts >= 1, mm,gate_up (2,1), got {args.tc_rows!r}")
    if min(args.experts, args.pool, args.calls) < 1:
        p.error("--experts, --pool and --calls must be >= 1")
    # prefill.cu sums a block's warps in shared memory sized for TC_WARPS (8) of them: more would write past
    # it; 0 would fall back to the automatic count unnoticed
    if args.tc_warps is not None and not 1 <= args.tc_warps <= 8:
        p.error(f"--tc-warps: expected warps per block in 1..8 (prefill.cu TC_WARPS), got {args.tc_warps}")
    if args.tc_from is not None and args.tc_from < 1:
        p.error(f"--tc-from: expected a token count >= 1, got {args.tc_from}")
    check_out(p, args.out)
    cls = get_backend("cuda")
    from colibri_plan.backends.cuda import launch as mod

    if args.gemv_prefill:
        mod._TC_FORMATS = frozenset()
    if args.tc_from is not None:
        mod._TC_MIN_TOKENS = args.tc_from
    if args.tc_warps:
        mod._TC_WARPS = args.tc_warps
    if args.tc_rows:
        mm, gu = (int(v) for v in args.tc_rows.split(","))
        mod._TC_R16.update(mm_tc=mm, mm_args_tc=mm, gate_up_tc=gu)

    if args.read_only:
        mod._NVRTC_OPTIONS = mod._NVRTC_OPTIONS + ("-DCOLIBRI_READ_ONLY",)
    if (reason := cls.unavailable_reason()) is not None:
        print(f"cuda unavailable: {reason}", file=sys.stderr)
        return 1
    be = cls.open(0)
    be.timing = True  # CUDA events around each op: last_device_seconds
    import cupy as cp

    rows = [{"op": "d2d_copy", "gbps": copy_gbps(cp)}]
    args.copy_gbps = rows[0]["gbps"]
    rng = np.random.default_rng(0)
    if args.gemv_sweep:
        rows += sweep(be, mod, args, rng)
    elif args.tune:
        be.close()
        rows += tune(cls, args, rng)
        be = cls.open(0)
    else:
        for fmt in args.formats.split(","):
            rows += ffn_rows(be, fmt, [int(t) for t in args.tokens.split(",")], args, rng)
    copy = rows[0]["gbps"]
    print(f"resident blocks per SM (kernel, shared bytes): {be._occupancy}", file=sys.stderr)
    print(f"device-to-device copy: {copy:.0f} GB/s")
    print("wall: host time of the call; op: GPU time of its copies and kernels; kernels: GPU time of the "
          "kernels alone; x/copy: that rate over the device-to-device copy rate")
    print(f"{'fmt':10} {'T':>3} {'wall us':>8} {'op us':>7} {'kern us':>8} {'wall GB/s':>9} {'op GB/s':>8} "
          f"{'kern GB/s':>9} {'wall/copy':>9} {'op/copy':>7} {'kern/copy':>9}")
    for r in rows[1:]:
        label = f"{r['fmt']} {r.get('variant', '')}".strip()
        print(f"{label:10} {r['tokens']:>3} {r['wall_s'] * 1e6:8.1f} {r['device_s'] * 1e6:7.1f} "
              f"{r['kernel_s'] * 1e6:8.1f} {r['wall_gbps']:9.0f} {r['device_gbps']:8.0f} "
              f"{r['kernel_gbps']:9.0f} "
              f"{r['wall_gbps'] / copy:9.2f} {r['device_gbps'] / copy:7.2f} {r['kernel_gbps'] / copy:9.2f}")
    if args.out:
        atomic_write_text(args.out, json.dumps({"device": be.device.to_dict(), "read_only": args.read_only,
                                                "gemv_prefill": args.gemv_prefill,
                                                "tc_min_tokens": mod._TC_MIN_TOKENS,
                                                "tc_rows": dict(mod._TC_R16), "tc_warps": mod._TC_WARPS,
                                                "gemv_tune": {k: {n: list(v) if isinstance(v, tuple) else v
                                                                  for n, v in t.items()}
                                                              for k, t in mod._GEMV_TUNE.items()},
                                                "rows": rows}, indent=1))
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
