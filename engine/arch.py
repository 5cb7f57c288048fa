"""Read a Hugging Face ``config.json`` into an :class:`~colibri_plan.formats.arch.ArchConfig`.

See :mod:`colibri_plan.formats.arch` for the families and the fields.
"""

from __future__ import annotations

from colibri_plan.errors import FormatError, UnsupportedError
from colibri_plan.formats.arch import (
    MLA_FAMILIES,
    SUPPORTED_FAMILIES,
    ArchConfig,
)


def _rope(cfg: dict) -> tuple[float, float, float]:
    """(rope_theta, partial_rotary_factor, linear factor) from either config layout."""
    rp = cfg.get("rope_parameters") or {}
    if rp and all(isinstance(v, dict) for v in rp.values()):
        raise UnsupportedError("per-layer-type rope_parameters are not supported")
    legacy = cfg.get("rope_scaling") or {}
    rope_type = rp.get("rope_type") or rp.get("type") or legacy.get("rope_type") or legacy.get("type") \
        or "default"
    theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    factor = 1.0
    if rope_type == "linear":
        factor = float(rp.get("factor", legacy.get("factor", 1.0)))
    elif rope_type != "default":
        raise UnsupportedError(f"RoPE type {rope_type!r} is not supported (default and linear are)")
    return float(theta), (None if prf is None else float(prf)), factor


def _need(cfg: dict, *names: str):
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    raise FormatError(f"config.json lacks {' / '.join(names)}")


def arch_from_hf_config(config: dict, allow_mla: bool = False) -> ArchConfig:
    """Read an :class:`ArchConfig` from a Hugging Face ``config.json`` dict.

    ``allow_mla=True`` returns DeepSeek-V2/V3 geometry (``attention="mla"``; head_dim = nope + rope
    channels) for planning; the forward pass still refuses it (:meth:`ArchConfig.check_supported`).

    Raises:
        UnsupportedError: unknown ``model_type``; MLA attention (DeepSeek-V2/V3, named in the message)
            unless ``allow_mla``; a RoPE scaling type other than default/linear.
        FormatError: a required key is missing or values are inconsistent.
    """
    if not isinstance(config, dict):
        raise FormatError("config.json must hold a JSON object")
    mt = config.get("model_type")
    if mt in MLA_FAMILIES:
        if not allow_mla:
            raise UnsupportedError(
                f"{mt}: multi-head latent attention (MLA) is not supported yet; its MoE block is, but the "
                f"model cannot run without MLA. Supported families: {', '.join(SUPPORTED_FAMILIES)}")
        return _deepseek_arch(config)
    if mt not in SUPPORTED_FAMILIES:
        raise UnsupportedError(f"model family {mt!r} ({', '.join(config.get('architectures') or [])}) is "
                               f"not supported; supported: {', '.join(SUPPORTED_FAMILIES)}")
    hidden = int(_need(config, "hidden_size"))
    n_layers = int(_need(config, "num_hidden_layers"))
    n_heads = int(_need(config, "num_attention_heads"))
    head_dim = int(config.get("head_dim") or hidden // n_heads)
    theta, prf, scale = _rope(config)
    act = config.get("hidden_act", "silu")
    common = dict(
        family=mt, architecture=(config.get("architectures") or [""])[0],
        vocab_size=int(_need(config, "vocab_size")), hidden_size=hidden, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=int(config.get("num_key_value_heads") or n_heads), head_dim=head_dim,
        rope_theta=theta, rope_scaling_factor=scale, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), hidden_act=act,
        top_k=int(_need(config, "num_experts_per_tok")),
    )
    inter = int(config.get("intermediate_size") or 0)
    if mt == "mixtral":
        sw = config.get("sliding_window")
        return ArchConfig(
            **common, n_experts=int(_need(config, "num_local_experts")), moe_intermediate_size=inter,
            moe_layers=tuple(range(n_layers)), partial_rotary_factor=prf or 1.0, norm_topk_prob=True,
            sliding_window=int(sw) if sw else None, sliding_layers=tuple(range(n_layers)) if sw else ())
    if mt in ("qwen2_moe", "qwen3_moe"):
        n_exp = int(_need(config, "num_experts", "num_local_experts"))
        step = int(config.get("decoder_sparse_step", 1) or 1)
        mlp_only = set(config.get("mlp_only_layers") or [])
        moe = tuple(i for i in range(n_layers) if i not in mlp_only and n_exp > 0 and (i + 1) % step == 0)
        sw = config.get("sliding_window") if config.get("use_sliding_window") else None
        if mt == "qwen2_moe":
            types = config.get("layer_types") or []
            sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if sw else ()
            shared = int(config.get("shared_expert_intermediate_size") or 0)
            extra = dict(attention_bias=bool(config.get("qkv_bias", True)), n_shared_experts=int(shared > 0),
                         shared_intermediate_size=shared, shared_expert_gate=shared > 0)
        else:
            sliding = tuple(range(n_layers)) if sw else ()
            extra = dict(attention_bias=bool(config.get("attention_bias", False)), qk_norm="head")
        return ArchConfig(
            **common, **extra, n_experts=n_exp,
            moe_intermediate_size=int(_need(config, "moe_intermediate_size")), moe_layers=moe,
            dense_intermediate_size=inter, partial_rotary_factor=prf or 1.0,
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            sliding_window=int(sw) if sw else None, sliding_layers=sliding)
    if mt == "olmoe":
        clip = config.get("clip_qkv")
        return ArchConfig(
            **common, n_experts=int(_need(config, "num_experts", "num_local_experts")),
            moe_intermediate_size=inter, moe_layers=tuple(range(n_layers)), partial_rotary_factor=prf or 1.0,
            attention_bias=bool(config.get("attention_bias", False)), qk_norm="full",
            clip_qkv=None if clip is None else float(clip),
            norm_topk_prob=bool(config.get("norm_topk_prob", False)))
    # glm4_moe: DeepSeek-V3-style router with GQA attention
    k_dense = int(config.get("first_k_dense_replace", 1))
    n_shared = int(config.get("n_shared_experts", 0) or 0)
    moe_inter = int(_need(config, "moe_intermediate_size"))
    return ArchConfig(
        **common, n_experts=int(_need(config, "n_routed_experts", "num_local_experts")),
        moe_intermediate_size=moe_inter, moe_layers=tuple(range(k_dense, n_layers)),
        dense_intermediate_size=inter, partial_rotary_factor=0.5 if prf is None else prf,
        attention_bias=bool(config.get("attention_bias", False)),
        qk_norm="head" if config.get("use_qk_norm") else None,
        n_shared_experts=n_shared, shared_intermediate_size=n_shared * moe_inter,
        first_k_dense_replace=k_dense, scoring="sigmoid",
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=int(config.get("n_group", 1) or 1), topk_group=int(config.get("topk_group", 1) or 1),
        group_score="top2_sum", e_score_correction_bias=True)


