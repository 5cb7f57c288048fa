"""Qwen3-Next and Qwen3.5-MoE hybrids (``model_type`` "qwen3_next", "qwen3_5_moe" with its
``text_config`` "qwen3_5_moe_text"; transformers ``Qwen3NextConfig``, ``Qwen3_5MoeTextConfig``):
plan-only for now.

config.json keys: ``num_experts`` (E), ``num_experts_per_tok`` (k), ``moe_intermediate_size`` (I),
``shared_expert_intermediate_size`` (one gated shared expert), ``mlp_only_layers`` +
``decoder_sparse_step`` (Qwen rule), ``full_attention_interval`` (every n-th layer is full attention, the
others Gated DeltaNet linear attention) or ``layer_types``, ``head_dim``, ``partial_rotary_factor``
(default 0.25).

Planning hook: only the full-attention layers grow the KV cache per token; linear-attention layers hold
a fixed-size state.
"""

from __future__ import annotations

from colibri_plan.families.base import ConfigReader, attention_fields, qwen_moe_layers
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
REFUSE = ("hybrid linear attention (Gated DeltaNet layers) is not supported yet; the model can be planned, "
          "not run")
TENSORS = None


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a Qwen3-Next / Qwen3.5-MoE text config (for planning; attention = its full layers)."""
    f = attention_fields(c, default_prf=0.25)
    shared = c.opt_int("shared_expert_intermediate_size", 0)
    return ArchConfig(
        **f, n_experts=c.need_int("num_experts", "num_local_experts"),
        moe_intermediate_size=c.need_int("moe_intermediate_size"),
        moe_layers=qwen_moe_layers(c, f["n_layers"]),
        dense_intermediate_size=c.opt_int("intermediate_size", 0), qk_norm="head",
        n_shared_experts=int(shared > 0), shared_intermediate_size=shared, shared_expert_gate=shared > 0,
        norm_topk_prob=c.opt_bool("norm_topk_prob", True))
