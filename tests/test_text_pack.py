"""`model pack` copies and checks a checkpoint's tokenizer files (engine/pack_text.py); a pack without them
still opens and runs on ids and says so; Model.generate's ``sample`` and ``stop_ids``."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke
from _text_models import train_tokenizer, write_text_checkpoint

from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.pack_text import open_text, text_status
from colibri_plan.errors import FormatError, IntegrityError
from colibri_plan.text.sampling import Sampler, SamplingParams


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def packed(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    write_text_checkpoint(d / "ck", tok=tok)
    r = invoke("--json", "model", "pack", d / "ck", d / "pk", "--quant", "f32")
    assert r.exit_code == 0, r.output
    return d


def test_pack_copies_and_records_the_tokenizer_files(packed, tok):
    index = json.loads((packed / "pk" / "pack.json").read_text())
    sec = index["tokenizer"]
    names = [r[0] for r in sec["files"]]
    assert names == ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    for name, nbytes, _ in sec["files"]:
        assert (packed / "pk" / name).read_bytes() == (packed / "ck" / name).read_bytes()
        assert nbytes == (packed / "ck" / name).stat().st_size
    assert sec["vocab_size"] == 400 and sec["chat_template"] is True
    assert sec["stop_ids"] == sorted([tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")])
    with open_pack(packed / "pk") as pk:
        codec = open_text(pk)
        assert codec.encode("expert") == tok.encode("expert").ids
        assert text_status(pk).startswith("text: tokenizer 400 tokens")


def test_a_changed_tokenizer_file_is_refused_when_read(packed, tmp_path):
    import shutil

    pk = shutil.copytree(packed / "pk", tmp_path / "pk")
    cfg = pk / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().replace("<|im_end|>", "<|endoftext|>"))
    with open_pack(pk) as p, pytest.raises(IntegrityError, match="tokenizer_config.json is missing or "):
        open_text(p)


def test_a_pack_without_a_tokenizer_runs_on_ids_and_says_so(tmp_path):
    build_fixture(tmp_path / "fx", FixtureConfig.small(layers=1, experts=8, top_k=2))
    with open_pack(tmp_path / "fx") as pk:
        assert "tokenizer" not in pk.index and open_text(pk) is None
        assert text_status(pk).startswith("text: none, runs on token ids only")
        with Model(pk) as m:
            assert len(m.generate([1, 2, 3], 3)) == 3


def test_a_checkpoint_without_tokenizer_json_packs_and_says_why(tmp_path, tok):
    ck = write_text_checkpoint(tmp_path / "ck", tok=tok)
    (ck / "tokenizer.json").unlink()
    (ck / "tokenizer.model").write_bytes(b"sentencepiece")
    r = invoke("--json", "model", "pack", ck, tmp_path / "pk", "--quant", "f32")
    assert r.exit_code == 0, r.output
    assert "tokenizer" not in json.loads((tmp_path / "pk" / "pack.json").read_text())
    assert "tokenizer.model (SentencePiece) but no tokenizer.json" in r.output


def test_a_tokenizer_of_another_vocabulary_is_refused_before_anything_is_written(tmp_path, tok):
    ck = write_text_checkpoint(tmp_path / "ck", vocab_size=400, tok=tok)
    cfg = json.loads((ck / "config.json").read_text())
    small = train_tokenizer(vocab_size=400)
    small.add_tokens([f"<extra_{i}>" for i in range(20)])   # 420 ids: past the model's 400
    small.save(str(ck / "tokenizer.json"))
    assert cfg["vocab_size"] == 400
    r = invoke("model", "pack", ck, tmp_path / "pk", "--quant", "f32")
    assert r.exit_code == 1
    assert "420 tokens but the model's vocabulary has 400" in r.output
    assert not (tmp_path / "pk").exists() and not list(tmp_path.glob(".pk.tmp-*"))


def test_generate_stops_after_a_stop_id_and_takes_a_sampler(packed):
    with open_pack(packed / "pk") as pk, Model(pk) as m:
        prompt = open_text(pk).encode("the plan")
        greedy = m.generate(prompt, 8)
        stop = greedy[3]
        cut = m.generate(prompt, 8, stop_ids={stop})
        assert cut == greedy[:greedy.index(stop) + 1]
        seen = []

        def argmax(logits):   # logits float32 [V]
            seen.append(logits.shape)
            return int(logits.argmax())
        assert m.generate(prompt, 8, sample=argmax) == greedy and seen == [(400,)] * 8
        a = m.generate(prompt, 8, sample=Sampler(SamplingParams(temperature=1.0, seed=5)))
        assert a == m.generate(prompt, 8, sample=Sampler(SamplingParams(temperature=1.0, seed=5)))
        assert a != greedy   # 400 tokens at temperature 1: eight argmax draws in a row are unlikely


def test_bad_section_is_a_format_error(packed, tmp_path):
    import shutil

    pk = shutil.copytree(packed / "pk", tmp_path / "pk")
    doc = json.loads((pk / "pack.json").read_text())
    doc["tokenizer"]["files"] = [["../../etc/passwd", 1, 2]]
    (pk / "pack.json").write_text(json.dumps(doc))
    with open_pack(pk) as p, pytest.raises(FormatError, match="tokenizer.files must be"):
        open_text(p)
