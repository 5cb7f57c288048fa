"""Replay placements in llama.cpp itself under a memory limit, and race it where the model exceeds RAM.

Not CI: needs llama.cpp's tools built from the llama-cpp-python sdist (``--llama-bin``, docs/replay.md),
root and the cgroup v1 memory controller; the models are built with transformers/torch in this venv.

``placements`` (issue 27, Build 1): for a GGUF (``--gguf``, or the random Qwen3-MoE of
bench/peer_llamacpp.py at ``--quant`` Q8_0/Q4_0 made with llama.cpp's converter and quantizer), a RAM
budget (``--ram-gb``) and ``--threads``: ``llama-fit-params`` at the budget, ``colibri-plan solve --ram``
on our pack of the same checkpoint and its ``export --to llama.cpp``, then ``llama-bench`` of llama.cpp's
defaults, fit's arguments, the export's ``-ot`` patterns, ``--cpu-moe``, ``--n-cpu-moe N``, a
down/gate-up split and ``--load-mode none`` (its ``--no-mmap``), ``--repeats`` rounds interleaved, each
run in a fresh memory cgroup of the budget with the GGUF evicted from the page cache first; per placement
one ``llama-completion`` run for llama.cpp's own memory breakdown and ``--fit-print`` for its projection.

``gpu-placements`` (Build 1 on the H200; bench/replay_gpu.py): the same on a CUDA build under a VRAM
budget (``--vram-gb``): fit's arguments, our ``--plan``'s export, ``-ngl N`` variants, ``--n-cpu-moe N``,
``--cpu-moe`` and a down-exps split, each sized by llama.cpp's own projection to fit the budget.

``beyond-ram`` (Build 4; bench/replay_beyond.py): a GLM-4.5-style checkpoint with skewed routing several
GB larger than ``--ram-gb``: our engine on ``solve --ram`` (O_DIRECT, pinned hot experts, LRU), colibrì's
hot-first fill on our engine, llama.cpp at its defaults (mmap) and with ``--load-mode none``, all under
the same limit; token-exactness by ``colibri-plan verify``, predictions beside the measurements.

``reprice FILE`` re-prices a stored beyond-ram result with the current planner (no llama.cpp run) and
``fault-probe`` measures the page faults of a mapped file it needs (bench/replay_reprice.py).

    flock /tmp/colibri-cpu.lock .venv/bin/python bench/replay_llamacpp.py placements \\
        --llama-bin /work/llama-build/build/bin --quant Q8_0 --ram-gb 4 --out bench/results/replay-q8-4gb.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import replay_cgroup as cg  # noqa: E402
import replay_llama as ll  # noqa: E402

GB = 1_000_000_000


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- arguments ---------------------------------------------------------------------------------------
def _positive_gb(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"expected a memory budget in GB (> 0), got {text!r}")
    return v


def _count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0 or v > 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return v


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    for name in ("placements", "beyond-ram"):
        p = sub.add_parser(name)
        p.add_argument("--llama-bin", required=True, help="folder holding llama-bench, llama-fit-params, "
                       "llama-completion (llama-quantize too unless --gguf)")
        p.add_argument("--llama-src", default=None, help="llama.cpp source tree (converter); default: the "
                       "llama-cpp-python sdist's, fetched into --work")
        p.add_argument("--work", default="/work/replay-work", help="cache folder (checkpoints, GGUFs, packs)")
        p.add_argument("--ram-gb", type=_positive_gb, required=True, help="the memory budget (GB = 1e9 B): "
                       "the cgroup limit, fit's target and solve --ram")
        p.add_argument("--threads", type=_count, default=2)
        p.add_argument("--repeats", type=_count, default=3, help="interleaved rounds per row")
        p.add_argument("--profile", default=None, help="our profile (default: profile this machine once)")
        p.add_argument("--colibri", default=None, help="colibri-plan command (default: this venv's)")
        p.add_argument("--ubatch", type=_count, default=512, help="llama.cpp's -ub (its default)")
        p.add_argument("--out", required=True, help="result JSON")
    pl = sub.choices["placements"]
    pl.add_argument("--quant", choices=("Q8_0", "Q4_0"), default="Q8_0")
    pl.add_argument("--gguf", default=None, help="a GGUF to replay instead of the random Qwen3-MoE")
    pl.add_argument("--pack", default=None, help="our pack of --gguf's checkpoint (for the export row)")
    pl.add_argument("--n-prompt", type=_count, default=512)
    pl.add_argument("--n-gen", type=_count, default=64)
    pl.add_argument("--n-cpu-moe", type=_count, default=None,
                    help="N of the --n-cpu-moe row (default: half the layers)")
    gp = sub.add_parser("gpu-placements",
                        help="placements under a VRAM budget on a GPU build (bench/replay_gpu.py)")
    gp.add_argument("--llama-bin", required=True, help="folder of a GPU build's llama-bench, "
                    "llama-fit-params, llama-completion")
    gp.add_argument("--gguf", required=True, help="the GGUF to replay")
    gp.add_argument("--quant", choices=("Q8_0", "Q4_0"), default="Q8_0", help="its type (--pure)")
    gp.add_argument("--vram-gb", type=_positive_gb, required=True, help="the VRAM budget (GB = 1e9 B)")
    gp.add_argument("--plan", default=None,
                    help="our plan at that budget (its export --to llama.cpp is a row)")
    gp.add_argument("--pick", default=None,
                    help="a plan solved with solve --target llama.cpp: its export replayed as row 'pick'")
    gp.add_argument("--profile", default=None, help="our profile of this machine (calibrate's default)")
    gp.add_argument("--colibri", default=None, help="colibri-plan command (default: this venv's)")
    gp.add_argument("--threads", type=_count, default=None, help="llama.cpp's -t (default: its own)")
    gp.add_argument("--repeats", type=_count, default=3, help="interleaved rounds per row")
    gp.add_argument("--ubatch", type=_count, default=512, help="recorded: llama-bench's default -ub")
    gp.add_argument("--n-prompt", type=_count, default=512)
    gp.add_argument("--n-gen", type=_count, default=64)
    gp.add_argument("--source", default="random Qwen3-MoE (bench/qwen3_numpy.py)", help="what the GGUF is")
    gp.add_argument("--out", required=True, help="result JSON")
    rp = sub.add_parser("reprice", help="re-price a stored beyond-ram result with the current planner "
                        "(no llama.cpp run; bench/replay_reprice.py)")
    rp.add_argument("file", help="a beyond-ram result JSON")
    rp.add_argument("--fault-probe", required=True, help="fault-probe's JSON of the same machine")
    rp.add_argument("--profile", required=True, help="a profile of the same machine (batched CPU, QD1 disk)")
    rp.add_argument("--coef", default=None, help="llama.cpp coefficients (calibrate --engine llama.cpp)")
    rp.add_argument("--heat", default=None, help="the run's heat file (default: the path it stores)")
    rp.add_argument("--out", default=None, help="where to write (default: rewrite FILE)")
    fp = sub.add_parser("fault-probe", help="measure page faults of a mapped file (profiler/fault.py)")
    fp.add_argument("--path", required=True, help="a folder on the disk that holds the GGUF")
    fp.add_argument("--size-gb", type=_positive_gb, default=2.0, help="test file size (GiB)")
    fp.add_argument("--runs", default="262144,2228224,8388608,67108864", help="run lengths, bytes")
    fp.add_argument("--out", required=True, help="result JSON")
    br = sub.choices["beyond-ram"]
    br.add_argument("--layers", type=_count, default=17, help="decoder layers (the first one dense)")
    br.add_argument("--experts", type=_count, default=64)
    br.add_argument("--skew", type=_fraction, default=0.12, help="router correction bias -skew*ln(rank)")
    br.add_argument("--out-std", type=_fraction, default=0.002,
                    help="std of the output projections (o_proj, down_proj): small keeps routing per token")
    br.add_argument("--n-prompt", type=_count, default=32)
    br.add_argument("--n-gen", type=_count, default=16)
    br.add_argument("--keep-checkpoint", action="store_true", help="keep the bf16 checkpoint (disk)")
    return ap


def check_args(ap, a) -> None:
    """Refuse what would fail later, before anything is built or run (argparse usage errors, exit 2)."""
    why = ll.check_llama_bin(a.llama_bin)
    if why:
        ap.error(why)
    if a.mode == "placements" and a.gguf is None and not (Path(a.llama_bin) / "llama-quantize").is_file():
        ap.error(f"--llama-bin {a.llama_bin}: no llama-quantize (needed without --gguf)")
    if getattr(a, "gguf", None) and not Path(a.gguf).is_file():
        ap.error(f"--gguf {a.gguf}: no such file")
    if getattr(a, "pack", None) and not (Path(a.pack) / "pack.json").is_file():
        ap.error(f"--pack {a.pack}: not a pack (no pack.json)")
    if a.profile and not Path(a.profile).is_file():
        ap.error(f"--profile {a.profile}: no such file")
    if not Path(a.out).resolve().parent.is_dir():
        ap.error(f"--out {a.out}: its folder does not exist")
    if a.mode == "gpu-placements":
        if a.plan and not Path(a.plan).is_file():
            ap.error(f"--plan {a.plan}: no such file")
        return   # no RAM limit: no cgroup needed
    why = cg.check_cgroup()
    if why:
        ap.error(why)


# ---- shared helpers ----------------------------------------------------------------------------------
def stat(xs: list[float]) -> dict | None:
    """median / min / max / runs of a list (None when empty)."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs} if xs else None


def host_total_mib() -> int:
    """The host's total memory as llama.cpp's CPU device reports it (sysconf pages), MiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ll.MiB


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               "unknown")
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_total_mib": host_total_mib(),
            "kernel": platform.release(), "cgroup": "v1 memory controller, page cache charged to the group"}


def llama_version(llama_bin: Path) -> str:
    r = cg.subprocess.run([str(llama_bin / "llama-bench"), "--version"], capture_output=True, text=True)
    return (r.stdout + r.stderr).strip().splitlines()[0] if (r.stdout + r.stderr).strip() else "unknown"


def limited(argv: list[str], limit_bytes: int, evict: list, timeout_s: float = 600.0) -> cg.CgroupRun:
    """``argv`` under the memory limit, the ``evict`` files dropped from the page cache first."""
    cg.evict(evict)
    return cg.run_limited(argv, limit_bytes, timeout_s=timeout_s)


def cgroup_summary(run: cg.CgroupRun, files: list) -> dict:
    """The counters of a run, with the files' bytes left in the page cache after it."""
    return {**run.to_dict(), "files_resident_after_bytes": cg.resident_bytes(files)}


def write_json(doc: dict, out: str) -> None:
    """``doc`` to ``out`` atomically (a temporary in the same folder, fsync, rename)."""
    from colibri_plan.fileio import atomic_write_text

    atomic_write_text(out, json.dumps(doc, indent=1) + "\n")


