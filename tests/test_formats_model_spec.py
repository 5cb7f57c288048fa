"""formats/model_spec: a spec file of another kind names the kind it expected."""

from __future__ import annotations

import json

import pytest

from colibri_plan.errors import FormatError
from colibri_plan.model import load_model_spec


def test_spec_file_of_another_kind_names_the_expected_kind(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"kind": "model-spec"}))
    with pytest.raises(FormatError, match="has kind 'model-spec', not a model spec: a spec file has kind "
                                          "'model_spec'"):
        load_model_spec(tmp_path / "spec.json")
