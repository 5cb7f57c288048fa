"""Checkpoints, GGUFs and packs for bench/replay_llamacpp.py (cached in its work folder).

Two checkpoints:

* ``qwen3``: the random Qwen3-MoE of bench/peer_llamacpp.py (its ``build_checkpoint``: bf16, 8 layers,
  32 experts top-8 of width 1024, hidden 2048; 1.84 GB at Q8_0), for the placement replay;
* ``glm``: a GLM-4.5-style MoE (``glm4_moe``: sigmoid router with ``e_score_correction_bias``, one shared
  expert, a dense first layer) written tensor by tensor, so a checkpoint larger than RAM never sits in
  memory. Its correction bias is ``-skew * ln(rank)`` over a random ranking per layer, which makes the
  routing heat Zipf-like (the bias moves the choice, not the gate weights); ``skew`` 0 is unskewed. The
  embedding is drawn large (``embed_std`` 1) and the output projections (attention ``o_proj``, every
  ``down_proj``) small (``out_std`` 0.002), so the residual stream stays the current token's embedding and
  routing depends on the token and the bias only. At transformers' scales (0.02 for both) the sublayers'
  outputs outgrow the embedding, the residual takes a direction shared by the whole context, and the
  deep layers' hot experts follow the prompt: on a 17-layer build with 128-wide experts, heat of one
  512-token prompt put 0.88 of its own selections on its hottest fifth in layer 15 but 0.42 of another
  prompt's; at these scales 0.56 and 0.56 in every layer.

GGUFs come from llama.cpp's own tools: ``convert_hf_to_gguf.py`` (from the llama-cpp-python sdist's
vendored tree) and ``llama-quantize --pure`` (every matrix in the one type, as our packs). A checkpoint
whose f16 GGUF would not fit the disk is converted straight to Q8_0 by the converter (``--outtype q8_0``).
Our packs come from ``colibri-plan model pack`` (experts and dense trunk in the pair's format).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
#: llama.cpp type -> our format storing the same kind of weights (int8 rows / int4 in blocks of 32)
OURS_FOR = {"Q8_0": "int8", "Q4_0": "int4-g32"}
#: llama.cpp block formats: bytes per block of 32 weights (32 codes + one float16 scale)
GGUF_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}

GLM_SIZES = dict(vocab_size=8192, hidden_size=2048, num_hidden_layers=17, num_attention_heads=16,
                 num_key_value_heads=4, intermediate_size=4096, moe_intermediate_size=1024,
                 n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1)


def peer():
    """bench/peer_llamacpp.py as a module (its checkpoint builder and sdist fetcher; stdlib-only import)."""
    sys.path.insert(0, str(BENCH))
    import peer_llamacpp

    return peer_llamacpp


def llama_src(work: Path, given: str | None) -> Path:
    """llama.cpp's source tree (converter, gguf-py): ``given``, else the llama-cpp-python sdist's vendored
    copy (fetched into ``work/sdist`` with ``pip download --no-binary`` as bench/peer_llamacpp.py does)."""
    return peer().llama_src(work, sys.executable, given)


_CONVERT = """
import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}  # our BPE's hash is unknown to it
sys.argv = ["convert_hf_to_gguf.py", {ckpt!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def convert(src: Path, ckpt: Path, out: Path, outtype: str = "f16", pre: str = "qwen2") -> None:
    """``ckpt`` -> GGUF ``out`` with llama.cpp's converter (written to a temp name, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    code = _CONVERT.format(src=str(src), ckpt=str(ckpt), outtype=outtype, out=str(tmp), pre=pre)
    subprocess.run([sys.executable, "-c", code], check=True)
    os.replace(tmp, out)


def quantize(llama_bin: Path, src: Path, out: Path, qtype: str, threads: int) -> None:
    """``llama-quantize --pure SRC OUT QTYPE THREADS`` (temp name, then renamed)."""
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([str(llama_bin / "llama-quantize"), "--pure", str(src), str(tmp), qtype, str(threads)],
                   check=True, stdout=subprocess.DEVNULL)
    os.replace(tmp, out)


def pack(ckpt: Path, out: Path, fmt: str, colibri: str) -> None:
    """Our pack of ``ckpt``: experts and dense trunk in ``fmt`` (``colibri-plan model pack``)."""
    subprocess.run([colibri, "model", "pack", str(ckpt), str(out), "--quant", fmt, "--dense-quant", fmt],
                   check=True, stdout=subprocess.DEVNULL)


def gguf_bits_per_weight(qtype: str) -> float:
    """Stored bits per weight of a llama.cpp block type (Q8_0 8.5, Q4_0 4.5)."""
    return 8 * GGUF_BLOCK_BYTES[qtype] / 32


# ---- the skewed GLM-4.5-style checkpoint, written layer by layer ------------------------------------
def glm_config(sizes: dict) -> dict:
    """config.json of the GLM checkpoint (transformers ``Glm4MoeConfig`` keys, as save_pretrained writes
    them: no MTP layer, one expert group, no attention bias or q/k norm)."""
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **sizes,
            "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rope_type": "default"},
            "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
            "use_qk_norm": False, "attention_bias": False, "num_nextn_predict_layers": 0,
            "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "dtype": "bfloat16",
            "initializer_range": 0.02, "attention_dropout": 0.0, "use_cache": True}


def glm_layer_shapes(sizes: dict, layer: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of one decoder layer (HF names after ``model.layers.{layer}.``)."""
    h, hd = sizes["hidden_size"], sizes["hidden_size"] // sizes["num_attention_heads"]
    q, kv = sizes["num_attention_heads"] * hd, sizes["num_key_value_heads"] * hd
    out = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
           "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
           "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q)}
    if layer < sizes["first_k_dense_replace"]:
        i = sizes["intermediate_size"]
        return {**out, "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
                "mlp.down_proj.weight": (h, i)}
    i, e = sizes["moe_intermediate_size"], sizes["n_routed_experts"]
    s = sizes["n_shared_experts"] * i
    out |= {"mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,),
            "mlp.shared_experts.gate_proj.weight": (s, h), "mlp.shared_experts.up_proj.weight": (s, h),
            "mlp.shared_experts.down_proj.weight": (h, s)}
    for x in range(e):
        out |= {f"mlp.experts.{x}.gate_proj.weight": (i, h), f"mlp.experts.{x}.up_proj.weight": (i, h),
                f"mlp.experts.{x}.down_proj.weight": (h, i)}
    return out


def skew_bias(n_experts: int, skew: float, rank_order) -> list[float]:
    """Correction bias per expert: ``-skew * ln(rank)``, rank 1 the hottest, ``rank_order[r]`` the expert
    of rank r + 1. Sigmoid scores of router logits spread about 1 spread about 0.2, so on 64 experts
    top-8 skew 0.12 gives the hottest fifth a little over half the selections (the real OLMoE counts of
    shared/data/routing give it 0.29-0.63)."""
    bias = [0.0] * n_experts
    for r, e in enumerate(rank_order):
        bias[int(e)] = -skew * math.log(r + 1)
    return bias


def build_glm(folder: Path, sizes: dict = GLM_SIZES, skew: float = 0.12, seed: int = 0,
              out_std: float = 0.002, embed_std: float = 1.0) -> dict:
    """Write the GLM checkpoint into ``folder``: one safetensors shard per layer (+ one for embedding,
    norm and LM head), an index, config.json and a byte-level BPE tokenizer with GLM's special tokens
    (llama.cpp's converter looks them up). Matrices ~ N(0, 0.02), the embedding ~ N(0, embed_std),
    output projections ~ N(0, out_std), routers ~ N(0, 1/sqrt(hidden)) so their logits spread about 1,
    norms 1.
    Returns {"bytes": total tensor bytes, "rank_orders": [the expert of each rank, per MoE layer]}.
    """
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    n_layers, h = sizes["num_hidden_layers"], sizes["hidden_size"]
    shards = [f"model-{i + 1:05d}-of-{n_layers + 1:05d}.safetensors" for i in range(n_layers + 1)]
    weight_map, total, orders = {}, 0, []
    for layer in range(n_layers + 1):
        if layer == n_layers:   # the last shard: embedding, final norm, LM head
            shapes = {"model.embed_tokens.weight": (sizes["vocab_size"], h), "model.norm.weight": (h,),
                      "lm_head.weight": (sizes["vocab_size"], h)}
        else:
            shapes = {f"model.layers.{layer}.{k}": v for k, v in glm_layer_shapes(sizes, layer).items()}
        tensors = {}
        for name, shape in shapes.items():
            if name.endswith("e_score_correction_bias"):   # float32, as in the real checkpoints
                order = torch.randperm(shape[0], generator=g).tolist()
                orders.append(order)
                tensors[name] = torch.tensor(skew_bias(shape[0], skew, order), dtype=torch.float32)
            elif len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                std = (h ** -0.5 if name.endswith("mlp.gate.weight")
                       else out_std if name.endswith(("o_proj.weight", "down_proj.weight"))
                       else embed_std if name == "model.embed_tokens.weight" else 0.02)
                tensors[name] = (torch.randn(shape, generator=g) * std).to(torch.bfloat16)
            total += tensors[name].numel() * tensors[name].element_size()
            weight_map[name] = shards[layer]
        tmp = folder / (shards[layer] + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / shards[layer])
        del tensors
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    _glm_tokenizer(folder)
    (folder / "config.json").write_text(json.dumps(glm_config(sizes), indent=2))   # last: marks it done
    return {"bytes": total, "rank_orders": orders}


def _glm_tokenizer(folder: Path) -> None:
    """A 512-token byte-level BPE with the special tokens GLM's converter asks for (prompts are token ids
    or short text: the vocabulary's content does not matter)."""
    import tokenizers
    import transformers

    special = ["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>", "<|observation|>"]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=512, special_tokens=special,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                bos_token="[gMASK]")
    fast.save_pretrained(str(folder))


def heat_shares(heat_path: Path) -> dict:
    """Skew of a heat file: the share of all selections the hottest 10/20/30/50% of (layer, expert)
    pairs take, pooled over layers (each layer's experts ranked on their own)."""
    import numpy as np

    from colibri_plan.formats.heat import load_heat

    counts = np.asarray(load_heat(heat_path).counts, dtype=float)   # [moe layers, experts]
    ranked = -np.sort(-counts, axis=1)                              # each layer hottest first
    total = ranked.sum()
    e = counts.shape[1]
    return {f"top_{pc}pct": float(ranked[:, :max(1, round(e * pc / 100))].sum() / total)
            for pc in (10, 20, 30, 50)}


def heat_transfer(heat_a: Path, heat_b: Path, share: float = 0.2) -> float:
    """How well one prompt's heat predicts another's: the share of ``heat_b``'s selections that
    ``heat_a``'s hottest ``share`` of each layer's experts take (``share`` itself when routing ignores
    which experts were hot before; heat_b's own hottest take :func:`heat_shares`)."""
    import numpy as np

    from colibri_plan.formats.heat import load_heat

    a = np.asarray(load_heat(heat_a).counts, dtype=float)           # [moe layers, experts]
    b = np.asarray(load_heat(heat_b).counts, dtype=float)
    k = max(1, round(a.shape[1] * share))
    hot = np.argsort(-a, axis=1)[:, :k]                             # [layers, k] a's hottest
    return float(np.take_along_axis(b, hot, axis=1).sum() / b.sum())
