"""Shared by the fuzz suites (test_fuzz_documents.py, test_fuzz_loaders.py): mutations of a valid input
and a bounded runner.

:func:`bounded` runs one case in a forked child under ``RLIMIT_AS`` (its address space at fork + 1 GiB)
and a 10 s wall-clock limit, so a runaway allocation or loop fails the test instead of taking the
machine; the child reports how the call ended and its peak RSS growth. :func:`check_outcome` then
asserts the contract: the call returned, or raised a :class:`~colibri_plan.errors.ColibriError`
subclass with a one-line message; any other exception (a traceback), a crash, 1 GiB more memory or
10 s is a failure.

Mutations (hypothesis strategies): of bytes — truncation, byte flips, inserted bytes; of JSON — a value
at any path replaced by another type, a huge or non-finite number, a path string, a deep nesting; a key
dropped.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import select
import signal
import time
import traceback

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from colibri_plan.errors import ColibriError

MEM_LIMIT = 1 << 30
TIME_LIMIT_S = 10.0
#: hypothesis settings of every fuzz test: reproducible in CI, bounded examples, our own time limit
FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=False,
                suppress_health_check=list(HealthCheck))


def fuzz(max_examples: int) -> settings:
    """:data:`FUZZ` with ``max_examples`` cases. For a longer hunt outside CI: ``COLIBRI_FUZZ_SCALE=10``
    multiplies the cases, ``COLIBRI_FUZZ_RANDOM=1`` draws new ones each run."""
    scale = int(os.environ.get("COLIBRI_FUZZ_SCALE", "1"))
    return settings(FUZZ, max_examples=max_examples * scale,
                    derandomize=os.environ.get("COLIBRI_FUZZ_RANDOM") != "1")

DEEP = 100_000
#: values a mutation puts in place of a field: type swaps, huge / non-finite numbers, path strings
EVIL = [None, True, False, 0, -1, 1, 7, 2**31, 2**53 + 1, 2**63, 2**64, 10**400, -2**64, 1e308, -1e308, 0.5,
        1e-300, float("nan"), float("inf"), float("-inf"), "", "7", "nan", "x" * 5000, "../../etc/passwd",
        "/dev/zero", "/proc/self/mem", "a/b", "\x00", "..", ".", "é", [], [1, 2], [[1]], {}, {"a": 1},
        [None] * 3, "deep"]


def _vm_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def bounded(fn, *args, **kwargs) -> dict:
    """Run ``fn(*args, **kwargs)`` in a forked child (memory and time bounded, see the module docstring).

    Returns:
        {"status": "ok" | "typed" | "raw" | "memory" | "timeout" | "crash", "type", "message",
         "traceback", "rss_growth"}.
    """
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        out: dict
        try:
            limit = _vm_bytes() + MEM_LIMIT
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            try:
                fn(*args, **kwargs)
                out = {"status": "ok"}
            except ColibriError as exc:
                out = {"status": "typed", "type": type(exc).__name__, "message": str(exc)}
            except MemoryError:
                out = {"status": "memory", "traceback": traceback.format_exc()[-3000:]}
            except BaseException as exc:  # noqa: BLE001 - what the test is looking for
                out = {"status": "raw", "type": type(exc).__name__, "message": str(exc)[:500],
                       "traceback": traceback.format_exc()[-3000:]}
            out["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024
            data = pickle.dumps(out)
        except BaseException:  # noqa: BLE001
            data = pickle.dumps({"status": "crash", "traceback": traceback.format_exc()[-3000:]})
        try:
            os.write(w, data)
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + TIME_LIMIT_S
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(r)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"status": "timeout"}
    if not chunks:
        return {"status": "crash", "traceback": f"child ended with wait status {status} and no report"}
    return pickle.loads(b"".join(chunks))


def check_outcome(res: dict, case: str = "") -> dict:
    """Assert the fuzz contract on a :func:`bounded` result (module docstring); returns it."""
    head = f"{case}: " if case else ""
    assert res["status"] in ("ok", "typed"), f"{head}{res['status']}: {res.get('type')}: " \
        f"{res.get('message')}\n{res.get('traceback', '')}"
    assert res.get("rss_growth", 0) < MEM_LIMIT, f"{head}peak RSS grew by {res['rss_growth']:,} B"
    if res["status"] == "typed":
        msg = res["message"]
        assert msg.strip(), f"{head}{res['type']} with an empty message"
        assert "\n" not in msg, f"{head}{res['type']} message spans lines: {msg!r:.300}"
        assert "Traceback" not in msg, f"{head}{msg!r:.300}"
    return res


# ---- mutations -------------------------------------------------------------------------------------

def byte_mutations() -> st.SearchStrategy:
    """("truncate", fraction) | ("flip", [(fraction, xor)]) | ("insert", fraction, bytes)."""
    frac = st.floats(0.0, 1.0, allow_nan=False)
    return st.one_of(
        st.tuples(st.just("truncate"), frac),
        st.tuples(st.just("flip"), st.lists(st.tuples(frac, st.integers(1, 255)), min_size=1, max_size=8)),
        st.tuples(st.just("insert"), frac, st.binary(min_size=1, max_size=16)))


def mutate_bytes(data: bytes, m: tuple, start: int = 0) -> bytes:
    """Apply a :func:`byte_mutations` value to ``data`` (positions at or after ``start``)."""
    span = max(len(data) - start, 1)

    def at(f: float) -> int:
        return min(start + int(f * span), max(len(data) - 1, 0))

    if m[0] == "truncate":
        return data[:start + int(m[1] * span)]
    if m[0] == "flip":
        b = bytearray(data)
        for f, x in m[1]:
            if b:
                b[at(f)] ^= x
        return bytes(b)
    pos = at(m[1])
    return data[:pos] + m[2] + data[pos:]


def json_paths(doc, prefix=(), limit: int = 4000) -> list[tuple]:
    """Every path (tuple of keys / indexes) in ``doc``, containers included, breadth-first up to ``limit``."""
    out, level = [prefix], [(prefix, doc)]
    while level and len(out) < limit:
        nxt = []
        for p, v in level:
            items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
            for k, c in items:
                out.append(p + (k,))
                nxt.append((p + (k,), c))
        level = nxt
    return out[:limit]


def json_mutations() -> st.SearchStrategy:
    """("set", path fraction, value) | ("drop", path fraction) | ("bytes", byte mutation)."""
    frac = st.floats(0.0, 1.0, allow_nan=False, exclude_max=True)
    return st.one_of(
        st.tuples(st.just("set"), frac, st.sampled_from(range(len(EVIL)))),
        st.tuples(st.just("drop"), frac),
        st.tuples(st.just("bytes"), byte_mutations()))


def mutate_json(doc, m: tuple) -> bytes:
    """The bytes of ``doc`` with a :func:`json_mutations` value applied (NaN/Infinity as JSON literals,
    deep nesting as raw text, so a reader meets exactly what a file can hold)."""
    if m[0] == "bytes":
        return mutate_bytes(json.dumps(doc).encode(), m[1])
    doc = json.loads(json.dumps(doc))
    paths = json_paths(doc)[1:] or [()]
    path = paths[int(m[1] * len(paths))]
    if not path:
        return json.dumps(doc).encode()
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if m[0] == "drop":
        del parent[path[-1]]
        return json.dumps(doc).encode()
    value = EVIL[m[2]]
    if value == "deep":
        parent[path[-1]] = "@@DEEP@@"
        return json.dumps(doc).replace('"@@DEEP@@"', "[" * DEEP + "]" * DEEP).encode()
    parent[path[-1]] = value
    return json.dumps(doc).encode()