def llama_memory(a, gguf: Path, p: ll.Placement, limit: int, ctx: int) -> dict:
    """llama.cpp's own accounting of ``p``: fit's projection (--fit-print, no run) and one short
    llama-completion run under the limit (its buffer sizes, memory breakdown, cgroup counters)."""
    llama_bin = Path(a.llama_bin)
    fp = cg.subprocess.run(ll.fit_print_argv(llama_bin, gguf, p, a.threads, ctx), capture_output=True,
                           text=True)
    run = limited(ll.completion_argv(llama_bin, gguf, p, a.threads, ctx, a.ubatch), limit, [gguf])
    log_text = run.stderr
    return {"fit_print": ll.parse_fit_print(fp.stdout), "fit_print_rc": fp.returncode,
            "completion": {"buffers": ll.parse_buffers(log_text), "breakdown": ll.parse_breakdown(log_text),
                           "perf": ll.parse_perf(log_text), "cgroup": cgroup_summary(run, [gguf]),
                           "log_tail": log_text.strip().splitlines()[-3:] if run.rc else []}}


def bench_once(a, gguf: Path, p: ll.Placement, limit: int, n_prompt: int, n_gen: int) -> dict:
    """One llama-bench measurement of ``p`` under the limit: its tests and the cgroup's counters."""
    argv = ll.bench_argv(Path(a.llama_bin), gguf, p, a.threads, n_prompt, n_gen, a.ubatch)
    run = limited(argv, limit, [gguf])
    out = {"cgroup": cgroup_summary(run, [gguf]), "ok": run.rc == 0}
    if run.rc == 0:
        out["tests"] = ll.parse_bench(run.stdout)
    else:
        out["error_tail"] = run.stderr.strip().splitlines()[-3:]
    return out


