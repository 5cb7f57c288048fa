"""Reading the fields of a JSON document with their types: one place for "a finite number, not a bool".

Every reader in ``formats/`` checks a document through these functions, so a hand-edited or corrupt
file fails with one kind of message, naming the document, the field's path and what was wanted::

    plan /x/plan.json: budgets.ram_budget_bytes must be a finite number >= 0, got Infinity; re-create ...

An :class:`At` is a place in a document (``at / "disk" / "random" / 2`` is ``disk.random[2]``); the
readers take the container, the key and the container's place, return the value, and raise
:class:`~colibri_plan.errors.FormatError`. JSON rules: a bool is never a number, NaN and the
infinities are never finite (nor an integer too large for a float), and a value is shown as JSON
(``NaN``, ``true``, ``"x"``, ``null``; or as Python's ``repr`` where a document's messages always did),
cut at 60 characters.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from colibri_plan.errors import FormatError

#: what an absent key reads as (a key that holds null is not absent)
_ABSENT = object()


@dataclass(frozen=True)
class At:
    """A place in a document: ``label`` names the document ("plan /x/plan.json", "profile"; "" when the
    path says enough), ``path`` the keys and list indices from its root, ``hint`` what to do (appended to
    every refusal after "; ").

    How a field is named and shown is the document's: by its whole path (``plan p.json:
    budgets.ram_budget_bytes must be ...``) or, with ``by_parent``, after the object that holds it
    (``profile dense_gemv[0]: device_index must be ...``); ``integer`` is its word for a whole number;
    values are shown as JSON, or with ``repr_values`` as Python writes them ('x', nan, True).
    """

    label: str
    hint: str = ""
    path: tuple = ()
    by_parent: bool = False
    integer: str = "a whole number"
    repr_values: bool = False

    def __truediv__(self, key) -> At:
        return dataclasses.replace(self, path=(*self.path, key))

    @property
    def dotted(self) -> str:
        """The path as written in messages: ``disk.random[2].read_gbps`` ("" at the root)."""
        return _dotted(self.path)

    def __str__(self) -> str:
        return f"{self.label} {self.dotted}".strip()

    def _end(self, hint: str | None = None) -> str:
        hint = self.hint if hint is None else hint
        return f"; {hint}" if hint else ""

    def _field(self) -> str:
        """"<label>: <path>", or by parent "<label> <parent path>: <key>"."""
        if not self.path or not self.label:
            return str(self)
        if self.by_parent and len(self.path) > 1 and not isinstance(self.path[-1], int):
            return f"{self.label} {_dotted(self.path[:-1])}: {self.path[-1]}"
        return f"{self.label}: {self.dotted}"

    def show(self, value: Any) -> str:
        """``value`` as this document's messages show it (:func:`shown`, or ``repr`` cut at 60)."""
        return shown(value, python=self.repr_values)

    def fail(self, what: str) -> NoReturn:
        """Refuse the value here: ``"<label> <path>: <what>; <hint>"``."""
        raise FormatError(f"{self}: {what}{self._end()}")

    def refuse(self, what: str, hint: str | None = None) -> NoReturn:
        """Refuse this field: ``"<label>: <path> <what>; <hint>"`` (``hint`` replaces the document's)."""
        raise FormatError(f"{self._field()} {what}{self._end(hint)}")

    def bad(self, want: str, value: Any) -> NoReturn:
        """Refuse a field's type or range: ``"<label>: <path> must be <want>, got <value>; <hint>"``."""
        self.refuse(f"must be {want}, got {self.show(value)}")

    def missing(self) -> NoReturn:
        """Refuse an absent field: ``"<label>: <path> is missing; <hint>"``."""
        self.refuse("is missing")


