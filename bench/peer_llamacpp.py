"""Our engine against llama.cpp at its defaults on the CPU: decode and prefill, paired, same checkpoint.

Optional extra (not in CI): needs ``transformers``/``torch`` in our venv and a llama.cpp build
(``--llama-bin``: the folder of ``llama-bench`` and ``llama-quantize``) with its source tree
(``--llama-src``: its own ``convert_hf_to_gguf.py`` and ``gguf-py``).

Steps (files cached under ``--work``):
1. a random-weight Qwen3-MoE checkpoint (transformers ``save_pretrained``, bf16; hidden 2048, 8 layers,
   16/4 heads of 128, 32 experts top-8 of width 1024, vocab 8192) with a small byte-level BPE tokenizer
   (llama.cpp's GGUF needs one; prompts are token ids, so the tokenizer is never used); ``--ckpt DIR``
   uses another checkpoint instead (the H200 host's run: bench/peer_llamacpp_gpu.py's 24-layer one, whose
   int8 pack and Q8_0 GGUF may be linked into ``--work``: a finished pack or GGUF there is reused);
2. GGUF f16 with llama.cpp's converter, then Q8_0 and Q4_0 with ``llama-quantize --pure`` (every matrix in
   the type, as ours); our packs: int8 experts + int8 dense, int4-g32h experts + int4-g32h dense (both
   Q4_0's bytes: 16 bytes of codes and a float16 scale per 32 weights). Stored bits per weight
   (``bits_per_weight``) and the GGUF / pack file sizes are in the table and the JSON;
3. per format pair, ``--pairs`` pairs of one measurement each, the order inside a pair alternating (ours
   first in even pairs, llama.cpp first in odd ones). Ours: a warm worker process on the ``cpu`` backend
   (``NUMBA_NUM_THREADS=--threads``), after one warm-up request; each request times the prefill of a 16-
   and a 64-token prompt (fresh KV cache, to the last position's logits) and greedy decode of
   ``--decode-tokens`` tokens after a 16-token prompt. llama.cpp: one ``llama-bench -t --threads -r 1``
   run at its defaults (no environment overrides; its own warm-up run before each test): pp16 and pp64
   at depth 0, tg``--decode-tokens`` at depth 16. ``--passive`` adds, labelled as an extra, llama.cpp
   under ``OMP_WAIT_POLICY=passive`` (how earlier versions of this script ran it: each OpenMP barrier
   sleeps, about half llama.cpp's decode on a 2-core VM);
4. our first ``--check-tokens`` greedy tokens are compared with transformers (fp32) on the same prompt.

llama.cpp's build (``llama-bench --version``) and system info (cpu_info, backends, and the other fields of
its JSON) are recorded. Prints medians, spreads (min..max) and the per-pair ratios ours / llama.cpp (tok/s
ratio for decode, llama.cpp seconds / ours for prefill: > 1 means ours is faster); writes JSON with ``--out``.

    flock /tmp/colibri-cpu.lock .venv/bin/python bench/peer_llamacpp.py --threads 2 \
        --out bench/results/peer-llamacpp-cpu-defaults.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = dict(vocab_size=8192, hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=1024,
             num_experts=32, num_experts_per_tok=8)
#: ours (experts = dense) vs llama.cpp, at equal bytes for int4 (int4-g32h and Q4_0: 4.5 bits a weight)
PAIRS = {"int8": ("int8", "Q8_0"), "int4": ("int4-g32h", "Q4_0")}
#: llama.cpp block formats: bytes per block of 32 weights (32 codes + one float16 scale)
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}
METRICS = ("decode_tok_s", "prefill_16_s", "prefill_64_s")
PROMPT_DECODE = 16  # decode runs after a prompt of this many tokens (llama-bench: tg at depth 16)


def quantized_shapes(sizes: dict = SIZES) -> list[tuple[int, int]]:
    """[out, in] of every matrix our pack stores in the pair's format (dense_format = expert format):
    per layer q/k/v/o and each expert's gate/up/down, then the LM head; the embedding, norms and routers
    stay float32 (engine/dense_quant.py)."""
    h, i, hd = sizes["hidden_size"], sizes["moe_intermediate_size"], sizes["head_dim"]
    q, kv = sizes["num_attention_heads"] * hd, sizes["num_key_value_heads"] * hd
    layer = [(q, h), (kv, h), (kv, h), (h, q)] + [(i, h), (i, h), (h, i)] * sizes["num_experts"]
    return layer * sizes["num_hidden_layers"] + [(sizes["vocab_size"], h)]


def bits_per_weight(fmt: str, sizes: dict = SIZES) -> float:
    """Stored bits per weight of ``fmt`` over :func:`quantized_shapes`: ours from ``quant.tensor_bytes``
    (codes plus scales: int8 a float32 per row, so 8 + 32/in; int4-g32 a float32 per 32 weights, 5.0;
    int4-g32h a float16 per 32, 4.5), a GGUF block format from its block (Q8_0 34 B / 32 = 8.5, Q4_0
    18 B / 32 = 4.5)."""
    if fmt in GGUF_BLOCK_BYTES:
        return 8 * GGUF_BLOCK_BYTES[fmt] / 32
    from colibri_plan.quant import tensor_bytes

    shapes = quantized_shapes(sizes)
    return 8 * sum(tensor_bytes(fmt, o, c) for o, c in shapes) / sum(o * c for o, c in shapes)


def checkpoint_sizes(ckpt: Path) -> dict:
    """The :data:`SIZES` keys as ``ckpt``'s config.json gives them (a ``--ckpt`` of other widths, e.g.
    the 24-layer checkpoint of bench/peer_llamacpp_gpu.py)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    return {k: cfg[k] for k in SIZES}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- our worker (one process; JSON lines on stdin/stdout) --------------------------------------------
