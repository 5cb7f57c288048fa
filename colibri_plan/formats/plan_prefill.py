"""Checks of a plan's optional ``predicted.prefill`` section (``solve --prompt-tokens N``;
docs/plan-format.md).

``formats/plan.py`` checks that the section is an object; this module checks every figure in it the
section's readers use, so a hand-edited section fails on load with a FormatError naming the field instead
of a KeyError or TypeError in ``plan show``, ``run --plan`` or ``verify``:

- ``prompt_tokens``: a whole number >= 1;
- ``prefill_s``: a finite number > 0 (``prefill_tok_s`` and ``verify``'s ratio divide by it);
- ``ttft_s`` and ``prefill_tok_s``: finite numbers > 0 (``solve`` and ``plan show`` print them), with
  ``ttft_s`` = ``prefill_s`` and ``prefill_tok_s`` = ``prompt_tokens / prefill_s`` (1e-6 relative: the
  planner writes them so; a hand edit of one figure alone would print a time the others contradict);
- ``terms``: an object whose ``experts_s``, ``dense_s``, ``lm_head_s``, ``attention_s``, ``handoff_s``
  and ``distinct_experts_per_layer`` are finite numbers >= 0 (printed), and whose optional
  ``disk_read_s`` and ``verify_s`` are too when present;
- ``curve`` (optional): a list of ``[prompt tokens (whole number >= 1), prefill seconds (finite >= 0)]``
  pairs, prompt lengths ascending without repeats (``verify`` interpolates it at a run's prompt length);
- ``figures`` (optional): an object (``planner.prefill.prefill_for_plan`` reads it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable

#: the ``terms`` figures ``solve`` and ``plan show`` print (required), and the ones added later (optional)
REQUIRED_TERMS = ("experts_s", "dense_s", "lm_head_s", "attention_s", "handoff_s",
                  "distinct_experts_per_layer")
OPTIONAL_TERMS = ("disk_read_s", "verify_s")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _shown(v) -> str:
    return json.dumps(v, default=str)[:60]


def check_prefill(predicted: dict, fail: Callable[[str], None]) -> None:
    """Check ``predicted["prefill"]`` when it is there (absent or null: an older plan, nothing to check).

    Args:
        predicted: the plan's ``predicted`` section (a dict; its ``prefill``, when not null, already
            checked to be an object by ``formats/plan.py``).
        fail: called with what is wrong (``"predicted.prefill.ttft_s must be ..."``); it must raise
            (``formats.plan._fail`` raises FormatError with the plan's path and what to do).
    """
    pre = predicted.get("prefill")
    if not isinstance(pre, dict):
        return
    where = "predicted.prefill"
    n = pre.get("prompt_tokens")
    if "prompt_tokens" not in pre:
        fail(f"{where}.prompt_tokens is missing")
    if not _finite(n) or not float(n).is_integer() or n < 1:
        fail(f"{where}.prompt_tokens must be a whole number >= 1, got {_shown(n)}")
    for key, unit in (("prefill_s", "seconds"), ("ttft_s", "seconds"), ("prefill_tok_s", "tok/s")):
        v = pre.get(key)
        if key not in pre:
            fail(f"{where}.{key} is missing")
        if not _finite(v) or v <= 0:
            fail(f"{where}.{key} must be a finite number > 0 ({unit}), got {_shown(v)}")
    pre_s = pre["prefill_s"]
    if not math.isclose(pre["ttft_s"], pre_s, rel_tol=1e-6):
        fail(f"{where}.ttft_s {pre['ttft_s']!r} is not {where}.prefill_s {pre_s!r} (the first token comes "
             f"out of the prompt's last row)")
    if not math.isclose(pre["prefill_tok_s"], n / pre_s, rel_tol=1e-6):
        fail(f"{where}.prefill_tok_s {pre['prefill_tok_s']!r} is not prompt_tokens / prefill_s "
             f"({n / pre_s:.6g})")
    terms = pre.get("terms")
    if not isinstance(terms, dict):
        fail(f"{where}.terms must be an object of the prefill's seconds per part, got {_shown(terms)}")
    for key in (*REQUIRED_TERMS, *OPTIONAL_TERMS):
        if key not in terms and key in OPTIONAL_TERMS:
            continue
        if key not in terms:
            fail(f"{where}.terms.{key} is missing")
        v = terms[key]
        if not _finite(v) or v < 0:
            fail(f"{where}.terms.{key} must be a finite number >= 0, got {_shown(v)}")
    curve = pre.get("curve")
    if curve is not None:
        if not isinstance(curve, list):
            fail(f"{where}.curve must be a list of [prompt tokens, prefill s] pairs, got {_shown(curve)}")
        for i, point in enumerate(curve):
            ok = (isinstance(point, list) and len(point) == 2 and _finite(point[0])
                  and float(point[0]).is_integer() and point[0] >= 1 and _finite(point[1]) and point[1] >= 0)
            if not ok:
                fail(f"{where}.curve[{i}] must be [prompt tokens (a whole number >= 1), prefill s (a finite "
                     f"number >= 0)], got {_shown(point)}")
            if i and point[0] <= curve[i - 1][0]:
                fail(f"{where}.curve must list prompt lengths in ascending order without repeats; "
                     f"curve[{i}] has {_shown(point[0])} after {_shown(curve[i - 1][0])}")
    if pre.get("figures") is not None and not isinstance(pre["figures"], dict):
        fail(f"{where}.figures must be an object of the rates the prefill was priced with, got "
             f"{_shown(pre['figures'])}")
