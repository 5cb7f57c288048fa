"""Our engine against llama.cpp on a GPU (issue 25, Build 6): all in VRAM, and at a VRAM budget.

Not CI: a GPU host with a CUDA build of llama.cpp (``--llama-bin``; bench/h200_llamacpp.sh builds it from
the llama-cpp-python 0.3.36 sdist's vendored tree, as ../shared/gpu/README.md says) and this checkout.
``--backend cpu`` with a CPU build runs the same flow on a small model (how it is tested off the GPU).

``prepare`` (cached in ``--work``): the random Qwen3-MoE of bench/qwen3_numpy.py (default the H200
fixture's widths: 24 layers, hidden 2048, 32/4 heads of 128, 32 experts top-8 of width 768, vocab
32000; bf16, seed 0), llama.cpp's own converter to GGUF f16 and ``llama-quantize --pure`` Q8_0 (as
bench/peer_llamacpp.py), and our ``colibri-plan model pack --quant int8 --dense-quant int8`` of the same
checkpoint (run beside the converter).

``bench``: ``--pairs`` counterbalanced pairs (ours first in even pairs, llama.cpp first in odd ones) of

* all in VRAM: ours on ``--backend`` (every expert in VRAM, the trunk and KV there, the captured decode
  step at its default: on) against ``llama-bench`` at its defaults (no environment overrides, no -t, -ngl
  at its default -1 = every layer + output; what it used is recorded from its JSON);
* the VRAM budget (``--vram-gb``): ours running ``--plan`` (``colibri-plan solve --vram`` at the budget)
  against llama.cpp given the same bytes through ``llama-fit-params --fit-target`` (free VRAM minus the
  budget), fit's arguments replayed in llama-bench, its memory breakdown (llama-completion) recorded.

Per measurement: prefill of ``--prefill`` tokens (ours: fresh cache to the last position's logits;
llama.cpp pp at depth 0) and decode of ``--decode-tokens`` after ``--depth`` (ours: a
``--depth``-token prompt, then ``--decode-tokens`` random ids fed one at a time, as llama-bench's tg feeds
random ids; ``--greedy-decode``: our greedy chain instead; llama.cpp tg at depth ``--depth``). The tiers
that served the timed decode's selections are recorded (``ours_hit_rate``). Our greedy tokens on the GPU
(both cases, an untimed pass) are checked against our CPU engine on the same pack and prompt. JSON
(``--out``) and a printed table.

    python bench/peer_llamacpp_gpu.py prepare --work /tmp/llw --llama-bin B --llama-src S
    python bench/peer_llamacpp_gpu.py bench --work /tmp/llw --llama-bin B --plan plan.json --out peer.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_llamacpp as peer  # noqa: E402
import qwen3_numpy as q3  # noqa: E402
import replay_gpu as rg  # noqa: E402
import replay_llama as ll  # noqa: E402
import replay_models as rm  # noqa: E402

QUANT, OURS = "Q8_0", "int8"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def paths(work: Path) -> dict:
    return {
        "ckpt": work / "ckpt",
        "f16": work / "model-f16.gguf",
        "gguf": work / f"model-{QUANT}.gguf",
        "pack": work / f"pack-{OURS}",
    }


# ---- prepare ---------------------------------------------------------------------------------------
def prepare(a) -> dict:
    """Checkpoint, GGUF and pack (each skipped when present); returns seconds per step."""
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    p, times = paths(work), {}
    sizes = {
        **q3.H200_SIZES,
        "num_hidden_layers": a.layers,
        "num_experts": a.experts,
        "moe_intermediate_size": a.width,
        "hidden_size": a.hidden,
        "vocab_size": a.vocab,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "num_experts_per_tok": a.top_k,
    }
    if not (p["ckpt"] / "config.json").exists():
        log(f"checkpoint: {sizes}")
        times["checkpoint_s"] = q3.build(p["ckpt"], sizes, seed=0)["seconds"]
    colibri = a.colibri or str(Path(sys.executable).with_name("colibri-plan"))
    packer = None
    t_pack = time.perf_counter()
    if not (p["pack"] / "pack.json").exists():
        log("our pack (int8 experts + int8 dense), beside the converter ...")
        packer = subprocess.Popen(
            [
                colibri,
                "model",
                "pack",
                str(p["ckpt"]),
                str(p["pack"]),
                "--quant",
                OURS,
                "--dense-quant",
                OURS,
                "--force",
            ],
            stdout=subprocess.DEVNULL,
        )
    if not p["gguf"].exists():
        if not p["f16"].exists():
            t0 = time.perf_counter()
            log("GGUF f16 (llama.cpp's converter) ...")
            rm.convert(Path(a.llama_src), p["ckpt"], p["f16"])
            times["convert_f16_s"] = time.perf_counter() - t0
        if a.wait_for:
            t0 = time.perf_counter()
            while not Path(a.wait_for).exists():
                if time.perf_counter() - t0 > a.wait_s:
                    raise SystemExit(f"{a.wait_for} did not appear in {a.wait_s} s (llama.cpp's build)")
                time.sleep(2)
            times["waited_for_build_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rm.quantize(Path(a.llama_bin), p["f16"], p["gguf"], QUANT, os.cpu_count() or 1)
        times["quantize_s"] = time.perf_counter() - t0
        p["f16"].unlink(missing_ok=True)
    if packer is not None:
        if packer.wait() != 0:
            raise SystemExit(f"colibri-plan model pack failed (exit {packer.returncode})")
        times["pack_s"] = time.perf_counter() - t_pack
    saved = work / "prepare-times.json"
    old = json.loads(saved.read_text()) if saved.exists() else {}
    saved.write_text(json.dumps({**old, **times, "sizes": sizes}))
    log(f"prepared in {work}: {times}")
    return {**old, **times}


# ---- our worker --------------------------------------------------------------------------------------
def worker(pack: str, backend: str, plan_path: str, context: int) -> None:
    """One warm engine: {"prefill": [[ids]], "prompt": ids, "decode": N} -> timings and tokens per line."""
    import numpy as np

    from colibri_plan.engine import runner
    from colibri_plan.engine.session import EngineSession

    weights = runner.open_weights(pack, None)
    plan = None
    if plan_path:
        from colibri_plan.formats.plan import load_plan

        plan = load_plan(plan_path)
        runner.check_plan(plan, weights)
    placement = runner.placement_for(weights, plan, backend, 0)
    where = runner.trunk_placement(weights, plan, None, backend, 0)
    cpu = backend if backend in runner.HOST_BACKENDS else "cpu"
    s = EngineSession(weights, placement, cpu_backend=cpu, trunk=where, context_tokens=context)
    model = s.model
    print(
        json.dumps(
            {
                "ready": True,
                "backend": backend,
                "plan": plan_path or None,
                "trunk": s.key,
                "graph_env": os.environ.get("COLIBRI_CUDA_GRAPH", "unset (default on)"),
                "load_s": s.load_s,
            }
        ),
        flush=True,
    )

    def last(ids, cache):
        return int(np.argmax(model._last_logits(ids, cache)))

    for line in sys.stdin:
        req, res = json.loads(line), {}
        for p in req["prefill"]:
            cache = model.new_cache(context)
            t0 = time.perf_counter()
            last(p, cache)
            res[f"prefill_{len(p)}_s"] = time.perf_counter() - t0
        feed = req.get("decode_ids")
        cache = model.new_cache(context)
        tok = last(req["prompt"], cache)
        toks = [tok]
        uses0 = dict(model.experts.stats.uses)
        t0 = time.perf_counter()
        for i in range(req["decode"]):
            # llama-bench's tg feeds a random id each step (std::rand() % n_vocab): so do we when given
            # ids, so that both engines route the same kind of input; else our greedy chain
            tok = last([feed[i] if feed else tok], cache)
            toks.append(tok)
        res["decode_tok_s"] = req["decode"] / (time.perf_counter() - t0)
        # tiers that served the timed decode's expert selections (the measured hit rate)
        res["decode_uses"] = {k: v - uses0.get(k, 0) for k, v in model.experts.stats.uses.items()}
        if feed:  # the greedy chain for the token check, untimed
            cache = model.new_cache(context)
            toks = [last(req["prompt"], cache)]
            for _ in range(req["decode"]):
                toks.append(last([toks[-1]], cache))
        res["tokens"] = toks
        tr = model.trunk
        g = getattr(tr, "_step_graph", None)
        # whether decode replayed captured graphs, and why not (a slow budget case is read from this)
        pr = getattr(g, "promoter", None)
        res["graph"] = {"off": getattr(tr, "graph_off", None), "hybrid_layers": len(g.hybrid) if g else None,
                        "waits": g.waits if g else None, "handoffs": g.handoffs if g else None,
                        "promotions": pr.swaps if pr else 0, "promotion_s": pr.swap_s if pr else 0.0}
        print(json.dumps(res), flush=True)
    s.close()


def ours(a, backend: str, plan: str | None) -> peer.Worker:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "worker",
        "--pack",
        str(paths(Path(a.work))["pack"]),
        "--backend",
        backend,
        "--plan",
        plan or "",
        "--context",
        str(a.context),
    ]
    return peer.Worker(argv, dict(os.environ))


# ---- llama.cpp -----------------------------------------------------------------------------------------
def llama_bench(a, gguf: Path, p: ll.Placement) -> tuple[dict, dict]:
    """One llama-bench run at its defaults but ``p``: ({prefill_N_s, decode_tok_s}, its other fields)."""
    argv = [
        str(Path(a.llama_bin) / "llama-bench"),
        "-m",
        str(gguf),
        "-p",
        str(a.prefill),
        "-n",
        str(a.decode_tokens),
        "-d",
        f"0,{a.depth}",
        "-r",
        "1",
        "-o",
        "json",
        *p.bench_args(),
    ]
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    out, info = {}, {}
    for t in ll.parse_bench(r.stdout):
        if t["test"] == "pp" and t["n_depth"] == 0:
            out[f"prefill_{t['n_prompt']}_s"] = t["n_prompt"] / t["avg_ts"]
        elif t["test"] == "tg" and t["n_depth"] == a.depth:
            out["decode_tok_s"] = t["avg_ts"]
        info = {
            k: t.get(k)
            for k in (
                "n_gpu_layers",
                "n_threads",
                "n_batch",
                "n_ubatch",
                "n_cpu_moe",
                "tensor_buft_overrides",
                "flash_attn",
                "type_k",
                "type_v",
                "backends",
                "build_commit",
                "cpu_info",
                "model_size",
                "model_n_params",
            )
        }
    return out, {"argv": argv, **info}


# ---- pairs ---------------------------------------------------------------------------------------------
def _hit_rate(uses: dict) -> dict:
    """Share of the timed decode's expert selections each tier served ({} when none were counted)."""
    n = sum(uses.values())
    return {k: v / n for k, v in uses.items()} if n else {}


