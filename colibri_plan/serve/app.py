"""The OpenAI-compatible HTTP API of `colibri-plan serve`, a FastAPI app run by uvicorn (cli/serve.py).

Routes: ``GET /health`` (no key needed), ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/completions`` and ``POST /v1/chat/completions``, each streamed as server-sent events
(``"stream": true``: ``data: {chunk}`` lines, then ``data: [DONE]``) or answered whole. Every error is an
OpenAI-style body (colibri_plan/serve/schema.py): 400 bad request, 401 missing or wrong key, 404 unknown model
or route, 413 body too large, 429 queue full (with ``Retry-After``), 500 engine failure.

One request decodes at a time (colibri_plan/serve/worker.py); sampling defaults to greedy, like `run`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from colibri_plan.errors import InputError, UnsupportedError
from colibri_plan.serve.gen import ClientGone, Generation
from colibri_plan.serve.schema import ApiError, ChatRequest, CompletionRequest, error_body, parse_body
from colibri_plan.serve.worker import EngineWorker, Job
from colibri_plan.text.sampling import SamplingParams
from colibri_plan.text.stream import StopStrings

__all__ = ["ServeSettings", "create_app"]


@dataclass(frozen=True)
class ServeSettings:
    """What the API serves and its limits.

    Attributes:
        model_name: the id clients name in ``model``.
        context_tokens: prompt + new tokens a request may ask (the plan's context, or `serve --context`).
        vocab_size: the model's vocabulary (token-id prompts are checked against it).
        api_key: the key requests must send as ``Authorization: Bearer KEY``; None = no key.
        max_body_bytes: largest request body (413 past it).
        default_max_tokens: new tokens of a completion without ``max_tokens`` (OpenAI's 16); a chat
            without it may fill the context.
    """

    model_name: str
    context_tokens: int
    vocab_size: int
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    default_max_tokens: int = 16


def _sse(doc) -> str:
    return f"data: {json.dumps(doc, ensure_ascii=False)}\n\n"


class _Api:
    """The routes' state: the engine worker, the text side, the settings (see :func:`create_app`)."""

    def __init__(self, worker: EngineWorker, settings: ServeSettings, codec, check_context=None):
        self.worker, self.s, self.codec = worker, settings, codec
        self.check_context = check_context   # fn(n_prompt, n_new): the engine's own context limits
        self.created = int(time.time())

    def auth(self, request: Request) -> None:
        key = self.s.api_key
        if key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send the key `serve --api-key` was given as "
                                "'Authorization: Bearer KEY'", code="invalid_api_key")

    async def body(self, request: Request) -> bytes:
        limit = self.s.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = ApiError(413, f"the request body passes the {limit:,} bytes this server accepts",
                           code="request_too_large")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        parts, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            parts.append(chunk)
        return b"".join(parts)

    def model(self, name: str) -> None:
        if name != self.s.model_name:
            raise ApiError(404, f"the model {name!r} does not exist here; this server serves "
                                f"{self.s.model_name!r} (GET /v1/models)", param="model",
                           code="model_not_found")

    def model_card(self) -> dict:
        return {"id": self.s.model_name, "object": "model", "created": self.created,
                "owned_by": "colibri-plan", "context_length": self.s.context_tokens,
                "text": self.codec is not None}

    def prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            if not prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            bad = [i for i in prompt if not 0 <= i < self.s.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary "
                                    f"0..{self.s.vocab_size - 1}", param="prompt")
            return list(prompt)
        if self.codec is None:
            raise ApiError(400, "this model was packed without a tokenizer: send the prompt as a list of "
                                "token ids", param="prompt")
        ids = self.codec.encode(prompt)
        if not ids:
            raise ApiError(400, "prompt is empty (no tokens)", param="prompt")
        return ids

    def max_tokens(self, asked: int | None, n_prompt: int, default: int | None, prompt_field: str) -> int:
        room = self.s.context_tokens - n_prompt
        if room < 1:
            raise ApiError(400, f"the prompt has {n_prompt} tokens and leaves no room for new ones in the "
                                f"{self.s.context_tokens}-token context", param=prompt_field,
                           code="context_length_exceeded")
        if asked is None:
            return room if default is None else min(default, room)
        if asked < 1:
            raise ApiError(400, f"max_tokens must be >= 1, got {asked}", param="max_tokens")
        if asked > room:
            raise ApiError(400, f"max_tokens {asked} + the prompt's {n_prompt} tokens pass the "
                                f"{self.s.context_tokens}-token context; ask for at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        return asked

    def submit(self, req, prompt_ids: list[int], default_max: int | None) -> Generation:
        chat = isinstance(req, ChatRequest)
        asked = req.max_tokens
        if chat and req.max_completion_tokens is not None:   # the newer name of the same limit
            asked = req.max_completion_tokens
        n_new = self.max_tokens(asked, len(prompt_ids), default_max, "messages" if chat else "prompt")
        try:
            if self.check_context is not None:
                self.check_context(len(prompt_ids), n_new)
        except (InputError, UnsupportedError) as exc:
            raise ApiError(400, str(exc), param="max_tokens", code="context_length_exceeded") from None
        try:
            params = SamplingParams(0.0 if req.temperature is None else req.temperature,
                                    1.0 if req.top_p is None else req.top_p, req.top_k or 0, req.seed).check()
            stops = StopStrings(req.stops())
        except InputError as exc:   # each message starts with the field's name
            field = str(exc).split(" ", 1)[0]
            raise ApiError(400, str(exc), param="stop" if field == "each" else field) from None
        stop_ids = self.codec.stop_ids if self.codec is not None else frozenset()
        job = Job(prompt_ids, n_new, params, stop_ids, asyncio.get_running_loop(), asyncio.Queue())
        if not self.worker.try_submit(job):
            wait = self.worker.retry_after_s()
            raise ApiError(429, f"the server is busy: one request decodes and {self.worker.max_queue} wait "
                                f"(serve --max-queue); try again in {wait} s",
                           headers={"Retry-After": str(wait)})
        return Generation(job, self.codec, stops)

    async def respond(self, request: Request, gen: Generation, req, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.s.model_name}

        def choice(text: str | None, finish: str | None, first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            delta = ({"role": "assistant", "content": ""} if first else {} if text is None
                     else {"content": text})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        if not req.stream:
            try:
                text = await gen.text_all(request)
            except ClientGone:
                return JSONResponse(error_body("client disconnected"), status_code=499)
            one = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                    "finish_reason": gen.finish_reason} if chat else choice(text, gen.finish_reason))
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                                 "choices": [one], "usage": gen.usage()})

        async def events():
            try:
                if chat:
                    yield _sse({**head, "choices": [choice(None, None, first=True)]})
                async for piece in gen.pieces():
                    yield _sse({**head, "choices": [choice(piece, None)]})
                yield _sse({**head, "choices": [choice(None, gen.finish_reason)]})
                if req.stream_options is not None and req.stream_options.include_usage:
                    yield _sse({**head, "choices": [], "usage": gen.usage()})
            except ApiError as exc:   # after the 200 header: the error travels as an event
                yield _sse(exc.body())
            finally:
                gen.job.cancel.set()   # the client went away (the task is cancelled) or the run ended
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def health(self) -> dict:
        w = self.worker
        return {"status": "ok", "model": self.s.model_name, "pending": w.pending, "max_queue": w.max_queue,
                "served": w.served, "cancelled": w.cancelled, "failed": w.failed, "rejected": w.rejected,
                "tokens": w.tokens}


