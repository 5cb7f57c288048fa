"""One request's generation as the HTTP side sees it: the engine's token ids turned into text pieces,
cut at stop strings, with the finish reason and the usage figures at the end.

The engine thread (colibri_plan/serve/worker.py) sends token ids; this runs on the server's event loop,
detokenizes them incrementally (:class:`~colibri_plan.text.stream.StreamDecoder`, or the ids as
text for a pack without a tokenizer) and ends the job early when a stop string matched or the client
went away.
"""

from __future__ import annotations

import asyncio
import time

from colibri_plan.errors import ColibriError, InputError, UnsupportedError
from colibri_plan.serve.schema import ApiError
from colibri_plan.serve.worker import Job
from colibri_plan.text.stream import IdText, StopStrings

__all__ = ["Generation", "ClientGone"]


class ClientGone(Exception):
    """The client of a whole (non-streamed) response disconnected while it waited."""


class Generation:
    """Text pieces of one job (:meth:`pieces`), then ``finish_reason`` and :meth:`usage`.

    Args:
        job: a submitted :class:`~colibri_plan.serve.worker.Job`.
        codec: the model's :class:`~colibri_plan.text.codec.TextCodec`, or None (ids as text).
        stops: the request's stop strings.
    """

    def __init__(self, job: Job, codec, stops: StopStrings):
        self.job, self.stops = job, stops
        self.text = codec.stream() if codec is not None else IdText()
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.report = None
        self._t0 = job.created_s  # not now: the engine may already be prefilling this job
        self._t_first = self._t_last = None

    async def _next(self, request):
        if request is None:   # a stream: the response task is cancelled when the client goes
            return await self.job.events.get()
        while True:   # a whole response: nothing is sent before the end, so ask the connection
            try:
                return await asyncio.wait_for(self.job.events.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientGone from None

    async def pieces(self, request=None):
        """Yield the text as it is generated ("" pieces are left out).

        Args:
            request: the Starlette request of a whole response, polled for a disconnect; None for a
                stream.

        Raises:
            ApiError: 400 for input the engine refused (e.g. a context past a DSA model's index_topk),
                500 for an engine failure, 503 when the server stops under the request.
            ClientGone: the client disconnected (a whole response only).
        """
        try:
            while True:
                kind, val = await self._next(request)
                if kind == "token":
                    now = time.perf_counter()
                    self._t_first = self._t_first or now
                    self._t_last = now
                    self.completion_tokens += 1
                    piece = self.stops.push(self.text.push(val))
                    if piece:
                        yield piece
                    if self.stops.stopped:
                        self.finish_reason = "stop"
                        return
                elif kind == "done":
                    self.report = val
                    tail = self.stops.push(self.text.flush())
                    tail += self.stops.flush()
                    if tail:
                        yield tail
                    last = val.tokens[-1] if val.tokens else None
                    ended = self.stops.stopped or (last in self.job.stop_ids)
                    self.finish_reason = "stop" if ended else "length"
                    return
                elif kind == "cancelled":
                    raise ApiError(503, "the server stopped before this request was decoded; send it again")
                else:
                    raise _engine_error(val)
        finally:
            self.job.cancel.set()   # a no-op after "done"; else the engine ends this job at its next token

    async def text_all(self, request) -> str:
        """The whole text (a non-streamed response)."""
        return "".join([p async for p in self.pieces(request)])

    def usage(self) -> dict:
        """OpenAI's ``usage`` plus the run's timing: ``time_to_first_token_s`` (queue + prefill, as the
        server saw it), ``prefill_s`` and ``decode_tok_s`` (the engine's RunReport when the run ended by
        itself, else the server's clock between the first and the last token)."""
        n_prompt = len(self.job.prompt_ids)
        out = {"prompt_tokens": n_prompt, "completion_tokens": self.completion_tokens,
               "total_tokens": n_prompt + self.completion_tokens,
               "time_to_first_token_s": None if self._t_first is None else round(self._t_first - self._t0, 6)}
        rep = self.report
        if rep is not None:
            out["prefill_s"] = round(rep.prefill_s, 6)
            out["decode_tok_s"] = round(rep.tok_s, 3) if rep.decode_steps else None
        elif self.completion_tokens > 1 and self._t_last > self._t_first:
            out["decode_tok_s"] = round((self.completion_tokens - 1) / (self._t_last - self._t_first), 3)
        return out


def _engine_error(exc: BaseException) -> ApiError:
    if isinstance(exc, (InputError, UnsupportedError)):
        return ApiError(400, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, ColibriError):
        return ApiError(500, f"the engine failed: {type(exc).__name__}: {exc}")
    return ApiError(500, f"the engine failed unexpectedly: {type(exc).__name__}: {exc}")
