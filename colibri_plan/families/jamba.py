"""Jamba (``model_type`` "jamba"; transformers ``JambaConfig``): plan-only for now.

config.json keys: ``num_experts`` (E), ``num_experts_per_tok`` (k), ``intermediate_size`` (I: the expert
and the dense MLP width), ``expert_layer_period`` / ``expert_layer_offset`` (layer i has experts when
i % period == offset; transformers' defaults 2 / 1), ``attn_layer_period`` / ``attn_layer_offset`` (layer
i is attention when i % period == offset, else Mamba; defaults 8 / 4). No RoPE; no shared expert.

Planning hook: only the attention layers grow the KV cache per token (Mamba layers keep a fixed state).
"""

from __future__ import annotations

from colibri_plan.families.base import ConfigReader, PlanGeometry, attention_fields
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("jamba",)
REFUSE = "Mamba layers are not supported yet; the model can be planned, not run"
TENSORS = None


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a Jamba config (for planning)."""
    f = attention_fields(c)
    period = c.opt_int("expert_layer_period", 2) or 1
    offset = c.opt_int("expert_layer_offset", 1)
    inter = c.need_int("intermediate_size")
    return ArchConfig(
        **f, n_experts=c.need_int("num_experts", "num_local_experts"), moe_intermediate_size=inter,
        moe_layers=tuple(i for i in range(f["n_layers"]) if i % period == offset),
        dense_intermediate_size=inter)


def plan(c: ConfigReader, arch: ArchConfig) -> PlanGeometry:
    """GQA cache on the attention layers only."""
    period = c.opt_int("attn_layer_period", 8) or 1
    offset = c.opt_int("attn_layer_offset", 4)
    attn = sum(1 for i in range(arch.n_layers) if i % period == offset)
    return PlanGeometry(arch, 2 * arch.n_kv_heads * arch.head_dim, attn)
