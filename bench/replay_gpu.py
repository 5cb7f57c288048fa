"""GPU mode of bench/replay_llamacpp.py (``gpu-placements``): llama.cpp placements under a VRAM budget.

On a CUDA build of llama.cpp (the H200 host) the budget is the GPU's memory, not RAM: nothing limits
VRAM from outside, so each placement is sized to fit ``--vram-gb`` by llama.cpp's own projection
(``llama-fit-params --fit-print on``, per device model + context + compute MiB, no weights loaded) and its
real use is recorded from ``llama-completion``'s memory breakdown (the ``CUDA0`` row at exit). Rows:

* ``all-gpu``: llama-bench's defaults (``-ngl -1``: every layer and the output on the GPU) - over the
  budget by design, the reference;
* ``fit``: ``llama-fit-params --fit-target M`` with M = the GPU's free MiB (nvidia-smi) minus the budget
  minus llama.cpp's own CUDA context (the breakdown's ``unaccounted`` MiB of a probe run): fit counts the
  context inside its target, every other row is sized by its model + KV + compute MiB, so this is fit at
  the same bytes of llama.cpp's own accounting ("self");
* ``fit-device``: the same with M = free minus the budget (what ``--fit-target`` gives a user who sets it
  from nvidia-smi: the context inside the budget, fewer bytes for weights than every other row);
* ``export``: ``colibri-plan export --to llama.cpp`` of our plan at the same budget (``--plan``);
* ``pick``: the export of a plan solved with ``solve --target llama.cpp`` (``--pick``), with its ``-ub``;
* ``ngl-N`` and ``ngl-N/2``: the last N whole layers on the GPU, N the most that fit;
* ``n-cpu-moe-M``: every layer on the GPU but the experts of the first M, M the fewest that fit;
* ``cpu-moe``: every expert tensor on the CPU, the rest on the GPU;
* ``down-split-M``: every ``ffn_down_exps`` on the CPU and the gate/up experts of the first M layers,
  M the fewest that fit (a per-projection split).

``llama-bench -p N -n N -r 1 -o json`` per measurement (its own warm-up before each test), ``--repeats``
rounds interleaved (the start rotates); no environment overrides, llama.cpp's default threads unless
``--threads``. The JSON is the CPU replay's (kind ``replay-llamacpp``, mode ``placements``), so
``colibri-plan calibrate --engine llama.cpp`` reads it: ``budget.limit_bytes`` is the host's memory
(no RAM limit here) and ``budget.vram_*`` the VRAM budget.
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import replay_llama as ll

GPU_PREFIXES = ("CUDA", "Vulkan", "ROCm", "Metal", "SYCL")


def log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr, flush=True)


def gpu_memory_mib() -> dict | None:
    """{"free_mib", "total_mib", "name"} of GPU 0 from nvidia-smi (None: no NVIDIA GPU here)."""
    try:
        r = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=memory.free,memory.total,name",
                "--format=csv,noheader,nounits",
                "-i",
                "0",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    free, total, name = (x.strip() for x in r.stdout.strip().splitlines()[0].split(",", 2))
    return {"free_mib": int(free), "total_mib": int(total), "name": name}


def gpu_projection_mib(rows: list[dict]) -> int:
    """MiB llama.cpp projects on its GPUs (``--fit-print`` rows of GPU devices: model + context + compute)."""
    return sum(
        r["model_mib"] + r["context_mib"] + r["compute_mib"]
        for r in rows
        if r["device"].startswith(GPU_PREFIXES)
    )


def run(argv: list[str], timeout_s: float = 600.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def projection(a, gguf: Path, p: ll.Placement, ctx: int) -> tuple[int, list]:
    """(GPU MiB, rows) of llama.cpp's own projection of ``p`` (no weights are loaded)."""
    r = run(
        ll.fit_print_argv(Path(a.llama_bin), gguf, p, a.threads or 1, ctx)
        if a.threads
        else _no_threads(ll.fit_print_argv(Path(a.llama_bin), gguf, p, 1, ctx))
    )
    rows = ll.parse_fit_print(r.stdout)
    return gpu_projection_mib(rows), rows


def _no_threads(argv: list[str]) -> list[str]:
    """``argv`` without its ``-t N`` (llama.cpp's default thread count)."""
    i = argv.index("-t")
    return argv[:i] + argv[i + 2 :]


def fewest_that_fit(make, lo: int, hi: int, fits) -> int:
    """The smallest k in [lo, hi] with ``fits(make(k))`` (``fits`` monotone: true from some k on); hi when
    none is smaller."""
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(make(mid)):
            hi = mid
        else:
            lo = mid + 1
    return lo


