"""`colibri-plan serve`: a server on 127.0.0.1 inside the test, driven by the official openai client
(streamed and whole, completions and chat), its answers equal to the engine's run of the same prompt and
seed; models, health, and the API key."""

from __future__ import annotations

import pytest
from _cli_fixtures import invoke
from _serve_helpers import LiveServer
from _text_models import train_tokenizer, write_text_checkpoint

from colibri_plan.engine import runner
from colibri_plan.engine.pack_text import open_text
from colibri_plan.run_options import RunOptions
from colibri_plan.text.sampling import SamplingParams, make_sampler

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")

CHAT = [{"role": "system", "content": "You place experts."},
        {"role": "user", "content": "Where is expert 3?"}]


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    write_text_checkpoint(d / "ck", tok=train_tokenizer())
    r = invoke("model", "pack", d / "ck", d / "pk", "--quant", "int8")
    assert r.exit_code == 0, r.output
    return d / "pk"


@pytest.fixture(scope="module")
def srv(pack_dir):
    with LiveServer(pack_dir) as s:
        yield s


def engine_text(pack_dir, ids, n, params=SamplingParams()):
    """What the engine's own run (runner.generate, as `run`) makes of ``ids``: (text, new ids)."""
    w = runner.open_weights(pack_dir)
    try:
        codec = open_text(w)
        rep = runner.generate(w, ids, RunOptions(tokens=n, backend="numpy"), sample=make_sampler(params),
                              stop_ids=codec.stop_ids)
        return codec.decode(rep.tokens), rep.tokens
    finally:
        w.close()


def test_models_and_health(srv):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert srv.client().models.retrieve("tiny").id == "tiny"
    h = srv.health()
    assert h["status"] == "ok" and h["model"] == "tiny" and h["max_queue"] == 8


def test_completion_equals_the_engine_run_greedy(srv, pack_dir):
    r = srv.client().completions.create(model="tiny", prompt="The plan places", max_tokens=12)
    want, ids = engine_text(pack_dir, srv.codec.encode("The plan places"), 12)
    assert r.choices[0].text == want
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens == len(srv.codec.encode("The plan places"))
    assert r.choices[0].finish_reason == ("stop" if ids[-1] in srv.codec.stop_ids else "length")
    extra = r.usage.model_extra
    assert extra["prefill_s"] > 0 and extra["time_to_first_token_s"] >= extra["prefill_s"]


def test_streamed_completion_is_the_whole_one_in_pieces(srv):
    c = srv.client()
    whole = c.completions.create(model="tiny", prompt="Experts stream", max_tokens=20, temperature=0.9,
                                 seed=11)
    chunks = list(c.completions.create(model="tiny", prompt="Experts stream", max_tokens=20, temperature=0.9,
                                       seed=11, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) > 3   # streamed, not one lump


def test_sampled_chat_equals_the_engine_run_with_the_same_seed(srv, pack_dir):
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234)
    c = srv.client()
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0.8, top_p=0.95,
                                  seed=1234, extra_body={"top_k": 50})
    want, ids = engine_text(pack_dir, srv.codec.encode_chat(CHAT), 16, params)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ids)
    other = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0.8, seed=99)
    assert other.choices[0].message.content != want   # another seed, another draw


def test_streamed_chat_sends_the_role_then_the_text(srv, pack_dir):
    chunks = list(srv.client().chat.completions.create(model="tiny", messages=CHAT, max_tokens=10,
                                                       stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert text == engine_text(pack_dir, srv.codec.encode_chat(CHAT), 10)[0]


def test_stop_strings_end_the_text_before_them(srv):
    c = srv.client()
    full = c.completions.create(model="tiny", prompt="The", max_tokens=24).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = c.completions.create(model="tiny", prompt="The", max_tokens=24, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    s = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="The", max_tokens=24,
                                                                   stop=stop, stream=True))
    assert s == r.choices[0].text


def test_token_id_prompts_work_without_text(srv, pack_dir):
    ids = srv.codec.encode("route")
    r = srv.client().completions.create(model="tiny", prompt=ids, max_tokens=6)
    assert r.choices[0].text == engine_text(pack_dir, ids, 6)[0]


def test_api_key_is_required_when_set(pack_dir):
    with LiveServer(pack_dir, api_key="s3cret", name="keyed") as s:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client(api_key="wrong").models.list()
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        status, _, body = s.raw("POST", "/v1/completions", b'{"model": "keyed", "prompt": "x"}')
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert s.raw("GET", "/health")[0] == 200   # liveness needs no key
        r = s.client(api_key="s3cret").completions.create(model="keyed", prompt="x", max_tokens=2)
        assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_tokens_equal_colibri_plan_run_with_the_same_prompt_and_seed(srv, pack_dir, chat):
    import json

    args = ["--prompt", "Plan the experts", "--tokens", 14, "--temperature", 0.7, "--top-p", 0.9,
            "--seed", 77, *(["--chat"] if chat else [])]
    r = invoke("--json", "run", "--model", pack_dir, "--backend", "numpy", *args)
    assert r.exit_code == 0, r.output
    want = json.loads(r.stdout)
    c = srv.client()
    kw = dict(model="tiny", max_tokens=14, temperature=0.7, top_p=0.9, seed=77)
    if chat:
        got = c.chat.completions.create(messages=[{"role": "user", "content": "Plan the experts"}], **kw)
        text = got.choices[0].message.content
    else:
        got = c.completions.create(prompt="Plan the experts", **kw)
        text = got.choices[0].text
    assert text == want["text"] == srv.codec.decode(want["tokens"])
    assert got.usage.completion_tokens == len(want["tokens"])
    assert got.usage.prompt_tokens == want["prompt_tokens"]


def test_the_client_speed_bench_streams_and_compares_with_the_engine(srv, tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "serve_openai.py"
    spec = importlib.util.spec_from_file_location("bench_serve_openai", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "serve.json"
    assert mod.main(["--url", srv.base_url, "--prompt-ids", "5,6,7", "--tokens", "24", "--requests", "2",
                     "--warmup", "0", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "tiny" and len(doc["requests"]) == 2
    assert all(r["tokens"] == r["usage"]["completion_tokens"] >= 2 for r in doc["requests"])
    assert doc["client_tok_s_median"] > 0 and doc["engine_tok_s"] == doc["server_tok_s_median"] > 0
    assert "client tok/s" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        mod.main(["--tokens", "0"])
    assert e.value.code == 2
