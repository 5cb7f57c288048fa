"""Read MoE geometry from a Hugging Face ``config.json`` dict (real field names, never library defaults).

Field names by family (as written in the published checkpoints' config.json):

- routed experts E: ``num_local_experts`` (Mixtral, gpt-oss), ``num_experts`` (Qwen2/3-MoE, OLMoE,
  Qwen3-Next/3.5), ``n_routed_experts`` (DeepSeek-V2/V3/V4, GLM-4.x/5, Kimi K2);
- top-k: ``num_experts_per_tok`` (gpt-oss's original config also ``experts_per_token``);
- expert width I: ``moe_intermediate_size``, except Mixtral, OLMoE and gpt-oss, whose experts are
  ``intermediate_size`` wide;
- shared experts: Qwen2-MoE/Qwen3-Next have one, ``shared_expert_intermediate_size`` wide; DeepSeek/GLM
  have ``n_shared_experts`` of width I;
- dense (non-MoE) layers: ``first_k_dense_replace`` and ``moe_layer_freq`` (DeepSeek/GLM/Kimi),
  ``mlp_layer_types`` ("dense"/"sparse", newer GLM), ``mlp_only_layers`` and ``decoder_sparse_step``
  (Qwen);
- MTP heads: ``num_nextn_predict_layers`` (DeepSeek-V3/V4, GLM-4.5, GLM-5).

Multimodal configs keep the language model under ``text_config`` (Qwen3.5, Kimi K2.5); it is used when
present.
"""

from __future__ import annotations

from typing import Any

from colibri_plan.errors import FormatError, UnsupportedError

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
#: families whose experts are ``intermediate_size`` wide (no separate moe_intermediate_size field)
_I_FROM_INTERMEDIATE = ("mixtral", "olmoe", "gpt_oss", "phimoe", "jamba")


def text_config(cfg: dict) -> dict:
    """The language-model part of a config (``text_config`` of multimodal configs, else ``cfg``)."""
    tc = cfg.get("text_config")
    if isinstance(tc, dict) and any(k in tc for k in _EXPERT_KEYS):
        return tc
    return cfg


def _int(cfg: dict, key: str, where: str, default: Any = None) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise FormatError(f"{where}: config has no {key!r}; it is needed to size the model")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise FormatError(f"{where}: config field {key!r} must be a non-negative integer, got {v!r}")
    return v


def is_moe_layer(cfg: dict, layer: int) -> bool:
    """Whether decoder layer ``layer`` has routed experts, by the family's own rule."""
    types = cfg.get("mlp_layer_types")
    if isinstance(types, list) and layer < len(types):
        return str(types[layer]).lower() in ("sparse", "moe")
    if "first_k_dense_replace" in cfg or "moe_layer_freq" in cfg:
        k = int(cfg.get("first_k_dense_replace") or 0)
        freq = cfg.get("moe_layer_freq") or 1
        if isinstance(freq, list):  # Megatron-style per-layer pattern, e.g. [0]*3 + [1]*58
            return layer >= k and layer < len(freq) and bool(freq[layer])
        return layer >= k and layer % int(freq) == 0
    if layer in (cfg.get("mlp_only_layers") or []):
        return False
    step = int(cfg.get("decoder_sparse_step") or 1)
    return (layer + 1) % step == 0


def moe_geometry(cfg: dict, where: str) -> dict:
    """Geometry fields of :class:`~colibri_plan.formats.model_spec.ModelSpec` from a config dict.

    Returns a dict with family, n_layers, moe_layers (decoder layers only, no MTP), mtp_layers (count of
    MTP heads the config declares), n_experts, top_k, n_shared_experts, hidden_size,
    moe_intermediate_size, shared_intermediate_size, vocab_size, expert_bias.

    Raises:
        UnsupportedError: the config has no routed-expert fields (a dense model).
        FormatError: a needed field is missing or not an integer.
    """
    cfg = text_config(cfg)
    family = str(cfg.get("model_type") or "unknown")
    e_key = next((k for k in _EXPERT_KEYS if cfg.get(k)), None)
    if e_key is None:
        raise UnsupportedError(
            f"{where}: config.json has no routed-expert field ({', '.join(_EXPERT_KEYS)}): "
            f"model_type {family!r} is not a Mixture-of-Experts model; colibri-plan sizes MoE models only")
    n_experts = _int(cfg, e_key, where)
    top_key = "num_experts_per_tok" if "num_experts_per_tok" in cfg else "experts_per_token"
    top_k = _int(cfg, top_key, where)
    hidden = _int(cfg, "hidden_size", where)
    n_layers = _int(cfg, "num_hidden_layers", where)
    if family in _I_FROM_INTERMEDIATE or "moe_intermediate_size" not in cfg:
        inter = _int(cfg, "intermediate_size", where)
    else:
        inter = _int(cfg, "moe_intermediate_size", where)
    if cfg.get("shared_expert_intermediate_size"):
        n_shared, shared_i = 1, _int(cfg, "shared_expert_intermediate_size", where)
    else:
        n_shared = _int(cfg, "n_shared_experts", where, 0) if "n_shared_experts" in cfg else 0
        shared_i = n_shared * inter
    vocab = _int(cfg, "vocab_size", where)
    moe_layers = tuple(i for i in range(n_layers) if is_moe_layer(cfg, i))
    if not moe_layers:
        raise FormatError(f"{where}: by its config no layer of this model has routed experts")
    return {"family": family, "n_layers": n_layers, "moe_layers": moe_layers,
            "mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0), "n_experts": n_experts,
            "top_k": top_k, "n_shared_experts": n_shared, "hidden_size": hidden,
            "moe_intermediate_size": inter, "shared_intermediate_size": shared_i, "vocab_size": vocab,
            "expert_bias": family == "gpt_oss"}


def _per_token_layers(cfg: dict) -> int:
    """Layers whose KV cache grows with every context token (sliding-window and linear-attention
    layers hold a fixed-size state)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        return sum(1 for t in types[:n] if t == "full_attention")
    interval = cfg.get("full_attention_interval")
    if interval:
        return n // int(interval)
    return n


def kv_bytes_per_token(cfg: dict, bytes_per_value: int = 2, mtp_layers: int = 0) -> int:
    """KV-cache bytes per context token for a config, at ``bytes_per_value`` (2 = a bf16/f16 cache).

    - MLA (``kv_lora_rank``; DeepSeek-V2/V3, GLM-4.7-Flash, GLM-5, Kimi K2): the cached latent,
      (kv_lora_rank + qk_rope_head_dim) values per layer.
    - GQA: 2 · n_kv_heads · head_dim values per full-attention layer (``head_dim`` defaults to
      hidden/heads). Sliding-window (gpt-oss) and linear-attention (Qwen3-Next/3.5) layers keep a fixed
      state and are not counted per token.
    MTP heads add one attention layer each.
    """
    cfg = text_config(cfg)
    layers = _per_token_layers(cfg) + int(mtp_layers)
    if cfg.get("kv_lora_rank"):
        per_layer = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
    else:
        heads = int(cfg.get("num_attention_heads") or 1)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_layer = 2 * kv_heads * head_dim
    return layers * per_layer * int(bytes_per_value)
