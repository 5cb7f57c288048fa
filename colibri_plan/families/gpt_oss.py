"""gpt-oss (``model_type`` "gpt_oss"; transformers ``GptOssConfig``): plan-only for now.

config.json keys: ``num_local_experts`` (E; OpenAI's original config: ``num_experts``),
``num_experts_per_tok`` (k; original: ``experts_per_token``), ``intermediate_size`` (I: the expert
width), ``layer_types`` (alternating "sliding_attention" / "full_attention"), ``sliding_window``,
``head_dim``, ``attention_bias`` (default true). Every layer has routed experts; no shared expert.

Planning hooks: experts carry biases (gate_up [2I], down [H]), so an expert is 3·H·I + 2·I + H values;
only full-attention layers grow the KV cache per token (sliding layers keep ``sliding_window`` tokens).
Checkpoints store experts fused and MXFP4-packed (``mlp.experts.gate_up_proj_blocks`` / ``_scales`` /
``_bias``); the router is ``mlp.router.weight`` / ``.bias``.
"""

from __future__ import annotations

from colibri_plan.families.base import ConfigReader, PlanGeometry, attention_fields, gqa_plan, sliding_layers
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("gpt_oss",)
REFUSE = ("attention sinks, clamped SwiGLU experts with biases and MXFP4 weights are not supported yet; "
          "the model can be planned, not run")
TENSORS = None


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a gpt-oss config (for planning)."""
    f = attention_fields(c, top_k_keys=("num_experts_per_tok", "experts_per_token"))
    n = f["n_layers"]
    sw = c.opt_int("sliding_window", 0)
    return ArchConfig(
        **f, n_experts=c.need_int("num_local_experts", "num_experts"),
        moe_intermediate_size=c.need_int("intermediate_size"), moe_layers=tuple(range(n)),
        attention_bias=c.opt_bool("attention_bias", True),
        sliding_window=sw or None, sliding_layers=sliding_layers(c, n) if sw else ())


def plan(c: ConfigReader, arch: ArchConfig) -> PlanGeometry:
    """GQA cache on the full-attention layers; experts with biases."""
    return gqa_plan(c, arch, expert_bias=True)
