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
