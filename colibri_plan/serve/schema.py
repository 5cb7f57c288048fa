"""The OpenAI-compatible requests `colibri-plan serve` accepts, and its errors.

Request bodies are checked with pydantic in strict mode (a string is not a number, a bool is not an
int): fields of the OpenAI API this engine does not implement are refused with 400 when set to anything
but their default (``n`` > 1, ``logprobs``, ``echo``, tools, ...), fields it does not know are ignored
(clients send many). Errors have OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["ApiError", "CompletionRequest", "ChatRequest", "parse_body", "error_body"]


class ApiError(Exception):
    """An HTTP error answered with an OpenAI-style body.

    Args:
        status: HTTP status (400, 401, 404, 413, 429, 500, 503).
        message: what was wrong and what to do.
        param: the request field at fault, if one. code: OpenAI's error code (``context_length_exceeded``,
            ``model_not_found``, ``invalid_api_key``, ...). headers: extra response headers (Retry-After).
    """

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The JSON body of the response."""
        return error_body(self.message, self.TYPES.get(self.status, "server_error"), self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    """Fields common to both endpoints (sampling defaults: greedy, as `colibri-plan run`)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None          # not OpenAI's; llama.cpp's and vLLM's servers take it too
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to something this engine does not do, or None."""
        if self.n != 1:
            return "n", "one choice per request (n = 1)"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "log-probabilities are not returned"
        if self.presence_penalty or self.frequency_penalty:
            return "presence_penalty", "presence and frequency penalties are not applied (give 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not applied"
        return None

    def stops(self) -> list[str]:
        """``stop`` as a list."""
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Generation):
    """``POST /v1/completions``: ``prompt`` is text or one list of token ids (one prompt per request)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "the prompt is not echoed"
        if self.suffix:
            return "suffix", "insertion (suffix) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "one candidate per request"
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                return "prompt", "one prompt per request (send the others as their own requests)"
        return super().unsupported()

    def one_prompt(self) -> str | list[int]:
        """The prompt: text or token ids (a one-element batch unwrapped)."""
        p = self.prompt
        return p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)) else p


class ContentPart(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class Message(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")   # name, tool_call_id ... reach the template
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self, i: int) -> dict:
        """The message as a chat template reads it: text content (text parts joined).

        Raises:
            ApiError: 400 for a part that is not text (images, audio).
        """
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported, got a "
                                        f"{part.type!r} part", param="messages")
            d["content"] = "".join(p.text for p in self.content)
        d.setdefault("content", "")
        return d


class ChatRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calls are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", "structured output is not supported"
        return super().unsupported()


#: the tags pydantic puts in an error's location for the member of a union it tried
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field(loc) -> str:
    """A pydantic error location as a path: ``messages[0].role`` (union member tags left out)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif "[" not in p and p not in _UNION_TAGS and not p.endswith("Part") and p != "Message":
            out += f".{p}" if out else p
    return out or "body"


def parse_body(raw: bytes, cls: type[_Generation]) -> _Generation:
    """Decode, parse and check a request body.

    Raises:
        ApiError: 400 for a body that is not UTF-8, not JSON, not an object, or whose fields have the
        wrong type or a value this engine does not support (the message names the field).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON"
                       ) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc.msg} at line {exc.lineno} column "
                            f"{exc.colno})") from None
    if not isinstance(doc, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(doc).__name__}")
    try:
        req = cls.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        top = str(err["loc"][0]) if err["loc"] else None
        if top == "prompt":   # a union: pydantic's first member message alone would mislead
            raise ApiError(400, "prompt must be text, or a list of token ids (whole numbers)",
                           param="prompt") from None
        more = f" (+{exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ApiError(400, f"{_field(err['loc'])}: {err['msg']}{more}", param=top) from None
    bad = req.unsupported()
    if bad is not None:
        raise ApiError(400, f"{bad[0]}: {bad[1]}", param=bad[0])
    return req
