"""Helpers shared by CLI commands: the context object, --json, output and progress."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
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


def verbose_option(f):
    """Add a per-command ``-v/--verbose`` flag (same effect as the global one): the details after the
    answer."""

    def callback(ctx, _param, value):
        if value:
            ctx.ensure_object(Ctx).verbose = True
        return value

    return click.option("--verbose", "-v", "verbose_flag", is_flag=True, expose_value=False,
                        callback=callback, help="Print the details too.")(f)


def collect_arg(names, name: str, build: Callable):
    """Decorator of a click command (put it next to ``def``): the parameters named in ``names`` reach the
    command as one argument ``name`` = ``build(**those not None)``; the others as themselves."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def command(**given):
            own = {k: given.pop(k) for k in list(given) if k in names}
            return fn(**{name: build(**{k: v for k, v in own.items() if v is not None})}, **given)

        return command

    return wrap


def options_arg(cls, name: str = "opts"):
    """:func:`collect_arg` for the frozen dataclass ``cls``: its fields' parameters reach the command as one
    ``cls``. Click options name their destination after the field (``--context`` -> ``context_tokens``)
    and take their default from ``cls()``, or are None when left out: the field then keeps its default.
    So each default is written once, in ``cls``."""
    import dataclasses

    return collect_arg({f.name for f in dataclasses.fields(cls)}, name, cls)


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


#: how long steps report progress: "auto" (default: bars when stderr is a terminal and --json is not
#: given, else lines), "bars", "lines" (one plain stderr line per step, as in a log) or "off"
PROGRESS_ENV = "COLIBRI_PLAN_PROGRESS"
_COUNT = re.compile(r"\((\d+)/(\d+)\)")


def progress_mode() -> str:
    """``"bars"``, ``"lines"`` or ``"off"``: see :data:`PROGRESS_ENV`. Bars never touch stdout."""
    mode = os.environ.get(PROGRESS_ENV, "auto").strip().lower()
    if mode in ("bars", "lines", "off"):
        return mode
    if get_ctx().json or not stderr_is_tty() or os.environ.get("TERM") == "dumb":
        return "lines"
    return "bars"


class Steps:
    """Progress of one long step on stderr: a rich bar with elapsed time and ETA on a terminal, the
    plain progress lines otherwise (see :func:`progress_mode`). Library code reports through callbacks;
    this turns them into either form::

        with Steps("packed experts") as bar:
            write_pack(..., progress=bar.count)      # fn(done, total)
        with Steps("what-if ram", total=7) as bar:
            what_if(..., progress=bar.say)           # fn(message): "... (3/7)" sets the count

    ``counted=False``: a step with no count (a solve), a spinner with the elapsed time on a terminal.
    Lines mode prints a counted step at most every ``every_s`` seconds (and at the end), a message
    callback's every line (``verbose_only`` lines need --verbose), exactly as before bars existed.
    """

    def __init__(self, label: str, total: int | None = None, every_s: float = 2.0, counted: bool = True):
        self.label, self.total, self.every_s, self.counted = label, total, every_s, counted
        self.mode = progress_mode()
        self._last = -math.inf  # the first count always prints
        self._bar = self._task = None

    def __enter__(self) -> Steps:
        if self.mode == "bars":
            import rich.progress as rp

            cols = [rp.SpinnerColumn(), rp.TextColumn("{task.description}")]
            if self.counted:
                cols += [rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(),
                         rp.TextColumn("ETA"), rp.TimeRemainingColumn()]
            else:  # a step with no count: a spinner and the elapsed time, gone when it ends
                cols.append(rp.TimeElapsedColumn())
            self._bar = rp.Progress(*cols, console=_console(sys.stderr, True), redirect_stdout=False,
                                    redirect_stderr=True, transient=not self.counted)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total)
        return self

    def __exit__(self, exc_type, *_):
        if self._bar is not None:
            if exc_type is None and self.total is not None:
                self._bar.update(self._task, completed=self.total)
            self._bar.stop()
            self._bar = None

    def count(self, done: int, total: int) -> None:
        """A ``fn(done, total)`` callback (pack, fixture, pack verify)."""
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
        elif self.mode == "lines":
            now = time.perf_counter()
            if done == total or now - self._last >= self.every_s:
                self._last = now
                progress(f"{self.label} {done}/{total}")

    def say(self, message: str, verbose_only: bool = False, advance: int = 0) -> None:
        """A ``fn(message)`` callback: a line in lines mode; on a bar the message becomes its text, a
        ``(i/n)`` in it (when ``advance`` is 0) sets the count to i - 1 of n, else ``advance`` adds."""
        if self._bar is None:
            if self.mode == "lines":
                progress(message, verbose_only=verbose_only)
            return
        text = message.strip()
        text = text if text.startswith(self.label) else f"{self.label}: {text}"
        kw: dict[str, Any] = {"description": text[:100]}
        m = _COUNT.search(message) if not advance else None
        if m:
            self.total = int(m.group(2))
            kw.update(completed=int(m.group(1)) - 1, total=self.total)
        elif advance:
            kw["advance"] = advance
        self._bar.update(self._task, **kw)

    def set(self, completed: int) -> None:
        """Set the bar's count (nothing in lines mode)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=completed)


def warn(message: str) -> None:
    """A warning on stderr."""
    click.echo(f"warning: {message}", err=True)


def _console(file, terminal: bool):
    """A rich console on ``file``: colours and the terminal's width only when ``terminal``."""
    from rich.console import Console

    if terminal:
        return Console(file=file, force_terminal=True, highlight=False, soft_wrap=False)
    return Console(file=file, force_terminal=False, color_system=None, width=TABLE_PIPE_WIDTH,
                   highlight=False, soft_wrap=False)


#: columns a table may use when stdout is not a terminal (rich would otherwise wrap at 80)
TABLE_PIPE_WIDTH = 400
#: the plain table frame: no edges, a dashed rule under the header (readable in a pipe, a log, a diff)
_PLAIN_BOX = "    \n    \n -  \n    \n    \n    \n    \n    \n"


def table(rows: list[list[Any]], header: list[str] | None, *, right: tuple[int, ...] = (),
          indent: int = 0) -> str:
    """An aligned text table rendered by rich: a header with a dashed rule under it, two spaces between
    columns, no trailing blanks. Cells are plain text (never rich markup). Coloured (bold header) when
    stdout is a terminal; plain and never wrapped in a pipe. ``header`` None: no header row; ``right``:
    indices of right-aligned columns; ``indent``: spaces before every line."""
    import io

    from rich.box import Box
    from rich.table import Table
    from rich.text import Text

    terminal = sys.stdout.isatty()
    n = len(header) if header is not None else max((len(r) for r in rows), default=0)
    t = Table(box=Box(_PLAIN_BOX, ascii=True), show_edge=False, pad_edge=False, padding=(0, 1, 0, 1),
              collapse_padding=True, show_header=header is not None, header_style="bold" if terminal else "")
    for i in range(n):
        t.add_column(Text(str(header[i])) if header is not None else "", no_wrap=True,
                     justify="right" if i in right else "left")
    for r in rows:
        t.add_row(*(Text(str(c)) for c in r))
    buf = io.StringIO()
    _console(buf, terminal).print(t)
    return "\n".join(" " * indent + line.rstrip() for line in buf.getvalue().rstrip("\n").split("\n"))


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
        if not re.fullmatch(r"\d+", t, re.ASCII):   # \d alone matches Unicode digits too
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


#: how the compute line names the plan's host tiers
_TIER_WORDS = {"ram_pinned": "pinned", "lru": "LRU hits", "disk": "streamed"}


def compute_lines(compute: dict | None, explain: dict | None = None) -> list[str]:
    """Which processor computes each host tier (the plan's ``compute`` section), and from
    ``compute_explain`` the seconds per expert of every candidate, as up to two lines: ``Compute: pinned
    on cpu, LRU hits on vulkan:0, streamed on vulkan:0`` and ``Compute per expert: pinned cpu 0.12 ms /
    vulkan:0 0.5 ms; ...``, and (``ram_pinned_decode_s``) the whole placement's tok/s with the pinned tier
    zero-copy on the trunk's GPU and without. No section: every host tier on the CPU."""
    if not compute:
        return ["Compute: host tiers (pinned, LRU hits, streamed) on the CPU (no unified-memory GPU chosen)"]
    out = ["Compute: " + ", ".join(f"{w} on {compute.get(t, 'cpu')}" for t, w in _TIER_WORDS.items())]
    whole = (explain or {}).get("ram_pinned_decode_s") or {}
    if whole:   # the trunk's GPU could compute the pins zero-copy: both whole placements, priced
        out.append("Compute pinned (zero-copy from mapped host memory on the trunk's GPU, or not), whole "
                   "placement: " + " / ".join(
            f"{k} {1 / v:.3f} tok/s" for k, v in whole.items() if isinstance(v, (int, float)) and v > 0))
    why = []
    for tier, word in _TIER_WORDS.items():
        cand = (explain or {}).get(tier) or {}
        secs = " / ".join(f"{k} {v * 1e3:.3g} ms" for k, v in cand.items() if isinstance(v, (int, float)))
        if secs:
            note = " (follow streamed: a hit reuses the slot's upload)" if tier == "lru" else ""
            why.append(f"{word} {secs}{note}")
    if why:
        out.append("Compute per expert: " + "; ".join(why))
    return out


