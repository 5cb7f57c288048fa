"""OLMoE (``model_type`` "olmoe"; transformers ``OlmoeConfig``).

config.json keys: ``num_experts`` (E), ``num_experts_per_tok`` (k), ``intermediate_size`` (I: the
expert width), ``clip_qkv`` (clamp q, k, v to ±value, or null), ``attention_bias``, ``norm_topk_prob``
(default false). Every layer has routed experts; RMSNorm over the whole q and k projections; softmax
router; no shared expert.

Tensors: the common names (``self_attn.{q,k}_norm`` are [nh·d] and [H / nh · nkv] wide here).
"""

from __future__ import annotations

from colibri_plan.families.base import COMMON_LAYER_NAMES, ConfigReader, TensorNames, attention_fields
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("olmoe",)
REFUSE = None
TENSORS = TensorNames(layer=dict(COMMON_LAYER_NAMES))


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of an OLMoE config."""
    f = attention_fields(c)
    clip = c.opt_float("clip_qkv", 0.0)
    return ArchConfig(
        **f, n_experts=c.need_int("num_experts", "num_local_experts"),
        moe_intermediate_size=c.need_int("intermediate_size"), moe_layers=tuple(range(f["n_layers"])),
        attention_bias=c.opt_bool("attention_bias", False), qk_norm="full", clip_qkv=clip or None,
        norm_topk_prob=c.opt_bool("norm_topk_prob", False))