def pairs(a, name: str, w: peer.Worker, gguf: Path, p: ll.Placement, req: dict) -> dict:
    """``--pairs`` counterbalanced pairs of one case; per-pair ratios ours / llama.cpp."""
    runs: dict = {"ours": [], "llama": []}
    info: dict = {}
    w.ask(req)  # warm-up (compiles, captures); llama-bench warms up itself
    for i in range(a.pairs):
        order = ("ours", "llama") if i % 2 == 0 else ("llama", "ours")
        for side in order:
            if side == "ours":
                runs["ours"].append(w.ask(req))
            else:
                res, info = llama_bench(a, gguf, p)
                runs["llama"].append(res)
        o, t = runs["ours"][-1], runs["llama"][-1]
        key = f"prefill_{a.prefill}_s"
        log(
            f"  {name} pair {i + 1}/{a.pairs} ({' then '.join(order)}): decode {o['decode_tok_s']:.1f} vs "
            f"{t['decode_tok_s']:.1f} tok/s; prefill {a.prefill} {a.prefill / o[key]:.0f} vs "
            f"{a.prefill / t[key]:.0f} tok/s"
        )
    metrics = {}
    for m in ("decode_tok_s", f"prefill_{a.prefill}_s"):
        o, t = [r[m] for r in runs["ours"]], [r[m] for r in runs["llama"]]
        ratio = [x / y for x, y in zip(o, t)] if m == "decode_tok_s" else [y / x for x, y in zip(o, t)]
        metrics[m] = {"ours": peer._stat(o), "llama": peer._stat(t), "ratio": peer._stat(ratio)}
    return {
        "llama_placement": p.to_dict(),
        "llama_bench": info,
        "ours_worker": w.info,
        "ours_graph": [r.get("graph") for r in runs["ours"]],
        "ours_decode_uses": [r.get("decode_uses") for r in runs["ours"]],
        "ours_hit_rate": _hit_rate(runs["ours"][-1].get("decode_uses") or {}),
        "metrics": metrics,
        "order": ["ours first" if i % 2 == 0 else "llama.cpp first" for i in range(a.pairs)],
        "tokens": {
            "ours": runs["ours"][0]["tokens"],
            "ours_all_runs_same": all(r["tokens"] == runs["ours"][0]["tokens"] for r in runs["ours"]),
        },
    }


