"""Text in, text out: the tokenizer files (colibri_plan/text/codec.py), chat templates
(colibri_plan/text/chat.py), streaming detokenization and stop strings (colibri_plan/text/stream.py) and
sampling (colibri_plan/text/sampling.py)."""

from __future__ import annotations

import numpy as np
import pytest
from _text_models import CHATML, train_tokenizer, write_text_files
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri_plan.errors import FormatError, InputError
from colibri_plan.text.chat import ChatTemplate
from colibri_plan.text.codec import TextCodec
from colibri_plan.text.sampling import Sampler, SamplingParams, make_sampler
from colibri_plan.text.stream import StopStrings, StreamDecoder

MESSAGES = [{"role": "system", "content": "You plan experts."},
            {"role": "user", "content": "Where does expert 7 live? ü – 🐦"}]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def codec(tok, tmp_path_factory):
    return TextCodec.from_folder(write_text_files(tmp_path_factory.mktemp("tx"), tok), 400)


def test_codec_reads_the_special_tokens_stop_ids_and_bos(codec, tok):
    assert codec.vocab_size == tok.get_vocab_size() == 400
    assert codec.stop_ids == {tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")}
    assert codec.special_tokens["bos_token"] == "<|bos|>"
    ids = codec.encode("the plan")
    assert ids[0] == tok.token_to_id("<|bos|>") and ids[1:] == codec.encode("the plan", False)
    assert codec.decode(ids) == "the plan"   # BOS is special: left out of the text


def test_chat_prompt_equals_transformers_apply_chat_template(codec, tmp_path_factory, tok):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    folder = write_text_files(tmp_path_factory.mktemp("hf"), tok)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                              bos_token="<|bos|>", eos_token="<|im_end|>")
    hf.chat_template = CHATML
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert codec.render_chat(MESSAGES) == want
    assert want.startswith("<|bos|><|im_start|>system\n") and want.endswith("<|im_start|>assistant\n")
    ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert codec.encode_chat(MESSAGES) == list(ids)


def test_template_whitespace_tojson_and_generation_block_as_transformers(tok, tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    src = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n<u>{{ m.content | tojson }}</u>\n"
           "    {% else %}\n{% generation %}<a>{{ m.content }}</a>{% endgeneration %}\n    {% endif %}\n"
           "{% endfor %}{{ eos_token }}")
    msgs = [{"role": "user", "content": "a <b> & 'c' ü"}, {"role": "assistant", "content": "ok"}]
    folder = write_text_files(tmp_path_factory.mktemp("ws"), tok)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                              eos_token="<|im_end|>")
    hf.chat_template = src
    ours = ChatTemplate(src, {"eos_token": "<|im_end|>"}).render(msgs, add_generation_prompt=False)
    assert ours == hf.apply_chat_template(msgs, tokenize=False)
    assert '"a <b> & \'c\' ü"' in ours   # tojson neither escapes HTML nor non-ASCII


def test_template_errors_are_typed():
    refusing = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(InputError, match="first must be user"):
        ChatTemplate(refusing).render([{"role": "assistant", "content": "x"}])
    with pytest.raises(FormatError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(InputError, match="sandbox"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": ""}])
    with pytest.raises(InputError, match="non-empty list"):
        ChatTemplate(CHATML).render([])


def test_codec_refuses_broken_or_foreign_files(tok, tmp_path):
    folder = write_text_files(tmp_path / "a", tok)
    with pytest.raises(FormatError, match="400 tokens but the model's vocabulary has 300"):
        TextCodec.from_folder(folder, 300)
    (folder / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(FormatError, match="eos_token_id"):
        TextCodec.from_folder(folder, 400)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(FormatError, match="tokenizers library cannot read it"):
        TextCodec.from_folder(folder, 400)
    with pytest.raises(InputError, match="no tokenizer.json"):
        TextCodec.from_folder(tmp_path / "empty", 400)
    nochat = TextCodec.from_folder(write_text_files(tmp_path / "b", tok, template=None), 400)
    with pytest.raises(InputError, match="no chat template"):
        nochat.encode_chat(MESSAGES)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 399), min_size=1, max_size=40))
def test_stream_pieces_join_to_the_whole_decode(codec, ids):
    s = codec.stream()
    pieces = [s.push(t) for t in ids] + [s.flush()]
    assert "".join(pieces) == codec.decode(ids)


def test_stream_of_real_text_never_shows_half_a_character(codec):
    text = "colibrì plans ü, – and 🐦 experts"
    ids = codec.encode(text, add_special_tokens=False)
    s = StreamDecoder(codec.decode)
    pieces = [s.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + s.flush() == text
    assert len(ids) > len([p for p in pieces if p])   # the emoji's bytes were held back, then shown once


def test_stop_strings_cut_across_pieces_and_hold_back_prefixes():
    s = StopStrings(["o w", "END"])
    assert s.push("Hel") == "Hel"
    assert s.push("lo") == "l"          # "o" may begin "o w": held back
    assert s.push(" world") == ""       # "o w" found: the text ends before it
    assert s.stopped and s.push("more") == "" and s.flush() == ""
    t = StopStrings(["END"])
    assert t.push("the EN") == "the " and t.flush() == "EN"   # never completed: shown at the end
    with pytest.raises(InputError, match="at most 4"):
        StopStrings(["a", "b", "c", "d", "e"])
    with pytest.raises(InputError, match="non-empty"):
        StopStrings([""])


def test_greedy_is_argmax_and_the_parameters_are_checked():
    assert make_sampler(SamplingParams()) is None
    assert make_sampler(None) is None
    for bad, match in [(dict(temperature=-0.1), "temperature"),
                       (dict(temperature=float("nan")), "temperature"),
                       (dict(temperature=1, top_p=0), "top_p"), (dict(temperature=1, top_k=-1), "top_k"),
                       (dict(temperature=1, seed=-1), "seed"), (dict(temperature=True), "temperature")]:
        with pytest.raises(InputError, match=match):
            make_sampler(SamplingParams(**bad))


def test_sampling_is_seeded_and_follows_the_softmax():
    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0], dtype=np.float32)
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    draws = [a(logits) for _ in range(4000)]
    assert draws == [b(logits) for _ in range(4000)]
    want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    got = np.bincount(draws, minlength=5) / len(draws)
    assert np.abs(got - want).max() < 0.03   # 4000 draws: the standard error is below 0.008
    assert Sampler(SamplingParams(temperature=1.0, seed=8))(logits) in range(5)


def test_top_k_and_top_p_keep_the_most_probable_tokens():
    logits = np.array([0.1, 3.0, 2.9, -2.0, 1.0], dtype=np.float32)
    p = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0)).probabilities(logits)
    assert set(np.flatnonzero(p)) == {1, 2} and p.sum() == pytest.approx(1.0)
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0)).probabilities(logits)
    assert set(np.flatnonzero(p)) == {1, 2}   # token 1 alone holds < 0.5 of the mass
    one = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=3))
    assert {one(logits) for _ in range(50)} == {1}
    cold = Sampler(SamplingParams(temperature=0.05, seed=3)).probabilities(logits)
    assert cold[1] > 0.85   # low temperature approaches argmax
