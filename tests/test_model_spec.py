"""ModelSpec and the catalogue against published facts (numbers written here from the sources, never
from our own output): shared/data/models.md, colibrì's GLM-5.2 figures and the models' own cards."""

import json

import pytest

from colibri_plan.errors import FormatError, InputError, UnsupportedError
from colibri_plan.model import ModelSpec, catalogue_names, load_model_spec, save_model_spec

MIB = 2**20

# models.md: name -> (MoE rows without MTP, MTP rows, E, k, H, I, bf16 MiB, int8 MiB, "int4+g32" MiB
# (0.5625 B/param = our int4-g64 with float32 scales), cold GB/token @int4)
FACTS = {
    "mixtral-8x7b": (32, 0, 8, 2, 4096, 14336, 336.0, 168.0, 94.5, 6.34),
    "mixtral-8x22b": (56, 0, 8, 2, 6144, 16384, 576.0, 288.0, 162.0, 19.03),
    "qwen1.5-moe-a2.7b": (24, 0, 60, 4, 2048, 1408, 16.5, 8.2, 4.6, 0.47),
    "qwen2-57b-a14b": (28, 0, 64, 8, 3584, 2560, 52.5, 26.2, 14.8, 3.47),
    "qwen3-30b-a3b": (48, 0, 128, 8, 2048, 768, 9.0, 4.5, 2.5, 1.02),
    "qwen3-235b-a22b": (94, 0, 128, 8, 4096, 1536, 36.0, 18.0, 10.1, 7.98),
    "qwen3-next-80b-a3b": (48, 0, 512, 10, 2048, 512, 6.0, 3.0, 1.7, 0.85),
    "qwen3.5-35b-a3b": (40, 0, 256, 8, 2048, 512, 6.0, 3.0, 1.7, 0.57),
    "deepseek-v2": (59, 0, 160, 6, 5120, 1536, 45.0, 22.5, 12.7, 4.70),
    "deepseek-v2-lite": (26, 0, 64, 6, 2048, 1408, 16.5, 8.2, 4.6, 0.76),
    "deepseek-v3": (58, 1, 256, 8, 7168, 2048, 84.0, 42.0, 23.6, 11.49),
    "deepseek-v4-flash": (43, 1, 256, 6, 4096, 2048, 48.0, 24.0, 13.5, 3.65),
    "deepseek-v4.1-flash": (40, 0, 384, 6, 5120, 2304, 67.5, 33.8, 19.0, 4.78),
    "olmoe-1b-7b": (16, 0, 64, 8, 2048, 1024, 12.0, 6.0, 3.4, 0.45),
    "glm-4.5": (89, 1, 160, 8, 5120, 1536, 45.0, 22.5, 12.7, 9.45),
    "glm-4.5-air": (45, 1, 128, 8, 4096, 1408, 33.0, 16.5, 9.3, 3.50),
    "glm-4.7-flash": (46, 0, 64, 4, 2048, 1536, 18.0, 9.0, 5.1, 0.98),
    "glm-5": (75, 1, 256, 8, 6144, 2048, 72.0, 36.0, 20.2, 12.74),
    "gpt-oss-20b": (24, 0, 32, 4, 2880, 2880, 47.5, 23.7, 13.4, 1.34),
    "gpt-oss-120b": (36, 0, 128, 4, 2880, 2880, 47.5, 23.7, 13.4, 2.02),
    "kimi-k2": (60, 0, 384, 8, 7168, 2048, 84.0, 42.0, 23.6, 11.89),
}

# models.md "routed total GB @int4": DeepSeek-V3/V4-Flash and GLM-4.5/Air count the MTP row, GLM-5's
# row does not (407.7 GB = 75 rows).
ROUTED_GB = {"mixtral-8x7b": (25.4, True), "qwen3-235b-a22b": (127.7, True), "deepseek-v3": (374.2, True),
             "deepseek-v4-flash": (159.5, True), "glm-4.5": (191.1, True), "glm-4.5-air": (57.3, True),
             "glm-5": (407.7, False), "kimi-k2": (570.8, True), "gpt-oss-120b": (64.5, True)}

# Published total parameters (model cards), without MTP heads. Kimi K2 ("1T") and GLM-4.7-Flash are
# too coarsely rounded to test; DeepSeek-V4 totals are not in the facts.
PUBLISHED_TOTAL_B = {"mixtral-8x7b": 46.7, "mixtral-8x22b": 141, "qwen1.5-moe-a2.7b": 14.3,
                     "qwen2-57b-a14b": 57.4, "qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235,
                     "qwen3-next-80b-a3b": 80, "qwen3.5-35b-a3b": 35, "deepseek-v2": 236,
                     "deepseek-v2-lite": 15.7, "deepseek-v3": 671, "olmoe-1b-7b": 6.9, "glm-4.5": 355,
                     "glm-4.5-air": 106, "glm-5": 744, "gpt-oss-20b": 20.9, "gpt-oss-120b": 116.8}


def test_glm52_matches_colibri_published_figures():
    s = load_model_spec("glm-5.2")
    assert s.n_routed_experts == 19_456 and s.n_moe_layers == 76
    assert s.moe_layers[0] == 3 and s.moe_layers[-2] == 77 and s.mtp_layers == (78,)
    assert s.expert_bytes("int4") == 18_915_328
    assert s.expert_bytes("int4-g64") == 21_233_664
    assert s.expert_bytes("int8") / 1e6 == pytest.approx(37.79, abs=0.005)  # the int8 MTP row
    assert s.cold_bytes_per_token("int4") / 1e9 == pytest.approx(11.35, abs=0.005)  # 75 x 8 x 18.92 MB
    assert s.cold_bytes_per_token("int4-g64") / 1e9 == pytest.approx(12.74, abs=0.005)
    assert s.kv_bytes_per_token == 182_016 + 114_688  # 0.297 MB per context token
    assert s.vocab_size == 154_880 and s.top_k == 8 and s.hidden_size == 6144


