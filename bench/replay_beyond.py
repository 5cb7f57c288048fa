"""``replay_llamacpp.py beyond-ram``: a model several GB larger than the memory limit (issue 27, Build 4).

The checkpoint is bench/replay_models.py's GLM-4.5-style MoE with skewed routing (correction bias
``-skew * ln(rank)``), packed in int8 for us and converted to Q8_0 by llama.cpp's converter. Under one
memory cgroup of ``--ram-gb`` (page cache charged), interleaved ``--repeats`` rounds of:

* ``ours``: ``colibri-plan verify --no-reference`` of ``solve --ram <limit>`` (O_DIRECT reads, pinned hot
  experts, LRU slots);
* ``hot-first``: the same engine on colibrì's hot-first fill at the same budget (bench/baseline_plan.py);
* ``llama.cpp mmap``: ``llama-bench`` at its defaults; ``llama.cpp no-mmap``: ``--load-mode none``.

Before each run the pack and the GGUF are evicted from the page cache. Token-exactness: one ``verify``
with the all-RAM reference per plan, outside the cgroup (the reference holds every expert), and the
tokens of every limited run compared with it. Predictions: each plan's own; for llama.cpp the
``solve --compare`` row priced as llama.cpp runs (mmap, page cache).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import replay_llama as ll
import replay_models as rm
import replay_ours as ro


def sizes(a) -> dict:
    """The GLM geometry for ``--layers`` / ``--experts`` (the rest as replay_models.GLM_SIZES)."""
    return {**rm.GLM_SIZES, "num_hidden_layers": a.layers, "n_routed_experts": a.experts}


def expected_bytes(sz: dict) -> dict:
    """Rough file sizes before building (bytes): bf16 checkpoint, our int8 pack, the Q8_0 GGUF."""
    h, i, e = sz["hidden_size"], sz["moe_intermediate_size"], sz["n_routed_experts"]
    moe = sz["num_hidden_layers"] - sz["first_k_dense_replace"]
    experts = moe * e * 3 * h * i
    dense = sz["num_hidden_layers"] * 4 * h * h + 2 * sz["vocab_size"] * h + moe * 3 * h * i
    params = experts + dense
    return {"checkpoint": 2 * params, "pack": params, "gguf": int(params * 34 / 32)}


def prepare(a, work: Path, colibri: str, log) -> dict:
    """Checkpoint -> our pack and the Q8_0 GGUF (cached); the checkpoint is deleted afterwards unless
    ``--keep-checkpoint``. Refuses to start when the disk cannot hold the three at once."""
    sz = sizes(a)
    tag = f"glm-l{a.layers}-e{a.experts}-skew{a.skew:g}-out{a.out_std:g}-emb1"
    work = work / tag
    work.mkdir(parents=True, exist_ok=True)
    ckpt, pack, gguf = work / "ckpt", work / "pack-int8", work / "model-Q8_0.gguf"
    info = {"tag": tag, "sizes": sz, "skew": a.skew, "out_std": a.out_std, "embed_std": 1.0,
            "expected_bytes": expected_bytes(sz)}
    if (pack / "pack.json").exists() and gguf.exists():
        return {**info, "work": work, "pack": pack, "gguf": gguf}
    need = sum(info["expected_bytes"].values())
    free = shutil.disk_usage(work).free
    if free < need * 1.05:
        raise SystemExit(f"beyond-ram: {need / 1e9:.1f} GB of disk needed in {work} (checkpoint, pack, "
                         f"GGUF), {free / 1e9:.1f} GB free; use fewer --layers/--experts")
    if not (ckpt / "config.json").exists():
        log(f"writing the GLM checkpoint ({info['expected_bytes']['checkpoint'] / 1e9:.1f} GB bf16) ...")
        built = rm.build_glm(ckpt, sz, a.skew, out_std=a.out_std)
        (work / "rank-orders.json").write_text(json.dumps(built["rank_orders"]))
    if not (pack / "pack.json").exists():
        log("packing ours (int8 experts and trunk) ...")
        rm.pack(ckpt, pack, "int8", colibri)
    if not gguf.exists():
        log("converting to GGUF Q8_0 (llama.cpp's converter, --outtype q8_0) ...")
        rm.convert(rm.llama_src(Path(a.work), a.llama_src), ckpt, gguf, outtype="q8_0", pre="glm4")
    if not a.keep_checkpoint:
        shutil.rmtree(ckpt)
    return {**info, "work": work, "pack": pack, "gguf": gguf}


def run(a, m) -> dict:
    """The whole comparison; ``m`` is bench/replay_llamacpp.py (its cgroup and llama.cpp helpers)."""
    colibri = a.colibri or ro.default_cli()
    limit = int(a.ram_gb * m.GB)
    prep = prepare(a, Path(a.work), colibri, m.log)
    work, pack, gguf = prep["work"], prep["pack"], prep["gguf"]
    ctx = a.n_prompt + a.n_gen + 1
    prof = ro.profile(colibri, pack, "int8", work, a.profile)
    vocab = sizes(a)["vocab_size"]   # prompts over the whole vocabulary, as llama-bench's random tokens
    heat = ro.heat(colibri, pack, work, n_prompt=512, vocab_hi=vocab)
    heat_b = ro.heat(colibri, pack, work, n_prompt=512, vocab_hi=vocab, seed=8)   # does heat carry over?
    plan, hot = work / f"plan-{a.ram_gb:g}gb.json", work / f"plan-hot-first-{a.ram_gb:g}gb.json"
    solved = ro.solve(colibri, prof, pack, heat, a.ram_gb, ctx, plan, a.n_prompt)
    hot_line = ro.hot_first_plan(prof, pack, heat, a.ram_gb, ctx, hot)
    ids = ro.prompt_ids(a.n_prompt, vocab_hi=vocab)
    doc = {"kind": "replay-llamacpp", "mode": "beyond-ram", "schema_version": 1,
           "created_utc": m.datetime.now(m.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "machine": m.machine(),
           "llama_cpp": {"bin": a.llama_bin, "version": m.llama_version(Path(a.llama_bin))},
           "model": {**{k: v for k, v in prep.items() if k not in ("work", "pack", "gguf")},
                     "pack": str(pack), "gguf": str(gguf), "pack_bytes": _bytes(pack),
                     "gguf_bytes": _bytes(gguf), "heat": str(heat), "heat_shares": rm.heat_shares(heat),
                     "heat_transfer_top_20pct": rm.heat_transfer(heat, heat_b)},
           "budget": {"ram_gb": a.ram_gb, "limit_bytes": limit, "limit_mib": limit / ll.MiB,
                      "model_over_limit_bytes": _bytes(gguf) - limit},
           "settings": {"threads": a.threads, "n_prompt": a.n_prompt, "n_gen": a.n_gen, "context": ctx,
                        "ubatch": a.ubatch, "repeats": a.repeats, "interleaved": True, "prompt_ids": ids,
                        "page_cache": "pack and GGUF evicted before every run (posix_fadvise DONTNEED)"},
           "ours": {"profile": prof, "plan": str(plan), "predicted": solved.get("predicted"),
                    "budgets": solved.get("budgets"), "compare": solved.get("compare"),
                    "hot_first_plan": str(hot), "hot_first_summary": hot_line}}
    rows = {"ours": {"engine": "colibri-plan", "plan": str(plan), "runs": []},
            "hot-first": {"engine": "colibri-plan", "plan": str(hot), "runs": []},
            "llama.cpp mmap": {"engine": "llama.cpp", "placement": ll.Placement("default", "defaults: mmap"),
                               "runs": []},
            "llama.cpp no-mmap": {"engine": "llama.cpp", "runs": [],
                                  "placement": ll.Placement("no-mmap", "--load-mode none", load_mode="none")}}
    for name, row in rows.items():
        if row["engine"] == "llama.cpp":
            m.log(f"memory breakdown: {name}")
            row.update(m.llama_memory(a, gguf, row["placement"], limit, ctx))
    load0 = m.os.getloadavg()[0]
    names = list(rows)
    for r in range(a.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            row = rows[name]
            if row["runs"] and not any(x["ok"] for x in row["runs"]):
                continue
            res = (_ours_once(a, m, colibri, Path(row["plan"]), pack, gguf, ids, limit)
                   if row["engine"] == "colibri-plan"
                   else m.bench_once(a, gguf, row["placement"], limit, a.n_prompt, a.n_gen))
            res["round"] = r
            row["runs"].append(res)
            m.log(f"  round {r + 1}/{a.repeats} {name}: {_short(res)}")
    doc["load_average_before_after"] = [load0, m.os.getloadavg()[0]]
    for name in ("ours", "hot-first"):   # the token check, outside the limit: the reference holds it all
        m.log(f"token check (verify with the all-RAM reference): {name}")
        rows[name]["reference_check"] = _reference(colibri, Path(rows[name]["plan"]), pack, a.n_gen, ids)
    _summarise(rows, solved.get("compare") or [])
    for row in rows.values():
        if "placement" in row:
            row["placement"] = row["placement"].to_dict()
    doc["rows"] = rows
    return doc


def _bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def _ours_once(a, m, colibri, plan: Path, pack: Path, gguf: Path, ids, limit) -> dict:
    """One ``verify --no-reference`` of ``plan`` under the limit."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ro.verify_argv(colibri, plan, pack, a.n_gen, ids, Path(tmp) / "r.json", reference=False)
        run = m.limited(argv, limit, [pack, gguf])
    out = {"cgroup": m.cgroup_summary(run, [pack]), "ok": run.rc == 0}
    if run.rc == 0:
        out["verify"] = ro.verify_summary(json.loads(run.stdout))
    else:
        out["error_tail"] = run.stderr.strip().splitlines()[-3:]
    return out


