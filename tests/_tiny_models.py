"""Tiny random-weight MoE models built with transformers (offline, float32, seeded), for engine tests.

Weights are re-drawn with a larger std than transformers' init (0.02) so that router margins are
meaningful and greedy tokens vary; norms get 1 + small noise so that a wrong norm placement shows.
torch/transformers are imported inside the functions (heavy imports stay lazy).
"""

from __future__ import annotations

COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=512)

# family -> (config class, model class, extra config). Each exercises the family's own features.
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # shared expert + gate, qkv bias, a dense layer
                  dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # per-head q/k norm, head_dim != H/heads, tied
                  dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       head_dim=24, norm_topk_prob=True, tie_word_embeddings=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",  # q/k norm over the full projection, clip_qkv
              dict(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2, clip_qkv=2.0,
                   eos_token_id=None, pad_token_id=None)),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",  # sigmoid+bias, groups, scaling, partial rope
                 dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                      first_k_dense_replace=1,
                      routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                      num_nextn_predict_layers=0)),
}


def build(family: str, folder, seed: int = 0, std: float = 0.15, dtype=None, **overrides):
    """Build, re-initialise and save_pretrained (safetensors) a tiny model of ``family``
    (``overrides`` replace config entries).

    Returns the transformers model (eval mode, float32) after saving it to ``folder``.
    """
    import torch
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
            else:  # norm weights and biases
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a real bias moves the choice, not the weights
                b.copy_(0.3 * torch.randn_like(b))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(folder))
    return model


def record_router_ids(model):
    """Attach hooks to every router module; returns (ids list per call order, remove fn).

    Each router returns (logits, weights, indices); ``calls`` collects the indices [T, K] in call order
    (layer order within a forward).
    """
    calls = []
    handles = [m.register_forward_hook(lambda mod, inp, out: calls.append(out[2].detach().numpy().copy()))
               for m in model.modules() if type(m).__name__.lower().endswith("router")]

    def remove():
        for h in handles:
            h.remove()
    return calls, remove