def bench_prompts(rnd, vocab: int, prefill: int, depth: int) -> dict:
    """The bench's timed prompts from ``rnd`` (random.Random(1)): {"prefill": [[prefill ids]], "prompt":
    [depth ids]}, each id in [2, vocab); the decode ids are drawn from ``rnd`` after them."""
    return {"prefill": [[rnd.randrange(2, vocab) for _ in range(prefill)]],
            "prompt": [rnd.randrange(2, vocab) for _ in range(depth)]}


def bench(a) -> dict:
    p = paths(Path(a.work))
    gguf = p["gguf"]
    vocab = json.loads((p["pack"] / "pack.json").read_text())["arch"]["vocab_size"]
    import random

    rnd = random.Random(1)
    prompts = bench_prompts(rnd, vocab, a.prefill, a.depth)
    # decode input: random ids as llama-bench's tg feeds (its own std::rand(); ours seeded, the same every
    # run), unless --greedy-decode (our greedy chain: a random checkpoint's repeats one token, whose
    # routing then stands for no traffic)
    feed = None if a.greedy_decode else [rnd.randrange(2, vocab) for _ in range(a.decode_tokens)]
    req = {**prompts, "decode": a.decode_tokens, "decode_ids": feed}
    doc: dict = {
        "kind": "peer-llamacpp-gpu",
        "backend": a.backend,
        "pairs": a.pairs,
        "prefill": a.prefill,
        "depth": a.depth,
        "decode_tokens": a.decode_tokens,
        "decode_input": "greedy chain" if feed is None else "random ids, seeded (llama-bench tg: random ids)",
        "vram_gb": a.vram_gb,
        "model": {
            "sizes": json.loads((Path(a.work) / "prepare-times.json").read_text()).get("sizes"),
            "gguf": str(gguf),
            "gguf_bytes": gguf.stat().st_size,
            "pack": str(p["pack"]),
            "pack_bytes": peer._size(p["pack"]),
            "ours_format": OURS,
            "llama_format": QUANT,
            "bits_per_weight": {"llama": rm.gguf_bits_per_weight(QUANT)},
        },
        "machine": {"cpu": peer._cpu(), "gpu": rg.gpu_memory_mib()},
        "llama_cpp_build": peer.llama_version(a),
        "llama_cpp_environment": "as inherited, no overrides",
        "cases": {},
    }
    fit = None
    if a.vram_gb:
        gpu = rg.gpu_memory_mib()
        budget_mib = a.vram_gb * 1e9 / ll.MiB
        ctx = max(a.prefill, a.depth + a.decode_tokens)
        # fit counts llama.cpp's CUDA context inside its target; our budget (and every replayed row's)
        # is model + KV + compute: subtract the context so both engines get the same bytes of weights
        ns = argparse.Namespace(llama_bin=a.llama_bin, threads=None, ubatch=512)
        context_mib = rg.context_probe_mib(ns, gguf, ctx)
        fit = rg.fit_at_vram(ns, gguf, budget_mib, gpu["free_mib"] if gpu else None, ctx, doc,
                             context_mib=context_mib)
        log(f"fit at {a.vram_gb:g} GB: {doc['fit'].get('args') or doc['fit'].get('refused')}")
        if fit is not None:
            mem = rg.memory(
                argparse.Namespace(llama_bin=a.llama_bin, threads=None, ubatch=512), gguf, fit, ctx
            )
            doc["fit"]["memory"] = mem
            doc["fit"]["projected_gpu_mib"] = rg.projection(
                argparse.Namespace(llama_bin=a.llama_bin, threads=None), gguf, fit, ctx
            )[0]
    cases = [("all_vram", None, ll.Placement("defaults", "llama-bench's defaults"))]
    if a.vram_gb and a.plan and fit is not None:
        cases.append(("vram_budget", a.plan, fit))
        doc["ours_plan"] = {
            "path": a.plan,
            "predicted": json.loads(Path(a.plan).read_text()).get("predicted"),
        }
    for name, plan, pl in cases:
        log(f"case {name}: ours on {a.backend}{' with ' + plan if plan else ', all in VRAM'}")
        w = ours(a, a.backend, plan)
        try:
            doc["cases"][name] = pairs(a, name, w, gguf, pl, req)
        finally:
            w.close()
    if a.check_cpu:
        log("our CPU engine on the same prompt (reference tokens) ...")
        w = ours(a, "cpu", None)
        try:
            ref = w.ask({"prefill": [], "prompt": prompts["prompt"], "decode": a.decode_tokens})["tokens"]
        finally:
            w.close()
        doc["cpu_reference_tokens"] = ref
        for c in doc["cases"].values():
            c["agreement_with_cpu"] = peer._agree(c["tokens"]["ours"], ref)
    return doc