def test_catalogue_covers_the_required_models():
    names = set(catalogue_names())
    assert set(FACTS) | {"glm-5.2"} <= names


@pytest.mark.parametrize("name", sorted(FACTS))
def test_catalogue_against_facts_table(name):
    rows, mtp, e, k, h, i, bf16, int8, g, cold = FACTS[name]
    s = load_model_spec(name)
    assert (s.n_experts, s.top_k, s.hidden_size, s.moe_intermediate_size) == (e, k, h, i)
    assert len(s.decode_moe_layers) == rows and len(s.mtp_layers) == mtp
    # within 1%, or within the table's rounding (0.1 MiB, 0.01 GB) for its smallest entries
    assert s.expert_bytes("bf16") / MIB == pytest.approx(bf16, rel=0.01, abs=0.05)
    assert s.expert_bytes("int8") / MIB == pytest.approx(int8, rel=0.01, abs=0.05)
    assert s.expert_bytes("int4-g64") / MIB == pytest.approx(g, rel=0.01, abs=0.05)
    assert s.cold_bytes_per_token("int4-g64") / 1e9 == pytest.approx(cold, rel=0.01, abs=0.005)


@pytest.mark.parametrize("name", sorted(ROUTED_GB))
def test_routed_totals_against_facts_table(name):
    gb, with_mtp = ROUTED_GB[name]
    s = load_model_spec(name)
    rows = s.n_moe_layers if with_mtp else len(s.decode_moe_layers)
    assert rows * s.n_experts * s.expert_bytes("int4-g64") / 1e9 == pytest.approx(gb, rel=0.01)


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL_B))
def test_total_parameters_against_model_cards(name):
    s = load_model_spec(name)
    without_mtp_experts = s.total_params - len(s.mtp_layers) * s.n_experts * s.expert_params
    assert without_mtp_experts / 1e9 == pytest.approx(PUBLISHED_TOTAL_B[name], rel=0.015)


def test_aliases_and_quant_override():
    assert load_model_spec("DeepSeek-R1").name == "deepseek-v3"
    s = load_model_spec("glm-5.2", quant="int4-g64")
    assert s.expert_format == "int4-g64" and s.expert_bytes() == 21_233_664
    with pytest.raises(UnsupportedError, match="unknown quant format"):
        load_model_spec("glm-5.2", quant="int5")


def test_unknown_name_and_missing_path():
    with pytest.raises(InputError, match="known models: .*glm-5.2"):
        load_model_spec("glm-9")
    with pytest.raises(InputError, match="does not exist"):
        load_model_spec("./no/such/checkpoint")


def test_expert_bytes_formula_small():
    s = ModelSpec("t", "mixtral", 2, (0, 1), 4, 2, 0, 64, 32, 0, 100, "int4", 1000, 10, "test")
    # gate/up [32, 64]: 32*32 B + 32*4 B scales; down [64, 32]: 64*16 + 64*4
    assert s.expert_bytes("int4") == 2 * (32 * 32 + 128) + (64 * 16 + 256)
    assert s.expert_bytes("bf16") == 3 * 64 * 32 * 2
    # int4-g32: gate/up 2 groups per row -> 32*2*4 B scales; down 1 group per row -> 64*4
    assert s.expert_bytes("int4-g32") == 2 * (32 * 32 + 256) + (64 * 16 + 256)
    assert s.cold_bytes_per_token("bf16") == 2 * 2 * 3 * 64 * 32 * 2
    assert s.dense_bytes("bf16") == 2000 and s.kv_bytes(1000) == 10_000


def test_fingerprint_is_geometry_only():
    a = load_model_spec("qwen3-30b-a3b")
    b = ModelSpec.from_dict({**a.to_dict(), "name": "renamed", "source": "x", "dense_params": 1})
    assert a.fingerprint() == b.fingerprint()
    c = ModelSpec.from_dict({**a.to_dict(), "top_k": 4})
    assert c.fingerprint() != a.fingerprint()


def test_bad_specs_are_format_errors():
    d = load_model_spec("olmoe-1b-7b").to_dict()
    with pytest.raises(FormatError, match="top_k"):
        ModelSpec.from_dict({**d, "top_k": 65})
    with pytest.raises(FormatError, match="missing field"):
        ModelSpec.from_dict({k: v for k, v in d.items() if k != "hidden_size"})
    with pytest.raises(FormatError, match="sorted"):
        ModelSpec.from_dict({**d, "moe_layers": [3, 1]})
    with pytest.raises(FormatError, match="non-negative integer"):
        ModelSpec.from_dict({**d, "n_experts": "64"})


def test_spec_file_round_trip(tmp_path):
    s = load_model_spec("glm-4.5-air", quant="int8")
    path = save_model_spec(s, tmp_path / "air.json")
    assert load_model_spec(path) == s
    (tmp_path / "bad.json").write_text(json.dumps({"kind": "plan", "schema_version": 1}))
    with pytest.raises(FormatError, match="not a model spec"):
        load_model_spec(tmp_path / "bad.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(InputError, match="checkpoint folder"):
        load_model_spec(tmp_path / "config.json")


def test_partial_entries_refuse(monkeypatch):
    from colibri_plan.model import catalogue

    entry = dict(catalogue.find_entry("deepseek-v4-flash"), partial=True, assumptions="layer count unknown")
    with pytest.raises(UnsupportedError, match="partial"):
        catalogue.spec_from_entry(entry)
