"""cli/common: --json output is strict JSON; every command's file readers name folders and devices."""

from __future__ import annotations

import json
import math

import pytest
from _cli_fixtures import invoke, refused, toy_plan

from colibri_plan.cli.common import to_json


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A profile, a model spec and a plan solved from them."""
    return toy_plan(tmp_path_factory)


def test_json_output_never_holds_nan(capsys):
    text = to_json({"a": {"tok_s": math.nan}, "b": [1.0, -math.inf], "c": "x"})
    assert json.loads(text) == {"a": {"tok_s": None}, "b": [1.0, None], "c": "x"}
    err = capsys.readouterr().err
    assert "a.tok_s (nan)" in err and "b[1] (-inf)" in err


def test_cli_readers_name_folders_and_devices(toy, tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    prof, model = toy / "profile.json", toy / "model.json"
    for args in (["plan", "show", d], ["heat", "show", d], ["calibrate", d, "--out", tmp_path / "c.json"],
                 ["solve", "--profile", prof, "--model", model, "--heat", "uniform", "--coefficients", d],
                 ["run", "--model", d, "--prompt-file", d]):
        refused(invoke(*args), str(d), "is a folder, expected a file")
    refused(invoke("solve", "--profile", prof, "--model", "/dev/null"), "/dev/null", "is not a regular file")
    refused(invoke("heat", "show", "/dev/null"), "/dev/null", "is not a regular file")
