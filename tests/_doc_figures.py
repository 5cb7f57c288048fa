"""Figures quoted in README.md and docs/*.md, tied to the result files they come from.

The convention (bench/results/README.md, "Figures in the docs"): a measured figure is followed by a tag

    49.20 tok/s<!-- fig h200-trunk/verify-gpu.json: measured.tok_s -->

an HTML comment (invisible once rendered; the prose names the file for the reader) that names a file
under ``bench/results/`` and one expression per figure, separated by ``;``. The tag takes the last N
numbers before it in its paragraph (N = its expressions), in order. An expression is a key path with
an optional chain of ``* k``, ``/ path``, ``+ path``, ``- path`` (spaced; left to right: units,
ratios, sums); ``range PATH`` takes two numbers, the minimum and the maximum of what the path finds.
A path is dot-separated keys, list indexes (``rows.0``), ``*`` (every element) and selections
(``rows[fmt=int4,tokens=1]``); ``"a.b"`` quotes a key with dots. A file name may hold ``{a,b,c}``
alternatives: the values of every file, then (``range``) their spread. In a text file (``.txt``,
``.log``) the expression is a quoted string: the figure must be a number on a line that contains it.
A figure matches when it equals the value rounded as printed (its own decimals); a single figure over
several values matches when every one prints as it.

Performance figures (tok/s, GB/s, MB/s, µs, ms, ms/token, ×/x ratios) outside code blocks and code
spans that no tag covers are *untagged*; a paragraph that says "unrecorded" declares its own, and
``<!-- fig not measured: why -->`` covers those since the previous tag (a default, an example's input),
``<!-- fig unrecorded: why -->`` those held by no file, and ``<!-- figs unrecorded: why -->`` anywhere in
a doc declares all its untagged figures (one run's printed output).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

TAG = re.compile(r"<!--\s*fig\s+(?P<file>[^:\s][^:]*?)\s*:\s*(?P<exprs>.*?)\s*-->", re.S)
#: a number as prose prints it: 1,090.1 / 0.53 / 42 / 4.6x (not inside a name such as int4-g32 or h200)
NUMBER = re.compile(r"(?<![\w.\-/^])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!\.\d)(?!(?!x(?!\w))\w)")
_NUM = r"\d[\d,]*(?:\.\d+)?"
PERF = re.compile(rf"(?:(?<![\w.]){_NUM}(?:\s*[–-]\s*{_NUM})?\s*(?:tok/s|GB/s|MB/s|µs|ms/token|ms)(?![\w/]))"
                  # a ratio 1.38× / ×0.79, not a shape 4096×4096
                  rf"|(?:(?<![\w.]){_NUM}[×x](?![\w]))|(?:(?<!\w)×{_NUM})")
UNRECORDED = "unrecorded"
#: ``<!-- fig not measured: why -->``: the figures since the previous tag are defaults or examples
NOT_MEASURED = "not measured"


class FigureError(Exception):
    """A tag that cannot be read or resolved (a bad file, key or expression)."""


@dataclass
class Figure:
    """A number in a doc: its text, where it is, and (once tagged) the tag that checks it."""
    doc: str
    line: int
    text: str
    start: int                  # offset in the doc
    tag: str | None = None      # the tag's text, when a tag covers it


def blocks(text: str):
    """Paragraph spans ``(start, end)`` of ``text`` outside fenced and indented code blocks: blank-line
    separated, and each list item, table row and heading on its own."""
    pos, fenced, start = 0, False, None
    for line in text.splitlines(keepends=True):
        s = line.strip()
        code = fenced or s.startswith("```") or line.startswith("    ") and start is None
        if s.startswith("```"):
            fenced = not fenced
        new = not s or code or re.match(r"(?:[-*] |\d+\. |\||#)", s)
        if new and start is not None:
            yield start, pos
            start = None
        if s and not code:
            start = pos if start is None else start
        pos += len(line)
    if start is not None:
        yield start, pos


def _mask(text: str) -> str:
    """``text`` with code spans, tags and links' targets blanked (same length), so their digits are not
    figures."""
    out = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group()), text)
    out = re.sub(r"<!--.*?-->", lambda m: " " * len(m.group()), out, flags=re.S)
    return re.sub(r"\]\([^)]*\)", lambda m: " " * len(m.group()), out)


def scan(doc: Path) -> tuple[list[tuple[Figure, str, str]], list[Figure]]:
    """(tagged figures as (figure, file, expression), untagged performance figures) of one doc."""
    text = doc.read_text(encoding="utf-8")
    name = str(doc.relative_to(ROOT)) if doc.is_relative_to(ROOT) else doc.name
    tagged, untagged = [], []
    whole_doc = re.search(r"<!--\s*figs\s+unrecorded\s*:", text) is not None  # one run's printed output
    for a, b in blocks(text):
        para, masked = text[a:b], _mask(text[a:b])
        used: set[int] = set()
        last = 0
        for m in TAG.finditer(para):
            if " ".join(m.group("file").split()) in (NOT_MEASURED, UNRECORDED):  # nothing to check
                used.update(range(last, m.start()))
                last = m.end()
                continue
            exprs = [" ".join(e.split()) for e in m.group("exprs").split(";") if e.strip()]
            want = sum(2 if e.startswith("range ") else 1 for e in exprs)
            nums = [n for n in NUMBER.finditer(masked, last, m.start())]
            if len(nums) < want:
                raise FigureError(f"{name}:{text.count(chr(10), 0, a + m.start()) + 1}: tag {m.group()!r} "
                                  f"wants {want} numbers before it, finds {len(nums)}")
            nums = nums[len(nums) - want:]
            for e in exprs:
                k = 2 if e.startswith("range ") else 1
                take, nums = nums[:k], nums[k:]
                fig = Figure(name, text.count("\n", 0, a + take[0].start()) + 1,
                             "–".join(n.group() for n in take), a + take[0].start(), m.group())
                tagged.append((fig, m.group("file").strip(), e))
                used.update(range(take[0].start(), take[-1].end()))
            last = m.end()
        if whole_doc or UNRECORDED in masked.lower():  # the word in the prose, not inside a tag
            continue
        for m in PERF.finditer(masked):
            if not any(i in used for i in range(m.start(), m.end())):
                line = text.count("\n", 0, a + m.start()) + 1
                untagged.append(Figure(name, line, " ".join(m.group().split()), a + m.start()))
    return tagged, untagged


# ---- resolving a tag ---------------------------------------------------------------------------------

def files_of(pattern: str) -> list[Path]:
    """The result files a tag's file name names (``{a,b}`` alternatives expanded), each checked to
    exist under bench/results/."""
    m = re.search(r"\{([^}]*)\}", pattern)
    names = [pattern[:m.start()] + alt + pattern[m.end():] for alt in m.group(1).split(",")] if m \
        else [pattern]
    out = []
    for n in names:
        p = (RESULTS / n).resolve()
        if RESULTS.resolve() not in p.parents or not p.is_file():
            raise FigureError(f"no result file bench/results/{n}")
        out.append(p)
    return out


def _segments(path: str) -> list[str]:
    return [s.strip('"') for s in re.findall(r'"[^"]*"|[^.\[\]]+(?:\[[^\]]*\])?', path)]


def _select(values: list, seg: str, where: str) -> list:
    m = re.fullmatch(r"([^\[]*)(?:\[(.*)\])?", seg)
    key, sel = m.group(1), m.group(2)
    out = []
    for v in values:
        if key == "*":
            out += list(v.values()) if isinstance(v, dict) else list(v)
        elif key:
            if isinstance(v, list) and key.isdigit():
                out.append(v[int(key)])
            elif isinstance(v, dict) and key in v:
                out.append(v[key])
            else:
                raise FigureError(f"{where}: no key {key!r}")
        else:
            out.append(v)
    if sel is not None:
        conds = [c.split("=", 1) for c in sel.split(",")]
        out = [e for lst in out for e in (lst if isinstance(lst, list) else [lst])
               if isinstance(e, dict) and all(str(e.get(k.strip())) == w.strip() for k, w in conds)]
        if not out:
            raise FigureError(f"{where}: nothing matches [{sel}]")
    return out


def resolve(doc: object, path: str, where: str) -> list[float]:
    """Every number ``path`` finds in a parsed JSON document."""
    values = [doc]
    for seg in _segments(path):
        values = _select(values, seg, f"{where}: {path}")
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not nums:
        raise FigureError(f"{where}: {path} holds no number")
    return nums


def evaluate(files: list[Path], expr: str) -> list[float]:
    """The values of ``expr`` (``[range ]TERM ((*|/|+|-) TERM)*``, left to right) over ``files``."""
    expr = expr.removeprefix("range ").strip()
    parts = re.split(r"\s+([*/+-])\s+", expr)
    out = []
    for f in files:
        doc = json.loads(f.read_text(encoding="utf-8"))
        where = str(f.relative_to(RESULTS))
        acc = None
        for i in range(0, len(parts), 2):
            term = parts[i]
            vals = [float(term)] if re.fullmatch(r"[\d.eE+-]+", term) else resolve(doc, term, where)
            if acc is None:
                acc = vals
            else:
                if len(vals) == 1:
                    vals = vals * len(acc)
                if len(vals) != len(acc):
                    raise FigureError(f"{where}: {expr}: {len(acc)} values against {len(vals)}")
                op = parts[i - 1]
                fn = {"*": lambda a, b: a * b, "/": lambda a, b: a / b, "+": lambda a, b: a + b,
                      "-": lambda a, b: a - b}[op]
                acc = [fn(a, b) for a, b in zip(acc, vals)]
        out += acc
    return out


def _printed(text: str) -> tuple[float, float]:
    """A printed number's value and half its last digit."""
    t = text.replace(",", "")
    dec = len(t.split(".")[1]) if "." in t else 0
    return float(t), 0.5 * 10 ** -dec


