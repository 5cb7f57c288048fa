"""`colibri-plan heat show / convert / synth`: corrupt or empty heat refused in one line, outputs never
inputs."""

from __future__ import annotations

import json

from _cli_fixtures import heat_doc, invoke, refused, same_bytes, write


def test_heat_convert_refuses_corrupt_and_empty(tmp_path):
    doc = heat_doc(tmp_path)
    doc["counts"][0][0] = 1e30
    refused(invoke("heat", "convert", write(tmp_path / "big.json", doc), tmp_path / "o.txt", "--to", "usage"),
            1, "whole numbers")
    zero = heat_doc(tmp_path, counts=[[0] * 4, [0] * 4])
    src = write(tmp_path / "zero.json", zero)
    for fmt in ("usage", "json"):
        refused(invoke("heat", "convert", src, tmp_path / f"o.{fmt}", "--to", fmt), 1,
                "heat is empty: no selections recorded")
        assert not (tmp_path / f"o.{fmt}").exists()
    r = invoke("heat", "show", src, "--json")      # show may show an empty heat
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["total_selections"] == 0


def test_heat_show_nan_tokens_is_one_line(tmp_path):
    src = write(tmp_path / "nan.json", heat_doc(tmp_path, tokens=float("nan")))
    for extra in ((), ("--json",)):
        refused(invoke("heat", "show", src, *extra), 1, "tokens")


def test_heat_and_profile_outputs_are_not_inputs(toy, tmp_path):
    spec = toy / "model.json"
    before = spec.read_bytes()
    refused(invoke("heat", "synth", spec, "--out", spec), "is the input")
    refused(invoke("profile", "--model", spec, "--out", spec, "--quick", "--probes", "ram"), "is the input")
    h = tmp_path / "h.usage"
    h.write_text("-1 4 0\n1 0 3\n")
    refused(invoke("heat", "convert", h, h, "--to", "json"), "is the input")
    assert same_bytes(spec, before) and h.read_text() == "-1 4 0\n1 0 3\n"
