"""Qwen2-MoE / Qwen1.5-MoE (``model_type`` "qwen2_moe"; transformers ``Qwen2MoeConfig``).

config.json keys: ``num_experts`` (E), ``num_experts_per_tok`` (k), ``moe_intermediate_size`` (I),
``shared_expert_intermediate_size`` (one shared expert of that width, 0 = none), ``intermediate_size``
(dense layers), ``mlp_only_layers`` + ``decoder_sparse_step`` (which layers have experts), ``qkv_bias``
(default true), ``norm_topk_prob`` (default false), ``use_sliding_window`` + ``sliding_window`` on the
``layer_types`` "sliding_attention" layers. Softmax router.

Tensors (after ``model.layers.{i}.``): router ``mlp.gate.weight`` [E, H]; experts
``mlp.experts.{e}.{gate,up,down}_proj.weight``; shared expert ``mlp.shared_expert.{gate,up,down}_proj``
[Is, H] / [H, Is], scaled by sigmoid(``mlp.shared_expert_gate.weight`` [1, H] · x).
"""

from __future__ import annotations

from colibri_plan.families.base import (
    COMMON_LAYER_NAMES,
    ConfigReader,
    TensorNames,
    attention_fields,
    qwen_moe_layers,
    shared_expert_names,
    sliding_layers,
)
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("qwen2_moe",)
REFUSE = None
TENSORS = TensorNames(layer={
    **COMMON_LAYER_NAMES, "mlp.shared_expert_gate.weight": "shared_gate",
    **shared_expert_names("mlp.shared_expert")})


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a Qwen2-MoE config."""
    f = attention_fields(c)
    n = f["n_layers"]
    sw = c.opt_int("sliding_window", 0) if c.opt_bool("use_sliding_window", False) else 0
    shared = c.opt_int("shared_expert_intermediate_size", 0)
    return ArchConfig(
        **f, n_experts=c.need_int("num_experts", "num_local_experts"),
        moe_intermediate_size=c.need_int("moe_intermediate_size"), moe_layers=qwen_moe_layers(c, n),
        dense_intermediate_size=c.opt_int("intermediate_size", 0),
        attention_bias=c.opt_bool("qkv_bias", True),
        n_shared_experts=int(shared > 0), shared_intermediate_size=shared, shared_expert_gate=shared > 0,
        norm_topk_prob=c.opt_bool("norm_topk_prob", False),
        sliding_window=sw or None, sliding_layers=sliding_layers(c, n) if sw else ())
