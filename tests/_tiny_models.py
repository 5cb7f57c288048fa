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
