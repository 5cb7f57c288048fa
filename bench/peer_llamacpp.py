"""Our engine against llama.cpp on the CPU: decode and prefill, paired, same checkpoint, same threads.

Optional extra (not in CI): needs ``transformers``/``torch`` in our venv and llama-cpp-python built from
source in a second venv (``--lcp-python``), whose source distribution provides llama.cpp's own
``convert_hf_to_gguf.py`` and ``gguf-py`` (``--llama-src``; fetched with ``pip download`` when absent).

Steps (files cached under ``--work``):
1. a random-weight Qwen3-MoE checkpoint (transformers ``save_pretrained``, bf16; default hidden 2048,
   8 layers, 16/4 heads of 128, 32 experts top-8 of width 1024, vocab 8192) with a small byte-level BPE
   tokenizer (llama.cpp's GGUF needs one; prompts are token ids, so the tokenizer is never used);
2. GGUF f16 with llama.cpp's converter, then Q8_0 and Q4_0 with ``llama_cpp.llama_model_quantize``
   (``pure``: every matrix in the type, as ours); our packs: int8 experts + int8 dense, int4-g32 experts
   + int4-g32 dense (Q4_0 is int4 in blocks of 32 with one scale per block). Stored bits per weight
   (``bits_per_weight``, printed and written per pair): int8 8.021 (8 + a float32 scale per row) against
   Q8_0 8.5, int4-g32 5.0 (a float32 scale per 32) against Q4_0 4.5 (a float16 scale per 32);
3. per format pair, two warm worker processes (ours in this venv on the ``cpu`` backend, llama.cpp in
   ``--lcp-python`` with ``n_threads = n_threads_batch = --threads``; both ``OMP_WAIT_POLICY=passive``;
   ``OPENBLAS_NUM_THREADS=--threads`` for both unless ``--ours-blas-threads``: the engine itself holds
   numpy's OpenBLAS at 1 thread beside numba's ``--threads`` on the cpu backend; ``--ours-trunk device``
   runs our trunk as the device trunk over the cpu backend's d_* ops)
   are asked in turn (ours, llama.cpp, ours, ...) for ``--pairs`` measurements of: prefill of a 16- and
   a 64-token prompt (seconds to the last position's logits, fresh KV cache), and greedy decode of
   ``--decode-tokens`` tokens after a 16-token prompt (tok/s);
4. the first ``--check-tokens`` greedy tokens of each engine are compared with transformers (fp32) on the
   same 16-token prompt.

Prints medians, spreads (min..max) and the per-pair ratios ours / llama.cpp (tok/s ratio for decode,
llama.cpp seconds / ours for prefill: > 1 means ours is faster); writes JSON with ``--out``.

    .venv/bin/python bench/peer_llamacpp.py --out bench/results/peer-llamacpp-cpu.json
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
PAIRS = {"int8": ("int8", "Q8_0"), "int4": ("int4-g32", "Q4_0")}  # ours (experts = dense) vs llama.cpp
#: llama.cpp block formats: bytes per block of 32 weights (32 codes + one float16 scale)
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}


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
    (codes plus float32 scales: int8 one per row, so 8 + 32/in; int4-g32 one per 32 weights, 5.0), a GGUF
    block format from its block (Q8_0 34 B / 32 = 8.5, Q4_0 18 B / 32 = 4.5)."""
    if fmt in GGUF_BLOCK_BYTES:
        return 8 * GGUF_BLOCK_BYTES[fmt] / 32
    from colibri_plan.quant import tensor_bytes

    shapes = quantized_shapes(sizes)
    return 8 * sum(tensor_bytes(fmt, o, c) for o, c in shapes) / sum(o * c for o, c in shapes)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- workers (one process per engine; JSON lines on stdin/stdout) ----------------------------------
