"""The model-family layer (colibri_plan/families): every registered family reads a tiny config into an
ArchConfig that round-trips and into ModelSpec geometry; unknown families and missing keys are named."""

from __future__ import annotations

import json

import pytest

from colibri_plan.errors import FormatError, UnsupportedError
from colibri_plan.families import (
    ENGINE_FAMILIES,
    FAMILIES,
    arch_from_config,
    plan_geometry,
    spec_fields_from_config,
    tensor_names,
)
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.formats.model_spec import ModelSpec

# H 32, 4 heads of 8 channels, 2 KV heads: a GQA layer caches 2 · 2 · 8 values = 64 B in bf16
BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_experts_per_tok=2)
MLA = dict(n_routed_experts=8, moe_intermediate_size=8, n_shared_experts=1, first_k_dense_replace=1,
           intermediate_size=48, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, n_group=2,
           topk_group=1)
QWEN_NEXT = dict(num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=8,
                 full_attention_interval=4, head_dim=8)
GPT_OSS_TYPES = ["sliding_attention", "full_attention"] * 2

# model_type -> (extra config keys, (E, I, MoE rows incl. MTP, shared width, KV bytes/token, expert bias))
TABLE = {
    "mixtral": (dict(num_local_experts=4, intermediate_size=16), (4, 16, (0, 1, 2, 3), 0, 4 * 64, False)),
    "qwen2_moe": (dict(num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=24,
                       intermediate_size=48, mlp_only_layers=[0]), (4, 8, (1, 2, 3), 24, 4 * 64, False)),
    "qwen3_moe": (dict(num_experts=4, moe_intermediate_size=8, intermediate_size=48, decoder_sparse_step=2),
                  (4, 8, (1, 3), 0, 4 * 64, False)),
    "olmoe": (dict(num_experts=4, intermediate_size=16, clip_qkv=2.0),
              (4, 16, (0, 1, 2, 3), 0, 4 * 64, False)),
    "glm4_moe": (dict(n_routed_experts=4, moe_intermediate_size=8, n_shared_experts=2,
                      first_k_dense_replace=1, intermediate_size=48, num_nextn_predict_layers=1),
                 (4, 8, (1, 2, 3, 4), 16, 5 * 64, False)),  # MTP head: row 4 and one more KV layer
    **{mt: (MLA, (8, 8, (1, 2, 3), 8, 4 * (16 + 4) * 2, False))
       for mt in ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite")},
    "glm_moe_dsa": (dict(MLA, mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
                    (8, 8, (1, 3), 8, 4 * 20 * 2, False)),
    "deepseek_v4": (dict(n_routed_experts=8, moe_intermediate_size=8, n_shared_experts=1, head_dim=16,
                         num_key_value_heads=1), (8, 8, (0, 1, 2, 3), 8, 4 * 2 * 16 * 2, False)),
    "gpt_oss": (dict(num_local_experts=4, intermediate_size=16, head_dim=8, layer_types=GPT_OSS_TYPES,
                     sliding_window=8), (4, 16, (0, 1, 2, 3), 0, 2 * 64, True)),
    **{mt: (QWEN_NEXT, (4, 8, (0, 1, 2, 3), 8, 1 * 64, False))
       for mt in ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")},
    "phimoe": (dict(num_local_experts=4, intermediate_size=16), (4, 16, (0, 1, 2, 3), 0, 4 * 64, False)),
    "jamba": (dict(num_experts=4, intermediate_size=16, expert_layer_period=2, expert_layer_offset=1,
                   attn_layer_period=4, attn_layer_offset=2), (4, 16, (1, 3), 0, 1 * 64, False)),
}


def _config(model_type: str) -> dict:
    return {"model_type": model_type, **BASE, **TABLE[model_type][0]}


def test_the_table_covers_every_registered_family():
    assert set(TABLE) == set(FAMILIES)
    assert set(ENGINE_FAMILIES) == {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe"}


@pytest.mark.parametrize("model_type", sorted(TABLE))
def test_family_round_trips_a_tiny_config(model_type):
    cfg = _config(model_type)
    n_experts, inter, rows, shared, kv, bias = TABLE[model_type][1]
    arch = arch_from_config(cfg, plan_only=True)
    assert arch.family == model_type and arch.n_layers == 4 and arch.hidden_size == 32
    assert ArchConfig.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch
    fields = spec_fields_from_config(cfg)
    assert (fields["n_experts"], fields["moe_intermediate_size"]) == (n_experts, inter)
    assert fields["moe_layers"] == rows
    assert (fields["shared_intermediate_size"], fields["kv_bytes_per_token"], fields["expert_bias"]) == (
        shared, kv, bias)
    assert plan_geometry(cfg).arch == arch
    spec = ModelSpec(name="tiny", **fields, expert_format="int4", dense_params=0, source="test")
    assert spec.family == model_type and spec.top_k == 2
    if model_type in ENGINE_FAMILIES:
        assert arch_from_config(cfg) == arch
        assert tensor_names(model_type).layer["input_layernorm.weight"] == "attn_norm"
    else:
        with pytest.raises(UnsupportedError, match=f"^{model_type}: .*not supported yet"):
            arch_from_config(cfg)
        with pytest.raises(UnsupportedError, match=model_type):
            tensor_names(model_type)


def test_mla_is_refused_naming_it_and_planned():
    cfg = _config("deepseek_v3")
    with pytest.raises(UnsupportedError, match=r"deepseek_v3: multi-head latent attention \(MLA\)"):
        arch_from_config(cfg)
    arch = arch_from_config(cfg, plan_only=True)
    assert (arch.attention, arch.head_dim, arch.rotary_dim, arch.scoring, arch.n_group) == ("mla", 12, 4,
                                                                                           "sigmoid", 2)
    v2 = arch_from_config(_config("deepseek_v2"), plan_only=True)
    assert (v2.scoring, v2.group_score, v2.n_group) == ("softmax", "max", 1)


@pytest.mark.parametrize("cfg", [{"model_type": "llama", **BASE, "intermediate_size": 64},
                                 {"model_type": "mystery_moe", **BASE, "num_experts": 8}])
def test_unknown_model_type_is_one_line_naming_it(cfg):
    with pytest.raises(UnsupportedError) as info:
        arch_from_config(cfg)
    msg = str(info.value)
    assert repr(cfg["model_type"]) in msg and "\n" not in msg
    with pytest.raises(UnsupportedError, match=repr(cfg["model_type"])):
        plan_geometry(cfg, where="x/config.json")
    if cfg["model_type"] == "llama":
        assert "not a Mixture-of-Experts model" in msg


@pytest.mark.parametrize("model_type,key,named", [
    ("mixtral", "hidden_size", "'hidden_size'"),
    ("qwen2_moe", "moe_intermediate_size", "'moe_intermediate_size'"),
    ("glm4_moe", "n_routed_experts", "'n_routed_experts' / 'num_local_experts'"),
    ("deepseek_v3", "qk_rope_head_dim", "'qk_rope_head_dim'"),
    ("gpt_oss", "num_experts_per_tok", "'num_experts_per_tok' / 'experts_per_token'"),
])
def test_missing_key_is_named(model_type, key, named):
    cfg = {k: v for k, v in _config(model_type).items() if k != key}
    with pytest.raises(FormatError, match=f"^cat/config.json: config has no {named}"):
        plan_geometry(cfg, where="cat/config.json")


def test_bad_values_and_no_model_type():
    with pytest.raises(FormatError, match="'num_hidden_layers' must be a non-negative integer"):
        plan_geometry({**_config("mixtral"), "num_hidden_layers": "4"})
    with pytest.raises(FormatError, match="has no model_type"):
        plan_geometry({k: v for k, v in _config("mixtral").items() if k != "model_type"})
    with pytest.raises(FormatError, match="no layer of this model has routed experts"):
        plan_geometry({**_config("qwen3_moe"), "decoder_sparse_step": 8})


def test_multimodal_wrapper_reads_its_text_config():
    inner = _config("qwen3_5_moe_text")
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
           "text_config": inner, "vision_config": {"hidden_size": 16}}
    assert spec_fields_from_config(cfg) == spec_fields_from_config(inner)


def test_rope_scaling_refused_for_the_engine_only():
    cfg = {**_config("qwen3_moe"), "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedError, match="qwen3_moe: RoPE type 'yarn'"):
        arch_from_config(cfg)
    assert arch_from_config(cfg, plan_only=True).rope_scaling_factor == 1.0
    linear = arch_from_config({**_config("mixtral"), "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 5e5}})
    assert (linear.rope_theta, linear.rope_scaling_factor) == (5e5, 2.0)


def test_family_tensor_names():
    m = tensor_names("mixtral").expert.match("block_sparse_moe.experts.3.w3.weight")
    assert m.group(1, 2) == ("3", "w3")
    assert tensor_names("mixtral").roles["w2"] == 2
    assert tensor_names("qwen2_moe").layer["mlp.shared_expert_gate.weight"] == "shared_gate"
    assert tensor_names("glm4_moe").layer["mlp.gate.e_score_correction_bias"] == "router_bias"
    assert "mlp.shared_expert_gate.weight" not in tensor_names("qwen3_moe").layer
