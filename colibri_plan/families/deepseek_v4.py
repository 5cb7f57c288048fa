"""DeepSeek-V4 (``model_type`` "deepseek_v4"; transformers ``DeepseekV4Config``): plan-only for now.

config.json keys: ``n_routed_experts`` (E), ``num_experts_per_tok`` (k), ``moe_intermediate_size`` (I),
``n_shared_experts`` (n_shared · I wide), ``first_k_dense_replace`` (absent in the Flash configs: every
layer has experts), ``num_key_value_heads`` and ``head_dim`` (the cached key/value heads),
``q_lora_rank`` / ``o_lora_rank`` / ``o_groups`` and the ``index_*`` sparse-attention indexer (not needed
for planning), ``num_nextn_predict_layers`` (MTP heads).

Planning hook: the KV cache is counted as 2 · num_key_value_heads · head_dim values per layer (the
indexer's cache is not counted).
"""

from __future__ import annotations

from colibri_plan.families.base import ConfigReader, attention_fields, dense_prefix_moe_layers
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("deepseek_v4",)
REFUSE = "DeepSeek-V4's compressed sparse attention is not supported yet; the model can be planned, not run"
TENSORS = None


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a DeepSeek-V4 config (for planning; router as DeepSeek-V3)."""
    f = attention_fields(c)
    n_shared = c.opt_int("n_shared_experts", 0)
    moe_inter = c.need_int("moe_intermediate_size")
    return ArchConfig(
        **f, n_experts=c.need_int("n_routed_experts", "num_experts"), moe_intermediate_size=moe_inter,
        moe_layers=dense_prefix_moe_layers(c, f["n_layers"], default_k=0),
        dense_intermediate_size=c.opt_int("intermediate_size", 0),
        n_shared_experts=n_shared, shared_intermediate_size=n_shared * moe_inter,
        first_k_dense_replace=c.opt_int("first_k_dense_replace", 0), scoring="sigmoid",
        routed_scaling_factor=c.opt_float("routed_scaling_factor", 1.0), e_score_correction_bias=True)
