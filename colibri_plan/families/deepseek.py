"""Multi-head latent attention (MLA) families: plan-only (the engine refuses MLA for now).

| model_type      | model                                   | transformers config class |
|-----------------|-----------------------------------------|---------------------------|
| deepseek_v2     | DeepSeek-V2, V2-Lite                    | ``DeepseekV2Config``      |
| deepseek_v3     | DeepSeek-V3/R1 (Kimi K2 ships this too) | ``DeepseekV3Config``      |
| deepseek_v32    | DeepSeek-V3.2 (+ DSA indexer)           | ``DeepseekV32Config``     |
| kimi_k2         | Kimi K2 (DeepSeek-V3 architecture)      | (remote code)             |
| glm_moe_dsa     | GLM-5 / GLM-5.x                         | ``GlmMoeDsaConfig``       |
| glm4_moe_lite   | GLM-4.7-Flash                           | ``Glm4MoeLiteConfig``     |

config.json keys: ``n_routed_experts`` (E), ``num_experts_per_tok`` (k), ``moe_intermediate_size`` (I),
``n_shared_experts`` (n_shared · I wide), ``first_k_dense_replace`` (default 0) + ``moe_layer_freq``, or
``mlp_layer_types`` (GLM-5); ``qk_nope_head_dim`` + ``qk_rope_head_dim`` (a query/key head's channels),
``kv_lora_rank`` (the cached latent); ``num_nextn_predict_layers`` (MTP heads). Router: DeepSeek-V2 is
softmax (group max when ``topk_method`` is "group_limited_greedy"); the others sigmoid +
``e_score_correction_bias`` with group-limited top-k (``n_group`` / ``topk_group``), top-2-sum groups.

Planning: KV bytes per token = (kv_lora_rank + qk_rope_head_dim) values per layer (bf16 = 2 B), one more
layer per MTP head; the DSA indexer's cache is not counted.
"""

from __future__ import annotations

from colibri_plan.families.base import (
    ConfigReader,
    PlanGeometry,
    attention_fields,
    dense_prefix_moe_layers,
    full_attention_layers,
)
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa", "glm4_moe_lite")
#: why the engine refuses it (its MoE block is implemented, its attention is not)
REFUSE = ("multi-head latent attention (MLA) is not supported yet; its MoE block is, but the model cannot "
          "run without MLA")
TENSORS = None


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of an MLA config (``attention="mla"``; head_dim = nope + rope channels, every head its
    own key/value head)."""
    f = attention_fields(c)
    rope_d = c.need_int("qk_rope_head_dim")
    head_dim = c.need_int("qk_nope_head_dim") + rope_d
    n_shared = c.opt_int("n_shared_experts", 0)
    moe_inter = c.need_int("moe_intermediate_size")
    v3 = c.model_type != "deepseek_v2" or c.cfg.get("scoring_func") == "sigmoid"  # sigmoid + bias routers
    grouped = v3 or c.cfg.get("topk_method") == "group_limited_greedy"
    f.update(n_kv_heads=f["n_heads"], head_dim=head_dim, partial_rotary_factor=rope_d / head_dim,
             rope_scaling_factor=1.0)  # MLA models use YaRN; only the base matters for planning
    return ArchConfig(
        **f, attention="mla", rope_interleave=c.opt_bool("rope_interleave", True),
        n_experts=c.need_int("n_routed_experts", "num_experts"), moe_intermediate_size=moe_inter,
        moe_layers=dense_prefix_moe_layers(c, f["n_layers"], default_k=0),
        dense_intermediate_size=c.opt_int("intermediate_size", 0),
        n_shared_experts=n_shared, shared_intermediate_size=n_shared * moe_inter,
        first_k_dense_replace=c.opt_int("first_k_dense_replace", 0), scoring="sigmoid" if v3 else "softmax",
        norm_topk_prob=c.opt_bool("norm_topk_prob", v3),
        routed_scaling_factor=c.opt_float("routed_scaling_factor", 1.0),
        n_group=(c.opt_int("n_group", 1) or 1) if grouped else 1,
        topk_group=(c.opt_int("topk_group", 1) or 1) if grouped else 1,
        group_score="top2_sum" if v3 else "max", e_score_correction_bias=v3)


def plan(c: ConfigReader, arch: ArchConfig) -> PlanGeometry:
    """MLA cache: kv_lora_rank + qk_rope_head_dim values per layer and context token."""
    return PlanGeometry(arch, c.need_int("kv_lora_rank") + c.need_int("qk_rope_head_dim"),
                        full_attention_layers(c, arch.n_layers), c.opt_int("num_nextn_predict_layers", 0))
