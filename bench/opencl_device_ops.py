"""OpenCL device-activation ops (``d_*``, backends/opencl.py): host overhead per op, wall time per op in a
chain, matmul weight bandwidth and attention KV bandwidth, each checked once against numpy.

Each op is issued ``--calls`` times back to back with its inputs already on the device, as decode chains
them. Per op: ``host_us`` (host time to enqueue one call: Python, checks, allocation, launch; nothing
waits) and ``wall_us`` (per call, the chain up to its final ``finish``: the device time when the device
is the slower side, i.e. when ``wall_us`` clearly exceeds ``host_us``). ``d_matmul`` cycles through
copies of its weight larger than the GPU's L2 cache; ``weight_gbps`` = weight bytes / wall time.
``d_attention`` is one decode query row (32 query heads, 8 kv heads, head_dim 128) at several contexts;
``kv_gbps`` = K + V bytes / wall time. ``roundtrip`` is a ``d_get`` then a ``d_put`` of [1, 4096].
``d_expert_ffn`` is one decode token's routed experts (``--experts`` int8 experts of [H, I]) on the
device x, against the contract's host path (``DeviceOps._d_expert_ffn``: x down, ``expert_ffn``, the sum
up) on the same inputs; ``d_matmul_many`` is q/k/v-like weights against three ``d_matmul`` calls.
``max_err`` = max |y - ref| / max |ref|. Prints a table; ``--out`` writes JSON; ``--sections`` picks
the rows (``ops``: the small ops, matmul, attention; ``experts``: d_expert_ffn and d_matmul_many).

    python bench/opencl_device_ops.py --device 0 --out /tmp/opencl_device_ops.json
    python bench/opencl_device_ops.py --sections experts --calls 20 --repeats 3   # PoCL: a few minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.device_ops import DArray, DeviceOps, attention_ref, rope_table
from colibri_plan.fileio import atomic_write_text

H, HQ, HKV, HD = 4096, 32, 8, 128


def chain(be, call, calls: int, repeats: int) -> dict:
    """Median host and wall microseconds per call of ``call(i)`` issued ``calls`` times back to back."""
    for i in range(3):  # compile, allocate, warm the pool
        call(i)
    be.synchronize()
    host, wall = [], []
    for _ in range(repeats):
        keep = []  # results alive to the end, as a layer's activations are
        t0 = time.perf_counter()
        for i in range(calls):
            keep.append(call(i))
        t1 = time.perf_counter()
        be.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return {"host_us": float(np.median(host)), "wall_us": float(np.median(wall)), "calls": calls,
            "repetitions": repeats}


def err(y, ref) -> float:
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(np.asarray(y, np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


def expert_rows(be, args, rng) -> list[dict]:
    """d_expert_ffn on the device against the contract's host path, and d_matmul_many against d_matmul."""
    n, hid, wid = args.experts, args.expert_hidden, args.expert_width
    qts = [tuple(quant.quantize(rng.standard_normal(s, dtype=np.float32) / 64, "int8")
                 for s in ((wid, hid), (wid, hid), (hid, wid))) for _ in range(n)]
    ws = [be.upload_expert(*q) for q in qts]
    x, gates = rng.standard_normal((1, hid), dtype=np.float32), np.full(n, 1.0 / n, np.float32)
    dx = be.d_put(x)
    ref = np.zeros((1, hid))
    for (g, u, d), gate in zip(qts, gates):
        hh = quant.matmul_ref(x, g) * (quant.matmul_ref(x, u) / (1 + np.exp(-quant.matmul_ref(x, g))))
        ref += float(gate) * quant.matmul_ref(hh.astype(np.float32), d)
    rows = []
    name = f"d_expert_ffn {n}x[{hid},{wid}] int8"
    for label, call in (("device", lambda i: be.d_expert_ffn(dx, ws, gates)),
                        ("host path", lambda i: DArray(dx.shape, DeviceOps._d_expert_ffn(be, dx, ws, gates),
                                                       id(be)))):
        row = {"op": f"{name} {label}", **chain(be, call, args.calls, args.repeats)}
        row["max_err"] = err(be.d_get(call(0)), ref)
        rows.append(row)
    qq = [quant.quantize(rng.standard_normal((o, hid), dtype=np.float32) / 64, "int8")
          for o in (hid, hid // 4, hid // 4)]
    qkv = [be.upload(q) for q in qq]
    many = {"op": f"d_matmul_many [1,{hid}] q/k/v int8",
            **chain(be, lambda i: be.d_matmul_many(dx, qkv), args.calls, args.repeats)}
    many["max_err"] = max(err(be.d_get(y), quant.matmul_ref(x, q))
                          for y, q in zip(be.d_matmul_many(dx, qkv), qq))
    rows.append(many)
    rows.append({"op": f"3 x d_matmul [1,{hid}] q/k/v int8",
                 **chain(be, lambda i: [be.d_matmul(dx, w) for w in qkv], args.calls, args.repeats)})
    return rows


def run(be, args) -> list[dict]:
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s, dtype=np.float32) for s in ((1, H), (H,), (1, H)))
    dx, dw, db = be.d_put(x), be.d_put(w), be.d_put(b)
    dt = be.d_put(rope_table(1.0 / (10000.0 ** (np.arange(0, HD, 2) / HD)), 4096))
    x64 = x.astype(np.float64)
    rows = []
    for name, call, ref in (
            ("d_add [1,4096]", lambda i: be.d_add(dx, db), x64 + b),
            ("d_add [1,4096]+[4096]", lambda i: be.d_add(dx, dw), x64 + w),
            ("d_rmsnorm [1,4096]", lambda i: be.d_rmsnorm(dx, dw, 1e-6),
             x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-6) * w),
            ("d_silu_mul [1,4096]", lambda i: be.d_silu_mul(dx, db), x64 / (1 + np.exp(-x64)) * b),
            ("d_scale_rows [1,4096]", lambda i: be.d_scale_rows(dx, np.float32([0.5])), x64 * 0.5),
            ("d_rope [1,32,128]", lambda i: be.d_rope(be.d_view(dx, (1, HQ, HD)), dt, i % 4000, HD, False),
             None)):
        row = {"op": name, **chain(be, call, args.calls, args.repeats)}
        if ref is not None:
            row["max_err"] = err(be.d_get(call(0)), ref)
        rows.append(row)
    kc, src = be.d_zeros((64, HKV, HD)), be.d_put(x[:, :HKV * HD].reshape(1, HKV, HD))
    rows.append({"op": "d_write_rows [1,8,128]",
                 **chain(be, lambda i: be.d_write_rows(kc, i % 64, src), args.calls, args.repeats)})
    t = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        be.d_put(be.d_get(dx))
        t.append((time.perf_counter() - t0) * 1e6)
    rows.append({"op": "roundtrip d_get+d_put [1,4096]", "host_us": float(np.median(t)),
                 "wall_us": float(np.median(t)), "roundtrip_bytes": 8 * H})
    for fmt, out, in_ in (("int8", 4096, 4096), ("int4", 4096, 4096), ("int8", 14336, 4096)):
        qt = quant.quantize(rng.standard_normal((out, in_), dtype=np.float32) / 64, fmt)
        ws = [be.upload(qt) for _ in range(max(2, -(-args.pool_bytes // qt.nbytes)))]
        xm = rng.standard_normal((1, in_), dtype=np.float32)
        dm = be.d_put(xm)
        row = {"op": f"d_matmul [1,{in_}]x[{in_},{out}] {fmt}", "weight_bytes": ws[0].nbytes,
               **chain(be, lambda i, dm=dm, ws=ws: be.d_matmul(dm, ws[i % len(ws)]), args.calls,
                       args.repeats)}
        row["weight_gbps"] = ws[0].nbytes / (row["wall_us"] * 1e-6) / 1e9
        row["max_err"] = err(be.d_get(be.d_matmul(dm, ws[0])), quant.matmul_ref(xm, qt))
        rows.append(row)
        for wt in ws:
            be.free(wt)
    for ctx in args.contexts:
        k, v = (rng.standard_normal((ctx, HKV, HD), dtype=np.float32) for _ in range(2))
        q = rng.standard_normal((1, HQ, HD), dtype=np.float32)
        dk, dv, dq = be.d_put(k), be.d_put(v), be.d_put(q)

        def call(i, dq=dq, dk=dk, dv=dv, ctx=ctx):
            return be.d_attention(dq, dk, dv, ctx, ctx - 1, HD ** -0.5)  # one decode row at the cache's end
        row = {"op": f"d_attention ctx {ctx}", "context_tokens": ctx,
               **chain(be, call, max(10, args.calls // 4), args.repeats)}
        row["kv_gbps"] = 2 * ctx * HKV * HD * 4 / (row["wall_us"] * 1e-6) / 1e9
        row["max_err"] = err(be.d_get(call(0)), attention_ref(q, k, v, ctx, ctx - 1, HD ** -0.5))
        rows.append(row)
    return rows


def print_op_table(rows: list[dict], gpu_columns: bool = False) -> None:
    """Print the op rows of the ``*_device_ops.py`` benches as a table on stdout.

    ``rows``: dicts with ``op`` (str), ``host_us`` and ``wall_us`` (float, microseconds per call) and,
    where measured, ``weight_gbps`` or ``kv_gbps`` (GB/s), ``max_err`` (relative). ``gpu_columns`` adds
    the CUDA bench's ``gpu_us`` (NaN where absent) and ``copy_fraction`` (of the device copy rate) columns.
    """
    gpu_head, copy_head = (f" {'gpu us':>8}", f" {'of copy':>7}") if gpu_columns else ("", "")
    print(f"{'op':<38} {'host us':>8}{gpu_head} {'wall us':>8} {'GB/s':>7}{copy_head} {'max err':>9}")
    for r in rows:
        bw = r.get("weight_gbps", r.get("kv_gbps"))
        gpu = f" {r.get('gpu_us', float('nan')):>8.1f}" if gpu_columns else ""
        frac = "" if 'copy_fraction' not in r else format(r['copy_fraction'], '.2f')
        copy = f" {frac:>7}" if gpu_columns else ""
        print(f"{r['op']:<38} {r['host_us']:>8.1f}{gpu} {r['wall_us']:>8.1f} "
              f"{'' if bw is None else f'{bw:.0f}':>7}{copy} "
              f"{'' if 'max_err' not in r else format(r['max_err'], '.1e'):>9}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--device", type=int, default=0, help="OpenCL device index (colibri-plan backends)")
    ap.add_argument("--calls", type=int, default=200, help="calls per chain")
    ap.add_argument("--repeats", type=int, default=5, help="chains per op (the median is reported)")
    ap.add_argument("--pool-bytes", type=int, default=512 << 20, help="matmul weight bytes cycled (> L2)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 32768])
    ap.add_argument("--sections", nargs="+", choices=("ops", "experts"), default=["ops", "experts"])
    ap.add_argument("--experts", type=int, default=8, help="routed experts per d_expert_ffn call")
    ap.add_argument("--expert-hidden", type=int, default=4096, help="H of the experts (and of q/k/v)")
    ap.add_argument("--expert-width", type=int, default=1024, help="I of the experts")
    args = ap.parse_args(argv)
    cls = get_backend("opencl")
    if cls.unavailable_reason():
        print(f"opencl unavailable: {cls.unavailable_reason()}", file=sys.stderr)
        return 2
    with cls.open(args.device) as be:
        rows = run(be, args) if "ops" in args.sections else []
        if "experts" in args.sections:
            rows += expert_rows(be, args, np.random.default_rng(1))
        result = {"device": be.device.name, "kind": be.device.kind, "driver": be.device.driver, "ops": rows}
    print(f"{result['device']} ({result['driver']})")
    print_op_table(rows)
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
