"""Sizing Hugging Face checkpoint folders from config.json + safetensors headers (tiny random models saved
by transformers with their real tensor names), and the typed errors for bad input."""

import json
import struct

import numpy as np
import pytest

from colibri_plan.errors import FormatError, InputError, UnsupportedError
from colibri_plan.model import load_model_spec
from colibri_plan.model.checkpoint import read_safetensors_header

torch = pytest.importorskip("torch", reason="torch (test extra) builds the tiny checkpoints")
transformers = pytest.importorskip("transformers", reason="transformers (test extra) builds the checkpoints")

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2)

# family -> (config class, model class, extra config, expected (E, I, shared width, MoE layers))
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=24),
                (4, 24, 0, (0, 1, 2))),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=6, moe_intermediate_size=16, shared_expert_intermediate_size=40,
                       intermediate_size=48, mlp_only_layers=[0]), (6, 16, 40, (1, 2))),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, moe_intermediate_size=16, intermediate_size=48, head_dim=8),
                  (8, 16, 0, (0, 1, 2))),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, intermediate_size=20),
              (4, 20, 0, (0, 1, 2))),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(n_routed_experts=8, moe_intermediate_size=16, intermediate_size=48,
                         n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=8,
                         qk_nope_head_dim=8,
                         qk_rope_head_dim=4, v_head_dim=8, n_group=2, topk_group=1), (8, 16, 32, (1, 2))),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=4, moe_intermediate_size=16, intermediate_size=48, n_shared_experts=1,
                      first_k_dense_replace=1, head_dim=8, n_group=1, topk_group=1), (4, 16, 16, (1, 2))),
}


def _save(family, folder):
    cfg_name, model_name, extra, _ = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_name)(**COMMON, **extra)
    model = getattr(transformers, model_name)(cfg)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        model = _save(family, folder)
        params = {n: p.numel() for n, p in model.state_dict().items()}  # what save_pretrained writes
        out[family] = (folder, params)
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpoint_geometry_and_sizes(saved, family):
    folder, params = saved[family]
    n_experts, inter, shared, moe_layers = FAMILIES[family][3]
    s = load_model_spec(folder)
    assert s.family == family and s.n_layers == 3 and s.moe_layers == moe_layers
    assert (s.n_experts, s.moe_intermediate_size, s.shared_intermediate_size) == (n_experts, inter, shared)
    assert (s.hidden_size, s.top_k, s.vocab_size) == (32, 2, 96)
    # sizes against the tensors transformers saved for the same model (router score biases included)
    routed = sum(n for name, n in params.items() if ".experts." in name)
    assert s.routed_params == routed
    assert s.dense_params == sum(params.values()) - routed
    assert s.expert_bytes("f32") == 4 * 3 * 32 * inter
    assert s.source.startswith("checkpoint: ") and "F32" in s.source


def test_catalogue_and_checkpoint_share_fingerprint_rules(saved):
    folder, _ = saved["mixtral"]
    s = load_model_spec(folder)
    renamed = type(s).from_dict({**s.to_dict(), "name": "other", "dense_params": 0})
    assert renamed.fingerprint() == s.fingerprint()