def worker_ours(pack: str) -> None:
    """Answers {"prefill": [ids...], "prompt": ids, "decode": N} with timings, one JSON line each; the
    first line ({"ready": true, ...}) says how the worker runs."""
    import numpy as np

    from colibri_plan.engine.blas_threads import openblas_threads
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack

    before = openblas_threads()
    m = Model(open_pack(pack), backend_name="cpu")
    print(json.dumps({"ready": True, "openblas_threads_at_start": before,
                      "openblas_threads_in_engine": openblas_threads()}), flush=True)
    for line in sys.stdin:
        req, res = json.loads(line), {}
        for p in req["prefill"]:
            cache = m.new_cache(256)
            t0 = time.perf_counter()
            m._last_logits(p, cache)
            res[f"prefill_{len(p)}_s"] = time.perf_counter() - t0
        cache = m.new_cache(256)
        toks = [int(np.argmax(m._last_logits(req["prompt"], cache)))]
        t0 = time.perf_counter()
        for _ in range(req["decode"]):
            toks.append(int(np.argmax(m._last_logits([toks[-1]], cache))))
        res["decode_tok_s"] = req["decode"] / (time.perf_counter() - t0)
        res["tokens"] = toks
        print(json.dumps(res), flush=True)


class Worker:
    """Our worker subprocess; ``ask(req)`` sends one request and returns its JSON answer."""

    def __init__(self, argv: list[str], env: dict):
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        first = self.p.stdout.readline()
        if not first:
            raise RuntimeError(f"worker {argv[-3:]} died at start (exit {self.p.wait()})")
        self.info = json.loads(first)

    def ask(self, req: dict) -> dict:
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker died (exit {self.p.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=60)


# ---- llama.cpp: llama-bench at its defaults ------------------------------------------------------------
def llama_bench(a, gguf: Path, env: dict) -> tuple[dict, dict]:
    """One ``llama-bench -r 1`` run: ({metric: value} as ours reports them, llama-bench's fields other
    than the timings: build, cpu_info, backends, threads, batch sizes, ...)."""
    argv = [str(Path(a.llama_bin) / "llama-bench"), "-m", str(gguf), "-t", str(a.threads), "-r", "1",
            "-p", "16,64", "-n", str(a.decode_tokens), "-d", f"0,{PROMPT_DECODE}", "-o", "json"]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
    out, info = {}, {}
    for t in json.loads(r.stdout):
        s = t["avg_ns"] * 1e-9
        if t["n_gen"] == 0 and t["n_depth"] == 0:
            out[f"prefill_{t['n_prompt']}_s"] = s
        elif t["n_prompt"] == 0 and t["n_depth"] == PROMPT_DECODE:
            out["decode_tok_s"] = t["n_gen"] / s
        info = {k: v for k, v in t.items() if k not in ("samples_ns", "samples_ts", "avg_ns", "stddev_ns",
                                                       "avg_ts", "stddev_ts", "test_time", "n_prompt",
                                                       "n_gen", "n_depth")}
    return out, info


def llama_version(a) -> str:
    r = subprocess.run([str(Path(a.llama_bin) / "llama-bench"), "--version"], capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


# ---- preparation ------------------------------------------------------------------------------------
def build_checkpoint(folder: Path) -> None:
    """Random bf16 Qwen3-MoE checkpoint (seed 0) and a 512-token byte-level BPE tokenizer."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(**SIZES, norm_topk_prob=True, tie_word_embeddings=False,
                                      max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    try:
        transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(str(folder))
    finally:
        torch.set_default_dtype(torch.float32)
    build_tokenizer(folder)


def build_tokenizer(folder: Path) -> None:
    """A 512-token byte-level BPE (its vocabulary does not matter: prompts are token ids) saved with
    transformers' fast-tokenizer files, which llama.cpp's converter reads."""
    import tokenizers
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))


_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # our BPE's hash is unknown to it
sys.argv = ["convert_hf_to_gguf.py", {ckpt!r}, "--outtype", "f16", "--outfile", {out!r}]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def prepare(a, work: Path) -> dict:
    """Checkpoint, GGUFs and packs (cached); returns paths and the build times in seconds."""
    times: dict[str, float] = {}
    ckpt = Path(a.ckpt) if a.ckpt else work / "ckpt"
    if a.ckpt and not (ckpt / "config.json").exists():
        raise SystemExit(f"--ckpt {ckpt}: no config.json there (a transformers Qwen3-MoE checkpoint)")
    if not (ckpt / "config.json").exists():
        t0 = time.perf_counter()
        build_checkpoint(ckpt)
        times["checkpoint_s"] = time.perf_counter() - t0
    f16 = work / "model-f16.gguf"
    missing = [k for k in a.formats.split(",") if not (work / f"model-{PAIRS[k][1]}.gguf").exists()]
    if missing and not f16.exists():
        t0 = time.perf_counter()
        code = _CONVERT.format(src=str(a.llama_src), ckpt=str(ckpt), out=str(f16) + ".tmp")
        subprocess.run([sys.executable, "-c", code], check=True)
        os.replace(str(f16) + ".tmp", f16)
        times["convert_f16_s"] = time.perf_counter() - t0
    paths = {}
    for key in a.formats.split(","):
        ours, theirs = PAIRS[key]
        g = work / f"model-{theirs}.gguf"
        if not g.exists():
            t0 = time.perf_counter()
            subprocess.run([str(Path(a.llama_bin) / "llama-quantize"), "--pure", str(f16), str(g) + ".tmp",
                            theirs, str(a.threads)], check=True, capture_output=True)
            os.replace(str(g) + ".tmp", g)
            times[f"quantize_{theirs}_s"] = time.perf_counter() - t0
        pack = work / f"pack-{ours}"
        if not (pack / "pack.json").exists():  # a finished pack (write_pack renames it in last)
            from colibri_plan.engine.pack import write_pack
            from colibri_plan.engine.weights import load_checkpoint

            t0 = time.perf_counter()
            write_pack(load_checkpoint(ckpt), pack, ours, dense_format=ours, overwrite=True)
            times[f"pack_{ours}_s"] = time.perf_counter() - t0
        paths[key] = (pack, g)
    f16.unlink(missing_ok=True)  # 3 GB only the quantizer reads; a new format's GGUF converts it again
    saved = work / "prepare-times.json"  # what a cached run did not redo is reported from the first
    old = json.loads(saved.read_text()) if saved.exists() else {}
    saved.write_text(json.dumps({**old, **times}))
    return {"ckpt": ckpt, "paths": paths, "times": {**old, **times}}


def reference_tokens(ckpt: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of transformers in float32 (the prompt's next token first)."""
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():  # a plain argmax loop: generate() would stop at or suppress the EOS id
        for _ in range(n):
            ids.append(int(torch.argmax(m(torch.tensor([ids])).logits[0, -1])))
    del m
    return ids[len(prompt):]


def _stat(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def _agree(a: list[int], b: list[int]) -> dict:
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"same": sum(x == y for x, y in zip(a, b)), "of": min(len(a), len(b)), "leading": prefix}


def _size(path: Path) -> int:
    """Bytes of a file, or of every file under a folder (a pack)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_pair(a, key: str, pack: Path, gguf: Path, prompts: dict, sizes: dict = SIZES) -> dict:
    """``--pairs`` counterbalanced pairs of one format pair; per-pair ratios ours / llama.cpp."""
    here = str(Path(__file__).resolve())
    ours_env = dict(os.environ, NUMBA_NUM_THREADS=str(a.threads))  # ours only: llama.cpp runs as it is
    ours = Worker([sys.executable, here, "--worker", "ours", "--path", str(pack)], ours_env)
    req = {"prefill": [prompts["p16"], prompts["p64"]], "prompt": prompts["p16"], "decode": a.decode_tokens}
    runs: dict[str, list[dict]] = {"ours": [], "llama": [], "llama_passive": []}
    info: dict = {}
    passive = dict(os.environ, OMP_WAIT_POLICY="passive")
    try:
        ours.ask(req)  # warm-up: compiles, page cache; llama-bench warms up itself before each test
        for i in range(a.pairs):
            order = ("ours", "llama") if i % 2 == 0 else ("llama", "ours")
            for side in order:
                if side == "ours":
                    runs["ours"].append(ours.ask(req))
                else:
                    res, info = llama_bench(a, gguf, dict(os.environ))
                    runs["llama"].append(res)
            if a.passive:
                runs["llama_passive"].append(llama_bench(a, gguf, passive)[0])
            o, t = runs["ours"][-1], runs["llama"][-1]
            log(f"  {key} pair {i + 1}/{a.pairs} ({' then '.join(order)}): decode {o['decode_tok_s']:.1f} vs "
                f"{t['decode_tok_s']:.1f} tok/s; prefill 64 {o['prefill_64_s'] * 1e3:.0f} vs "
                f"{t['prefill_64_s'] * 1e3:.0f} ms")
    finally:
        ours.close()
    fo, fl = PAIRS[key]
    res: dict = {"ours_format": fo, "llama_format": fl,
                 "bits_per_weight": {"ours": bits_per_weight(fo, sizes), "llama": bits_per_weight(fl, sizes)},
                 "ours_worker": {k: v for k, v in ours.info.items() if k != "ready"}, "llama_bench": info,
                 "ours_pack_bytes": _size(pack), "llama_gguf_bytes": _size(gguf),
                 "order": ["ours first" if i % 2 == 0 else "llama.cpp first" for i in range(a.pairs)],
                 "metrics": {}}
    for m in METRICS:
        o, t = [r[m] for r in runs["ours"]], [r[m] for r in runs["llama"]]
        ratio = [x / y for x, y in zip(o, t)] if m == "decode_tok_s" else [y / x for x, y in zip(o, t)]
        res["metrics"][m] = {"ours": _stat(o), "llama": _stat(t), "ratio": _stat(ratio)}
        if runs["llama_passive"]:
            res["metrics"][m]["llama_passive_extra"] = _stat([r[m] for r in runs["llama_passive"]])
    res["tokens"] = {"ours": runs["ours"][0]["tokens"]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/peer-llamacpp", help="cache folder (checkpoint, GGUFs, packs)")
    ap.add_argument("--llama-bin", default="/work/llama-build/build/bin", help="folder of llama-bench, "
                    "llama-quantize")
    ap.add_argument("--llama-src", default="/work/llama-build/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp",
                    help="llama.cpp source folder (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--formats", default="int8,int4", help="pairs to run: int8 (int8 / Q8_0), int4 "
                    "(int4-g32h / Q4_0)")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--check-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="threads of both engines")
    ap.add_argument("--passive", action="store_true", help="extra row: llama.cpp under OMP_WAIT_POLICY="
                    "passive (not its default; off by default)")
    ap.add_argument("--ckpt", default=None, help="an existing Qwen3-MoE checkpoint folder to use instead "
                    "of building the 8-layer one (e.g. the GPU peer's 24-layer WORK/ckpt); a Q8_0 GGUF or "
                    "pack already in --work is reused")
    ap.add_argument("--prepare-only", action="store_true",
                    help="make the GGUFs, packs and reference tokens, then stop")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=("ours",), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "ours":
        return worker_ours(a.path)
    if a.pairs < 1 or a.threads < 1 or any(k not in PAIRS for k in a.formats.split(",")):
        ap.error(f"--pairs and --threads must be >= 1, --formats a comma list of {', '.join(PAIRS)}")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    prep = prepare(a, work)
    sizes = checkpoint_sizes(prep["ckpt"])
    import random

    rnd = random.Random(1)
    prompts = {f"p{n}": [rnd.randrange(2, 500) for _ in range(n)] for n in (16, 64)}
    ref = reference(a, work, prep["ckpt"], prompts["p16"])
    if a.prepare_only:
        log(f"prepared in {work} (reference tokens too): {prep['times']}")
        return
    load0 = os.getloadavg()
    results = {}
    for key in a.formats.split(","):
        pack, gguf = prep["paths"][key]
        r = run_pair(a, key, pack, gguf, prompts, sizes)
        r["agreement_with_transformers"] = {"ours": _agree(r["tokens"]["ours"][:a.check_tokens],
                                                           ref["tokens"][:a.check_tokens])}
        results[key] = r
    load1 = os.getloadavg()
    report(results, a, load0, load1)
    if a.out:
        doc = {"kind": "peer-llamacpp-cpu-defaults",
               "model": "random Qwen3-MoE (transformers save_pretrained, bf16)", "sizes": sizes,
               "checkpoint": str(prep["ckpt"]),
               "threads": a.threads, "pairs": a.pairs, "decode_tokens": a.decode_tokens,
               "prompt_tokens": {"decode": PROMPT_DECODE, "prefill": [16, 64]}, "cpu": _cpu(),
               "llama_cpp_build": llama_version(a), "llama_cpp_environment": "as inherited, no overrides",
               "passive_extra": a.passive, "prepare_s": prep["times"],
               "load_average_before_after": [load0[0], load1[0]], "reference_tokens": ref["tokens"],
               "results": results}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(a.out + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, a.out)


def reference(a, work: Path, ckpt: Path, prompt: list[int]) -> dict:
    """transformers' fp32 greedy tokens on ``prompt`` (cached in the work folder)."""
    ref_file = work / "reference.json"
    ref = json.loads(ref_file.read_text()) if ref_file.exists() else None
    if ref and ref["prompt"] == prompt and len(ref["tokens"]) >= a.check_tokens:
        return ref
    log("transformers fp32 reference tokens ...")
    # in a child process: the float32 model is 4x the bf16 checkpoint, freed when it exits
    here = str(Path(__file__).parent)
    code = (f"import json, sys; sys.path.insert(0, {here!r}); import peer_llamacpp as p; "
            f"print(json.dumps(p.reference_tokens({str(ckpt)!r}, {prompt!r}, {a.check_tokens})))")
    toks = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                     text=True).stdout.strip().splitlines()[-1])
    ref = {"prompt": prompt, "tokens": toks}
    ref_file.write_text(json.dumps(ref))
    return ref