def logits(model, ids):
    """Full-sequence logits float32 [T, V] of a transformers model for ids [T]."""
    import torch

    with torch.no_grad():
        out = model(torch.as_tensor([list(ids)], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def greedy(model, prompt, n):
    """n greedy tokens by full recomputation each step (no cache involved on the reference side)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def expert_tensor_names(family: str, layer: int, e: int) -> tuple[str, str, str]:
    """HF names of (gate, up, down) of one expert, as save_pretrained writes them."""
    p = f"model.layers.{layer}."
    if family == "mixtral":
        return tuple(f"{p}block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
    return tuple(f"{p}mlp.experts.{e}.{r}_proj.weight" for r in ("gate", "up", "down"))


def with_dequantized_experts(folder, weights, out):
    """Copy checkpoint ``folder`` to ``out`` with every routed expert replaced by
    dequantize(weights.expert(layer, e)); returns ``out``."""
    import shutil
    from pathlib import Path

    from safetensors.numpy import load_file, save_file

    from colibri_plan.quant import dequantize

    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(folder / "config.json", out / "config.json")
    tensors = load_file(str(folder / "model.safetensors"))
    for layer, e in weights.expert_keys():
        for name, qt in zip(expert_tensor_names(weights.arch.family, layer, e), weights.expert(layer, e)):
            assert name in tensors, name
            tensors[name] = dequantize(qt)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_hf(folder, family: str):
    """from_pretrained of a tiny model folder (float32, eval mode)."""
    import transformers

    return getattr(transformers, FAMILIES[family][1]).from_pretrained(str(folder)).eval()


# ---- MLA families (DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-4.7-Flash, GLM-5) -------------------------------

MLA_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                  n_shared_experts=1, max_position_embeddings=512, num_hidden_layers=3,
                  first_k_dense_replace=1)

# name -> (config class, model class, extra config, model_type written to config.json or None)
MLA_FAMILIES = {
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",  # q LoRA, group-limited greedy (group max)
                    dict(q_lora_rank=32, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                         routed_scaling_factor=1.5), None),
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",  # plain q_proj, greedy top-k
                         dict(q_lora_rank=None, topk_method="greedy", num_hidden_layers=2), None),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # sigmoid + bias, top-2-sum groups, scaling
                    dict(q_lora_rank=32, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                         num_nextn_predict_layers=0), None),
    "kimi_k2": ("DeepseekV3Config", "DeepseekV3ForCausalLM",  # DeepSeek-V3 architecture, labelled kimi_k2
                dict(q_lora_rank=32, n_group=1, topk_group=1, routed_scaling_factor=2.827,
                     num_nextn_predict_layers=0, v_head_dim=24), "kimi_k2"),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",  # GLM-4.7-Flash: V3 maths, GLM layout
                      dict(q_lora_rank=32, n_group=1, topk_group=1, routed_scaling_factor=1.8,
                           num_hidden_layers=2, rms_norm_eps=1e-5), None),
    # DSA (index_topk >= 64: the tests' 48-token contexts stay within it, where DSA is plain MLA)
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",  # DeepSeek-V3.2: indexer every layer
                     dict(q_lora_rank=32, n_group=4, topk_group=2, routed_scaling_factor=2.5, index_topk=64,
                          index_n_heads=2, index_head_dim=16), None),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM",  # GLM-5: layer 1 reuses layer 0's choice
                    dict(q_lora_rank=32, n_group=1, topk_group=1, routed_scaling_factor=2.5, index_topk=64,
                         index_n_heads=2, index_head_dim=16, indexer_types=["full", "shared", "full"],
                         rms_norm_eps=1e-5), None),
}


#: name -> (first seed whose router gaps are >= 1e-3 on the tests' sequences, router weight std: softmax
#: routers want smaller logits than sigmoid ones for their probabilities to spread)
MLA_SEEDS = {"deepseek_v2": (4, 0.15), "deepseek_v2_lite": (2, 0.2), "deepseek_v3": (3, 0.6),
             "kimi_k2": (0, 0.6), "glm4_moe_lite": (0, 0.6), "deepseek_v32": (0, 0.6),
             "glm_moe_dsa": (1, 0.6)}


def build_mla(name: str, folder, seed: int | None = None, std: float = 0.2, router_std: float | None = None,
              **overrides):
    """Build, re-initialise (as :func:`build`; router weights with ``router_std`` so that router scores
    spread; seed and router_std default to :data:`MLA_SEEDS`) and save a tiny MLA model of
    ``MLA_FAMILIES[name]``; the config.json's model_type is relabelled when the entry says so (Kimi-K2).
    Returns the model (eval mode, float32)."""
    seed = MLA_SEEDS[name][0] if seed is None else seed
    router_std = MLA_SEEDS[name][1] if router_std is None else router_std
    import json
    from pathlib import Path

    import torch
    import transformers

    cfg_name, model_name, extra, label = MLA_FAMILIES[name]
    cfg = getattr(transformers, cfg_name)(**{**MLA_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, router_std if pname.endswith("mlp.gate.weight") else std)
            else:
                p.copy_((1.0 if "norm" in pname else 0.0) + 0.1 * torch.randn_like(p))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(str(folder))
    if label:
        path = Path(folder) / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "model_type": label}, indent=2))
    return model


def min_router_gap(model, seqs) -> float:
    """Smallest gap, over every token of ``seqs`` and every router, between the k-th and (k+1)-th choice
    score (and, for group-limited routers, between the topk_group-th and next group score), with the
    router semantics of transformers (sigmoid + e_score_correction_bias, top-2-sum groups; or softmax with
    group max for DeepSeek-V2's group_limited_greedy)."""
    import numpy as np
    import torch

    seen = []

    def hook(mod, inp, out):
        seen.append((mod, out[0].detach().numpy().copy()))  # router logits [T, E]

    routers = [m for m in model.modules() if type(m).__name__.lower().endswith("router")]
    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        with torch.no_grad():
            for s in seqs:
                model(torch.as_tensor([list(s)], dtype=torch.long), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    gaps = []
    for mod, logits in seen:
        logits = logits.astype(np.float64).reshape(-1, logits.shape[-1])
        bias = getattr(mod, "e_score_correction_bias", None)
        if bias is not None:
            s = 1 / (1 + np.exp(-logits)) + bias.detach().numpy()
        else:
            z = np.exp(logits - logits.max(axis=1, keepdims=True))
            s = z / z.sum(axis=1, keepdims=True)
        g, tg = getattr(mod, "num_group", 1) or 1, getattr(mod, "topk_group", 1) or 1
        if getattr(mod, "topk_method", "group_limited_greedy") != "group_limited_greedy":
            g = 1
        if g > 1 and tg < g:
            grouped = s.reshape(len(s), g, -1)
            gs = np.sort(grouped, axis=2)[:, :, -2:].sum(2) if bias is not None else grouped.max(2)  # [T, G]
            ordered = -np.sort(-gs, axis=1)
            gaps.append((ordered[:, tg - 1] - ordered[:, tg]).min())
            mask = np.zeros_like(gs, dtype=bool)
            np.put_along_axis(mask, np.argsort(-gs, axis=1)[:, :tg], True, axis=1)
            s = np.where(np.repeat(mask, s.shape[1] // g, axis=1), s, -np.inf)
        k = mod.top_k
        ss = -np.sort(-s, axis=1)
        gaps.append((ss[:, k - 1] - ss[:, k]).min())
    return float(min(gaps))


# ---- a tiny Mixtral checkpoint written with numpy only (no torch): fuzz and bad-input tests -------------

NUMPY_MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], vocab_size=32,
                     hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=8,
                     rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
#: the first of its two shards (embed, norm, LM head and layer 0); the second holds layer 1
SHARD = "model-00001-of-00002.safetensors"


def numpy_mixtral_tensors(layers: int = 2) -> list[dict]:
    """HF-named float32 tensors of :data:`NUMPY_MIXTRAL`, one dict per shard (layer i in shard i)."""
    import numpy as np

    c = NUMPY_MIXTRAL
    h, nh, nkv, d, i_, e_, v = (c[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                "head_dim", "intermediate_size", "num_local_experts",
                                                "vocab_size"))
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    shards = [{"model.embed_tokens.weight": r(v, h), "model.norm.weight": 1 + r(h),
                "lm_head.weight": r(v, h)}]
    shards += [{} for _ in range(layers - 1)]
    for i in range(layers):
        p, t = f"model.layers.{i}.", shards[i]
        t.update({p + "input_layernorm.weight": 1 + r(h), p + "post_attention_layernorm.weight": 1 + r(h),
                  p + "self_attn.q_proj.weight": r(nh * d, h), p + "self_attn.k_proj.weight": r(nkv * d, h),
                  p + "self_attn.v_proj.weight": r(nkv * d, h), p + "self_attn.o_proj.weight": r(h, nh * d),
                  p + "block_sparse_moe.gate.weight": r(e_, h)})
        for e in range(e_):
            q = f"{p}block_sparse_moe.experts.{e}."
            t.update({q + "w1.weight": r(i_, h), q + "w3.weight": r(i_, h), q + "w2.weight": r(h, i_)})
    return shards


def write_numpy_mixtral(folder, layers: int = 2, **config):
    """Write :data:`NUMPY_MIXTRAL` (``config`` entries replaced) with ``layers`` layers of weights as
    ``layers`` shards plus ``model.safetensors.index.json`` into ``folder``; returns the folder."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**NUMPY_MIXTRAL, "num_hidden_layers": layers, **config}))
    weight_map = {}
    for k, t in enumerate(numpy_mixtral_tensors(layers)):
        name = f"model-{k + 1:05d}-of-{layers:05d}.safetensors"
        save_file(t, str(folder / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in t})
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder
