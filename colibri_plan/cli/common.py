"""Helpers shared by CLI commands: the context object, --json, output and progress."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click


@dataclass
class Ctx:
    """Global CLI options."""

    json: bool = False
    verbose: bool = False
    debug: bool = False


def json_option(f):
    """Add a per-command ``--json`` flag (same effect as the global one)."""

    def callback(ctx, _param, value):
        if value:
            ctx.ensure_object(Ctx).json = True
        return value

    return click.option("--json", "json_flag", is_flag=True, expose_value=False, callback=callback,
                        help="Print one JSON document on stdout.")(f)


def get_ctx() -> Ctx:
    """The current Ctx (a default one outside a click context)."""
    ctx = click.get_current_context(silent=True)
    return ctx.ensure_object(Ctx) if ctx is not None else Ctx()


def _finite_only(obj: Any, path: str, bad: list[str]) -> Any:
    """``obj`` with every non-finite float replaced by None; ``bad`` collects their dotted paths."""
    if isinstance(obj, float) and not math.isfinite(obj):
        bad.append(f"{path or 'the document'} ({obj})")
        return None
    if isinstance(obj, dict):
        return {k: _finite_only(v, f"{path}.{k}" if path else str(k), bad) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_only(v, f"{path}[{i}]", bad) for i, v in enumerate(obj)]
    return obj


def to_json(data: Any) -> str:
    """``data`` as strict JSON text (indent 1; unknown objects as str).

    JSON has no NaN or Infinity (``json.dumps`` would write the bare words, which other readers reject),
    so a non-finite float is written as ``null`` and a warning on stderr names where it was.
    """
    try:
        return json.dumps(data, indent=1, default=str, allow_nan=False)
    except ValueError:
        bad: list[str] = []
        text = json.dumps(_finite_only(data, "", bad), indent=1, default=str, allow_nan=False)
        warn(f"--json output: not-finite value(s) written as null: {', '.join(bad[:5])}"
             + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))
        return text


def emit(data: Any, human: Callable[[], str] | str | None = None) -> None:
    """Print ``data`` as one JSON document with --json (strict JSON: see :func:`to_json`), else the human
    text (or JSON if none)."""
    if get_ctx().json or human is None:
        click.echo(to_json(data))
    else:
        click.echo(human() if callable(human) else human)


def progress(message: str, verbose_only: bool = False) -> None:
    """A progress line on stderr (``verbose_only`` lines need --verbose)."""
    if verbose_only and not get_ctx().verbose:
        return
    click.echo(message, err=True)


def warn(message: str) -> None:
    """A warning on stderr."""
    click.echo(f"warning: {message}", err=True)


def table(rows: list[list[Any]], header: list[str]) -> str:
    """A plain aligned text table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def stderr_is_tty() -> bool:
    return sys.stderr.isatty()


def parse_prompt(text: str, where: str) -> list[int]:
    """Token ids from ``text``: integers separated by whitespace and/or commas.

    Raises:
        InputError: no ids, or an item that is not a non-negative integer (names ``where``).
    """
    import re

    from colibri_plan.errors import InputError

    items = [t for t in re.split(r"[\s,]+", text.strip()) if t]
    if not items:
        raise InputError(f"{where}: the prompt is empty; give at least one token id")
    for t in items:
        if not re.fullmatch(r"\d+", t):
            raise InputError(f"{where}: {t!r} is not a token id (non-negative integers separated by "
                             "spaces or commas)")
    return [int(t) for t in items]


def read_prompt(prompt_ids: str | None, prompt_file: str | None) -> list[int]:
    """The prompt from exactly one of ``--prompt-ids`` / ``--prompt-file`` (`run` and `verify`).

    Raises:
        InputError: neither or both given; the file is missing/unreadable; bad ids.
    """
    from colibri_plan.errors import InputError
    from colibri_plan.fileio import check_input_file

    if (prompt_ids is None) == (prompt_file is None):
        raise InputError("give exactly one of --prompt-ids 1,2,3 or --prompt-file FILE")
    if prompt_ids is not None:
        return parse_prompt(prompt_ids, "--prompt-ids")
    path = check_input_file(prompt_file, "prompt file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read prompt file {path}: {exc}") from exc
    return parse_prompt(text, f"prompt file {path}")