def _reference(colibri, plan: Path, pack: Path, n_gen: int, ids) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        r = _run(ro.verify_argv(colibri, plan, pack, n_gen, ids, Path(tmp) / "r.json", reference=True))
    if r.returncode != 0:
        return {"ok": False, "error_tail": r.stderr.strip().splitlines()[-3:]}
    doc = json.loads(r.stdout)
    return {"ok": True, **ro.verify_summary(doc),
            "reference_tokens": (doc.get("reference") or {}).get("tokens")}


def _run(argv):
    import subprocess

    return subprocess.run(argv, capture_output=True, text=True)


def _short(res: dict) -> str:
    if not res["ok"]:
        c = res["cgroup"]
        return f"failed rc {c['rc']} oom_kills {c['oom_kills']}"
    if "verify" in res:
        v = res["verify"]
        return (f"decode {v['tok_s']:.2f} tok/s (predicted {v['predicted_tok_s']:.2f}), "
                f"prefill {v['prefill_tok_s']:.1f}")
    return " ".join(f"{t['test']} {t['avg_ts']:.2f}" for t in res["tests"])


def _summarise(rows: dict, compare: list[dict]) -> None:
    """Per row: decode and prefill tok/s (median, min, max, runs), the prediction beside them, and for
    our rows whether every limited run's tokens equal the all-RAM reference's."""
    by_name = {c["placement"]: c for c in compare}
    for name, row in rows.items():
        ok = [r for r in row["runs"] if r["ok"]]
        if row["engine"] == "colibri-plan":
            row["decode_tok_s"] = _stat([r["verify"]["tok_s"] for r in ok])
            row["prefill_tok_s"] = _stat([r["verify"]["prefill_tok_s"] for r in ok
                                          if r["verify"]["prefill_tok_s"]])
            row["predicted_tok_s"] = ok[0]["verify"]["predicted_tok_s"] if ok else None
            ref = row.get("reference_check", {}).get("reference_tokens")
            row["token_exact"] = (None if not ref or not ok
                                  else all(r["verify"]["tokens"] == ref for r in ok)
                                  and bool(row["reference_check"].get("token_exact")))
        else:
            row["decode_tok_s"] = _stat([t["avg_ts"] for r in ok for t in r["tests"] if t["test"] == "tg"])
            row["prefill_tok_s"] = _stat([t["avg_ts"] for r in ok for t in r["tests"] if t["test"] == "pp"])
            priced = by_name.get("llama.cpp --fit layers")
            row["predicted_tok_s"] = priced["tok_s"] if priced and name == "llama.cpp mmap" else None
            row["predicted_from"] = ("solve --compare 'llama.cpp --fit layers' (mmap)"
                                     if row["predicted_tok_s"] else None)
        if row.get("predicted_tok_s") and row["decode_tok_s"]:
            row["measured_over_predicted"] = row["decode_tok_s"]["median"] / row["predicted_tok_s"]
    hot = by_name.get("colibri hot-first")
    rows["hot-first"]["compare_row_colibri_tok_s"] = hot["tok_s"] if hot else None


