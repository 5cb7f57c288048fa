"""The engine behind `colibri-plan serve`: one thread owns the :class:`~colibri_plan.engine.session.
EngineSession` and decodes one request at a time; requests wait in a bounded queue.

The session is opened, used and closed in that one thread (a GPU backend's device, streams and uploads
stay with the thread that made them). A request is a :class:`Job`; the thread reports each new token id,
then the run's :class:`~colibri_plan.formats.report.RunReport` (or the error), to the job's asyncio queue
on the server's event loop. A job whose ``cancel`` is set (the client went away, a stop string matched)
ends at its next token: the sampler raises :class:`Cancelled` inside ``Model.generate``, between two
forward passes, so the engine's state stays whole and the slot is free for the next job.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from colibri_plan.text.sampling import SamplingParams, make_sampler

__all__ = ["Job", "EngineWorker", "Cancelled"]


class Cancelled(Exception):
    """Raised by a job's sampler to end its generation early (never leaves this module)."""


@dataclass
class Job:
    """One generation request.

    Attributes:
        prompt_ids: the prompt's token ids. max_tokens: new tokens at most (>= 1).
        params: how each token is chosen. stop_ids: ids that end the generation (EOS).
        loop: the event loop that reads ``events``; events: an ``asyncio.Queue`` of ``(kind, value)``:
            ``("token", id)`` per new token, then one of ``("done", RunReport)``, ``("cancelled", None)``,
            ``("error", exception)``.
        cancel: set it to end the job at its next token (or to skip it while it waits).
        created_s: ``time.perf_counter()`` when the job was made (time to first token counts from it).
    """

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop_ids: frozenset = frozenset()
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens: int = 0
    #: perf_counter seconds when the job was made, before it is submitted: the engine thread may start
    #: its prefill before the request's reader exists, so time to first token counts from here
    created_s: float = field(default_factory=time.perf_counter)

    def put(self, kind: str, value) -> None:
        """Hand an event to the job's reader (from the engine thread)."""
        if self.loop is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:   # the event loop closed (the server stopped): nobody reads this job
            self.cancel.set()


class EngineWorker:
    """The engine thread and its bounded queue.

    Args:
        open_session: ``fn() -> EngineSession`` (called in the engine thread).
        max_queue: jobs that may wait while one runs (>= 0); one more is refused (:meth:`try_submit`).

    Attributes:
        served, cancelled, failed, rejected: counts of jobs so far. tokens: new tokens generated in all.
    """

    def __init__(self, open_session: Callable[[], object], max_queue: int = 8):
        self._open, self.max_queue = open_session, int(max_queue)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._ready = threading.Event()
        self.error: BaseException | None = None
        self.served = self.cancelled = self.failed = self.rejected = self.tokens = 0
        self._job_s = 0.0   # moving mean of a job's seconds (the Retry-After estimate)
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="colibri-plan-engine", daemon=True)

    def start(self) -> None:
        """Start the thread and wait until the session is open; re-raises what opening it raised."""
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            raise self.error

    @property
    def pending(self) -> int:
        """Jobs running or waiting."""
        with self._lock:
            return self._pending

    def try_submit(self, job: Job) -> bool:
        """Queue ``job`` unless one job runs and ``max_queue`` wait already; False when refused."""
        with self._lock:
            if self._pending >= 1 + self.max_queue or not self._thread.is_alive():
                self.rejected += 1
                return False
            self._pending += 1
        self._jobs.put(job)
        return True

    def retry_after_s(self) -> int:
        """Whole seconds after which a refused client may try again: the queue ahead at the mean job time
        (1 .. 60)."""
        return int(min(60, max(1, math.ceil(self._job_s * max(1, self.pending)))))

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel what waits, end the running job at its next token, close the session, join the thread."""
        while True:
            try:
                self._jobs.get_nowait().cancel.set()   # unread: their readers see the server stop
            except queue.Empty:
                break
        self._jobs.put(None)
        if self._current is not None:
            self._current.cancel.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            session = self._open()
        except BaseException as exc:  # noqa: BLE001 - handed to start()'s caller
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while (job := self._jobs.get()) is not None:
                t0, self._current = time.perf_counter(), job
                try:
                    if job.cancel.is_set():
                        self.cancelled += 1
                        job.put("cancelled", None)
                    else:
                        self._generate(session, job)
                finally:
                    self._current = None
                    with self._lock:
                        self._pending -= 1
                    self._job_s = 0.8 * self._job_s + 0.2 * (time.perf_counter() - t0)
        finally:
            session.close()

    def _generate(self, session, job: Job) -> None:
        sampler = make_sampler(job.params)

        def sample(logits: np.ndarray) -> int:   # logits float32 [V]
            if job.cancel.is_set():
                raise Cancelled
            tok = int(np.argmax(logits)) if sampler is None else sampler(logits)   # argmax: as greedy
            job.tokens += 1
            self.tokens += 1
            job.put("token", tok)
            return tok

        try:
            rep = session.generate(job.prompt_ids, job.max_tokens, sample=sample, stop_ids=job.stop_ids)
        except Cancelled:
            self.cancelled += 1
            job.put("cancelled", None)
        except Exception as exc:  # noqa: BLE001 - the reader answers it (a 500 or an error event)
            self.failed += 1
            job.put("error", exc)
        else:
            self.served += 1
            job.put("done", rep)
