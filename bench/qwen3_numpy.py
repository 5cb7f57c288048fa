"""A random Qwen3-MoE checkpoint written with numpy alone (safetensors, bf16), for the GPU peer benchmark.

bench/peer_llamacpp.py builds its checkpoint with transformers (``Qwen3MoeForCausalLM(cfg).save_pretrained``):
at the H200 fixture's widths (24 layers, 32 experts of width 768, hidden 2048, vocab 32000: 4.1e9 weights)
that initialises every weight on one thread. This writes the same layout without torch: one safetensors
shard per layer (+ one for the embedding, final norm and LM head), ``model.safetensors.index.json``, the
``config.json`` transformers writes for a Qwen3-MoE (both ``num_experts`` and ``num_local_experts``, so
either transformers generation reads it) and the tokenizer of bench/peer_llamacpp.py. Weights as
transformers initialises them: matrices ~ N(0, 0.02), norms 1; drawn per tensor from
``SeedSequence(seed).spawn``, so the checkpoint is the same for a seed whatever the thread count.

    python bench/qwen3_numpy.py OUT_DIR [--layers 24 --experts 32 --width 768 --hidden 2048 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

#: the H200 fixture's widths (bench/h200_trunk.py: Qwen3-30B-A3B's hidden, heads and expert width)
H200_SIZES = dict(
    vocab_size=32000,
    hidden_size=2048,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=32,
    num_experts_per_tok=8,
)


def config(sizes: dict) -> dict:
    """config.json as transformers 5 writes a Qwen3MoeConfig (plus ``num_experts``, its 4.x name)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **sizes,
        "num_local_experts": sizes["num_experts"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "dtype": "bfloat16",
    }


def layer_shapes(sizes: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of decoder layer ``layer`` (transformers' Qwen3-MoE names)."""
    h, hd = sizes["hidden_size"], sizes["head_dim"]
    q, kv, i = (
        sizes["num_attention_heads"] * hd,
        sizes["num_key_value_heads"] * hd,
        sizes["moe_intermediate_size"],
    )
    p = f"model.layers.{layer}."
    out = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
        p + "mlp.gate.weight": (sizes["num_experts"], h),
    }
    for e in range(sizes["num_experts"]):
        out |= {
            p + f"mlp.experts.{e}.gate_proj.weight": (i, h),
            p + f"mlp.experts.{e}.up_proj.weight": (i, h),
            p + f"mlp.experts.{e}.down_proj.weight": (h, i),
        }
    return out


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even (as torch's .to(bfloat16))."""
    u = x.astype(np.float32, copy=False).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> int:
    """One safetensors file of bf16 tensors given as uint16 bit arrays (written to a temp name, renamed).
    Returns the tensor bytes."""
    header, off = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a).tobytes())
    os.replace(tmp, path)
    return off


def _draw(seq: np.random.SeedSequence, name: str, shape: tuple) -> np.ndarray:
    if len(shape) == 1:  # norms: ones, as transformers initialises them
        return bf16_bits(np.ones(shape, np.float32))
    g = np.random.default_rng(seq)
    return bf16_bits(g.standard_normal(shape, dtype=np.float32) * np.float32(0.02))


def build(
    folder: Path, sizes: dict = H200_SIZES, seed: int = 0, threads: int | None = None, tokenizer: bool = True
) -> dict:
    """Write the checkpoint into ``folder`` (config.json last: it marks the folder complete).
    Returns {"bytes": tensor bytes, "seconds": wall time}."""
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    n = sizes["num_hidden_layers"]
    shards = [f"model-{i + 1:05d}-of-{n + 1:05d}.safetensors" for i in range(n + 1)]
    h, v = sizes["hidden_size"], sizes["vocab_size"]
    plans = [layer_shapes(sizes, lay) for lay in range(n)]
    plans.append({"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)})
    names = [name for p in plans for name in p]
    seqs = dict(zip(names, np.random.SeedSequence(seed).spawn(len(names))))  # one stream per tensor
    weight_map, total = {}, 0
    with ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool:  # numpy's fills release the GIL
        for shard, shapes in zip(shards, plans):
            arrays = dict(zip(shapes, pool.map(lambda kv: _draw(seqs[kv[0]], *kv), shapes.items())))
            total += write_safetensors(folder / shard, arrays)
            weight_map |= {name: shard for name in shapes}
            del arrays
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    if tokenizer:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import peer_llamacpp

        peer_llamacpp.build_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(config(sizes), indent=2))
    return {"bytes": total, "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
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
        ap.add_argument(f"--{name}", type=int, default=H200_SIZES[key], dest=key)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    sizes = {**H200_SIZES, **{k: getattr(a, k) for k in H200_SIZES if hasattr(a, k)}}
    out = Path(a.out)
    if (out / "config.json").exists():
        print(f"{out}: already built")
        return 0
    r = build(out, sizes, a.seed, a.threads)
    print(f"{out}: {r['bytes'] / 1e9:.2f} GB of bf16 tensors in {r['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