def _stat(xs):
    import statistics

    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs} if xs else None


def report(doc: dict) -> None:
    """The printed table: decode / prefill tok/s, prediction, cgroup peak, token check per row."""
    b, s = doc["budget"], doc["settings"]
    md = doc["model"]
    print(f"\n{md['tag']}: GGUF {md['gguf_bytes'] / 1e9:.2f} GB, pack {md['pack_bytes'] / 1e9:.2f} GB, "
          f"limit {b['ram_gb']:g} GB; heat {md['heat_shares']}")
    print(f"{s['threads']} threads, prompt {s['n_prompt']}, decode {s['n_gen']}, {s['repeats']} rounds")
    print(f"{'row':18} {'decode tok/s':>24} {'predicted':>10} {'prefill tok/s':>22} "
          f"{'peak rss/cache MiB':>19} exact")
    for name, r in doc["rows"].items():
        d, p = r.get("decode_tok_s"), r.get("prefill_tok_s")
        fd = f"{d['median']:.2f} [{d['min']:.2f}..{d['max']:.2f}]" if d else "failed"
        fp = f"{p['median']:.1f} [{p['min']:.1f}..{p['max']:.1f}]" if p else "-"
        pr = f"{r['predicted_tok_s']:.2f}" if r.get("predicted_tok_s") else "-"
        pk = r["runs"][0]["cgroup"]["peak"] if r["runs"] else {}
        peak = f"{pk.get('rss', 0) / ll.MiB:.0f}/{pk.get('cache', 0) / ll.MiB:.0f}"
        print(f"{name:18} {fd:>24} {pr:>10} {fp:>22} {peak:>19} {r.get('token_exact', '-')}")
    sys.stdout.flush()
