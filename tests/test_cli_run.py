"""`colibri-plan run`: --tokens N gives N ids, options refused before any work, the KV cache grows as it
fills, stats never go into the pack."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke, pack_and_profile, refused, same_bytes, solve_json

from colibri_plan.errors import InputError

PROMPT = "5,80,200,7"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "runfiles", plan=True)


def test_run_generates_n_tokens_with_and_without_a_plan(files):
    plain = invoke("run", "--model", files / "fx", "--prompt-ids", PROMPT, "--tokens", 3, "--json")
    assert plain.exit_code == 0, plain.output
    want = json.loads(plain.stdout)["tokens"]
    assert len(want) == 3
    doc, _ = solve_json(files, "--ram", "1.5", "--out", files / "plan.json")
    planned = invoke("run", "--model", files / "fx", "--plan", files / "plan.json", "--prompt-ids", PROMPT,
                     "--tokens", 3, "--json")
    assert planned.exit_code == 0, planned.output
    got = json.loads(planned.stdout)
    assert got["tokens"] == want and got["decode_steps"] == 2
    one = invoke("run", "--model", files / "fx", "--plan", files / "plan.json", "--prompt-ids", PROMPT,
                 "--tokens", 1)
    assert one.exit_code == 0, one.output
    assert one.stdout.split("\n")[0] == str(want[0]) and "no decode step" in one.stdout


def test_run_quant_on_a_pack_is_refused(files):
    r = invoke("run", "--model", files / "fx", "--prompt-ids", PROMPT, "--tokens", 1, "--quant", "int8")
    assert r.exit_code == 1 and "fixed when it is made" in r.output and "int4" in r.output


def test_run_bad_backend_is_a_usage_error_before_any_progress(files):
    r = invoke("run", "--model", files / "fx", "--prompt-ids", PROMPT, "--backend", "bogus")
    assert r.exit_code == 2 and "bogus" in r.output and "loading" not in r.output


def test_token_counts_bounded(files):
    refused(invoke("run", "--model", files / "fx", "--tokens", "99999999999999999999", "--prompt-ids", "1"),
            2, "--tokens")
    refused(invoke("verify", "--plan", files / "plan.json", "--model", files / "fx", "--tokens", "1000001"),
            2, "--tokens")


def test_long_run_does_not_allocate_its_kv_up_front(files, monkeypatch):
    from colibri_plan.engine.forward import Model

    asked = []

    def new_cache(self, capacity=256):
        asked.append(capacity)
        raise InputError("stop before decoding")

    monkeypatch.setattr(Model, "new_cache", new_cache)
    refused(invoke("run", "--model", files / "fx", "--tokens", "1000000", "--prompt-ids", "1"), 1, "stop")
    assert asked and asked[0] <= 4096   # the cache doubles as it fills


def test_run_stats_never_go_into_the_pack(tiny_pack, tmp_path):
    index = (tiny_pack / "pack.json").read_bytes()
    refused(invoke("run", "--model", tiny_pack, "--prompt-ids", "1,2", "--tokens", 1,
                   "--stats-out", tiny_pack / "pack.json"), "is inside the input")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("1 2")
    refused(invoke("run", "--model", tiny_pack, "--prompt-file", prompt, "--tokens", 1,
                   "--usage-out", prompt), "is the input")
    assert same_bytes(tiny_pack / "pack.json", index) and prompt.read_text() == "1 2"
