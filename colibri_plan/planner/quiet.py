"""Keep a native solver's prints off stdout.

HiGHS (behind ``scipy.optimize.milp`` / ``linprog``) can print straight to the C-level stdout (fd 1),
e.g. ``HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();``, bypassing Python; a
``--json`` command's stdout must hold one document only. :func:`no_native_stdout` points fd 1 at
``/dev/null`` for the duration of a call and restores it, also on an exception.

Thread-safe enough: one process-wide lock and a count of callers inside, so concurrent or nested solves
share one redirection and the last one out restores fd 1. While a solve runs, whatever any thread writes
to fd 1 is dropped (Python-level ``sys.stdout`` is flushed first, so nothing printed before is lost).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

_lock = threading.Lock()
_state = {"depth": 0, "saved": None}


def _flush() -> None:
    with contextlib.suppress(Exception):
        sys.stdout.flush()


@contextlib.contextmanager
def no_native_stdout():
    """Redirect fd 1 to /dev/null inside the block (no-op where fd 1 cannot be duplicated)."""
    with _lock:
        if _state["depth"] == 0:
            _flush()
            try:
                saved = os.dup(1)
            except OSError:
                saved = None
            if saved is not None:
                null = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(null, 1)
                finally:
                    os.close(null)
            _state["saved"] = saved
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0 and _state["saved"] is not None:
                os.dup2(_state["saved"], 1)
                os.close(_state["saved"])
                _state["saved"] = None