def _worker_loop(prefill, decode_step, reset, info: dict | None = None) -> None:
    """Answers {"prompt": [...], "decode": N} with timings; one JSON line per request. The first line
    ({"ready": true, **info}) says how the worker runs."""
    print(json.dumps({"ready": True, **(info or {})}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        res = {}
        for p in req.get("prefill", []):
            reset()
            t0 = time.perf_counter()
            prefill(p)
            res[f"prefill_{len(p)}_s"] = time.perf_counter() - t0
        if "prompt" in req:
            reset()
            tok = prefill(req["prompt"])
            toks = [tok]
            t0 = time.perf_counter()
            for _ in range(req["decode"]):
                tok = decode_step(tok)
                toks.append(tok)
            res["decode_tok_s"] = req["decode"] / (time.perf_counter() - t0)
            res["tokens"] = toks
        print(json.dumps(res), flush=True)


def worker_ours(pack: str, trunk: str) -> None:
    import numpy as np

    from colibri_plan.engine.blas_threads import openblas_threads
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack

    p = open_pack(pack)
    before = openblas_threads()
    if trunk == "device":  # the device trunk (engine/trunk.py) over the cpu backend's d_* ops
        from colibri_plan.engine.moe import open_backend

        m = Model(p, backend_name="cpu", trunk_backend=open_backend("cpu"), context_tokens=256)
    else:
        m = Model(p, backend_name="cpu")
    info = {"openblas_threads_at_start": before, "openblas_threads_in_engine": openblas_threads(),
            "trunk": trunk}
    st = {}

    def reset():
        st["cache"] = m.new_cache(256)

    def prefill(ids):
        return int(np.argmax(m._last_logits(ids, st["cache"])))

    def step(tok):
        return int(np.argmax(m._last_logits([tok], st["cache"])))

    _worker_loop(prefill, step, reset, info)


def worker_llama(gguf: str, threads: int) -> None:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    nv = llm.n_vocab()

    def logits():
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(nv,))

    def prefill(ids):
        llm.eval(ids)
        return int(np.argmax(logits()))

    def step(tok):
        llm.eval([tok])
        return int(np.argmax(logits()))

    _worker_loop(prefill, step, llm.reset)


class Worker:
    """A worker subprocess; ``ask(req)`` sends one request and returns its JSON answer."""

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


# ---- preparation ------------------------------------------------------------------------------------
def build_checkpoint(folder: Path) -> None:
    """Random bf16 Qwen3-MoE checkpoint (seed 0) and a 512-token byte-level BPE tokenizer."""
    import tokenizers
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
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))


def llama_src(work: Path, lcp_python: str, given: str | None) -> Path:
    """Folder of llama.cpp's sources (convert_hf_to_gguf.py, gguf-py) from the llama-cpp-python sdist."""
    if given:
        return Path(given)
    found = sorted(work.glob("sdist/llama_cpp_python-*/vendor/llama.cpp"))
    if not found:
        subprocess.run([lcp_python, "-m", "pip", "download", "llama-cpp-python", "--no-deps",
                        "--no-binary", ":all:", "-d", str(work / "sdist")], check=True)
        tar = next((work / "sdist").glob("llama_cpp_python-*.tar.gz"))
        subprocess.run(["tar", "xzf", str(tar), "-C", str(work / "sdist")], check=True)
        found = sorted(work.glob("sdist/llama_cpp_python-*/vendor/llama.cpp"))
    return found[-1]


_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"  # our BPE's hash is unknown to it
sys.argv = ["convert_hf_to_gguf.py", {ckpt!r}, "--outtype", "f16", "--outfile", {out!r}]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""

_QUANTIZE = """
import ctypes, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread, p.pure = llama_cpp.LLAMA_FTYPE_MOSTLY_{t}, {threads}, True
rc = llama_cpp.llama_model_quantize({src!r}.encode(), {out!r}.encode(), ctypes.byref(p))
raise SystemExit(rc)
"""


def prepare(a, work: Path) -> dict:
    """Checkpoint, GGUFs and packs (cached); returns paths and the build times in seconds."""
    times: dict[str, float] = {}
    ckpt = work / "ckpt"
    if not (ckpt / "config.json").exists():
        t0 = time.perf_counter()
        build_checkpoint(ckpt)
        times["checkpoint_s"] = time.perf_counter() - t0
    f16 = work / "model-f16.gguf"
    if not f16.exists():
        src = llama_src(work, a.lcp_python, a.llama_src)
        t0 = time.perf_counter()
        code = _CONVERT.format(src=str(src), ckpt=str(ckpt), out=str(f16) + ".tmp")
        subprocess.run([sys.executable, "-c", code], check=True)
        os.replace(str(f16) + ".tmp", f16)
        times["convert_f16_s"] = time.perf_counter() - t0
    paths = {}
    for key, (ours, theirs) in PAIRS.items():
        _prepare_pair(a, work, ckpt, f16, key, ours, theirs, times, paths)
    saved = work / "prepare-times.json"  # what a cached run did not redo is reported from the first
    old = json.loads(saved.read_text()) if saved.exists() else {}
    saved.write_text(json.dumps({**old, **times}))
    return {"ckpt": ckpt, "paths": paths, "times": {**old, **times}}


