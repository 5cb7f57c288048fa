"""Decode speed and dense bytes/token of a pack with an f32 vs an int8 dense trunk (issue 13, step 1).

One random Qwen3-MoE-like checkpoint (transformers ``save_pretrained``: hidden 1024, 8 layers, 16
experts top-4, expert width 256, vocab 8192, untied LM head), packed twice with int8 experts: dense
trunk f32 and int8. Each variant decodes ``--tokens`` tokens greedily on the ``cpu`` backend (every
expert in RAM); variants are interleaved ``--repeats`` times, medians reported.

dense bytes/token = bytes of every dense tensor one decode step reads (trunk matrices in their stored
format, norms/routers float32, one embedding row).

Usage: ``.venv/bin/python bench/dense_quant.py [--tokens 16] [--repeats 3] [--out FILE]``
(default ``--out bench/results/dense-quant.json``)
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def build_checkpoint(folder: Path) -> None:
    """Random float32 Qwen3-MoE checkpoint (seed 0) saved to ``folder``."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=8192, hidden_size=1024, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                      intermediate_size=2048, moe_intermediate_size=256, num_experts=16,
                                      num_experts_per_tok=4, norm_topk_prob=True, tie_word_embeddings=False,
                                      max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).eval().save_pretrained(str(folder))


def dense_bytes_per_token(dense: dict) -> int:
    """Bytes of dense weights one decode step reads (embedding: one row)."""
    import numpy as np

    n = 0
    for name, v in dense.items():
        n += int(v.shape[1]) * np.dtype(np.float32).itemsize if name == "embed" else int(v.nbytes)
    return n


def decode(pack: Path, tokens: int) -> tuple[float, list[int], int]:
    """(tok/s, token ids, dense bytes/token) of one greedy decode of ``tokens`` after a 4-token prompt."""
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack

    with open_pack(pack) as p, Model(p, backend_name="cpu") as m:
        m.generate([1, 2, 3, 4], 2)  # warm-up: numba compile, uploads
        t0 = time.perf_counter()
        ids = m.generate([1, 2, 3, 4], tokens)
        dt = time.perf_counter() - t0
        return tokens / dt, ids, dense_bytes_per_token(p.dense)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/dense-quant.json")
    a = ap.parse_args()
    from colibri_plan.engine.pack import write_pack
    from colibri_plan.engine.weights import load_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="dense-quant-"))
    build_checkpoint(tmp / "ckpt")
    w = load_checkpoint(tmp / "ckpt", expert_format="f32")
    packs = {f: write_pack(w, tmp / f"pack-{f}", "int8", dense_format=f) for f in ("f32", "int8")}
    runs: dict[str, list] = {f: [] for f in packs}
    for _ in range(a.repeats):
        for f, p in packs.items():
            runs[f].append(decode(p, a.tokens))
    rows = []
    for f, rs in runs.items():
        rows.append({"dense_format": f, "tok_s_median": round(statistics.median(r[0] for r in rs), 2),
                     "tok_s_runs": [round(r[0], 2) for r in rs], "dense_bytes_per_token": rs[0][2],
                     "dense_file_bytes": (packs[f] / "dense.safetensors").stat().st_size,
                     "tokens": rs[0][1]})
    same = sum(x == y for x, y in zip(rows[0]["tokens"], rows[1]["tokens"]))
    doc = {"model": "random Qwen3-MoE, hidden 1024, 8 layers, 16 experts top-4, width 256, vocab 8192",
           "expert_format": "int8", "backend": "cpu", "decode_tokens": a.tokens, "repeats": a.repeats,
           "tokens_agreeing": same, "rows": rows}
    print(f"{'dense':6} {'tok/s (median)':>15} {'dense MB/token':>15} {'dense file MB':>14}")
    for r in rows:
        print(f"{r['dense_format']:6} {r['tok_s_median']:15.2f} {r['dense_bytes_per_token'] / 1e6:15.2f} "
              f"{r['dense_file_bytes'] / 1e6:14.2f}")
    print(f"greedy tokens agreeing: {same}/{a.tokens}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