def matches(value: float, text: str) -> bool:
    """True when ``value`` rounds to the printed ``text`` (at its own decimals)."""
    want, half = _printed(text)
    return math.isfinite(value) and abs(value - want) <= half * (1 + 1e-9) + 1e-12


def check(fig: Figure, file: str, expr: str) -> str | None:
    """None when the tagged figure is what its file holds, else why not."""
    try:
        files = files_of(file)
        if files[0].suffix in (".txt", ".log"):
            needle = expr.strip().strip('"')
            lines = [ln for f in files for ln in f.read_text(encoding="utf-8").splitlines() if needle in ln]
            if not lines:
                return f"no line of {file} holds {needle!r}"
            if any(fig.text.replace(",", "") == n.group().replace(",", "") for ln in lines
                   for n in NUMBER.finditer(ln)):
                return None
            return f"{fig.text} is on no line of {file} that holds {needle!r}"
        vals = evaluate(files, expr)
    except FigureError as exc:
        return str(exc)
    if expr.startswith("range "):
        lo, hi = fig.text.split("–")
        ok = matches(min(vals), lo) and matches(max(vals), hi)
        got = f"{min(vals):.6g}–{max(vals):.6g}"
    else:
        ok = all(matches(v, fig.text) for v in vals)  # several files: each must print as the figure
        got = ", ".join(f"{v:.6g}" for v in vals)
    return None if ok else f"{fig.text} but {file}: {expr} holds {got}"

