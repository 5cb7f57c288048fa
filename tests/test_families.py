"""The model-family layer (colibri_plan/families): every registered family reads a tiny config into an
ArchConfig that round-trips and into ModelSpec geometry; unknown families and missing keys are named."""

from __future__ import annotations

import json

import numpy as np
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
           intermediate_size=48, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
           n_group=2, topk_group=1, num_key_value_heads=4)
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
       for mt in ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe_lite")},
    "deepseek_v32": (dict(MLA, q_lora_rank=24), (8, 8, (1, 2, 3), 8, 4 * (16 + 4) * 2, False)),
    "glm_moe_dsa": (dict(MLA, q_lora_rank=24, mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
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
    assert set(ENGINE_FAMILIES) == {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2",
                                    "deepseek_v3", "kimi_k2", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"}


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
        with pytest.raises(UnsupportedError, match=f"^{model_type}: .*(not supported yet|not implemented)"):
            arch_from_config(cfg)
        with pytest.raises(UnsupportedError, match=model_type):
            tensor_names(model_type)


def test_mla_runs_and_its_geometry_is_read():
    arch = arch_from_config(_config("deepseek_v3"))
    assert (arch.attention, arch.head_dim, arch.rotary_dim, arch.scoring, arch.n_group) == ("mla", 12, 4,
                                                                                           "sigmoid", 2)
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.qk_nope_head_dim, arch.qk_rope_head_dim,
            arch.v_head_dim, arch.kv_values_per_token) == (0, 16, 8, 4, 8, 20)
    assert arch_from_config({**_config("deepseek_v3"), "q_lora_rank": 24}).q_lora_rank == 24
    v2 = arch_from_config(_config("deepseek_v2"))
    assert (v2.scoring, v2.group_score, v2.n_group, v2.norm_topk_prob, v2.rope_interleave) == (
        "softmax", "max", 1, False, True)
    grouped = arch_from_config({**_config("deepseek_v2"), "topk_method": "group_limited_greedy"})
    assert (grouped.n_group, grouped.topk_group, grouped.group_score) == (2, 1, "max")
    assert tensor_names("kimi_k2").layer["self_attn.kv_b_proj.weight"] == "attn.kv_b"


@pytest.mark.parametrize("model_type,change,field", [
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank"),
    ("glm_moe_dsa", {"q_lora_rank": 0}, "q_lora_rank"),
    ("deepseek_v3", {"index_topk": 2048}, "index_topk"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("kimi_k2", {"qk_head_dim": 16}, "qk_head_dim"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v3", {"qk_rope_head_dim": 5}, "qk_rope_head_dim"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias"),
    ("deepseek_v3", {"v_head_dim": None}, "v_head_dim"),
    ("deepseek_v3", {"rope_scaling": {"type": "llama3", "factor": 8.0}}, "llama3"),
])
def test_mla_variant_not_implemented_is_one_line_naming_the_field(model_type, change, field):
    cfg = {**_config(model_type), **change}
    if model_type in ("deepseek_v32", "glm_moe_dsa"):
        cfg["index_topk"] = 2048
    with pytest.raises(FormatError if field == "qk_rope_head_dim" else UnsupportedError) as info:
        arch_from_config(cfg)
    msg = str(info.value)
    assert msg.startswith("config.json: " if field == "qk_rope_head_dim" else f"{model_type}: "), msg
    assert field in msg and "\n" not in msg, msg
    if field != "qk_rope_head_dim":  # an odd rope width is no architecture at all
        assert plan_geometry(cfg).kv_values_per_layer == cfg.get("kv_lora_rank", 16) + cfg["qk_rope_head_dim"]


def test_dsa_families_run_as_mla_with_their_indexer_fields():
    """DeepSeek-V3.2 / GLM-5 read as MLA with index_topk (transformers' defaults when absent), always
    interleaved RoPE (their configs have no rope_interleave), and the indexer tensors named."""
    v32 = arch_from_config({**_config("deepseek_v32"), "rope_interleave": False})
    assert (v32.attention, v32.rope_interleave, v32.q_lora_rank) == ("mla", True, 24)
    assert (v32.index_topk, v32.index_n_heads, v32.index_head_dim) == (2048, 64, 128)
    glm = arch_from_config({**_config("glm_moe_dsa"), "index_topk": 64, "index_n_heads": 2})
    assert (glm.index_topk, glm.index_n_heads, glm.index_head_dim, glm.moe_layers) == (64, 2, 128, (1, 3))
    assert ArchConfig.from_dict(glm.to_dict()) == glm
    assert ArchConfig.from_dict({k: v for k, v in glm.to_dict().items() if not k.startswith("index_")}
                                ).index_topk == 0  # packs written before the DSA fields still load
    assert arch_from_config(_config("deepseek_v3")).index_topk == 0
    for mt in ("deepseek_v32", "glm_moe_dsa"):
        names = tensor_names(mt).layer
        assert names["self_attn.indexer.wq_b.weight"] == "attn.indexer.wq_b"
        assert names["self_attn.indexer.k_norm.bias"] == "attn.indexer.k_norm_bias"


def test_mla_kv_bytes_count_the_latent_and_rope_rows():
    cfg = {**_config("glm_moe_dsa"), "layer_types": ["indexed_attention"] * 4, "num_nextn_predict_layers": 1}
    geo = plan_geometry(cfg)
    assert (geo.kv_values_per_layer, geo.kv_layers) == (16 + 4, 4)
    assert spec_fields_from_config(cfg)["kv_bytes_per_token"] == 5 * 20 * 2  # + the MTP head, bf16


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
    cfg = {**_config("qwen3_moe"), "rope_scaling": {"rope_type": "llama3", "factor": 4.0}}
    with pytest.raises(UnsupportedError, match="qwen3_moe: RoPE type 'llama3'"):
        arch_from_config(cfg)
    assert arch_from_config(cfg, plan_only=True).rope_scaling_factor == 1.0
    linear = arch_from_config({**_config("mixtral"), "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                                        "rope_theta": 5e5}})
    assert (linear.rope_theta, linear.rope_scaling_factor) == (5e5, 2.0)


# DeepSeek-V3's published rope_scaling (legacy layout) with its max_position_embeddings
DSV3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("model_type,rope_scaling", [
    ("deepseek_v3", DSV3_YARN),
    ("deepseek_v3", {**DSV3_YARN, "mscale": 0.707, "mscale_all_dim": 0.5, "beta_fast": None}),
    ("qwen3_moe", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("glm4_moe", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8192,
                  "attention_factor": 1.2, "truncate": False}),
])
def test_yarn_is_read_and_its_frequencies_match_transformers(model_type, rope_scaling):
    torch = pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from colibri_plan.families.rope import attention_factor, inv_freq, mla_softmax_scale, yarn_get_mscale

    cfg = {**_config(model_type), "rope_scaling": rope_scaling, "rope_theta": 10000.0,
           "max_position_embeddings": 163840}
    arch = arch_from_config(cfg)
    assert (arch.rope_type, arch.yarn_factor, arch.rope_scaling_factor) == ("yarn", rope_scaling["factor"],
                                                                            1.0)
    assert ArchConfig.from_dict(json.loads(json.dumps(arch.to_dict()))) == arch

    class Cfg:  # the attributes _compute_yarn_parameters reads
        hidden_size, num_attention_heads, max_position_embeddings = 32, 4, 163840
        head_dim = arch.rotary_dim
        rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0,
                           **{k: v for k, v in rope_scaling.items() if k != "type"}}

        def standardize_rope_params(self):
            pass

    want, want_af = ROPE_INIT_FUNCTIONS["yarn"](Cfg())
    np.testing.assert_allclose(inv_freq(arch), want.numpy(), rtol=1e-6)
    assert attention_factor(arch) == pytest.approx(want_af)
    if arch.attention == "mla":
        m = yarn_get_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
        assert mla_softmax_scale(arch) == pytest.approx(12 ** -0.5 * m * m)
    del torch


def test_arch_config_mla_fields_are_typed_and_old_packs_still_load():
    arch = arch_from_config(_config("deepseek_v3"))
    d = arch.to_dict()
    with pytest.raises(FormatError, match="arch.kv_lora_rank must be a whole number"):
        ArchConfig.from_dict({**d, "kv_lora_rank": "16"})
    with pytest.raises(FormatError, match="head_dim 12 must be qk_nope_head_dim"):
        ArchConfig.from_dict({**d, "qk_nope_head_dim": 6})
    with pytest.raises(FormatError, match="GQA architecture has them 0"):
        ArchConfig.from_dict({**d, "attention": "gqa"})
    gqa = arch_from_config(_config("mixtral")).to_dict()
    old = {k: v for k, v in gqa.items() if not k.startswith(("yarn_", "q_lora", "kv_lora", "qk_", "v_head"))
           and k != "rope_type"}  # an index written before MLA and YaRN
    assert ArchConfig.from_dict(old) == ArchConfig.from_dict(gqa)
    planned_only = ArchConfig.from_dict({**old, "attention": "mla", "n_kv_heads": 4})  # no MLA widths
    with pytest.raises(UnsupportedError, match="MLA attention without kv_lora_rank"):
        planned_only.check_supported()


def test_family_tensor_names():
    m = tensor_names("mixtral").expert.match("block_sparse_moe.experts.3.w3.weight")
    assert m.group(1, 2) == ("3", "w3")
    assert tensor_names("mixtral").roles["w2"] == 2
    assert tensor_names("qwen2_moe").layer["mlp.shared_expert_gate.weight"] == "shared_gate"
    assert tensor_names("glm4_moe").layer["mlp.gate.e_score_correction_bias"] == "router_bias"
    assert "mlp.shared_expert_gate.weight" not in tensor_names("qwen3_moe").layer


# ---- issue 17: wrong types and runaway counts are named FormatErrors -----------------------------------

@pytest.mark.parametrize("key,value,match", [
    ("num_hidden_layers", 10**9, "more than 4,096"),
    ("num_hidden_layers", 2**64, "more than 4,096"),
    ("num_experts", 2**40, "more than"),
    ("hidden_size", float("nan"), "'hidden_size' must be a non-negative integer"),
    ("head_dim", float("inf"), "'head_dim' must be a non-negative integer"),
    ("intermediate_size", float("nan"), "'intermediate_size' must be a non-negative integer"),
    ("decoder_sparse_step", float("inf"), "'decoder_sparse_step' must be a non-negative integer"),
    ("architectures", {"a": "Qwen3MoeForCausalLM"}, "'architectures' must be a list"),
    ("architectures", [1, 2], "'architectures' must be a list of class names"),
    ("rope_parameters", [1, 2], "'rope_parameters' must be an object"),
    ("rope_scaling", "linear", "'rope_scaling' must be an object"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "x"}, "'rope_theta' must be a finite"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": None}, "'rope_theta' is null"),
    ("rope_scaling", {"rope_type": ["linear"], "factor": 2.0}, "'rope_type' must be a string"),
    ("rope_theta", "1e6", "'rope_theta' must be a finite number"),
    ("mlp_only_layers", [[1]], "'mlp_only_layers' must be a list of plain values"),
])
def test_bad_config_values_are_named_format_errors(key, value, match):
    """Each gave a traceback or grew memory without bound (set(range(n_layers)))."""
    cfg = {**_config("qwen3_moe"), key: value}
    for read in (lambda: arch_from_config(cfg, plan_only=True), lambda: spec_fields_from_config(cfg)):
        with pytest.raises(FormatError, match=match):
            read()