def report(doc: dict) -> None:
    print(
        f"\n{doc['pairs']} counterbalanced pairs; ours {doc['model']['ours_format']} on {doc['backend']}, "
        f"llama.cpp {doc['model']['llama_format']} at its defaults; decode {doc['decode_tokens']} after "
        f"{doc['depth']}, prefill {doc['prefill']}"
    )
    print(f"{'case':12} {'metric':10} {'ours':>26} {'llama.cpp':>26} {'ours/llama.cpp (per pair)':>28}")
    for name, c in doc["cases"].items():
        for m, mm in c["metrics"].items():
            n = int(m.split("_")[1]) if m.startswith("prefill") else None

            def f(s, n=n):  # tok/s: prefill seconds -> prompt tok/s
                v = (
                    [n / x for x in (s["median"], s["max"], s["min"])]
                    if n
                    else [s["median"], s["min"], s["max"]]
                )
                return f"{v[0]:9.1f} [{v[1]:.1f}..{v[2]:.1f}] tok/s"

            rs = " ".join(f"{x:.2f}" for x in mm["ratio"]["runs"])
            print(
                f"{name:12} {'decode' if n is None else f'prefill{n}':10} {f(mm['ours']):>26} "
                f"{f(mm['llama']):>26}   {mm['ratio']['median']:.2f} ({rs})"
            )
        ag = c.get("agreement_with_cpu")
        lb = c["llama_bench"]
        if c.get("ours_hit_rate"):
            print(f"{'':12} ours: selections served by " + ", ".join(
                f"{k} {v:.1%}" for k, v in c["ours_hit_rate"].items() if v))
        print(
            f"{'':12} llama-bench: -ngl {lb.get('n_gpu_layers')} -t {lb.get('n_threads')} "
            f"-ub {lb.get('n_ubatch')} backends {lb.get('backends')}; "
            + (
                f"our tokens vs our CPU engine: {ag['same']}/{ag['of']} same, {ag['leading']} leading"
                if ag
                else "tokens not checked"
            )
        )
    if doc.get("fit"):
        f = doc["fit"]
        gpu = (f.get("memory") or {}).get("gpu_self_mib")
        print(
            f"fit at {doc['vram_gb']:g} GB: {' '.join(f.get('args') or [f.get('refused', '?')])}; GPU MiB "
            f"projected {f.get('projected_gpu_mib')}, used at exit {gpu}"
        )


