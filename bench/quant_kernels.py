"""Quantized-kernel throughput per backend, device, format and shape, with its yardsticks.

Measures, in one run:
- per backend/device/format/shape/tokens: seconds per ``matmul`` and per batched ``expert_ffn`` call,
  effective weight GB/s (packed weight bytes read / s) and GFLOP/s (2·T·out·in / s);
- RAM read bandwidth with all cores (numba parallel sum over ``--ram-bytes``, else numpy in threads),
  before and after the kernels, and the ratio fastest CPU-device int4 GEMV GB/s / RAM GB/s;
- on CUDA devices the device-to-device copy bandwidth (CuPy, read + write bytes per second) and the
  ratio CUDA int4 batched expert FFN GB/s / copy GB/s; the Vulkan / CUDA ratio on that op.

Weights are cycled through a pool larger than the last-level cache (``--pool-bytes``), so GB/s is what
streams from memory, not from cache. Each figure is the median of ``--repeats`` passes over the pool.
The machine may be shared: compare figures of one run only.

    .venv/bin/python bench/quant_kernels.py --backends numpy,cpu,opencl --out /tmp/kernels.json
    .venv/bin/python bench/quant_kernels.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

import numpy as np

from colibri_plan import quant
from colibri_plan.backends import BACKEND_NAMES, get_backend
from colibri_plan.errors import ColibriError
from colibri_plan.fileio import atomic_write_text

H, I = 6144, 2048  # GLM-5.2 hidden size and routed expert width (colibri_plan/data/models.json)
SHAPES = {"gate/up 2048x6144": (I, H), "down 6144x2048": (H, I)}  # (out, in)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class RamProbe:
    """RAM read GB/s with all cores over one ``nbytes`` array: numba parallel sum (the cpu backend's
    compiler), else numpy ``add.reduce`` in one thread per core (it releases the GIL)."""

    def __init__(self, nbytes: int):
        n = max(1, nbytes // 4 // 256) * 256
        self.a = np.ones(n, np.float32).reshape(256, -1)  # every page touched before timing
        try:
            from colibri_plan.backends.cpu.kernels import read_sum

            self.method = "numba parallel sum (float32)"
            self._fn = lambda: read_sum(self.a)
        except Exception:  # noqa: BLE001 - numba missing: fall back
            parts = np.array_split(self.a, os.cpu_count() or 1)
            self.method = f"numpy add.reduce in {len(parts)} threads"

            def fn():
                ts = [threading.Thread(target=np.add.reduce, args=(p, None)) for p in parts]
                [t.start() for t in ts]
                [t.join() for t in ts]

            self._fn = fn
        self._fn()
        self.samples: list[float] = []

    def sample(self) -> float:
        """One timed pass; returns (and records) GB/s."""
        t0 = time.perf_counter()
        self._fn()
        self.samples.append(self.a.nbytes / (time.perf_counter() - t0) / 1e9)
        return self.samples[-1]

    def report(self) -> dict:
        return {"method": self.method, "bytes": int(self.a.nbytes), "samples_gbps": self.samples,
                "gbps": float(np.median(self.samples))}


def cuda_copy_gbps(nbytes: int, repeats: int) -> dict | None:
    """Device-to-device copy bandwidth on CUDA device 0, (read + write) bytes / s; None without CuPy."""
    try:
        import cupy as cp

        if not cp.cuda.is_available():
            return None
        a = cp.ones(nbytes // 4, cp.float32)
        b = cp.empty_like(a)
        b[...] = a
        cp.cuda.Device().synchronize()
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(10):
                b[...] = a
            cp.cuda.Device().synchronize()
            rates.append(10 * 2 * a.nbytes / (time.perf_counter() - t0) / 1e9)
        return {"method": "cupy copy, (read+write) bytes", "bytes": int(a.nbytes),
                "gbps": float(np.median(rates)), "samples_gbps": rates}
    except Exception as exc:  # noqa: BLE001 - report, do not crash
        log(f"cuda copy bandwidth not measured: {exc}")
        return None


def weight_pool(fmt: str, out_f: int, in_f: int, pool_bytes: int, rng) -> list[quant.QuantTensor]:
    """Distinct copies (separate memory) of one random quantized weight, ~pool_bytes in all."""
    w = rng.standard_normal((out_f, in_f), dtype=np.float32) / np.float32(math.sqrt(in_f))  # y ~ N(0, 1)
    qt = quant.quantize(w, fmt)
    n = max(2, math.ceil(pool_bytes / qt.nbytes))
    return [qt] + [quant.QuantTensor(fmt, out_f, in_f, qt.data.copy(),
                                     None if qt.scales is None else qt.scales.copy()) for _ in range(n - 1)]


def time_passes(be, fn, n_calls: int, repeats: int, probe: RamProbe | None = None) -> tuple[list, list]:
    """Seconds per call: ``fn(i)`` for i in range(n_calls), one warm-up pass, then ``repeats`` passes.
    With ``probe``, a RAM read sample is taken right before each pass (paired figures on a shared
    machine). Returns (seconds per call per pass, RAM GB/s per pass or [])."""
    for i in range(min(n_calls, 2)):
        fn(i)
    be.synchronize()
    out, ram = [], []
    for _ in range(repeats):
        if probe is not None:
            ram.append(probe.sample())
        t0 = time.perf_counter()
        for i in range(n_calls):
            fn(i)
        be.synchronize()
        out.append((time.perf_counter() - t0) / n_calls)
    return out, ram


def bench_device(be, args, rng, probe: RamProbe) -> list[dict]:
    rows = []
    dev = be.device
    base = {"backend": be.name, "device_index": dev.index, "device_name": dev.name, "device_kind": dev.kind}
    for fmt in args.formats:
        if fmt not in be.formats:
            log(f"  {be.name}: {fmt} unsupported, skipped")
            continue
        # matmul at both GLM-5.2 expert shapes
        for label, (o, i) in SHAPES.items():
            ws = [be.upload(q) for q in weight_pool(fmt, o, i, args.pool_bytes, rng)]
            for T in args.tokens:
                x = rng.standard_normal((T, i), dtype=np.float32)
                paired = probe if (dev.kind == "cpu" and T == 1) else None  # the acceptance figure
                s, ram = time_passes(be, lambda k, x=x, ws=ws: be.matmul(x, ws[k]), len(ws),
                                     args.repeats, paired)
                med = float(np.median(s))
                rows.append({**base, "op": "matmul", "fmt": fmt, "shape": label, "out_features": o,
                             "in_features": i, "tokens": T, "seconds": med, "samples_s": s,
                             "weight_gbps": ws[0].nbytes / med / 1e9,
                             "gflops": 2 * T * o * i / med / 1e9})
                if ram:
                    ratios = [ws[0].nbytes / t / 1e9 / r for t, r in zip(s, ram)]
                    rows[-1].update(ram_gbps_paired=ram, ratio_to_ram_paired=float(np.median(ratios)))
                log(f"  {be.name}:{dev.index} matmul {fmt} {label} T={T}: "
                    f"{rows[-1]['weight_gbps']:.2f} GB/s")
            for w in ws:
                be.free(w)
        # batched expert FFN: args.experts experts per call, cycling through a pool of experts
        gate, up, down = (weight_pool(fmt, o, i, args.pool_bytes // 3, rng)
                          for o, i in ((I, H), (I, H), (H, I)))
        n = min(len(gate), len(up), len(down))
        experts = [be.upload_expert(gate[k], up[k], down[k]) for k in range(n)]
        ebytes = sum(w.nbytes for w in experts[0])
        batch = min(args.experts, n)
        for T in args.tokens:
            xs = [rng.standard_normal((T, H), dtype=np.float32) for _ in range(batch)]

            def call(k, xs=xs, experts=experts, batch=batch, n=n):
                be.expert_ffn(xs, [experts[(k * batch + j) % n] for j in range(batch)])

            calls = max(1, n // batch)
            s, _ = time_passes(be, call, calls, args.repeats)
            med = float(np.median(s))
            rows.append({**base, "op": "expert_ffn", "fmt": fmt, "shape": f"{batch} experts H={H} I={I}",
                         "out_features": H, "in_features": I, "tokens": T, "experts": batch,
                         "seconds": med, "samples_s": s, "weight_gbps": batch * ebytes / med / 1e9,
                         "gflops": batch * 2 * T * 3 * H * I / med / 1e9})
            log(f"  {be.name}:{dev.index} expert_ffn {fmt} x{batch} T={T}: "
                f"{rows[-1]['weight_gbps']:.2f} GB/s")
        for e in experts:
            for w in e:
                be.free(w)
    return rows


def best(rows, **match) -> dict | None:
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return max(hits, key=lambda r: r["weight_gbps"]) if hits else None


def summarise(rows: list[dict], ram: dict, copy: dict | None) -> dict:
    out = {"ram_read_gbps": ram["gbps"]}
    for label in SHAPES:
        cpu_rows = [r for r in rows if r["device_kind"] == "cpu"]
        b = best(cpu_rows, op="matmul", fmt="int4", shape=label, tokens=1)
        if b:
            out[f"cpu_int4_gemv {label}"] = {"backend": b["backend"], "weight_gbps": b["weight_gbps"],
                                             "ratio_to_ram": b["weight_gbps"] / ram["gbps"],
                                             "ratio_to_ram_paired": b.get("ratio_to_ram_paired")}
    for T in sorted({r["tokens"] for r in rows}):
        ffn = {k: best(rows, backend=k, op="expert_ffn", fmt="int4", device_kind="gpu", tokens=T)
               for k in ("cuda", "vulkan")}
        if copy and ffn["cuda"]:
            out[f"cuda_ffn_int4_T{T}_over_d2d_copy"] = ffn["cuda"]["weight_gbps"] / copy["gbps"]
        if ffn["cuda"] and ffn["vulkan"]:
            out[f"vulkan_over_cuda_ffn_int4_T{T}"] = ffn["vulkan"]["weight_gbps"] / ffn["cuda"]["weight_gbps"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKEND_NAMES), help="comma list (default: all)")
    p.add_argument("--formats", default="int4,int4-g64", help="comma list of quant formats")
    p.add_argument("--tokens", default="1,16", help="comma list of token counts")
    p.add_argument("--experts", type=int, default=8, help="experts per expert_ffn call (top-k)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--pool-bytes", type=int, default=512 << 20, help="weights cycled per shape")
    p.add_argument("--ram-bytes", type=int, default=1 << 30)
    p.add_argument("--emulated", action="store_true",
                   help="also time Vulkan devices that are CPU emulations (lavapipe: slow)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller pools (CI smoke run)")
    p.add_argument("--out", help="write the JSON results here")
    args = p.parse_args(argv)
    args.formats = [quant.check_format(f) for f in args.formats.split(",") if f]
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    if args.quick:
        args.repeats, args.pool_bytes, args.ram_bytes = 3, min(args.pool_bytes, 64 << 20), 256 << 20
    rng = np.random.default_rng(0)

    log("RAM read bandwidth ...")
    probe = RamProbe(args.ram_bytes)
    for _ in range(args.repeats):
        probe.sample()
    copy = cuda_copy_gbps(1 << 30, args.repeats) if "cuda" in args.backends.split(",") else None
    rows, skipped = [], []
    for name in args.backends.split(","):
        try:
            cls = get_backend(name)
            reason = cls.unavailable_reason()
        except (ColibriError, ImportError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if reason:
            skipped.append({"backend": name, "reason": reason})
            log(f"{name}: skipped ({reason})")
            continue
        for dev in cls.list_devices():
            if dev.kind == "cpu" and name == "vulkan" and not args.emulated:
                skipped.append({"backend": name, "device": dev.name, "reason": "CPU emulation (--emulated)"})
                continue
            log(f"{name}:{dev.index} {dev.name}")
            try:
                with cls.open(dev.index) as be:
                    rows += bench_device(be, args, rng, probe)
            except ColibriError as exc:
                skipped.append({"backend": name, "device": dev.name, "reason": str(exc)})
                log(f"{name}:{dev.index}: {exc}")
    for _ in range(args.repeats):
        probe.sample()
    ram = probe.report()  # samples before, between (paired) and after the kernels
    summary = summarise(rows, ram, copy)

    hdr = (f"{'backend':8} {'dev':4} {'op':10} {'fmt':9} {'shape':24} {'T':>3} {'ms':>9} {'GB/s':>8} "
           f"{'GFLOP/s':>8}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['backend']:8} {r['device_index']:<4} {r['op']:10} {r['fmt']:9} {r['shape']:24} "
              f"{r['tokens']:>3} {r['seconds'] * 1e3:9.3f} {r['weight_gbps']:8.2f} {r['gflops']:8.1f}")
    print(f"\nRAM read: {ram['gbps']:.1f} GB/s ({ram['method']}, median of {len(ram['samples_gbps'])})")
    if copy:
        print(f"CUDA device-to-device copy: {copy['gbps']:.0f} GB/s ({copy['method']})")
    for k, v in summary.items():
        if isinstance(v, dict):
            paired = v["ratio_to_ram_paired"]
            print(f"{k}: {v['backend']} {v['weight_gbps']:.2f} GB/s = {v['ratio_to_ram']:.0%} of RAM read"
                  + ("" if paired is None else f" (paired with RAM samples: {paired:.0%})"))
        elif k != "ram_read_gbps":
            print(f"{k}: {v:.2f}")
    for s in skipped:
        print(f"skipped {s['backend']} {s.get('device', '')}: {s['reason']}")
    if args.out:
        doc = {"kind": "kernel-bench", "args": {k: v for k, v in vars(args).items()},
               "ram": ram, "cuda_copy": copy, "rows": rows, "summary": summary, "skipped": skipped}
        atomic_write_text(args.out, json.dumps(doc, indent=1) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
