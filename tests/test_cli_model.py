"""`colibri-plan model show` on a pack: the stored dense format and the file's bytes."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke, pack_and_profile


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "polish")


def test_model_show_reports_the_stored_format_and_file_bytes(files):
    r = invoke("model", "show", files / "fx")
    assert r.exit_code == 0, r.output
    size = (files / "fx" / "dense.safetensors").stat().st_size
    line = next(x for x in r.stdout.splitlines() if "dense trunk" in x)
    assert "at f32" in line and f"{size:,} B" in line
    doc = json.loads(invoke("model", "show", files / "fx", "--json").stdout)
    assert doc["dense_format"] == "f32" and doc["dense_file_bytes"] == size
    assert doc["dense_bytes"] == 4 * doc["dense_params"]
    glm = invoke("model", "show", "glm-5.2")
    assert "at bf16" in next(x for x in glm.stdout.splitlines() if "dense trunk" in x)