def heat(a) -> None:
    """Routing heat of the decode the bench times: a --depth-token prompt, then --tokens decode steps fed
    random ids (seed 2: other ids than the bench's, the same kind), every expert on --backend; written as
    a heat JSON (engine/runner.write_stats) for `solve --heat`, so the plan is priced on that traffic.
    ``--context bench``: the prompt is the bench's own (``bench_prompts`` at --prefill), the decode ids
    still seed 2's: on a random checkpoint the prompt decides which experts a decode selects (on the
    24-layer checkpoint's CPU run, a heat of another prompt covered 53.6% of the bench decode's selections
    with its hot half, one of the bench's prompt 96.8%: bench/results/routing-context-cpu.json).
    ``--conversations N``: N such runs on fresh caches (each its own decode ids; ``--context other``: its
    own prompt too), all in one heat: the timed decode is the first ``--tokens`` steps after a prompt, and
    on that checkpoint routing moves over those first steps and then settles (a 2.5 GB plan's VRAM experts
    chosen on the other steps of one 256-step heat covered 94.8% of its first 64, 99.9% of the later ones:
    the heat of bench/results/h200-llamacpp-r6/heat-holdout.json), so one long run over-weights the
    settled part."""
    import random

    import numpy as np

    from colibri_plan.engine import runner
    from colibri_plan.engine.moe import RoutingRecorder
    from colibri_plan.engine.session import EngineSession

    weights = runner.open_weights(a.pack, None)
    rec = RoutingRecorder(weights.arch)
    vocab, rnd = weights.arch.vocab_size, random.Random(2)
    bench_prompt = bench_prompts(random.Random(1), vocab, a.prefill, a.depth)["prompt"]
    s = EngineSession(weights, runner.placement_for(weights, None, a.backend, 0), cpu_backend="cpu",
                      trunk=runner.trunk_placement(weights, None, None, a.backend, 0),
                      context_tokens=a.depth + a.tokens + 1, recorder=rec)
    with s:
        for _ in range(a.conversations):
            other = a.context == "other"
            prompt = [rnd.randrange(2, vocab) for _ in range(a.depth)] if other else bench_prompt
            cache = s.model.new_cache(a.depth + a.tokens + 1)
            s.model._last_logits(prompt, cache)
            for _ in range(a.tokens):
                np.asarray(s.model._last_logits([rnd.randrange(2, vocab)], cache))
    written = runner.write_stats(rec, weights, a.out, None)
    log(f"heat of {a.conversations} x ({a.depth} prompt + {a.tokens} random-id decode tokens) -> "
        f"{written['stats_out']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    pr, be, wk, ht = (sub.add_parser(x) for x in ("prepare", "bench", "worker", "heat"))
    for p in (pr, be):
        p.add_argument("--work", required=True, help="cache folder (checkpoint, GGUF, pack)")
        p.add_argument(
            "--llama-bin",
            required=True,
            help="folder of llama-bench, llama-fit-params, llama-completion, llama-quantize",
        )
        p.add_argument("--colibri", default=None, help="colibri-plan command (default: this python's)")
    pr.add_argument(
        "--llama-src", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)"
    )
    pr.add_argument("--wait-for", default=None, help="a file whose appearance says llama-quantize is built")
    pr.add_argument("--wait-s", type=float, default=900.0)
    for key, name in (
        ("num_hidden_layers", "layers"),
        ("num_experts", "experts"),
        ("moe_intermediate_size", "width"),
        ("hidden_size", "hidden"),
        ("vocab_size", "vocab"),
        ("num_attention_heads", "heads"),
        ("num_key_value_heads", "kv-heads"),
        ("num_experts_per_tok", "top-k"),
    ):
        pr.add_argument(f"--{name}", type=int, default=q3.H200_SIZES[key])
    be.add_argument("--backend", default="cuda", help="our engine's backend (cpu: the off-GPU test)")
    be.add_argument("--pairs", type=int, default=4)
    be.add_argument("--decode-tokens", type=int, default=64)
    be.add_argument("--depth", type=int, default=16, help="decode after this many prompt tokens")
    be.add_argument("--prefill", type=int, default=512)
    be.add_argument("--context", type=int, default=1024, help="our KV cache's tokens")
    be.add_argument("--vram-gb", type=float, default=2.5, help="the budget case (0: skip it)")
    be.add_argument("--plan", default=None, help="our plan at --vram-gb (colibri-plan solve --vram)")
    be.add_argument("--greedy-decode", action="store_true",
                    help="decode our greedy chain instead of random ids (llama-bench's tg feeds random ids)")
    be.add_argument("--no-check-cpu", dest="check_cpu", action="store_false", help="skip the CPU tokens")
    be.add_argument("--out", default=None)
    wk.add_argument("--pack", required=True)
    wk.add_argument("--backend", required=True)
    wk.add_argument("--plan", default="")
    wk.add_argument("--context", type=int, required=True)
    ht.add_argument("--pack", required=True)
    ht.add_argument("--backend", default="cuda")
    ht.add_argument("--depth", type=int, default=16)
    ht.add_argument("--tokens", type=int, default=256)
    ht.add_argument("--conversations", type=int, default=1, help="runs of --depth + --tokens, fresh caches")
    ht.add_argument("--context", choices=("other", "bench"), default="other",
                    help="the prompt before the decode: another one (seed 2) or the bench's own")
    ht.add_argument("--prefill", type=int, default=512, help="--context bench: the bench's --prefill")
    ht.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.mode == "heat":
        if a.conversations < 1 or a.tokens < 1 or a.depth < 1 or a.prefill < 0:
            ap.error("heat: --conversations, --tokens and --depth must be >= 1, --prefill >= 0")
        out = Path(a.out)
        if out.is_dir() or not out.resolve().parent.is_dir():
            ap.error(f"heat: --out {a.out}: give a file path in an existing folder")
        if not (Path(a.pack) / "pack.json").is_file():
            ap.error(f"heat: --pack {a.pack}: no pack.json there (colibri-plan model pack makes one)")
        from colibri_plan.errors import ColibriError

        try:
            heat(a)
        except ColibriError as exc:  # a backend that cannot open here, a bad pack: one line
            raise SystemExit(f"error: {type(exc).__name__}: {exc}") from None
        return 0
    if a.mode == "worker":
        worker(a.pack, a.backend, a.plan, a.context)
        return 0
    if a.mode == "prepare":
        prepare(a)
        return 0
    if a.pairs < 1 or a.decode_tokens < 1 or a.prefill < 1 or a.depth < 1:
        ap.error("--pairs, --decode-tokens, --prefill and --depth must be >= 1")
    if a.plan and not Path(a.plan).is_file():
        ap.error(f"--plan {a.plan}: no such file")
    doc = bench(a)
    report(doc)
    if a.out:
        tmp = Path(a.out + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, a.out)
        log(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
