"""CUDA device-activation ops (``d_*``, backends/cuda_device.py): host overhead per op, GPU time per op,
matmul weight bandwidth against a device-to-device copy, attention KV bandwidth.

Each op is issued ``--calls`` times back to back with its inputs already on the device, as decode chains
them (~15 ops per layer per token). Per op:

- ``host_us``: host time to enqueue one call (Python, checks, allocation, launches; nothing waits), the
  figure that bounds decode when kernels are short;
- ``gpu_us``: GPU time per call (CUDA events around the chain, divided by the calls);
- ``wall_us``: wall time per call of the chain including the final synchronisation.

``d_matmul`` (and ``d_matmul_many``, q/k/v in one call) cycles through a pool of weights larger than the
L2 cache, so its ``weight_gbps`` (weight bytes / gpu time) is a DRAM figure; ``copy_fraction`` divides it
by the device-to-device copy rate (read + write bytes / s) of the same GPU in the same run.
``d_attention`` is one decode query row (32 query heads, 8 kv heads, head_dim 128) at several contexts;
``kv_gbps`` = K + V bytes read / gpu time. ``roundtrip`` is a ``d_get`` of [1, 4096] plus a ``d_put`` of
[1, 4096] (what a MoE layer of a GPU trunk pays for the host experts). Each op's result is also checked
once against numpy (``max_err``: max |y - ref| / max |ref|). Prints a table; ``--out`` writes JSON.

    python bench/cuda_device_ops.py --out /tmp/cuda_device_ops.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.device_ops import attention_ref, rope_ref, rope_table
from colibri_plan.fileio import atomic_write_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_expert_ffn import copy_gbps  # noqa: E402 - the same copy-bandwidth yardstick
from opencl_device_ops import print_op_table  # noqa: E402 - the op table of the device-op benches

H = 4096  # hidden size of the small ops and the matmul
HQ, HKV, HD = 32, 8, 128  # attention heads, kv heads, head dim


def chain(be, call, calls: int, repeats: int) -> dict:
    """Median host/gpu/wall microseconds per call of ``call(i)`` issued ``calls`` times back to back."""
    cp = be.cp
    ev0, ev1 = cp.cuda.Event(), cp.cuda.Event()
    for i in range(3):  # compile, allocate, warm the pool
        call(i)
    be.synchronize()
    host, gpu, wall = [], [], []
    for _ in range(repeats):
        keep = []  # results alive until the end: the pool does not hand the same block back every call
        with be.dev:
            ev0.record(be.stream)
        t0 = time.perf_counter()
        for i in range(calls):
            keep.append(call(i))
        t1 = time.perf_counter()
        with be.dev:
            ev1.record(be.stream)
        be.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
        gpu.append(cp.cuda.get_elapsed_time(ev0, ev1) * 1e3 / calls)
    return {"host_us": float(np.median(host)), "gpu_us": float(np.median(gpu)),
            "wall_us": float(np.median(wall)), "calls": calls, "repetitions": repeats}


def err(y: np.ndarray, ref: np.ndarray) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def small_ops(be, rng, args) -> list[dict]:
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((1, H), (H,), (1, H)))
    dx, dw, db = be.d_put(x), be.d_put(w), be.d_put(b)
    inv = 1.0 / (10000.0 ** (np.arange(0, HD, 2, dtype=np.float32) / HD))
    table = rope_table(inv, 4096)
    dt = be.d_put(table)
    dq = be.d_view(dx, (1, HQ, HD))
    x64 = x.astype(np.float64)
    rows = []
    for name, call, ref, got in (
            ("d_add [1,4096]", lambda i: be.d_add(dx, db), x64 + b, lambda: be.d_add(dx, db)),
            ("d_add [1,4096]+[4096]", lambda i: be.d_add(dx, dw), x64 + w, lambda: be.d_add(dx, dw)),
            ("d_rmsnorm [1,4096]", lambda i: be.d_rmsnorm(dx, dw, 1e-6),
             x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-6) * w, lambda: be.d_rmsnorm(dx, dw, 1e-6)),
            ("d_silu_mul [1,4096]", lambda i: be.d_silu_mul(dx, db), x64 / (1 + np.exp(-x64)) * b,
             lambda: be.d_silu_mul(dx, db)),
            ("d_scale_rows [1,4096]", lambda i: be.d_scale_rows(dx, np.float32([0.5])), x64 * 0.5,
             lambda: be.d_scale_rows(dx, np.float32([0.5]))),
            ("d_rope [1,32,128]", lambda i: be.d_rope(dq, dt, i % 4000, HD, False),
             rope_ref(x64.reshape(1, HQ, HD), table.astype(np.float64), 7, HD, False).reshape(1, H),
             lambda: be.d_view(be.d_rope(dq, dt, 7, HD, False), (1, H)))):
        row = {"op": name, **chain(be, call, args.calls, args.repeats)}
        row["max_err"] = err(be.d_get(got()), ref)
        rows.append(row)
    kc = be.d_zeros((64, HKV, HD))
    src = be.d_view(be.d_put(x[:, :HKV * HD]), (1, HKV, HD))
    rows.append({"op": "d_write_rows [1,8,128]", **chain(be, lambda i: be.d_write_rows(kc, i % 64, src),
                                                           args.calls, args.repeats)})
    t = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        be.d_put(be.d_get(dx))
        t.append((time.perf_counter() - t0) * 1e6)
    be.synchronize()
    rows.append({"op": "roundtrip d_get+d_put [1,4096]", "host_us": float(np.median(t)),
                 "wall_us": float(np.median(t)), "roundtrip_bytes": 2 * 4 * H})
    return rows


def matmul_rows(be, rng, args, gbps: float) -> list[dict]:
    rows = []
    for fmt, out, in_ in (("int8", 4096, 4096), ("int4", 4096, 4096), ("int8", 14336, 4096)):
        qt = quant.quantize(rng.standard_normal((out, in_), dtype=np.float32) / 64, fmt)
        pool = max(2, -(-args.pool_bytes // qt.nbytes))  # copies cycling past the L2 cache
        ws = [be.upload(qt) for _ in range(pool)]
        for T in args.matmul_tokens:  # T > 1: a dense prefill (the tensor-core kernels)
            x = rng.standard_normal((T, in_), dtype=np.float32)
            dx = be.d_put(x)
            row = {"op": f"d_matmul [{T},{in_}]x[{in_},{out}] {fmt}", "fmt": fmt, "tokens": T,
                   "out_features": out, "in_features": in_, "weight_bytes": ws[0].nbytes, "pool": pool,
                   **chain(be, lambda i, dx=dx, ws=ws, n=pool: be.d_matmul(dx, ws[i % n]), args.calls,
                           args.repeats)}
            row["weight_gbps"] = ws[0].nbytes / (row["gpu_us"] * 1e-6) / 1e9
            row["copy_fraction"] = row["weight_gbps"] / gbps
            row["max_err"] = err(be.d_get(be.d_matmul(dx, ws[0])), quant.matmul_ref(x, qt))
            rows.append(row)
        for w in ws:
            be.free(w)
    # q/k/v of a GQA layer (32 heads, 8 kv heads of 128) as one d_matmul_many: one launch, three matrices
    qts = [quant.quantize(rng.standard_normal((o, H), dtype=np.float32) / 64, "int8")
           for o in (H, 1024, 1024)]
    nbytes = sum(q.nbytes for q in qts)
    pool = max(2, -(-args.pool_bytes // nbytes))
    sets = [[be.upload(q) for q in qts] for _ in range(pool)]
    x = rng.standard_normal((1, H), dtype=np.float32)
    dx = be.d_put(x)
    row = {"op": "d_matmul_many q/k/v [1,4096] int8", "fmt": "int8", "weight_bytes": nbytes, "pool": pool,
           **chain(be, lambda i: be.d_matmul_many(dx, sets[i % pool]), args.calls, args.repeats)}
    row["weight_gbps"] = nbytes / (row["gpu_us"] * 1e-6) / 1e9
    row["copy_fraction"] = row["weight_gbps"] / gbps
    row["max_err"] = max(err(be.d_get(y), quant.matmul_ref(x, q))
                         for y, q in zip(be.d_matmul_many(dx, sets[0]), qts))
    rows.append(row)
    for ws in sets:
        for w in ws:
            be.free(w)
    return rows


def attention_rows(be, rng, args) -> list[dict]:
    rows = []
    for ctx in args.contexts:
        k, v = (rng.standard_normal((ctx, HKV, HD), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((1, HQ, HD), dtype=np.float32)
        dk, dv, dq = be.d_put(k), be.d_put(v), be.d_put(q)
        scale = HD ** -0.5

        def call(i, dq=dq, dk=dk, dv=dv, ctx=ctx, scale=scale):
            return be.d_attention(dq, dk, dv, ctx, ctx - 1, scale)  # one decode row at the cache's end
        row = {"op": f"d_attention ctx {ctx}", "context_tokens": ctx, "n_heads": HQ, "n_kv_heads": HKV,
               "head_dim": HD, **chain(be, call, max(10, args.calls // 4), args.repeats)}
        kv_bytes = 2 * ctx * HKV * HD * 4
        row["kv_gbps"] = kv_bytes / (row["gpu_us"] * 1e-6) / 1e9
        row["max_err"] = err(be.d_get(be.d_attention(dq, dk, dv, ctx, ctx - 1, scale)),
                             attention_ref(q, k, v, ctx, ctx - 1, scale))
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--calls", type=int, default=200, help="calls per chain")
    ap.add_argument("--repeats", type=int, default=5, help="chains per op (the median is reported)")
    ap.add_argument("--pool-bytes", type=int, default=512 << 20, help="matmul weight bytes cycled (> L2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 32768])
    ap.add_argument("--matmul-tokens", type=int, nargs="+", default=[1],
                    help="rows of x per d_matmul (T > 1: prefill, the tensor-core kernels)")
    ap.add_argument("--gemv-prefill", action="store_true",
                    help="T > 1 on the GEMV kernels too (the kernels before the tensor-core ones)")
    args = ap.parse_args(argv)
    if args.gemv_prefill:
        from colibri_plan.backends.cuda import launch as mod

        mod._TC_FORMATS = frozenset()
    cls = get_backend("cuda")
    if cls.unavailable_reason():
        print(f"cuda unavailable: {cls.unavailable_reason()}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    with cls.open(args.device) as be:
        with be.dev:
            gbps = copy_gbps(be.cp)
        rows = small_ops(be, rng, args) + matmul_rows(be, rng, args, gbps) + attention_rows(be, rng, args)
        result = {"device": be.device.name, "copy_gbps": gbps, "ops": rows}
    print(f"{be.device.name}: device-to-device copy {gbps:.0f} GB/s (read + write)")
    print_op_table(rows, gpu_columns=True)
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