def _dotted(path: tuple) -> str:
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def shown(value: Any, limit: int = 60, python: bool = False) -> str:
    """``value`` as JSON (``NaN``, ``Infinity``, ``true``, ``"x"``), or with ``python`` its ``repr``; at
    most ``limit`` characters."""
    try:
        text = repr(value) if python else json.dumps(value, default=str)
    except (ValueError, RecursionError):   # a cycle or a nesting too deep to write
        text = f"a {type(value).__name__} nested too deep to show"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_number(v: Any) -> bool:
    """A finite number: a JSON int or float (a numpy one too), not a bool, not NaN or infinite (an integer
    too large for a float is not)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def is_whole(v: Any, integral_floats: bool = False) -> bool:
    """A whole number: an int (a numpy one too; not a bool), or with ``integral_floats`` a finite float
    like 3.0."""
    if isinstance(v, bool):
        return False
    return isinstance(v, numbers.Integral) or (integral_floats and isinstance(v, float) and v.is_integer())


def _get(container, key, at: At, optional: bool):
    """(value, its At); an absent key is :data:`_ABSENT` when ``optional``, else refused."""
    here = at / key
    if isinstance(container, dict):
        v = container.get(key, _ABSENT)
    elif isinstance(container, list) and isinstance(key, int) and -len(container) <= key < len(container):
        v = container[key]
    else:
        v = _ABSENT
    if v is _ABSENT and not optional:
        here.missing()
    return v, here


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bounds(lo, hi, lo_open: bool, hi_open: bool, whole: bool) -> str:
    """" >= 0", " > 0 and <= 1e+06", " in 1..64" (whole numbers between two bounds), or ""."""
    if lo is None and hi is None:
        return ""
    if whole and lo is not None and hi is not None:
        return f" in {_num(lo)}..{_num(hi)}"
    parts = ([f"{'>' if lo_open else '>='} {_num(lo)}"] if lo is not None else []) + \
        ([f"{'<' if hi_open else '<='} {_num(hi)}"] if hi is not None else [])
    return " " + " and ".join(parts)


def _in_range(v, lo, hi, lo_open: bool, hi_open: bool) -> bool:
    return ((lo is None or (v > lo if lo_open else v >= lo))
            and (hi is None or (v < hi if hi_open else v <= hi)))


def number(container, key, at: At, *, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False,
           optional: bool = False, unit: str = "", want: str | None = None) -> float | int | None:
    """``container[key]``, a finite number in the bounds (``lo_open`` / ``hi_open``: excluded).

    ``optional``: absent or null reads as None. ``unit`` follows the bounds in the message (" s",
    " (seconds)"); ``want`` replaces the whole wanted phrase.
    """
    v, here = _get(container, key, at, optional)
    if optional and (v is _ABSENT or v is None):
        return None
    if not is_number(v) or not _in_range(v, lo, hi, lo_open, hi_open):
        here.bad(want or f"a finite number{_bounds(lo, hi, lo_open, hi_open, False)}{unit}", v)
    return v


def whole(container, key, at: At, *, lo=None, hi=None, optional: bool = False, integral_floats: bool = False,
          want: str | None = None) -> int | None:
    """``container[key]``, a whole number in ``lo..hi`` (both included), as an int.

    ``integral_floats``: 3.0 counts as 3 (JSON writers that print every number as a float).
    """
    v, here = _get(container, key, at, optional)
    if optional and (v is _ABSENT or v is None):
        return None
    if not is_whole(v, integral_floats) or not _in_range(v, lo, hi, False, False):
        here.bad(want or f"{here.integer}{_bounds(lo, hi, False, False, True)}", v)
    return int(v)


def flag(container, key, at: At, *, optional: bool = False, want: str | None = None) -> bool | None:
    """``container[key]``, true or false (``optional``: absent or null reads as None)."""
    v, here = _get(container, key, at, optional)
    if optional and (v is _ABSENT or v is None):
        return None
    if not isinstance(v, bool):
        here.bad(want or "true or false", v)
    return v


def text(container, key, at: At, *, optional: bool = False, nonempty: bool = False,
         choices: Iterable[str] | None = None, want: str | None = None) -> str | None:
    """``container[key]``, a string (``nonempty``: not ""; ``choices``: one of them)."""
    v, here = _get(container, key, at, optional)
    if optional and (v is _ABSENT or v is None):
        return None
    if choices is not None:
        choices = tuple(choices)
        if v not in choices or not isinstance(v, str):
            here.bad(want or f"one of {', '.join(choices)}", v)
    elif not isinstance(v, str) or (nonempty and not v):
        here.bad(want or ("a non-empty string" if nonempty else "a string"), v)
    return v


def mapping(container, key, at: At, *, optional: bool = False, want: str | None = None) -> dict | None:
    """``container[key]``, an object (``optional``: absent or null reads as None)."""
    v, here = _get(container, key, at, optional)
    if optional and (v is _ABSENT or v is None):
        return None
    if not isinstance(v, dict):
        here.bad(want or "an object", v)
    return v


def items(container, key, at: At, *, optional: bool = False, nonempty: bool = False,
          want: str | None = None) -> list | None:
    """``container[key]``, a list (``nonempty``: with at least one item)."""
    v, here = _get(container, key, at, optional)
    if optional and (v is _ABSENT or v is None):
        return None
    if not isinstance(v, list) or (nonempty and not v):
        here.bad(want or ("a non-empty list" if nonempty else "a list"), v)
    return v


def each(container, key, at: At, **kw) -> Iterator[tuple[Any, At]]:
    """(item, its At) of the list ``container[key]`` (checked as :func:`items`; absent and optional:
    nothing)."""
    lst = items(container, key, at, **kw)
    for i, v in enumerate(lst or ()):
        yield v, at / key / i


def document(doc, at: At) -> dict:
    """The document itself, which must be an object."""
    if not isinstance(doc, dict):
        at.bad("a JSON object", doc)
    return doc


def require(container: dict, keys: Iterable[str], at: At) -> None:
    """Refuse ``container`` (an object at ``at``) when it lacks any of ``keys``, naming them all."""
    lost = [k for k in keys if k not in container]
    if lost:
        at.fail(f"missing {', '.join(lost)}")
