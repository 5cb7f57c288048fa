"""A `serve` app on 127.0.0.1 inside the test process (uvicorn in a thread, a port picked by the OS), the
engine behind it opened as `colibri-plan serve` opens it, and raw HTTP for the requests no client sends."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

from colibri_plan.engine import runner
from colibri_plan.engine.moe import RoutingRecorder
from colibri_plan.engine.pack_text import open_text
from colibri_plan.engine.session import EngineSession
from colibri_plan.serve.app import ServeSettings, create_app
from colibri_plan.serve.worker import EngineWorker


class LiveServer:
    """``with LiveServer(pack_dir, ...) as srv:`` serves the pack at ``srv.base_url`` until the block ends."""

    def __init__(self, pack_dir, *, name: str = "tiny", api_key: str | None = None, max_queue: int = 8,
                 context_tokens: int = 4096, max_body_bytes: int = 4 * 2**20, backend: str = "numpy"):
        self.weights = runner.open_weights(pack_dir)
        arch = self.weights.arch
        self.codec = open_text(self.weights)
        placement = runner.placement_for(self.weights, None, backend)
        where = runner.trunk_placement(self.weights, None, None, backend)

        def open_session():
            return EngineSession(self.weights, placement, cpu_backend=backend, trunk=where,
                                 recorder=RoutingRecorder(arch, keep_ids=False),
                                 context_tokens=context_tokens)

        self.worker = EngineWorker(open_session, max_queue=max_queue)
        self.settings = ServeSettings(model_name=name, context_tokens=context_tokens,
                                      vocab_size=arch.vocab_size, api_key=api_key,
                                      max_body_bytes=max_body_bytes)
        self.name = name

    def __enter__(self):
        import uvicorn

        self.worker.start()
        app = create_app(self.worker, self.settings, self.codec,
                         lambda n, m: runner.check_context(self.weights.arch, n, m))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the test server did not start in 30 s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.stop()
        self.sock.close()
        self.weights.close()

    def client(self, **kw):
        """The official openai client pointed at this server (no retries: a test sees every answer)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=kw.pop("api_key", "unused"), max_retries=0,
                             timeout=kw.pop("timeout", 60), **kw)

    def raw(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 60):
        """(status, headers, parsed JSON body or text) of one raw HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        try:
            doc = json.loads(data)
        except ValueError:
            doc = data.decode("utf-8", "replace")
        return resp.status, resp.headers, doc   # headers: case-insensitive

    def health(self) -> dict:
        return self.raw("GET", "/health")[2]

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """/health once nothing runs or waits (or after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if h["pending"] == 0 or time.monotonic() > deadline:
                return h
            time.sleep(0.02)
