"""formats/pack_index: a pack's dense trunk is budgeted in the format it is stored in."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _cli_fixtures import pack_and_profile

from colibri_plan.formats.pack_index import pack_dense_format
from colibri_plan.model import load_model_spec


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "polish")


def test_pack_spec_carries_the_stored_dense_format(files):
    spec = load_model_spec(files / "fx")
    assert spec.dense_format == "f32"            # the pack writer stores dense tensors as float32
    file_bytes = (files / "fx" / "dense.safetensors").stat().st_size
    # f32 trunk: 4 B per parameter; the file adds only its JSON header
    assert spec.dense_bytes("f32") == 4 * spec.dense_params
    assert 0 < file_bytes - spec.dense_bytes("f32") < 64 * 1024
    assert spec.fingerprint() == load_model_spec(files / "fx").with_format("int8").fingerprint()


def test_dense_format_from_the_safetensors_header_when_the_index_lacks_it(files, tmp_path):
    from safetensors.numpy import save_file

    index = json.loads((files / "fx" / "pack.json").read_text())
    index["format"].pop("dense_format")
    assert pack_dense_format(files / "fx", index) == "f32"
    save_file({"a": np.zeros((2, 3), dtype=np.float16)}, str(tmp_path / "dense.safetensors"))
    assert pack_dense_format(tmp_path, {"format": {}}) == "f16"
    assert pack_dense_format(tmp_path / "none", {"format": {}}) is None


def test_spec_from_arch_charges_mla_layers_their_latent_and_rope_rows_only():
    import dataclasses

    from colibri_plan.formats.arch import ArchConfig
    from colibri_plan.formats.pack_index import spec_from_arch

    base = ArchConfig(family="deepseek_v3", vocab_size=64, hidden_size=32, n_layers=3, n_heads=4,
                      n_kv_heads=4, head_dim=24, n_experts=8, top_k=2, moe_intermediate_size=16,
                      moe_layers=[1, 2], dense_intermediate_size=32)
    gqa = spec_from_arch(base, "int8", 1000, "t", "test")
    assert gqa.kv_bytes_per_token == 3 * 2 * 4 * 24 * 4          # layers x (K + V) x heads x dim x f32
    mla = dataclasses.replace(base, attention="mla", kv_lora_rank=16, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16)
    assert spec_from_arch(mla, "int8", 1000, "t", "test").kv_bytes_per_token == 3 * (16 + 8) * 4
