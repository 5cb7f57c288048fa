"""Mixtral (``model_type`` "mixtral"; transformers ``MixtralConfig`` / ``MixtralForCausalLM``).

config.json keys: ``num_local_experts`` (E), ``num_experts_per_tok`` (k), ``intermediate_size`` (I: an
expert is as wide as a dense FFN would be), ``sliding_window`` (every layer, when not null). Every layer
has routed experts; GQA attention with RoPE; softmax router, top-k, always renormalised; no shared expert.

Tensors (after ``model.layers.{i}.``): router ``block_sparse_moe.gate.weight`` [E, H]; expert e
``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) [I, H] and ``w2`` (down) [H, I]. The
``mlp.gate`` / ``mlp.experts.*`` names of transformers' in-memory layout are accepted too.
"""

from __future__ import annotations

import re

from colibri_plan.families.base import COMMON_LAYER_NAMES, ROLES, ConfigReader, TensorNames, attention_fields
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("mixtral",)
#: None: the engine runs it
REFUSE = None
TENSORS = TensorNames(
    layer={**COMMON_LAYER_NAMES, "block_sparse_moe.gate.weight": "router"},
    expert=re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                      r"\.weight$"),
    roles={**ROLES, "w1": 0, "w3": 1, "w2": 2})


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of a Mixtral config."""
    f = attention_fields(c)
    sw = c.opt_int("sliding_window", 0)
    return ArchConfig(
        **f, n_experts=c.need_int("num_local_experts"), moe_intermediate_size=c.need_int("intermediate_size"),
        moe_layers=tuple(range(f["n_layers"])), norm_topk_prob=True,
        sliding_window=sw or None, sliding_layers=tuple(range(f["n_layers"])) if sw else ())
