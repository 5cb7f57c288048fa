"""Do numpy's BLAS pool and the cpu backend's numba pool fight over the cores? Variants side by side.

The engine runs the dense trunk (attention projections, router, shared/dense MLPs, LM head) through
numpy's OpenBLAS pool and the CPU-resident experts through numba's OpenMP pool, one after the other in
the same process, while device threads drive GPU experts. Each variant below sets a different
thread environment and runs in its own fresh interpreter (the settings are read when OpenBLAS and
numba start their pools, so they cannot change inside one process). Variants run round-robin, one
process per (variant, repeat), so drift on a shared machine hits them alike; figures are medians.

Engine mode (a pack and a plan made on this machine; see docs/engine.md, "Threads on many-core hosts"):

    python3 -P bench/engine_threads.py --model PACK --plan PLAN [--tokens 16] [--repeats 3] \\
        [--variants openblas-spin,default,blas-timeout-4,blas-1thread,omp-active] [--out threads.json]

    columns: decode ms/token (median step), CPU expert ms, device ms (all devices), dense ms (all
    outside the experts), per token; the tokens of every variant must be identical.

Micro mode (no pack: one synthetic layer pattern of the default fixture geometry on the cpu backend):

    python3 -P bench/engine_threads.py --micro [--hidden 6144 --width 2048 --top-k 8 --layers 3]

    columns: dense ms and CPU expert ms per token when each half runs alone (back to back) and
    interleaved as in decode (per layer: attention GEMVs, router, experts; then the LM head).

Extra variants: ``--env 'label:KEY=VAL,KEY=VAL'`` (repeatable).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# first, before anything imports numpy: colibri_plan sets its OPENBLAS_THREAD_TIMEOUT default, which
# OpenBLAS reads only when numpy loads it (a script that imports numpy first keeps OpenBLAS's spin)
import colibri_plan  # noqa: F401

#: every variable a variant may set; each child starts with all of them removed from the environment,
#: then the variant's own values set, so a variant means the same thing whatever the caller exported
THREAD_VARS = ("OPENBLAS_THREAD_TIMEOUT", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
               "NUMBA_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_DEFAULT_NUM_THREADS")
VARIANTS = {
    "openblas-spin": {"OPENBLAS_THREAD_TIMEOUT": "28"},  # OpenBLAS's own default: 2^28 cycles of spin
    "default": {},  # what colibri_plan sets when the user sets nothing (OPENBLAS_THREAD_TIMEOUT=4)
    "blas-timeout-4": {"OPENBLAS_THREAD_TIMEOUT": "4"},  # the smallest: BLAS workers sleep at once
    "blas-1thread": {"OPENBLAS_NUM_THREADS": "1"},
    "omp-active": {"OMP_WAIT_POLICY": "active"},
}
DEFAULT_VARIANTS = "openblas-spin,default,blas-timeout-4,blas-1thread,omp-active"


def _engine_child(args) -> dict:
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.runner import generate
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.run_options import RunOptions

    plan = load_plan(args.plan)
    with open_pack(args.model) as pack:
        rep = generate(pack, [1, 2, 3, 4], RunOptions(tokens=args.tokens + 1, backend="cpu", read_threads=8),
                       plan=plan)
    comp = rep.expert_compute_s_per_token
    return {"decode_ms": rep.decode_s_median * 1e3, "cpu_expert_ms": comp.get("cpu", 0.0) * 1e3,
            "device_ms": sum(v for k, v in comp.items() if k != "cpu") * 1e3,
            "dense_ms": rep.dense_s_per_token * 1e3, "tokens": rep.tokens}


def _micro_child(args) -> dict:
    import numpy as np

    from colibri_plan.backends import get_backend
    from colibri_plan.quant import quantize

    H, I, K, L, d = args.hidden, args.width, args.top_k, args.layers, 64
    rng = np.random.default_rng(0)
    f32 = np.float32

    def mat(o, i):
        return rng.standard_normal((o, i), dtype=f32) / f32(np.sqrt(i))

    trunk = [[mat(4 * d, H), mat(2 * d, H), mat(2 * d, H), mat(H, 4 * d), mat(64, H)] for _ in range(L)]
    lm_head = mat(4096, H)
    cpu = get_backend("cpu").open(0)
    experts = [cpu.upload_expert(quantize(mat(I, H), "int4"), quantize(mat(I, H), "int4"),
                                 quantize(mat(H, I), "int4")) for _ in range(K)]
    x = rng.standard_normal((1, H), dtype=f32)

    def dense(layer):  # q, k, v, o and router GEMVs of one layer: [1, H] · [N, H]ᵀ
        q, k, v, o, r = trunk[layer]
        a = x @ q.T
        x @ k.T, x @ v.T, x @ r.T
        return a @ o.T

    def moe():
        return cpu.expert_ffn([x] * K, experts)

    def token(which: str) -> tuple[float, float]:
        td = te = 0.0
        for layer in range(L):
            if which != "moe":
                t0 = time.perf_counter()
                dense(layer)
                td += time.perf_counter() - t0
            if which != "dense":
                t0 = time.perf_counter()
                moe()
                te += time.perf_counter() - t0
        if which != "moe":
            t0 = time.perf_counter()
            x @ lm_head.T
            td += time.perf_counter() - t0
        return td, te

    out, ref = {}, [y.copy() for y in moe()]
    for which in ("both", "dense", "moe", "both"):  # one warm-up pass, then the three timed ones
        time.sleep(0.5)  # let the other pool's spinning threads (if any) go to sleep: "alone" is alone
        runs = [token(which) for _ in range(args.tokens)]
        if which != "moe":
            out[f"dense_{which}_ms"] = statistics.median(r[0] for r in runs) * 1e3
        if which != "dense":
            out[f"cpu_expert_{which}_ms"] = statistics.median(r[1] for r in runs) * 1e3
    out["bit_identical"] = all(np.array_equal(a, b) for a, b in zip(ref, moe()))
    return out


ENGINE_COLS = ("decode_ms", "cpu_expert_ms", "device_ms", "dense_ms")
MICRO_COLS = ("dense_dense_ms", "dense_both_ms", "cpu_expert_moe_ms", "cpu_expert_both_ms")


def _parse_env(spec: str) -> tuple[str, dict]:
    label, _, rest = spec.partition(":")
    env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    bad = [k for k in env if k not in THREAD_VARS]
    if not label or bad:
        raise SystemExit(f"--env {spec!r}: want 'label:KEY=VAL,...' with keys among {THREAD_VARS}")
    return label, env


def blas_timeout_read() -> int | None:
    """OPENBLAS_THREAD_TIMEOUT as the loaded OpenBLAS parsed it (0 = unset: its 2^28-cycle default);
    None when no OpenBLAS exporting ``openblas_thread_timeout`` is loaded (or not on Linux)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            libs = [ln.split()[-1] for ln in f if "openblas" in ln.lower() and ".so" in ln]
        lib = ctypes.CDLL(libs[0])
        lib.openblas_thread_timeout.restype = ctypes.c_uint
        return int(lib.openblas_thread_timeout())
    except (OSError, IndexError, AttributeError):
        return None


