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
  ``disk_read_s``, ``verify_s`` and ``offload_h2d_s`` are too when present;
- ``curve`` (optional): a list of ``[prompt tokens (whole number >= 1), prefill seconds (finite >= 0)]``
  pairs, prompt lengths ascending without repeats (``verify`` interpolates it at a run's prompt length);
- ``figures`` (optional): an object (``planner.prefill.prefill_for_plan`` reads it).
"""

from __future__ import annotations

import math

from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

#: the ``terms`` figures ``solve`` and ``plan show`` print (required), and the ones added later (optional)
REQUIRED_TERMS = ("experts_s", "dense_s", "lm_head_s", "attention_s", "handoff_s",
                  "distinct_experts_per_layer")
OPTIONAL_TERMS = ("disk_read_s", "verify_s", "offload_h2d_s")


def check_prefill(predicted: dict, at: At) -> None:
    """Check ``predicted["prefill"]`` when it is there (absent or null: an older plan, nothing to check).

    Args:
        predicted: the plan's ``predicted`` section (a dict; its ``prefill``, when not null, already
            checked to be an object by ``formats/plan.py``).
        at: where ``predicted`` is (``plan <path>`` / "predicted": messages name
            ``predicted.prefill.<field>`` and the plan's advice).

    Raises:
        FormatError: naming the field, what it must be and what it holds.
    """
    pre = predicted.get("prefill")
    if not isinstance(pre, dict):
        return
    at = at / "prefill"
    n = f.whole(pre, "prompt_tokens", at, lo=1, integral_floats=True)
    for key, unit in (("prefill_s", "seconds"), ("ttft_s", "seconds"), ("prefill_tok_s", "tok/s")):
        f.number(pre, key, at, lo=0, lo_open=True, unit=f" ({unit})")
    pre_s = pre["prefill_s"]
    if not math.isclose(pre["ttft_s"], pre_s, rel_tol=1e-6):
        (at / "ttft_s").fail(f"{pre['ttft_s']!r} is not {at.dotted}.prefill_s {pre_s!r} (the first token "
                             "comes out of the prompt's last row)")
    if not math.isclose(pre["prefill_tok_s"], n / pre_s, rel_tol=1e-6):
        (at / "prefill_tok_s").fail(f"{pre['prefill_tok_s']!r} is not prompt_tokens / prefill_s "
                                    f"({n / pre_s:.6g})")
    terms = pre.get("terms")   # absent reads as null: either way not the object the readers print
    if not isinstance(terms, dict):
        (at / "terms").bad("an object of the prefill's seconds per part", terms)
    for key in REQUIRED_TERMS:
        f.number(terms, key, at / "terms", lo=0)
    for key in OPTIONAL_TERMS:
        if key in terms:
            f.number(terms, key, at / "terms", lo=0)
    curve = f.items(pre, "curve", at, optional=True, want="a list of [prompt tokens, prefill s] pairs")
    for i, point in enumerate(curve or ()):
        ok = (isinstance(point, list) and len(point) == 2 and f.is_whole(point[0], True) and point[0] >= 1
              and f.is_number(point[1]) and point[1] >= 0)
        if not ok:
            (at / "curve" / i).bad("[prompt tokens (a whole number >= 1), prefill s (a finite number >= 0)]",
                                   point)
        if i and point[0] <= curve[i - 1][0]:
            (at / "curve").fail(f"must list prompt lengths in ascending order without repeats; curve[{i}] "
                                f"has {f.shown(point[0])} after {f.shown(curve[i - 1][0])}")
    f.mapping(pre, "figures", at, optional=True, want="an object of the rates the prefill was priced with")