def sized_placements(a, gguf: Path, n_layers: int, ctx: int, budget_mib: float, fit, export,
                     extra=()) -> list:
    """The placements of the module docstring, each sized by llama.cpp's projection to fit the budget."""
    cache: dict = {}

    def fits(p: ll.Placement) -> bool:
        key = tuple(p.bench_args())
        if key not in cache:
            cache[key] = projection(a, gguf, p, ctx)[0]
        return cache[key] <= budget_mib

    def ngl(k):  # k: layers NOT on the GPU (so that "fewest" is the search)
        return ll.Placement(
            f"ngl-{n_layers + 1 - k}",
            f"-ngl {n_layers + 1 - k}: the last "
            f"{n_layers + 1 - k} of {n_layers} layers + output on the GPU, whole",
            ngl=n_layers + 1 - k,
        )

    def ncm(k):
        return ll.Placement(
            f"n-cpu-moe-{k}",
            f"--n-cpu-moe {k}: every layer on the GPU but the experts of the first {k}",
            n_cpu_moe=k,
        )

    def down(k):
        gu = [rf"blk\.({'|'.join(map(str, range(k)))})\.ffn_(up|gate)_exps=CPU"] if k else []
        return ll.Placement(
            f"down-split-{k}",
            f"every ffn_down_exps and the gate/up experts of the first {k} "
            "layers on the CPU, the rest on the GPU",
            overrides=[ll.DOWN_SPLIT_PATTERN] + gu,
        )

    n_gpu = n_layers + 1 - fewest_that_fit(ngl, 0, n_layers + 1, fits)
    out = [
        ll.Placement(
            "all-gpu",
            "llama-bench's defaults: -ngl -1, every layer and the output on the GPU "
            "(over the budget: the reference)",
        )
    ]
    out += [p for p in (fit, *extra, export) if p is not None]
    out += [ngl(n_layers + 1 - n_gpu)]
    if n_gpu // 2 >= 1 and n_gpu // 2 != n_gpu:
        out += [ngl(n_layers + 1 - n_gpu // 2)]
    out += [
        ncm(fewest_that_fit(ncm, 0, n_layers, fits)),
        ll.Placement(
            "cpu-moe", "--cpu-moe: every expert tensor on the CPU, the rest on the GPU", cpu_moe=True
        ),
        down(fewest_that_fit(down, 0, n_layers, fits)),
    ]
    for p in out:
        if tuple(p.bench_args()) not in cache:
            cache[tuple(p.bench_args())] = projection(a, gguf, p, ctx)[0]
    return [(p, cache[tuple(p.bench_args())]) for p in out]


def fit_at_vram(a, gguf: Path, budget_mib: float, free_mib: int | None, ctx: int, doc: dict,
                context_mib: float = 0.0, name: str = "fit", key: str = "fit"):
    """llama-fit-params leaving ``free - budget - context_mib`` MiB free on the GPU; its placement (named
    ``name``, recorded under ``doc[key]``) or None (refused)."""
    margin = max(0, int((free_mib or 0) - budget_mib - context_mib))
    argv = [
        str(Path(a.llama_bin) / "llama-fit-params"),
        "-m",
        str(gguf),
        "-c",
        str(ctx),
        "-fitt",
        str(margin),
    ]
    argv += ["-t", str(a.threads)] if a.threads else []
    r = run(argv)
    fit = {
        "argv": argv,
        "margin_mib": margin,
        "gpu_free_mib": free_mib,
        "context_mib_subtracted": context_mib,
        "rc": r.returncode,
        "stdout": r.stdout.strip(),
        "log": [ln for ln in r.stderr.splitlines() if "fit" in ln][-12:],
    }
    doc[key] = fit
    if r.returncode != 0:
        fit["refused"] = next((ln for ln in r.stderr.splitlines() if "fit" in ln), "llama-fit-params failed")
        return None
    try:
        p = ll.parse_fit_args(r.stdout)
    except ValueError as e:
        fit["refused"] = str(e)
        return None
    fit["args"] = p.common_args() + ["-c", str(p.ctx)]
    if name != p.name:
        p = ll.Placement(name, p.what + (" (target including llama.cpp's CUDA context)" if context_mib == 0
                                         else ""), overrides=p.overrides, n_cpu_moe=p.n_cpu_moe,
                         cpu_moe=p.cpu_moe, ngl=p.ngl, ctx=p.ctx)
    return p


def context_probe_mib(a, gguf: Path, ctx: int) -> float:
    """llama.cpp's own CUDA context on the GPU, MiB: the ``unaccounted`` MiB of the GPU row of a short
    ``--cpu-moe`` run's breakdown at exit (device memory in use beyond model + KV + compute); 0 when the
    breakdown has none."""
    probe = memory(a, gguf, ll.Placement("probe", "context probe", cpu_moe=True), ctx)
    rows = (probe["completion"]["breakdown"] or {}).get("at_exit") or []
    gpu = [x for x in rows if x["name"].startswith(GPU_PREFIXES)]
    return float(max(0, sum(x.get("unaccounted_mib", 0) for x in gpu)))


def export_placement(a, doc: dict, plan: str | None = None, name: str = "export"):
    """``export --to llama.cpp`` of ``plan`` (default ``--plan``) as a placement named ``name`` (None
    without a plan); a ``--target llama.cpp`` plan's pick keeps its ``-ub``."""
    plan = plan if plan is not None else a.plan
    if not plan:
        return None
    import replay_ours as ro

    exp = ro.export_llama(a.colibri or ro.default_cli(), Path(plan))
    got = {"plan": plan, "export": exp}
    doc["ours"] = {**(doc.get("ours") or {}), **(got if name == "export" else {name: got})}
    if exp.get("verdict") == "keep --fit":  # the abstain: its placement is fit's own row
        log(f"{name}: keep --fit ({(exp.get('choice') or {}).get('why')})")
        return None
    args = str(exp.get("args") or "").split()
    ub = int(args[args.index("-ub") + 1]) if "-ub" in args[:-1] else None
    return ll.Placement(
        name,
        f"colibri-plan export --to llama.cpp of {plan} at the VRAM budget: " + str(exp.get("args")),
        overrides=list(exp.get("patterns") or []),
        ngl=exp.get("ngl"),
        ubatch=ub,
    )


def memory(a, gguf: Path, p: ll.Placement, ctx: int) -> dict:
    """One short llama-completion run: its buffers and memory breakdown (llama.cpp's own accounting)."""
    argv = ll.completion_argv(Path(a.llama_bin), gguf, p, a.threads or 1, ctx, a.ubatch)
    argv = argv if a.threads else _no_threads(argv)
    attempt = 0
    while attempt < 3:  # llama.cpp's log thread sometimes loses its last lines at exit: retry
        attempt += 1
        r = run(argv)
        bd = ll.parse_breakdown(r.stderr)
        if r.returncode != 0 or (bd["at_exit"] and ll.parse_perf(r.stderr)):
            break
    gpu = [x for x in bd["at_exit"] or [] if x["name"].startswith(GPU_PREFIXES)]
    return {
        "completion": {
            "rc": r.returncode,
            "buffers": ll.parse_buffers(r.stderr),
            "breakdown": bd,
            "perf": ll.parse_perf(r.stderr),
            "log_tail": r.stderr.strip().splitlines()[-3:] if r.returncode else [],
            "attempts": attempt,
        },
        "gpu_self_mib": sum(x.get("self_mib", 0) for x in gpu) if gpu else None,
    }


def bench_once(a, gguf: Path, p: ll.Placement) -> dict:
    """One llama-bench measurement of ``p`` (its defaults but for the placement)."""
    argv = [
        str(Path(a.llama_bin) / "llama-bench"),
        "-m",
        str(gguf),
        "-p",
        str(a.n_prompt),
        "-n",
        str(a.n_gen),
        "-r",
        "1",
        "-o",
        "json",
        *(["-t", str(a.threads)] if a.threads else []),
        *p.bench_args(),
    ]
    r = run(argv)
    out = {"argv": argv, "ok": r.returncode == 0}
    if r.returncode == 0:
        out["tests"] = ll.parse_bench(r.stdout)
    else:
        out["error_tail"] = r.stderr.strip().splitlines()[-3:]
    return out


def run_gpu_placements(a, rx) -> dict:
    """The whole replay (``rx``: bench/replay_llamacpp.py's module, for its shared helpers)."""
    import replay_models as rm

    from colibri_plan.model import load_model_spec

    gguf = Path(a.gguf)
    spec = load_model_spec(str(gguf))
    ctx = a.n_prompt + a.n_gen
    gpu = gpu_memory_mib()
    budget_mib = a.vram_gb * 1e9 / ll.MiB
    host_bytes = rx.host_total_mib() * ll.MiB
    doc: dict = {
        "kind": "replay-llamacpp",
        "mode": "placements",
        "schema_version": 1,
        "device": "gpu",
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {**rx.machine(), "gpu": gpu, "cgroup": "none (VRAM budget; RAM not limited)"},
        "llama_cpp": {"bin": a.llama_bin, "version": rx.llama_version(Path(a.llama_bin))},
        "model": {
            "gguf": str(gguf),
            "gguf_bytes": gguf.stat().st_size,
            "quant": a.quant,
            "n_layers": spec.n_layers,
            "n_experts": spec.n_experts,
            "top_k": spec.top_k,
            "source": a.source,
            "block_bits_per_weight": rm.gguf_bits_per_weight(a.quant),
        },
        "budget": {
            "vram_gb": a.vram_gb,
            "vram_limit_mib": budget_mib,
            "ram_gb": None,
            "limit_bytes": host_bytes,
            "host_total_mib": rx.host_total_mib(),
            "accounting": "llama.cpp's projection (--fit-print) to size, its breakdown "
            "(llama-completion) recorded",
        },
        "settings": {
            "threads": a.threads,
            "n_prompt": a.n_prompt,
            "n_gen": a.n_gen,
            "ubatch": a.ubatch,
            "batch": 2048,
            "context": ctx,
            "repeats": a.repeats,
            "interleaved": True,
            "environment": "as inherited, no overrides",
        },
    }
    if a.profile:
        doc["ours"] = {"profile": a.profile}
    free = gpu["free_mib"] if gpu else None
    context_mib = context_probe_mib(a, gguf, ctx)
    doc["budget"]["llama_context_mib"] = context_mib
    log(f"llama.cpp's CUDA context: {context_mib:.0f} MiB (unaccounted in its breakdown)")
    fit = fit_at_vram(a, gguf, budget_mib, free, ctx, doc, context_mib=context_mib)
    log(f"fit: {doc['fit'].get('args') or doc['fit'].get('refused')}")
    fit_dev = fit_at_vram(a, gguf, budget_mib, free, ctx, doc, name="fit-device", key="fit_device")
    log(f"fit-device: {doc['fit_device'].get('args') or doc['fit_device'].get('refused')}")
    export = export_placement(a, doc)
    pick = export_placement(a, doc, a.pick, "pick") if a.pick else None
    sized = sized_placements(a, gguf, spec.n_layers, ctx, budget_mib, fit, export, (fit_dev, pick))
    rows = {
        p.name: {**p.to_dict(), "projected_gpu_mib": mib, "within_budget": mib <= budget_mib, "runs": []}
        for p, mib in sized
    }
    placements = [p for p, _ in sized]
    for p in placements:
        log(f"memory breakdown: {p.name} (projected {rows[p.name]['projected_gpu_mib']} MiB on the GPU)")
        rows[p.name].update(memory(a, gguf, p, ctx))
    load0 = os.getloadavg()[0]
    for r in range(a.repeats):
        order = placements[r % len(placements) :] + placements[: r % len(placements)]
        for p in order:
            if rows[p.name]["runs"] and not any(x["ok"] for x in rows[p.name]["runs"]):
                continue
            res = bench_once(a, gguf, p)
            res["round"] = r
            rows[p.name]["runs"].append(res)
            log(
                f"  round {r + 1}/{a.repeats} {p.name}: "
                + (
                    " ".join(f"{t['test']} {t['avg_ts']:.1f}" for t in res["tests"])
                    if res["ok"]
                    else f"failed: {res['error_tail']}"
                )
            )
    threads = next(
        (
            t["n_threads"]
            for row in rows.values()
            for run_ in row["runs"]
            if run_["ok"]
            for t in run_["tests"]
            if t.get("n_threads")
        ),
        None,
    )
    doc["settings"]["threads"] = a.threads or threads or os.cpu_count()
    doc["settings"]["threads_from"] = "--threads" if a.threads else "llama-bench's default (its JSON)"
    for row in rows.values():
        row["decode_tok_s"] = rx.tok_s_of(row["runs"], "tg")
        row["prefill_tok_s"] = rx.tok_s_of(row["runs"], "pp")
    doc["load_average_before_after"] = [load0, os.getloadavg()[0]]
    doc["placements"] = list(rows.values())
    return doc


def report(doc: dict) -> None:
    """The printed table: decode / prefill tok/s, llama.cpp's GPU use (projected and at exit)."""
    s, b = doc["settings"], doc["budget"]
    print(
        f"\n{doc['model']['quant']} {doc['model']['gguf_bytes'] / 2**20:.0f} MiB, "
        f"VRAM budget {b['vram_gb']:g} GB "
        f"({b['vram_limit_mib']:.0f} MiB), {s['threads']} threads, pp{s['n_prompt']} / tg{s['n_gen']}, "
        f"{s['repeats']} interleaved rounds"
    )
    print(f"{'placement':16} {'decode tok/s':>24} {'prefill tok/s':>26} {'GPU MiB proj/used':>18} budget")

    def f(st):
        return f"{st['median']:.1f} [{st['min']:.1f}..{st['max']:.1f}]" if st else "-"

    for r in doc["placements"]:
        used = r.get("gpu_self_mib")
        print(
            f"{r['name']:16} {f(r['decode_tok_s']):>24} {f(r['prefill_tok_s']):>26} "
            f"{r['projected_gpu_mib']:>8}/{used if used is not None else '-':>8} "
            f"{'yes' if r['within_budget'] else 'over'}"
        )