def _run_child(argv: list[str], variant_env: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(variant_env)
    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--child", *argv]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"child failed ({' '.join(f'{k}={v}' for k, v in variant_env.items())}):\n"
                         f"{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--plan")
    ap.add_argument("--micro", action="store_true", help="synthetic layer pattern, no pack needed")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per variant")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"among {', '.join(VARIANTS)}")
    ap.add_argument("--env", action="append", default=[], help="extra variant 'label:KEY=VAL,KEY=VAL'")
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--out", help="write the results here (JSON)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.micro and not (args.model and args.plan):
        ap.error("give --model and --plan, or --micro")
    if args.child:
        res = _micro_child(args) if args.micro else _engine_child(args)
        res["blas_timeout_read"] = blas_timeout_read()
        print(json.dumps(res))
        return
    variants = {}
    for name in filter(None, args.variants.split(",")):
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)} (or --env)")
        variants[name] = VARIANTS[name]
    variants.update(_parse_env(s) for s in args.env)
    argv = [a for a in sys.argv[1:] if a != "--child"]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for name, env in variants.items():
            print(f"[{r + 1}/{args.repeats}] {name}", file=sys.stderr, flush=True)
            runs[name].append(_run_child(argv, env))
    cols = MICRO_COLS if args.micro else ENGINE_COLS
    rows = []
    for name, rs in runs.items():
        row = {"variant": name, "env": variants[name], "repeats": len(rs)}
        row.update({c: statistics.median(x[c] for x in rs) for c in cols})
        row["blas_timeout_read"] = sorted({x["blas_timeout_read"] for x in rs}, key=str)
        if "tokens" in rs[0]:
            row["tokens"] = rs[0]["tokens"]
            row["tokens_agree_across_repeats"] = all(x["tokens"] == rs[0]["tokens"] for x in rs)
        else:
            row["bit_identical"] = all(x["bit_identical"] for x in rs)
        rows.append(row)
    same = len({json.dumps(r.get("tokens")) for r in rows}) == 1
    print(f"{'variant':16s}" + "".join(f"{c:>20s}" for c in cols) + "  OpenBLAS-read  env")
    for row in rows:
        print(f"{row['variant']:16s}" + "".join(f"{row[c]:20.2f}" for c in cols)
              + f"  {str(row['blas_timeout_read']):13s}  {row['env']}")
    if not args.micro:
        print(f"tokens identical across variants: {same}")
    doc = {"mode": "micro" if args.micro else "engine", "cpu_count": os.cpu_count(), "args": vars(args),
           "rows": rows, "tokens_identical": same if not args.micro else None}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