def tok_s_of(runs: list[dict], test: str) -> dict | None:
    """tok/s of ``test`` (pp / tg) over the successful runs: median, min, max, one figure per run."""
    xs = [t["avg_ts"] for r in runs if r["ok"] for t in r["tests"] if t["test"] == test]
    return stat(xs)


# ---- placements (Build 1) ----------------------------------------------------------------------------
def run_placements(a) -> dict:
    import replay_models as rm
    import replay_ours as ro

    colibri = a.colibri or ro.default_cli()
    limit = int(a.ram_gb * GB)
    ctx = a.n_prompt + a.n_gen
    work = Path(a.work)
    if a.gguf:
        gguf, pack = Path(a.gguf), Path(a.pack) if a.pack else None
    else:
        work = work / "qwen3"
        gguf, pack = prepare_qwen3(a, work, rm, colibri)
    from colibri_plan.model import load_model_spec

    spec = load_model_spec(str(gguf))
    doc: dict = {"kind": "replay-llamacpp", "mode": "placements", "schema_version": 1,
                 "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 "machine": machine(),
                 "llama_cpp": {"bin": a.llama_bin, "version": llama_version(Path(a.llama_bin))},
                 "model": {"gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "quant": a.quant,
                           "n_layers": spec.n_layers, "n_experts": spec.n_experts, "top_k": spec.top_k,
                           "source": "--gguf" if a.gguf else "random Qwen3-MoE of bench/peer_llamacpp.py",
                           "block_bits_per_weight": rm.gguf_bits_per_weight(a.quant)},
                 "budget": {"ram_gb": a.ram_gb, "limit_bytes": limit, "limit_mib": limit / ll.MiB,
                            "host_total_mib": host_total_mib()},
                 "settings": {"threads": a.threads, "n_prompt": a.n_prompt, "n_gen": a.n_gen,
                              "ubatch": a.ubatch, "batch": 2048, "context": ctx, "repeats": a.repeats,
                              "interleaved": True,
                              "page_cache": "GGUF evicted before every run (posix_fadvise DONTNEED)"}}
    fit = fit_at_budget(a, gguf, limit, doc)
    export = None
    if pack is not None:
        export = ours_export(a, ro, colibri, pack, work, ctx, doc)
    placements = ll.standard_placements(spec.n_layers, fit, export, a.n_cpu_moe)
    rows = {p.name: {**p.to_dict(), "runs": []} for p in placements}
    for p in placements:
        log(f"memory breakdown: {p.name}")
        rows[p.name].update(llama_memory(a, gguf, p, limit, ctx))
    load0 = os.getloadavg()[0]
    for r in range(a.repeats):
        order = placements[r % len(placements):] + placements[:r % len(placements)]   # rotate the start
        for p in order:
            if rows[p.name]["runs"] and not any(x["ok"] for x in rows[p.name]["runs"]):
                continue   # failed once (e.g. killed at the limit): not retried
            res = bench_once(a, gguf, p, limit, a.n_prompt, a.n_gen)
            res["round"] = r
            rows[p.name]["runs"].append(res)
            log(f"  round {r + 1}/{a.repeats} {p.name}: " + (
                " ".join(f"{t['test']} {t['avg_ts']:.1f}" for t in res["tests"]) if res["ok"]
                else f"failed rc {res['cgroup']['rc']} oom_kills {res['cgroup']['oom_kills']}"))
    for row in rows.values():
        row["decode_tok_s"] = tok_s_of(row["runs"], "tg")
        row["prefill_tok_s"] = tok_s_of(row["runs"], "pp")
    doc["load_average_before_after"] = [load0, os.getloadavg()[0]]
    doc["placements"] = list(rows.values())
    return doc


