"""Input checks found by a new-user test: heat fields that must be whole counts, memory figures beyond any
machine, --seed / --tokens / --context ranges, empty output names, and plan messages that name the file
and give one piece of advice."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _solver_fixtures import toy_profile
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.heat import Heat, load_heat, read_usage_text, save_heat, write_usage_text
from colibri_plan.formats.profile import save_profile


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("morevalid")
    build_fixture(d / "fx", FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    save_profile(toy_profile(ram_available_bytes=8 * 10**9, shape=(128, 256)), d / "profile.json")
    r = invoke("solve", "--profile", d / "profile.json", "--model", d / "fx", "--heat", "synth",
               "--out", d / "plan.json")
    assert r.exit_code == 0, r.output
    return d


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def refused(r, code: int, *words: str):
    """A one-line refusal: the exit code, no traceback, every word in the message."""
    assert r.exit_code == code, r.output
    assert isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in r.output
    for w in words:
        assert w in r.output, r.output


def heat_doc(tmp_path, **change) -> dict:
    h = Heat(n_experts=4, layers=(1, 2), counts=np.array([[5, 0, 3, 1], [2, 2, 2, 2]]), top_k=2, tokens=7,
             n_model_layers=3)
    doc = json.loads(save_heat(h, tmp_path / "good.json").read_text())
    doc.update(change)
    return doc


def write(path, doc) -> str:
    path.write_text(json.dumps(doc))   # json.dumps writes NaN as the bare token NaN, as a user file might
    return str(path)


@pytest.mark.parametrize("value", [1e30, "5", 1.5, -1, True, float("nan"), 2**53])
def test_heat_count_must_be_a_whole_json_number(tmp_path, value):
    doc = heat_doc(tmp_path)
    doc["counts"][0][2] = value
    with pytest.raises(FormatError, match="count of layer 1 expert 2 .*whole numbers"):
        load_heat(write(tmp_path / "bad.json", doc))


@pytest.mark.parametrize("field,value", [("tokens", float("nan")), ("tokens", "7"), ("tokens", 2.5),
                                         ("tokens", -1), ("n_model_layers", -3), ("n_model_layers", 1.5),
                                         ("n_experts", "4"), ("top_k", 9), ("engine_id", 2**32)])
def test_heat_scalar_fields_checked(tmp_path, field, value):
    with pytest.raises(FormatError, match=f"{field} must be a whole number"):
        load_heat(write(tmp_path / "bad.json", heat_doc(tmp_path, **{field: value})))


def test_heat_layer_beyond_model_layers_refused(tmp_path):
    with pytest.raises(FormatError, match="layer 2 is beyond n_model_layers = 1"):
        load_heat(write(tmp_path / "bad.json", heat_doc(tmp_path, n_model_layers=1)))


def test_whole_float_counts_accepted_and_fractions_written_whole(tmp_path):
    doc = heat_doc(tmp_path, tokens=7.0)
    doc["counts"][0][0] = 5.0
    back = load_heat(write(tmp_path / "ok.json", doc))
    assert back.tokens == 7 and isinstance(back.tokens, int) and back.counts[0, 0] == 5
    frac = Heat(n_experts=3, layers=(0,), counts=np.array([[0.3, 2.6, 0.0]]), tokens=3)
    again = load_heat(save_heat(frac, tmp_path / "frac.json"))   # the writer's output reads back
    assert again.counts.tolist() == [[1.0, 3.0, 0.0]]


def test_usage_text_bounds(tmp_path):
    (tmp_path / "wide.txt").write_text("-1 2 99999999999\n0 0 1\n")
    with pytest.raises(FormatError, match="n_experts <="):
        read_usage_text(tmp_path / "wide.txt")
    (tmp_path / "big.txt").write_text(f"-1 2 4\n0 0 {2**53}\n")
    with pytest.raises(FormatError, match=":2: .*too large"):
        read_usage_text(tmp_path / "big.txt")
    huge = Heat(n_experts=2, layers=(0,), counts=np.array([[1e30, 1.0]]))
    with pytest.raises(InputError, match="too large for a usage file"):
        write_usage_text(huge, tmp_path / "never.txt")
    assert not (tmp_path / "never.txt").exists()


def test_heat_convert_refuses_corrupt_and_empty(tmp_path):
    doc = heat_doc(tmp_path)
    doc["counts"][0][0] = 1e30
    refused(invoke("heat", "convert", write(tmp_path / "big.json", doc), tmp_path / "o.txt", "--to", "usage"),
            1, "FormatError", "whole numbers")
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
        refused(invoke("heat", "show", src, *extra), 1, "FormatError", "tokens")


def solve(files, *extra):
    return invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", "--heat", "synth",
                  *extra)


def test_memory_figures_beyond_any_machine(files):
    refused(solve(files, "--ram", "auto", "--headroom", "1e300"), 2, "--headroom", "beyond any machine")
    refused(solve(files, "--ram", "1e300"), 2, "--ram", "beyond any machine")
    refused(solve(files, "--ram", "0.515", "--context", "9999999"), 1,
            "too small for --context 9999999 tokens", "0.515 GB")
    refused(solve(files, "--context", "99999999999999"), 2, "--context")


def test_small_budgets_keep_their_digits(files):
    r = solve(files, "--ram", "0.005", "--context", "0")
    refused(r, 1, "0.005 GB")
    assert "0.01 GB" not in r.output


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_seed_range(files, tmp_path, seed):
    refused(solve(files, "--seed", seed), 2, "--seed")
    refused(invoke("heat", "synth", files / "fx", "--out", tmp_path / "h.json", "--seed", seed), 2, "--seed")
    refused(invoke("model", "fixture", "--small", tmp_path / "fx", "--seed", seed), 2, "--seed")
    assert not (tmp_path / "h.json").exists() and not (tmp_path / "fx").exists()


def test_token_counts_bounded(files):
    refused(invoke("run", "--model", files / "fx", "--tokens", "99999999999999999999", "--prompt-ids", "1"),
            2, "--tokens")
    refused(invoke("verify", "--plan", files / "plan.json", "--model", files / "fx", "--tokens", "1000001"),
            2, "--tokens")


def test_empty_output_names_refused(files):
    before = sorted(p.name for p in files.iterdir())
    refused(invoke("export", files / "plan.json", "--to", "colibri", "--out", ""), 1, "output path is empty")
    refused(invoke("export", files / "plan.json", "--to", "llama.cpp", "--out", ""), 1,
            "output path is empty")
    refused(invoke("verify", "--plan", files / "plan.json", "--model", files / "fx", "--report", ""), 1,
            "output path is empty")
    assert sorted(p.name for p in files.iterdir()) == before   # no default file written instead


def test_plan_messages_name_the_file_and_advise_once(files, tmp_path):
    doc = json.loads((files / "plan.json").read_text())
    bad = dict(doc, coefficients=dict(doc.get("coefficients") or {}, dense=float("nan")))
    r = invoke("plan", "show", write(tmp_path / "nan.json", bad))
    refused(r, 1, "coefficients", "re-create the plan")
    assert "calibrate" not in r.output and r.output.count("re-create") == 1
    big = json.loads(json.dumps(doc))
    big["layers"][0]["lru_slots"] = 10**12
    refused(invoke("plan", "show", write(tmp_path / "lru.json", big)), 1, "lru.json", "RAM tiers hold")


def test_long_run_does_not_allocate_its_kv_up_front(files, monkeypatch):
    from colibri_plan.engine.forward import Model

    asked = []

    def new_cache(self, capacity=256):
        asked.append(capacity)
        raise InputError("stop before decoding")

    monkeypatch.setattr(Model, "new_cache", new_cache)
    refused(invoke("run", "--model", files / "fx", "--tokens", "1000000", "--prompt-ids", "1"), 1, "stop")
    assert asked and asked[0] <= 4096   # the cache doubles as it fills
