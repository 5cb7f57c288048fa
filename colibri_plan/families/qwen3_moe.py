"""Qwen3-MoE (``model_type`` "qwen3_moe"; transformers ``Qwen3MoeConfig``).

config.json keys: ``num_experts`` (E; transformers 5 writes ``num_local_experts``), ``num_experts_per_tok``
(k), ``moe_intermediate_size`` (I), ``intermediate_size`` (dense layers), ``mlp_only_layers`` +
``decoder_sparse_step``, ``head_dim`` (may differ from H / heads), ``attention_bias`` (default false),
``norm_topk_prob`` (default false), ``use_sliding_window`` + ``sliding_window`` (every layer). RMSNorm
over each head's q and k; softmax router; no shared expert.

Tensors: the common names (``self_attn.{q,k}_norm``, ``mlp.gate``, ``mlp.experts.{e}.*_proj``).
"""

from __future__ import annotations

from colibri_plan.families.base import (
    COMMON_LAYER_NAMES,
    ConfigReader,
    TensorNames,
    attention_fields,
    qwen_moe_layers,
)
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("qwen3_moe",)
REFUSE = None
TENSORS = TensorNames(layer=dict(COMMON_LAYER_NAMES))


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a Qwen3-MoE config."""
    f = attention_fields(c)
    n = f["n_layers"]
    sw = c.opt_int("sliding_window", 0) if c.opt_bool("use_sliding_window", False) else 0
    return ArchConfig(
        **f, n_experts=c.need_int("num_experts", "num_local_experts"),
        moe_intermediate_size=c.need_int("moe_intermediate_size"), moe_layers=qwen_moe_layers(c, n),
        dense_intermediate_size=c.opt_int("intermediate_size", 0),
        attention_bias=c.opt_bool("attention_bias", False), qk_norm="head",
        norm_topk_prob=c.opt_bool("norm_topk_prob", False),
        sliding_window=sw or None, sliding_layers=tuple(range(n)) if sw else ())