def prepare_qwen3(a, work: Path, rm, colibri: str) -> tuple[Path, Path]:
    """The random Qwen3-MoE (cached): checkpoint, f16 GGUF, ``--quant`` GGUF and our matching pack (the
    checkpoint and the f16 GGUF may be deleted once both are made)."""
    work.mkdir(parents=True, exist_ok=True)
    gguf, pack = work / f"model-{a.quant}.gguf", work / f"pack-{rm.OURS_FOR[a.quant]}"
    if gguf.exists() and (pack / "pack.json").exists():
        return gguf, pack
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").exists():
        log("building the random Qwen3-MoE checkpoint ...")
        rm.peer().build_checkpoint(ckpt)
    f16 = work / "model-f16.gguf"
    if not f16.exists():
        log("converting to GGUF f16 (llama.cpp's converter) ...")
        rm.convert(rm.llama_src(Path(a.work), a.llama_src), ckpt, f16)
    if not gguf.exists():
        log(f"quantizing to {a.quant} (llama-quantize --pure) ...")
        rm.quantize(Path(a.llama_bin), f16, gguf, a.quant, a.threads)
    if not (pack / "pack.json").exists():
        log(f"packing ours ({rm.OURS_FOR[a.quant]}) ...")
        rm.pack(ckpt, pack, rm.OURS_FOR[a.quant], colibri)
    return gguf, pack


