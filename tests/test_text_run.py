"""`colibri-plan run` with text: --prompt / --prompt-file of text / --chat, sampling options, the answer
streamed to stdout, EOS from generation_config; a model without a tokenizer says so; ids stay ids."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke
from _text_models import train_tokenizer, write_text_checkpoint

from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.pack_text import open_text


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def pk(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("run-text")
    write_text_checkpoint(d / "ck", tok=tok)
    assert invoke("model", "pack", d / "ck", d / "pk", "--quant", "f32").exit_code == 0
    return d / "pk"


def run_json(*args):
    r = invoke("--json", "run", "--backend", "numpy", *args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_text_prompt_is_encoded_and_the_answer_decoded(pk):
    doc = run_json("--model", pk, "--prompt", "The plan places experts", "--tokens", 10)
    with open_pack(pk) as p:
        codec = open_text(p)
        assert doc["prompt_tokens"] == len(codec.encode("The plan places experts"))
        assert doc["text"] == codec.decode(doc["tokens"]) and doc["seed"] is None
    ids = ",".join(map(str, codec.encode("The plan places experts")))
    assert run_json("--model", pk, "--prompt-ids", ids, "--tokens", 10)["tokens"][:len(doc["tokens"])] \
        == doc["tokens"]   # the same ids given as ids: the same greedy tokens


def test_the_streamed_stdout_is_the_text_and_the_report_goes_to_stderr(pk):
    want = run_json("--model", pk, "--prompt", "Where", "--tokens", 9, "--temperature", 0.9, "--seed", 4)
    r = invoke("run", "--backend", "numpy", "--model", pk, "--prompt", "Where", "--tokens", 9,
               "--temperature", 0.9, "--seed", 4)
    assert r.exit_code == 0, r.output
    assert r.stdout == want["text"] + "\n"
    assert "tok/s" in r.stderr and "hit rates" in r.stderr


def test_seeded_sampling_repeats_and_the_chat_template_applies(pk):
    hot = ("--temperature", 1.0, "--seed", 21)
    a = run_json("--model", pk, "--prompt", "hi", "--chat", "--tokens", 12, *hot)
    b = run_json("--model", pk, "--prompt", "hi", "--chat", "--tokens", 12, *hot)
    g = run_json("--model", pk, "--prompt", "hi", "--chat", "--tokens", 12)
    assert a["tokens"] == b["tokens"] and a["seed"] == 21 and a["tokens"] != g["tokens"]
    with open_pack(pk) as p:
        chat_ids = open_text(p).encode_chat([{"role": "user", "content": "hi"}])
    assert a["prompt_tokens"] == len(chat_ids) > len(open_text(open_pack(pk)).encode("hi"))


def test_a_prompt_file_of_text_is_text_and_of_ids_is_ids(pk, tmp_path):
    (tmp_path / "t.txt").write_text("The plan places experts", encoding="utf-8")
    (tmp_path / "i.txt").write_text("5 6 7\n")
    assert run_json("--model", pk, "--prompt-file", tmp_path / "t.txt", "--tokens", 4)["tokens"] == \
        run_json("--model", pk, "--prompt", "The plan places experts", "--tokens", 4)["tokens"]
    doc = run_json("--model", pk, "--prompt-file", tmp_path / "i.txt", "--tokens", 4)
    assert doc["prompt_tokens"] == 3 and "text" not in doc


def test_generation_ends_at_the_eos_of_generation_config(tok, tmp_path, pk):
    greedy = run_json("--model", pk, "--prompt", "The", "--tokens", 12)["tokens"]
    eos = greedy[4]
    ck = write_text_checkpoint(tmp_path / "ck", tok=tok)
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert invoke("model", "pack", ck, tmp_path / "pk", "--quant", "f32").exit_code == 0
    cut = run_json("--model", tmp_path / "pk", "--prompt", "The", "--tokens", 12)["tokens"]
    assert cut == greedy[:greedy.index(eos) + 1] and len(cut) < 12


def test_text_on_a_model_without_a_tokenizer_says_so(tmp_path):
    build_fixture(tmp_path / "fx", FixtureConfig.small(layers=1, experts=8, top_k=2))
    r = invoke("run", "--model", tmp_path / "fx", "--prompt", "hello", "--tokens", 2)
    assert r.exit_code == 1 and "needs the model's tokenizer" in r.output
    assert "runs on token ids only" in r.output and "Traceback" not in r.output
    (tmp_path / "words.txt").write_text("not ids")
    r = invoke("run", "--model", tmp_path / "fx", "--prompt-file", tmp_path / "words.txt", "--tokens", 2)
    assert r.exit_code == 1 and "needs the model's tokenizer" in r.output


@pytest.mark.parametrize("args, code, message", [
    (["--prompt-ids", "1", "--chat"], 2, "--chat needs a text prompt"),
    (["--prompt", "x", "--prompt-ids", "1"], 1, "exactly one of --prompt-ids"),
    (["--prompt", "x", "--temperature", "3"], 2, "--temperature"),
    (["--prompt", "x", "--top-p", "0"], 2, "--top-p"),
])
def test_bad_text_options_are_usage_errors(pk, args, code, message):
    r = invoke("run", "--model", pk, "--tokens", 2, *args)
    assert r.exit_code == code and message in r.output, r.output