def create_app(worker: EngineWorker, settings: ServeSettings, codec=None, check_context=None) -> FastAPI:
    """The FastAPI app over a started :class:`~colibri_plan.serve.worker.EngineWorker`.

    Args:
        settings: :class:`ServeSettings`. codec: the model's TextCodec, or None (token-id prompts only;
            the text of the answer is its ids). check_context: ``fn(n_prompt, n_new)`` raising
            UnsupportedError past the engine's limits (``runner.check_context`` of the model's arch).
    """
    api = _Api(worker, settings, codec, check_context)
    app = FastAPI(title="colibri-plan", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):   # unknown route, wrong method
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}"),
                            status_code=exc.status_code)

    @app.get("/health")
    async def health():
        return api.health()

    @app.get("/v1/models")
    async def models(request: Request):
        api.auth(request)
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        api.auth(request)
        api.model(name)
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        api.auth(request)
        req = parse_body(await api.body(request), CompletionRequest)
        api.model(req.model)
        gen = api.submit(req, api.prompt_ids(req.one_prompt()), settings.default_max_tokens)
        return await api.respond(request, gen, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        api.auth(request)
        req = parse_body(await api.body(request), ChatRequest)
        api.model(req.model)
        if codec is None:
            raise ApiError(400, "this model was packed without a tokenizer, so it has no chat: use "
                                "/v1/completions with token ids", param="messages")
        try:
            ids = codec.encode_chat([m.for_template(i) for i, m in enumerate(req.messages)])
        except InputError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        gen = api.submit(req, ids, None)
        return await api.respond(request, gen, req, chat=True)

    return app