def fit_at_budget(a, gguf: Path, limit: int, doc: dict) -> ll.Placement | None:
    """llama-fit-params given the budget as its margin from the host's total memory; its placement, or
    None when it refuses (recorded in ``doc["fit"]``)."""
    margin = max(0, host_total_mib() - int(limit // ll.MiB))
    argv = ll.fit_argv(Path(a.llama_bin), gguf, a.threads, margin)
    r = cg.subprocess.run(argv, capture_output=True, text=True)
    fit = {"argv": argv, "margin_mib": margin, "rc": r.returncode, "stdout": r.stdout.strip(),
           "log": [ln for ln in r.stderr.splitlines() if "fit" in ln][-8:]}
    doc["budget"]["fit_margin_mib"] = margin
    doc["fit"] = fit
    if r.returncode != 0:
        fit["refused"] = next((ln.split(": ", 2)[-1] for ln in r.stderr.splitlines() if "failed to fit" in ln
                               or "unable to fit" in ln), "llama-fit-params failed")
        log(f"llama-fit-params refused the budget: {fit['refused']}")
        return None
    p = ll.parse_fit_args(r.stdout)
    fit["args"] = p.common_args() + ["-c", str(p.ctx)]
    return p


def ours_export(a, ro, colibri: str, pack: Path, work: Path, ctx: int, doc: dict) -> ll.Placement:
    """solve --ram at the budget on our pack, and the export's -ot patterns as a placement."""
    import replay_models as rm

    # only the export's -ot patterns are replayed here: a quick profile places the experts as well
    prof = ro.profile(colibri, pack, rm.OURS_FOR[a.quant], work, a.profile, quick=True)
    heat = ro.heat(colibri, pack, work)
    plan = work / f"plan-{a.ram_gb:g}gb-ctx{ctx}.json"
    solved = ro.solve(colibri, prof, pack, heat, a.ram_gb, ctx, plan, a.n_prompt)
    exp = ro.export_llama(colibri, plan)
    doc["ours"] = {"pack": str(pack), "profile": prof, "heat": str(heat), "plan": str(plan),
                   "predicted": solved.get("predicted"), "budgets": solved.get("budgets"),
                   "compare": solved.get("compare"), "export": exp}
    return ll.Placement("export", "colibri-plan export --to llama.cpp of solve --ram at the budget: "
                        + exp["args"], overrides=list(exp["patterns"]), ngl=exp.get("ngl"))


def report(doc: dict) -> None:
    """The printed table: per row decode / prefill tok/s, llama.cpp's Host breakdown, the cgroup peak."""
    s, b = doc["settings"], doc["budget"]
    print(f"\n{doc['model']['quant']} {doc['model']['gguf_bytes'] / 2**20:.0f} MiB, budget {b['ram_gb']:g} GB"
          " "
          f"({b['limit_mib']:.0f} MiB cgroup), {s['threads']} threads, pp{s['n_prompt']} / tg{s['n_gen']}, "
          f"{s['repeats']} interleaved rounds; load {doc['load_average_before_after']}")
    print(f"{'placement':16} {'decode tok/s':>24} {'prefill tok/s':>24} {'host model/ctx/compute MiB':>27} "
          f"{'peak rss/cache MiB':>19}")
    for r in doc["placements"]:
        def f(st):
            return f"{st['median']:.1f} [{st['min']:.1f}..{st['max']:.1f}]" if st else "-"
        host = next((x for x in r["completion"]["breakdown"]["at_exit"] or [] if x["name"] == "Host"), None)
        hb = f"{host['model_mib']}/{host['context_mib']}/{host['compute_mib']}" if host else "-"
        pk = r["runs"][0]["cgroup"]["peak"] if r["runs"] else {}
        peak = f"{pk.get('rss', 0) / ll.MiB:.0f}/{pk.get('cache', 0) / ll.MiB:.0f}" if pk else "-"
        note = "" if any(x["ok"] for x in r["runs"]) else " (failed: see runs)"
        print(f"{r['name']:16} {f(r['decode_tok_s']):>24} {f(r['prefill_tok_s']):>24} {hb:>27} "
              f"{peak:>19}{note}")


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.mode in ("reprice", "fault-probe"):   # no llama.cpp and no cgroup: the stored file, the planner
        import replay_reprice

        for f in ([a.file, a.fault_probe, a.profile] + [x for x in (a.coef,) if x]
                  if a.mode == "reprice" else []):
            if not Path(f).is_file():
                ap.error(f"{f}: no such file")
        if a.mode == "fault-probe" and not Path(a.path).is_dir():
            ap.error(f"--path {a.path}: not a folder")
        from colibri_plan.errors import ColibriError
        from colibri_plan.fileio import check_output_path

        out = a.out or a.file  # reprice rewrites FILE in place unless --out says otherwise
        others = [a.fault_probe, a.profile, a.coef, a.heat] if a.mode == "reprice" else []
        try:
            check_output_path(out, [x for x in others if x], kind=None)
            doc = (replay_reprice.run_reprice(a, log) if a.mode == "reprice"
                   else replay_reprice.run_fault_probe(a, machine()))
        except (ColibriError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            ap.exit(2, f"{ap.prog}: error: {a.mode}: {type(e).__name__}: {e} (give the files the replay, "
                       "fault-probe and profile commands wrote)\n")
        write_json(doc, out)
        log(f"wrote {out}")
        return 0
    check_args(ap, a)
    if a.mode == "placements":
        doc = run_placements(a)
        report(doc)
    elif a.mode == "gpu-placements":
        import replay_gpu

        doc = replay_gpu.run_gpu_placements(a, sys.modules[__name__])
        replay_gpu.report(doc)
    else:
        import replay_beyond

        doc = replay_beyond.run(a, sys.modules[__name__])
        replay_beyond.report(doc)
    write_json(doc, a.out)
    log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