def repin_line(repin: dict | None) -> str:
    """The plan's live re-pinning policy (its ``repin`` section) as one line; absent or disabled: off."""
    if not repin or not repin.get("enabled"):
        return "Re-pinning: off (solve --repin-every N turns it on)"
    every, window = repin.get("every_tokens", "?"), repin.get("window_tokens", "?")
    return (f"Re-pinning: every {every} tokens, window {window} tokens, at most {repin.get('max_swaps', 4)} "
            "swaps per layer and round")


def knob_lines(knobs: dict | None, *, compute: dict | None = None, compute_explain: dict | None = None,
               repin: dict | None = None) -> list[str]:
    """The engine knobs a plan was solved for (its ``knobs`` section, docs/plan-format.md) as up to seven
    lines, for `solve` and `plan show`: the engine's reads and memory, the LRU model, the slot counts the
    trace-driven search tried, the page cache, then which processor computes each host tier (``compute``,
    ``compute_explain``) and the re-pinning policy (``repin``). Every key is optional in a plan (a
    hand-edited one may lack some): a missing figure is left out; no ``knobs`` (a plan from before issue
    #16) gives only the compute and re-pinning lines, and those only when the plan has the sections."""
    if not knobs:
        return (compute_lines(compute, compute_explain) if compute else []) + \
            ([repin_line(repin)] if repin else [])
    k, cm, pc = knobs, knobs.get("cache_model") or {}, knobs.get("page_cache") or {}
    parts = []
    if "target" in k:
        parts.append(f"target {k['target']}")
    if "o_direct" in k:
        # the engine reads buffered only for an explicit false (engine/placement.py): null is O_DIRECT
        parts.append("buffered reads" if k["o_direct"] is False else "O_DIRECT reads")
    if "vram_overhead_bytes_per_expert" in k:
        parts.append(f"VRAM overhead {k['vram_overhead_bytes_per_expert'] / 2**20:.3f} MiB/expert")
    if "keep_host_copies" in k:
        parts.append(f"host copies {'kept' if k['keep_host_copies'] else 'released'} "
                     f"({k.get('host_copy_bytes', 0) / 1e9:.2f} GB)")
    if "queue_depth" in k:   # last: its source is a sentence
        disk = k.get("disk_read_gbps")
        src = f" ({k['queue_depth_source']})" if k.get("queue_depth_source") else ""
        parts.append(f"queue depth {k['queue_depth']}, "
                     + (f"disk {disk:.2f} GB/s" if disk is not None else "no disk figure") + src)
    lines = ["Knobs: " + "; ".join(parts)] if parts else []
    if cm:
        if cm.get("kind") == "trace":
            model = (f"routing trace, {cm.get('trace_decode_calls', '?')} decode calls over "
                     f"{cm.get('trace_layers', '?')} layers")
        else:
            model = "Che (independent requests; no routing trace in the heat)"
        slots = f"; slots {cm.get('lru_slots_mode', '?')}"
        if "lru_slots_max" in cm:
            slots += f": max {cm['lru_slots_max']}"
            if "lru_slots_mean" in cm:
                slots += f", mean {cm['lru_slots_mean']:.1f}"
        lines.append(f"LRU model: {model}{slots}")
        tried = [t for t in cm.get("lru_search") or [] if isinstance(t, dict)]
        if tried:
            best = max((t["tok_s"] for t in tried if "tok_s" in t), default=None)

            def one(t):
                if "tok_s" not in t:
                    return f"{t.get('slots')} -> does not fit"
                kept = ", kept" if t["tok_s"] == best else ""
                return (f"{t.get('slots')} -> {t['tok_s']:.3f} tok/s (LRU hit "
                        f"{t.get('lru_hit_rate', 0.0):.1%}{kept})")

            lines.append("LRU slots tried: " + ", ".join(one(t) for t in tried))
    if "capacity_bytes" in pc:
        pool = f" (pool {pc['pool_bytes'] / 1e9:.2f} GB)" if "pool_bytes" in pc else ""
        lines.append(f"Page cache: could hold {pc['capacity_bytes'] / 1e9:.2f} GB beside this plan{pool}; "
                     + ("read through" if pc.get("used") else "not used: O_DIRECT"))
    return lines + compute_lines(compute, compute_explain) + [repin_line(repin)]


def held_out_line(predicted: dict, warn_only: bool = False) -> str | None:
    """The plan's VRAM share of its heat's decode selections in sample and held out (planner/holdout.py),
    or None (no trace in the heat; with ``warn_only``, also when the two differ by 2 points or less)."""
    ho = predicted.get("hit_rate_held_out")
    if not ho or (warn_only and ho["in_sample"] - ho["held_out"] <= 0.02):
        return None
    return (f"VRAM holds {ho['in_sample'] * 100:.1f}% of the selections of the heat's {ho['decode_steps']} "
            f"decode steps, {ho['held_out'] * 100:.1f}% held out (two folds): a run whose routing differs "
            "from the heat's gets less than predicted")
