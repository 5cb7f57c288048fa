"""GLM-4.5 / GLM-4.6 / GLM-4.5-Air (``model_type`` "glm4_moe"; transformers ``Glm4MoeConfig``).

config.json keys: ``n_routed_experts`` (E), ``num_experts_per_tok`` (k), ``moe_intermediate_size`` (I),
``n_shared_experts`` (fused into one MLP n_shared · I wide), ``first_k_dense_replace`` (default 1, dense
layers first, ``intermediate_size`` wide), ``n_group`` / ``topk_group`` (group-limited top-k),
``routed_scaling_factor``, ``norm_topk_prob`` (default true), ``use_qk_norm``, ``attention_bias``,
``partial_rotary_factor`` (default 0.5), ``num_nextn_predict_layers`` (MTP heads: planned, not run).
DeepSeek-V3-style router: sigmoid scores + ``e_score_correction_bias`` for the choice only; GQA attention.

Tensors (after ``model.layers.{i}.``): ``mlp.gate.weight`` [E, H], ``mlp.gate.e_score_correction_bias``
[E], ``mlp.shared_experts.{gate,up,down}_proj`` [n_shared·I, H] / [H, n_shared·I], routed
``mlp.experts.{e}.{gate,up,down}_proj``.
"""

from __future__ import annotations

from colibri_plan.families.base import (
    COMMON_LAYER_NAMES,
    ConfigReader,
    TensorNames,
    attention_fields,
    dense_prefix_moe_layers,
    shared_expert_names,
)
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("glm4_moe",)
REFUSE = None
TENSORS = TensorNames(layer={
    **COMMON_LAYER_NAMES, "mlp.gate.e_score_correction_bias": "router_bias",
    **shared_expert_names("mlp.shared_experts")})


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a GLM-4.x-MoE config."""
    f = attention_fields(c, default_prf=0.5)
    n_shared = c.opt_int("n_shared_experts", 0)
    moe_inter = c.need_int("moe_intermediate_size")
    return ArchConfig(
        **f, n_experts=c.need_int("n_routed_experts", "num_local_experts"), moe_intermediate_size=moe_inter,
        moe_layers=dense_prefix_moe_layers(c, f["n_layers"], default_k=1),
        dense_intermediate_size=c.opt_int("intermediate_size", 0),
        attention_bias=c.opt_bool("attention_bias", False),
        qk_norm="head" if c.opt_bool("use_qk_norm", False) else None,
        n_shared_experts=n_shared, shared_intermediate_size=n_shared * moe_inter,
        first_k_dense_replace=c.opt_int("first_k_dense_replace", 1), scoring="sigmoid",
        norm_topk_prob=c.opt_bool("norm_topk_prob", True),
        routed_scaling_factor=c.opt_float("routed_scaling_factor", 1.0),
        n_group=c.opt_int("n_group", 1) or 1, topk_group=c.opt_int("topk_group", 1) or 1,
        group_score="top2_sum", e_score_correction_bias=True)
