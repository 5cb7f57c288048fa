"""The `colibri-plan serve` command itself, run as a user runs it: a child process on 127.0.0.1 (port 0),
the address read from its --json line, a plan in force, Ctrl-C to stop it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from _cli_fixtures import invoke, pack_and_profile
from _text_models import train_tokenizer, write_text_checkpoint

openai = pytest.importorskip("openai", reason="the openai client is not installed (pip install -e '.[test]')")

EXE = [str(Path(sys.executable).with_name("colibri-plan"))]


def _start(*args, env=None):
    """Start `colibri-plan --json serve ARGS`; returns (process, the JSON document it printed when ready)."""
    p = subprocess.Popen([*EXE, "--json", "serve", "--port", "0", "--backend", "numpy", *map(str, args)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    text, deadline = "", time.monotonic() + 120
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        text += line
        try:
            return p, json.loads(text)
        except ValueError:
            continue
    p.kill()
    raise AssertionError(f"serve did not get ready: {text!r} {p.stderr.read()!r}")


def _stop(p) -> str:
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    return err


@pytest.fixture(scope="module")
def text_pack(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    write_text_checkpoint(d / "ck", tok=train_tokenizer())
    assert invoke("model", "pack", d / "ck", d / "pk", "--quant", "int8").exit_code == 0
    return d / "pk"


def test_serve_binds_loopback_by_default_and_stops_on_ctrl_c(text_pack):
    p, doc = _start("--model", text_pack, "--api-key", "k1", "--context", "512")
    try:
        assert doc["host"] == "127.0.0.1" and doc["model"] == "pk" and doc["text"] is True
        assert doc["context_tokens"] == 512 and doc["api_key"] is True
        with urllib.request.urlopen(f"http://127.0.0.1:{doc['port']}/health", timeout=30) as r:
            assert json.load(r)["status"] == "ok"
        c = openai.OpenAI(base_url=doc["url"], api_key="k1", max_retries=0)
        r = c.chat.completions.create(model="pk", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert r.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=doc["url"], api_key="k2", max_retries=0).models.list()
    finally:
        err = _stop(p)
    assert "text: tokenizer 400 tokens" in err and "Traceback" not in err
    with pytest.raises(ConnectionRefusedError):   # nothing listens there any more
        socket.create_connection(("127.0.0.1", doc["port"]), timeout=10).close()


def test_serve_runs_a_plan_on_token_ids(tmp_path_factory):
    d = pack_and_profile(tmp_path_factory, "serveplan", plan=True)
    p, doc = _start("--model", d / "fx", "--plan", d / "plan.json",
                    env={"COLIBRI_PLAN_NO_RAM_CHECK": "1"})
    try:
        assert doc["text"] is False
        c = openai.OpenAI(base_url=doc["url"], api_key="x", max_retries=0)
        r = c.completions.create(model="fx", prompt=[5, 6, 7, 8], max_tokens=6)
        ids = [int(t) for t in r.choices[0].text.split()]
        want = invoke("--json", "run", "--model", d / "fx", "--plan", d / "plan.json",
                      "--prompt-ids", "5,6,7,8", "--tokens", 6, "--backend", "numpy")
        assert want.exit_code == 0, want.output
        assert ids == json.loads(want.stdout)["tokens"]
    finally:
        err = _stop(p)
    assert "runs on token ids only" in err


def test_a_port_in_use_is_a_clean_error(text_pack):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([*EXE, "serve", "--model", str(text_pack), "--port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr
