"""Phi-3.5-MoE (``model_type`` "phimoe"; transformers ``PhimoeConfig``): plan-only for now.

config.json keys: ``num_local_experts`` (E), ``num_experts_per_tok`` (k), ``intermediate_size`` (I: the
expert width), ``sliding_window``, ``attention_bias``. Every layer has routed experts; no shared expert;
the KV cache counts every layer. The sparsemixer router and LayerNorm (not RMSNorm) blocks are not in the
engine.
"""

from __future__ import annotations

from colibri_plan.families.base import ConfigReader, attention_fields
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("phimoe",)
REFUSE = ("the sparsemixer router and LayerNorm blocks are not supported yet; the model can be planned, "
          "not run")
TENSORS = None


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a PhiMoE config (for planning)."""
    f = attention_fields(c)
    sw = c.opt_int("sliding_window", 0)
    return ArchConfig(
        **f, n_experts=c.need_int("num_local_experts", "num_experts"),
        moe_intermediate_size=c.need_int("intermediate_size"), moe_layers=tuple(range(f["n_layers"])),
        attention_bias=c.opt_bool("attention_bias", False), sliding_window=sw or None,
        sliding_layers=tuple(range(f["n_layers"])) if sw else ())