def _with_mtp_head(folder, work):
    """A copy of the tiny DeepSeek-V3 checkpoint ``folder`` plus an MTP head's routed experts (layer 3) and
    its ``eh_proj`` [H, 2H]."""
    from safetensors.numpy import save_file

    work.mkdir()
    for f in folder.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    rng = np.random.default_rng(0)
    mtp = {}
    for e in range(8):
        base = f"model.layers.3.mlp.experts.{e}"
        mtp[f"{base}.gate_proj.weight"] = rng.standard_normal((16, 32), dtype=np.float32)
        mtp[f"{base}.up_proj.weight"] = rng.standard_normal((16, 32), dtype=np.float32)
        mtp[f"{base}.down_proj.weight"] = rng.standard_normal((32, 16), dtype=np.float32)
    mtp["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
    save_file(mtp, str(work / "mtp.safetensors"))
    return work


def test_mtp_row_from_headers(saved, tmp_path):
    """A DeepSeek-V3 checkpoint stores its MTP head as layer num_hidden_layers (61 in the real one)."""
    folder, _ = saved["deepseek_v3"]
    work = _with_mtp_head(folder, tmp_path / "ds3mtp")
    s = load_model_spec(work)
    base = load_model_spec(folder)
    assert s.moe_layers == (1, 2, 3) and s.mtp_layers == (3,) and s.decode_moe_layers == (1, 2)
    assert s.n_routed_experts == 24
    assert s.dense_params == base.dense_params + 32 * 64
    assert s.cold_bytes_per_token("f32") == base.cold_bytes_per_token("f32")  # MTP not on the decode path
    assert s.kv_bytes_per_token == base.kv_bytes_per_token * 4 // 3  # 3 layers + the MTP layer
    assert base.kv_bytes_per_token == 3 * (8 + 4) * 2  # (kv_lora_rank + rope dim) x bf16 per layer


def _copy(folder, dest):
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


@pytest.mark.parametrize("field,value,match", [
    ("moe_intermediate_size", 12, "wide in the headers"),
    ("num_experts", 4, "routed experts in the headers"),
    ("mlp_only_layers", [], "config.json puts them in 3 layers"),
    ("shared_expert_intermediate_size", 24, "shared experts are"),
    ("hidden_size", 48, "hidden_size 48"),
])
def test_config_header_mismatch_is_format_error(saved, tmp_path, field, value, match):
    folder = _copy(saved["qwen2_moe"][0], tmp_path / "ck")
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=match):
        load_model_spec(folder)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_model_spec(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        load_model_spec(tmp_path / "empty")


def test_config_without_moe_fields_is_unsupported(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dense")
    with pytest.raises(UnsupportedError, match="not a Mixture-of-Experts model"):
        load_model_spec(tmp_path / "dense")


def test_truncated_safetensors(saved, tmp_path):
    folder = _copy(saved["mixtral"][0], tmp_path / "ck")
    shard = next(folder.glob("*.safetensors"))
    blob = shard.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    shard.write_bytes(blob[: 8 + n // 2])  # cut inside the header
    with pytest.raises(FormatError, match="truncated safetensors header"):
        load_model_spec(folder)
    shard.write_bytes(blob[: 8 + n + 100])  # header intact, tensor data cut
    with pytest.raises(FormatError, match="past the end of the file"):
        load_model_spec(folder)
    shard.write_bytes(blob[:5])
    with pytest.raises(FormatError, match="truncated safetensors file"):
        load_model_spec(folder)
    shard.write_bytes(struct.pack("<Q", 6) + b"{oops}")
    with pytest.raises(FormatError, match="not valid JSON"):
        read_safetensors_header(shard)


def test_missing_shard_named_in_index(saved, tmp_path):
    folder = _copy(saved["mixtral"][0], tmp_path / "ck")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(InputError, match="missing: model-00001-of-00002"):
        load_model_spec(folder)


def _synthetic(folder, config, tensors):
    from safetensors.numpy import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_gpt_oss_mxfp4_layout(tmp_path):
    """gpt-oss stores experts fused and MXFP4-packed: gate_up_proj_blocks [E, 2I, H/32, 16] uint8,
    *_scales [E, 2I, H/32], *_bias [E, 2I]; the header gives the expert count, config.json the widths."""
    e, h, i = 4, 64, 64
    z = np.zeros
    t = {"model.embed_tokens.weight": z((50, h), np.float16), "lm_head.weight": z((50, h), np.float16)}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp"
        t[f"{p}.router.weight"] = z((e, h), np.float16)
        t[f"{p}.router.bias"] = z((e,), np.float16)
        t[f"{p}.experts.gate_up_proj_blocks"] = z((e, 2 * i, h // 32, 16), np.uint8)
        t[f"{p}.experts.gate_up_proj_scales"] = z((e, 2 * i, h // 32), np.uint8)
        t[f"{p}.experts.gate_up_proj_bias"] = z((e, 2 * i), np.float16)
        t[f"{p}.experts.down_proj_blocks"] = z((e, h, i // 32, 16), np.uint8)
        t[f"{p}.experts.down_proj_scales"] = z((e, h, i // 32), np.uint8)
        t[f"{p}.experts.down_proj_bias"] = z((e, h), np.float16)
    cfg = {"model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": e, "num_experts_per_tok": 2,
           "hidden_size": h, "intermediate_size": i, "vocab_size": 50, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "layer_types": ["sliding_attention", "full_attention"]}
    s = load_model_spec(_synthetic(tmp_path / "oss", cfg, t))
    assert s.expert_bias and s.n_routed_experts == 8 and s.moe_intermediate_size == i
    assert s.dense_params == 2 * 50 * h + 2 * (e * h + e)  # experts (and their biases) are not dense
    assert s.expert_bytes("bf16") == (3 * h * i + 2 * i + h) * 2
    assert s.kv_bytes_per_token == 1 * 2 * 2 * 16 * 2  # only the full-attention layer grows per token
    cfg["num_local_experts"] = 8
    (tmp_path / "oss" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="holds 4 routed experts in the headers, config.json says 8"):
        load_model_spec(tmp_path / "oss")


def test_fused_float_layout_checks_width(tmp_path):
    """A fused [E, 2I, H] / [E, H, I] layout (transformers' in-memory form) is read and width-checked."""
    e, h, i = 4, 32, 16
    t = {"model.embed_tokens.weight": np.zeros((10, h), np.float32),
         "model.layers.0.mlp.gate.weight": np.zeros((e, h), np.float32),
         "model.layers.0.mlp.experts.gate_up_proj": np.zeros((e, 2 * i, h), np.float32),
         "model.layers.0.mlp.experts.down_proj": np.zeros((e, h, i), np.float32)}
    cfg = {"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": e, "num_experts_per_tok": 2,
           "hidden_size": h, "moe_intermediate_size": i, "vocab_size": 10, "num_attention_heads": 4}
    s = load_model_spec(_synthetic(tmp_path / "fused", cfg, t))
    assert s.n_routed_experts == e and s.dense_params == 10 * h + e * h
    cfg["moe_intermediate_size"] = 8
    (tmp_path / "fused" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"\[16\] wide in the headers"):
        load_model_spec(tmp_path / "fused")


# --- a folder holding config.json alone (planning before the download) ------------------------------------

def _config_only(family, folder, **overrides):
    """Save only the config of FAMILIES[family] (what a user fetches before the weights)."""
    cfg_name, _, extra, _ = FAMILIES[family]
    getattr(transformers, cfg_name)(**COMMON, **{**extra, **overrides}).save_pretrained(folder)
    assert [f.name for f in folder.iterdir()] == ["config.json"]
    return folder


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_config_only_folder_matches_full_checkpoint(saved, tmp_path, family):
    from colibri_plan.model.checkpoint import CONFIG_ONLY_NOTE

    full = load_model_spec(saved[family][0])
    s = load_model_spec(_config_only(family, tmp_path / "cfg"))
    n_experts, inter, _, moe_layers = FAMILIES[family][3]
    assert s.moe_layers == moe_layers and s.n_experts == n_experts
    # 3 · H · I parameters per expert (gate, up [I, H]; down [H, I]) at 2 B (bf16) / 4 B (f32)
    assert s.expert_params == 3 * 32 * inter
    assert (s.expert_bytes("bf16"), s.expert_bytes("f32")) == (2 * 3 * 32 * inter, 4 * 3 * 32 * inter)
    assert s.routed_params == len(moe_layers) * n_experts * 3 * 32 * inter
    assert s.fingerprint() == full.fingerprint()
    assert s.dense_params == full.dense_params  # transformers' count == the saved tensors' element count
    assert s.kv_bytes_per_token == full.kv_bytes_per_token
    assert s.source.startswith(CONFIG_ONLY_NOTE) and full.source.startswith("checkpoint: ")


def test_config_only_deepseek_mtp_and_router_bias(saved, tmp_path):
    """A config declaring an MTP head gets its MTP row (as the catalogue does), so the fingerprint equals
    the checkpoint that ships the head; the dense count is transformers' parameters, which leave out the
    router's score-correction bias (a persistent buffer, E values per MoE row) that the headers hold."""
    folder, params = saved["deepseek_v3"]
    with_mtp = load_model_spec(_with_mtp_head(folder, tmp_path / "ds3mtp"))
    s = load_model_spec(_config_only("deepseek_v3", tmp_path / "cfg", num_nextn_predict_layers=1))
    assert s.moe_layers == (1, 2, 3) and s.mtp_layers == (3,)
    assert s.fingerprint() == with_mtp.fingerprint()
    assert s.kv_bytes_per_token == with_mtp.kv_bytes_per_token
    no_mtp = load_model_spec(_config_only("deepseek_v3", tmp_path / "cfg0", num_nextn_predict_layers=0))
    base = load_model_spec(folder)
    assert no_mtp.fingerprint() == base.fingerprint()
    bias = [n for n in params if n.endswith("e_score_correction_bias")]
    assert len(bias) == 2 and no_mtp.dense_params == base.dense_params - 2 * 8
    # MTP trunk: one more decoder layer's non-expert parameters + eh_proj [H, 2H] + three H-wide norms
    layer2 = sum(n for name, n in params.items()
                 if name.startswith("model.layers.2.") and ".experts." not in name and name not in bias)
    assert s.dense_params - no_mtp.dense_params == layer2 + 2 * 32 * 32 + 3 * 32


def test_config_only_index_without_shards(saved, tmp_path):
    """config.json + model.safetensors.index.json, no shard downloaded yet: still sized from the config."""
    folder = _config_only("mixtral", tmp_path / "cfg")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors"}}))
    assert load_model_spec(folder).fingerprint() == load_model_spec(saved["mixtral"][0]).fingerprint()


def test_config_only_needs_transformers(tmp_path, monkeypatch):
    import colibri_plan.model.metacount as metacount

    def no_torch(*a, **k):
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(metacount, "count_params", no_torch)
    with pytest.raises(UnsupportedError, match="needs torch and transformers"):
        load_model_spec(_config_only("mixtral", tmp_path / "cfg"))


def test_config_only_without_model_type(tmp_path):
    folder = _config_only("mixtral", tmp_path / "cfg")
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["model_type"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="no model_type"):
        load_model_spec(folder)


def test_model_show_config_only_prints_the_note(tmp_path):
    from click.testing import CliRunner

    from colibri_plan.cli import cli
    from colibri_plan.model.checkpoint import CONFIG_ONLY_NOTE

    folder = _config_only("qwen3_moe", tmp_path / "cfg")
    res = CliRunner().invoke(cli, ["model", "show", str(folder)])
    assert res.exit_code == 0, res.output
    assert CONFIG_ONLY_NOTE in res.output
    res = CliRunner().invoke(cli, ["model", "show", str(folder), "--json"])
    doc = json.loads(res.output)
    assert doc["source"].startswith(CONFIG_ONLY_NOTE) and doc["expert_params"] == 3 * 32 * 16
    assert doc["by_format"]["bf16"]["expert_bytes"] == 2 * 3 * 32 * 16
