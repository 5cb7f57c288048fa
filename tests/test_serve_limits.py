"""`serve` under bad requests and load: 4xx with an OpenAI-style body and the server keeps serving; one
decode at a time with a bounded queue (429 + Retry-After); a client that disconnects mid-stream frees its
slot; a bounded loopback load test (8 clients x 10 requests) that loses nothing."""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time

import pytest
from _cli_fixtures import invoke
from _serve_helpers import LiveServer
from _text_models import train_tokenizer, write_text_checkpoint

from colibri_plan.engine.fixture import FixtureConfig, build_fixture

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")

GOOD = {"model": "tiny", "prompt": "The plan", "max_tokens": 3}


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("limits")
    write_text_checkpoint(d / "ck", tok=train_tokenizer())
    r = invoke("model", "pack", d / "ck", d / "pk", "--quant", "int8")
    assert r.exit_code == 0, r.output
    return d / "pk"


@pytest.fixture(scope="module")
def srv(pack_dir):
    with LiveServer(pack_dir, context_tokens=64, max_body_bytes=1 << 20) as s:
        yield s


def _json(doc) -> bytes:
    return json.dumps(doc).encode()


BAD = [
    ("malformed JSON", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("invalid UTF-8", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
    ("prompt of the wrong type", "/v1/completions", _json({**GOOD, "prompt": 5}), 400, "prompt"),
    ("max_tokens a string", "/v1/completions", _json({**GOOD, "max_tokens": "ten"}), 400, "max_tokens"),
    ("temperature a bool", "/v1/completions", _json({**GOOD, "temperature": True}), 400, "temperature"),
    ("temperature out of range", "/v1/completions", _json({**GOOD, "temperature": 7}), 400, "temperature"),
    ("negative max_tokens", "/v1/completions", _json({**GOOD, "max_tokens": -5}), 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", _json({**GOOD, "max_tokens": 10**12}), 400, "max_tokens"),
    ("prompt past the context", "/v1/completions", _json({**GOOD, "prompt": "plan " * 200}), 400, "prompt"),
    ("prompt past the context (chat)", "/v1/chat/completions",
     _json({"model": "tiny", "messages": [{"role": "user", "content": "plan " * 200}]}), 400, "messages"),
    ("token id outside the vocabulary", "/v1/completions", _json({**GOOD, "prompt": [1, 4000]}), 400,
     "prompt"),
    ("unknown model", "/v1/completions", _json({**GOOD, "model": "gpt-9"}), 404, "model"),
    ("two choices", "/v1/completions", _json({**GOOD, "n": 2}), 400, "n"),
    ("five stop strings", "/v1/completions", _json({**GOOD, "stop": list("abcde")}), 400, "stop"),
    ("messages missing", "/v1/chat/completions", _json({"model": "tiny"}), 400, "messages"),
    ("a message without a role", "/v1/chat/completions", _json({"model": "tiny", "messages": [{}]}), 400,
     "messages"),
    ("an image part", "/v1/chat/completions",
     _json({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}), 400,
     "messages"),
    ("unknown route", "/v1/embeddings", _json({"model": "tiny", "input": "x"}), 404, None),
]


@pytest.mark.parametrize("what,path,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(srv, what, path, body, status, param):
    got, _, doc = srv.raw("POST", path, body)
    assert got == status, doc
    err = doc["error"]
    assert isinstance(err["message"], str) and len(err["message"]) > 10 and err["type"]
    if param is not None:
        assert err["param"] == param
    ok, _, answer = srv.raw("POST", "/v1/completions", _json(GOOD))
    assert ok == 200 and answer["usage"]["completion_tokens"] >= 1


def test_a_10_mb_body_is_refused_with_413(srv):
    big = _json({**GOOD, "prompt": "x" * 10_000_000})
    status, _, doc = srv.raw("POST", "/v1/completions", big)
    assert status == 413 and "1,048,576 bytes" in doc["error"]["message"]
    assert srv.raw("POST", "/v1/completions", _json(GOOD))[0] == 200


def test_the_openai_client_sees_typed_errors(srv):
    c = srv.client()
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="x", max_tokens=1000)
    assert e.value.body["code"] == "context_length_exceeded"


def _stream_open(srv, max_tokens: int):
    """A raw streamed completion, read up to its first data line: (connection, response)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    conn.request("POST", "/v1/completions", body=_json({"model": "tiny", "prompt": [1, 2, 3],
                                                        "max_tokens": max_tokens, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: {")
    return conn, resp


def test_a_client_that_disconnects_mid_stream_frees_its_slot(pack_dir):
    with LiveServer(pack_dir, context_tokens=4096) as s:
        before = s.health()
        conn, _ = _stream_open(s, 4000)
        conn.sock.shutdown(2)   # the client goes away after its first token
        conn.close()
        h = s.wait_idle()
        assert h["pending"] == 0 and h["cancelled"] == before["cancelled"] + 1
        assert h["tokens"] - before["tokens"] < 4000   # ended early, not run to max_tokens
        r = s.client().completions.create(model="tiny", prompt="next", max_tokens=4)
        assert r.usage.completion_tokens >= 1


def test_one_decode_at_a_time_and_a_full_queue_answers_429(pack_dir):
    with LiveServer(pack_dir, context_tokens=4096, max_queue=0) as s:
        conn, resp = _stream_open(s, 4000)   # holds the one slot for a few seconds
        try:
            status, headers, doc = s.raw("POST", "/v1/completions", _json(GOOD))
            assert status == 429 and doc["error"]["type"] == "rate_limit_error"
            assert int(headers["Retry-After"]) >= 1
            assert s.health()["rejected"] == 1
        finally:
            conn.close()
        s.wait_idle()
        assert s.raw("POST", "/v1/completions", _json(GOOD))[0] == 200


def test_a_pack_without_a_tokenizer_serves_token_ids(tmp_path):
    build_fixture(tmp_path / "fx", FixtureConfig.small(layers=1, experts=8, top_k=2, vocab=300))
    with LiveServer(tmp_path / "fx", name="fx") as s:
        r = s.client().completions.create(model="fx", prompt=[1, 2, 3], max_tokens=4)
        ids = [int(t) for t in r.choices[0].text.split()]
        assert len(ids) == 4 and all(0 <= i < 300 for i in ids)
        status, _, doc = s.raw("POST", "/v1/completions", _json({"model": "fx", "prompt": "text"}))
        assert status == 400 and "without a tokenizer" in doc["error"]["message"]
        status, _, doc = s.raw("POST", "/v1/chat/completions",
                               _json({"model": "fx", "messages": [{"role": "user", "content": "hi"}]}))
        assert status == 400 and "no chat" in doc["error"]["message"]


def test_loopback_load_8_clients_x_10_requests_loses_nothing(pack_dir, capsys):
    n_clients, n_requests = 8, 10
    with LiveServer(pack_dir, context_tokens=256, max_queue=n_clients) as s:
        latencies, failures = [], []

        def client(k: int) -> None:
            c = s.client(timeout=120)
            for j in range(n_requests):
                t0 = time.perf_counter()
                try:
                    if j % 2:
                        chunks = list(c.completions.create(model="tiny", prompt=f"client {k} asks {j}",
                                                           max_tokens=8, stream=True))
                        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
                    else:
                        r = c.chat.completions.create(model="tiny", max_tokens=8,
                                                      messages=[{"role": "user", "content": f"{k}/{j}"}])
                        assert r.choices[0].finish_reason in ("stop", "length")
                        assert r.usage.completion_tokens >= 1
                except Exception as exc:  # noqa: BLE001 - every failure is reported below
                    failures.append(f"client {k} request {j}: {type(exc).__name__}: {exc}")
                latencies.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        assert len(latencies) == n_clients * n_requests
        h = s.wait_idle()
        assert h["served"] == n_clients * n_requests and h["rejected"] == 0 and h["failed"] == 0
    q = statistics.quantiles(latencies, n=100, method="inclusive")  # within the samples
    with capsys.disabled():
        print(f"\nserve load, {n_clients} clients x {n_requests} requests of 8 tokens: latency p50 "
              f"{q[49] * 1e3:.1f} ms, p90 {q[89] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms, "
              f"max {max(latencies) * 1e3:.1f} ms")