def _prepare_pair(a, work: Path, ckpt: Path, f16: Path, key: str, ours: str, theirs: str, times: dict,
                  paths: dict) -> None:
    """GGUF of ``theirs`` and our pack in ``ours`` (cached), their build seconds into ``times``."""
    g = work / f"model-{theirs}.gguf"
    if not g.exists():
        t0 = time.perf_counter()
        code = _QUANTIZE.format(t=theirs, threads=a.threads, src=str(f16), out=str(g) + ".tmp")
        subprocess.run([a.lcp_python, "-c", code], check=True)
        os.replace(str(g) + ".tmp", g)
        times[f"quantize_{theirs}_s"] = time.perf_counter() - t0
    pack = work / f"pack-{ours}"
    if not (pack / "index.json").exists() and not pack.exists():
        from colibri_plan.engine.pack import write_pack
        from colibri_plan.engine.weights import load_checkpoint

        t0 = time.perf_counter()
        write_pack(load_checkpoint(ckpt), pack, ours, dense_format=ours)
        times[f"pack_{ours}_s"] = time.perf_counter() - t0
    paths[key] = (pack, g)


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


def run_pair(a, key: str, pack: Path, gguf: Path, prompts: dict, env: dict) -> dict:
    """Interleaved measurements of one format pair; per-pair ratios ours / llama.cpp."""
    here = str(Path(__file__).resolve())
    blas = {} if a.ours_blas_threads is None else {"OPENBLAS_NUM_THREADS": str(a.ours_blas_threads)}
    ours = Worker([sys.executable, here, "--worker", "ours", "--path", str(pack),
                   "--ours-trunk", a.ours_trunk], dict(env, **blas))
    try:
        theirs = Worker([a.lcp_python, here, "--worker", "llama", "--path", str(gguf),
                         "--threads", str(a.threads)], env)
    except BaseException:
        ours.close()
        raise
    req = {"prefill": [prompts["p16"], prompts["p64"]], "prompt": prompts["p16"], "decode": a.decode_tokens}
    runs: dict[str, list[dict]] = {"ours": [], "llama": []}
    try:
        ours.ask(req), theirs.ask(req)  # warm-up: compiles, page cache, thread pools
        for i in range(a.pairs):
            runs["ours"].append(ours.ask(req))
            runs["llama"].append(theirs.ask(req))
            o, t = runs["ours"][-1], runs["llama"][-1]
            log(f"  {key} pair {i + 1}/{a.pairs}: decode {o['decode_tok_s']:.1f} vs {t['decode_tok_s']:.1f} "
                f"tok/s; prefill 16 {o['prefill_16_s'] * 1e3:.0f} vs {t['prefill_16_s'] * 1e3:.0f} ms")
    finally:
        ours.close()
        theirs.close()
    res: dict = {"ours_format": PAIRS[key][0], "llama_format": PAIRS[key][1],
                 "bits_per_weight": {"ours": bits_per_weight(PAIRS[key][0]),
                                     "llama": bits_per_weight(PAIRS[key][1])},
                 "ours_worker": {k: v for k, v in ours.info.items() if k != "ready"},
                 "ours_pack_bytes": sum(f.stat().st_size for f in pack.rglob("*") if f.is_file()),
                 "llama_gguf_bytes": gguf.stat().st_size, "metrics": {}}
    for m in ("decode_tok_s", "prefill_16_s", "prefill_64_s"):
        o = [r[m] for r in runs["ours"]]
        t = [r[m] for r in runs["llama"]]
        ratio = [x / y for x, y in zip(o, t)] if m == "decode_tok_s" else [y / x for x, y in zip(o, t)]
        res["metrics"][m] = {"ours": _stat(o), "llama": _stat(t), "ratio": _stat(ratio)}
    res["tokens"] = {"ours": runs["ours"][0]["tokens"], "llama": runs["llama"][0]["tokens"]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/peer-llamacpp", help="cache folder (checkpoint, GGUFs, packs)")
    ap.add_argument("--lcp-python", default="/work/lcp-venv/bin/python")
    ap.add_argument("--llama-src", default=None, help="llama.cpp source folder (default: the sdist's)")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--check-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ours-blas-threads", type=int, default=None,
                    help="OPENBLAS_NUM_THREADS of our worker (default: --threads, as llama.cpp's); the "
                         "engine itself holds numpy's OpenBLAS at 1 thread on the cpu backend "
                         "(engine/blas_threads.py): a second BLAS thread fought numba's threads on a "
                         "2-core host (router matmul 56 ms per layer)")
    ap.add_argument("--ours-trunk", choices=("cpu", "device"), default="cpu",
                    help="our trunk: the classic host path, or the device trunk over the cpu backend")
    ap.add_argument("--lcp-build-s", type=float, default=None, help="llama-cpp-python build time, recorded")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=("ours", "llama"), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "ours":
        return worker_ours(a.path, a.ours_trunk)
    if a.worker == "llama":
        return worker_llama(a.path, a.threads)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    prep = prepare(a, work)
    import random

    rnd = random.Random(1)
    prompts = {f"p{n}": [rnd.randrange(2, 500) for _ in range(n)] for n in (16, 64)}
    ref_file = work / "reference.json"
    ref = json.loads(ref_file.read_text()) if ref_file.exists() else None
    if not ref or ref["prompt"] != prompts["p16"] or len(ref["tokens"]) < a.check_tokens:
        log("transformers fp32 reference tokens ...")
        # in a child process: the float32 model is 4x the bf16 checkpoint, freed when it exits
        here, ckpt = str(Path(__file__).parent), str(prep["ckpt"])
        code = (f"import json, sys; sys.path.insert(0, {here!r}); import peer_llamacpp as p; "
                f"print(json.dumps(p.reference_tokens({ckpt!r}, {prompts['p16']!r}, {a.check_tokens})))")
        toks = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                         text=True).stdout.strip().splitlines()[-1])
        ref = {"prompt": prompts["p16"], "tokens": toks}
        ref_file.write_text(json.dumps(ref))
    env = dict(os.environ, OMP_WAIT_POLICY="passive", NUMBA_NUM_THREADS=str(a.threads),
               OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads),
               MKL_NUM_THREADS=str(a.threads))
    load0 = os.getloadavg()
    results = {}
    for key in a.formats.split(","):
        pack, gguf = prep["paths"][key]
        r = run_pair(a, key, pack, gguf, prompts, env)
        n = a.check_tokens
        r["agreement_with_transformers"] = {e: _agree(r["tokens"][e][:n], ref["tokens"][:n])
                                            for e in ("ours", "llama")}
        results[key] = r
    load1 = os.getloadavg()
    report(results, ref, a, load0, load1)
    if a.out:
        doc = {"kind": "peer-llamacpp-cpu", "model": "random Qwen3-MoE (transformers save_pretrained, bf16)",
               "sizes": SIZES, "threads": a.threads, "ours_blas_threads": a.ours_blas_threads,
               "ours_trunk": a.ours_trunk,
               "pairs": a.pairs, "decode_tokens": a.decode_tokens,
               "prompt_tokens": {"decode": 16, "prefill": [16, 64]}, "cpu": _cpu(),
               "llama_cpp_python": _lcp_version(a),
               "llama_cpp_python_build_s": a.lcp_build_s, "prepare_s": prep["times"],
               "load_average_before_after": [load0[0], load1[0]], "reference_tokens": ref["tokens"],
               "results": results}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(a.out + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, a.out)