def report(results: dict, a, load0, load1) -> None:
    """The printed table: medians [min..max] per engine and the ratio ours / llama.cpp per pair."""
    print(f"\n{a.pairs} counterbalanced pairs, {a.threads} threads, llama.cpp at its defaults; decode "
          f"{a.decode_tokens} tokens after {PROMPT_DECODE}; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"{'pair':16} {'metric':12} {'ours':>24} {'llama.cpp':>24} {'ratio (>1: ours faster)':>26}")
    for r in results.values():
        name = f"{r['ours_format']}/{r['llama_format']}"
        for m, mm in r["metrics"].items():
            scale, unit = (1.0, "tok/s") if m == "decode_tok_s" else (1e3, "ms")

            def fmt(s, scale=scale, unit=unit):
                return f"{s['median'] * scale:7.1f} [{s['min'] * scale:.1f}..{s['max'] * scale:.1f}] {unit}"

            ratios = " ".join(f"{x:.2f}" for x in mm["ratio"]["runs"])
            print(f"{name:16} {m.replace('_s', '').replace('_tok', ''):12} {fmt(mm['ours']):>24} "
                  f"{fmt(mm['llama']):>24}   {mm['ratio']['median']:.2f} ({ratios})")
            if "llama_passive_extra" in mm:
                print(f"{'':16} {'  extra':12} {'':>24} {fmt(mm['llama_passive_extra']):>24}   "
                      "(llama.cpp with OMP_WAIT_POLICY=passive, not its default)")
        b = r["bits_per_weight"]
        print(f"{'':16} bits per weight (quantized matrices): ours {b['ours']:.3f}, llama.cpp "
              f"{b['llama']:.3f}; files: pack {r['ours_pack_bytes'] / 1e9:.3f} GB, "
              f"GGUF {r['llama_gguf_bytes'] / 1e9:.3f} GB")
        ag = r["agreement_with_transformers"]["ours"]
        print(f"{'':16} our greedy tokens vs transformers fp32 (first {a.check_tokens}): {ag['same']} same, "
              f"{ag['leading']} leading")


def _cpu() -> str:
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                return f"{ln.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