def _deepseek_arch(config: dict) -> ArchConfig:
    """DeepSeek-V2/V3 geometry (MLA attention; the MoE block as in their transformers routers)."""
    mt = config["model_type"]
    n_layers = int(_need(config, "num_hidden_layers"))
    n_heads = int(_need(config, "num_attention_heads"))
    rope_d = int(_need(config, "qk_rope_head_dim"))
    head_dim = int(_need(config, "qk_nope_head_dim")) + rope_d
    # MLA models use YaRN scaling; only the base matters for planning (the forward pass refuses MLA)
    theta = float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 1e4)))
    k_dense = int(config.get("first_k_dense_replace", 0) or 0)
    freq = int(config.get("moe_layer_freq", 1) or 1)
    types = config.get("mlp_layer_types")  # GLM-5: "dense"/"sparse" per layer, when given
    moe = (tuple(i for i, t in enumerate(types) if t == "sparse") if types
           else tuple(i for i in range(k_dense, n_layers) if i % freq == 0))
    n_shared = int(config.get("n_shared_experts", 0) or 0)
    moe_inter = int(_need(config, "moe_intermediate_size"))
    v3 = mt != "deepseek_v2" or config.get("scoring_func") == "sigmoid"  # sigmoid + bias routers
    grouped = v3 or config.get("topk_method") == "group_limited_greedy"
    return ArchConfig(
        family=mt, architecture=(config.get("architectures") or [""])[0], attention="mla",
        vocab_size=int(_need(config, "vocab_size")), hidden_size=int(_need(config, "hidden_size")),
        n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, head_dim=head_dim, rope_theta=theta,
        partial_rotary_factor=rope_d / head_dim, rope_interleave=bool(config.get("rope_interleave", True)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        n_experts=int(_need(config, "n_routed_experts", "num_experts")),
        top_k=int(_need(config, "num_experts_per_tok")), moe_intermediate_size=moe_inter,
        moe_layers=moe,
        dense_intermediate_size=int(config.get("intermediate_size") or 0),
        n_shared_experts=n_shared, shared_intermediate_size=n_shared * moe_inter,
        first_k_dense_replace=k_dense, scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=bool(config.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=int(config.get("n_group", 1) or 1) if grouped else 1,
        topk_group=int(config.get("topk_group", 1) or 1) if grouped else 1,
        group_score="top2_sum" if v3 else "max", e_score_correction_bias=v3,
        hidden_act=config.get("hidden_act", "silu"))