def report(results: dict, ref: dict, a, load0, load1) -> None:
    """The printed table: medians [min..max] per engine and the ratio ours / llama.cpp per pair."""
    print(f"\n{a.pairs} interleaved pairs, {a.threads} threads, decode {a.decode_tokens} tokens after 16; "
          f"load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"{'pair':16} {'metric':12} {'ours':>22} {'llama.cpp':>22} {'ratio (>1: ours faster)':>26}")
    for _key, r in results.items():
        name = f"{r['ours_format']}/{r['llama_format']}"
        for m, mm in r["metrics"].items():
            scale, unit = (1.0, "tok/s") if m == "decode_tok_s" else (1e3, "ms")

            def fmt(s, scale=scale, unit=unit):
                return f"{s['median'] * scale:7.1f} [{s['min'] * scale:.1f}..{s['max'] * scale:.1f}] {unit}"

            ratios = " ".join(f"{x:.2f}" for x in mm["ratio"]["runs"])
            print(f"{name:16} {m.replace('_s', '').replace('_tok', ''):12} {fmt(mm['ours']):>22} "
                  f"{fmt(mm['llama']):>22}   {mm['ratio']['median']:.2f} ({ratios})")
        print(f"{'':16} bits per weight (quantized matrices): ours {bits_per_weight(r['ours_format']):.3f}, "
              f"llama.cpp {bits_per_weight(r['llama_format']):.3f}")
        ag = r["agreement_with_transformers"]
        print(f"{'':16} greedy tokens vs transformers fp32 (first {a.check_tokens}): ours "
              f"{ag['ours']['same']} same, {ag['ours']['leading']} leading; llama.cpp "
              f"{ag['llama']['same']} same, {ag['llama']['leading']} leading")


def _cpu() -> str:
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                return f"{ln.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


def _lcp_version(a) -> str:
    r = subprocess.run([a.lcp_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                       capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    main()
