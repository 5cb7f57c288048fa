"""Verify a plan: run it, compare every predicted term with what was measured, and give a verdict.

:func:`verify_plan` checks that the plan was made for this pack (model fingerprint), runs the plan on
the engine (:func:`colibri_plan.engine.runner.generate`, the path `run` takes), runs the all-RAM CPU
reference on the same prompt (the same call without the plan), and builds a *verify report* (JSON
document kind ``"verify-report"``, :mod:`colibri_plan.formats.report`): the plan's predictions, the run's
measurements in the same vocabulary (:class:`~colibri_plan.formats.report.RunReport`), one comparison
row per term, and the verdict:

* token-exact: the plan's generated ids equal the reference's;
* tok/s within ±25 % of the prediction (``measured / predicted`` in [0.75, 1.25]);
* hit rate within ±5 points: the share of expert uses served from memory (VRAM, pinned or LRU, i.e.
  1 − disk share) predicted against measured.

Beside it, when the plan predicts the prefill (``predicted.prefill``) and the run timed one, a prefill
verdict with the decode's tolerance: ``prefill_ratio`` = measured / predicted prefill tok/s at the run's
prompt length (:func:`prefill_tok_s_ratio`, = predicted / measured seconds to first token;
:func:`predicted_prefill_at`) and ``prefill_ok`` (within ±25 %). The decode verdict stays the primary
one: ``ok`` does not include the prefill (a short verify prompt's prefill is noisy and the prefill model
is uncalibrated); ``verify --strict`` fails on ``ok`` alone. Both are null without a prefill prediction
(older plans).

Predicted and measured use the plan's keys (``docs/plan-format.md``), so every row pairs one key with
itself. ``dense + attention`` compares everything outside the routed experts; where the run timed
attention apart (a device trunk: measured ``attention_s``, ``dense_s`` then without it) and where the plan
predicts the trunk (``predicted.trunk``: dense, attention and host round trip per token on its device),
rows for dense and attention alone follow. Where the plan predicts the prefill (``predicted.prefill``) and
the run timed it, two rows compare the prefill at the run's prompt length (:func:`predicted_prefill_at`;
its own verdict, not part of ``ok``): its tok/s, whose measured/predicted ratio is the verdict's
``prefill_ratio``, and the time to first token in seconds beside it, without a ratio (it would be the
inverse one). Measured ``expert_compute_s[<device>]`` includes the device's activation transfers.
``calibrate`` (:mod:`colibri_plan.planner.calibrate`) refits the cost model's coefficients from these
reports.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone

from colibri_plan.fileio import fingerprint
from colibri_plan.formats.fields import is_number, is_whole
from colibri_plan.formats.report import (  # noqa: F401 - the report file's readers, re-exported
    HIT_TIERS,
    KIND,
    SCHEMA_VERSION,
    RunReport,
    load_report,
    save_report,
)
from colibri_plan.run_options import VERIFY_DEFAULTS, RunOptions

#: verdict tolerances (issue 8): tok/s ratio band and hit-rate points
TOK_S_TOLERANCE = 0.25
HIT_RATE_TOLERANCE = 0.05


def check_plan_model(plan, pack) -> None:
    """Refuse a plan made for another model or expert format than ``pack`` (an open PackedModel).

    Raises:
        MismatchError: naming both fingerprints (see :func:`colibri_plan.formats.plan.check_model`).
    """
    from colibri_plan.formats.plan import check_model

    check_model(plan, pack.spec(), where=str(pack.path))


def this_machine_fingerprint() -> str | None:
    """The profile-style fingerprint of this machine (CPU, cores, RAM, GPUs); None if it cannot be built."""
    try:
        from colibri_plan.formats.profile import machine_fingerprint
        from colibri_plan.profiler.machine import list_all_devices, machine_info

        return machine_fingerprint(machine_info(), list_all_devices()[0])
    except Exception:  # noqa: BLE001 - only feeds a warning
        return None


def dense_format_warning(plan, pack_path) -> str | None:
    """A warning when the plan priced the dense trunk in another format than the pack at ``pack_path``
    stores it in (``solve --dense-format`` overrides it for planning): the run holds the pack's bytes, not
    the planned ones. None when they agree or either is unknown."""
    from pathlib import Path

    from colibri_plan.formats.pack_index import pack_dense_format, read_index

    planned = (plan.doc.get("trunk") or {}).get("dense_format") or plan.doc.get("dense_format")
    held = pack_dense_format(Path(pack_path), read_index(pack_path))
    if not planned or not held or planned == held:
        return None
    return (f"the plan priced the dense trunk in {planned}, but the pack stores it in {held}: the run holds "
            f"{held} bytes, so the plan's RAM/VRAM budgets and dense time do not hold; solve again with "
            f"--dense-format {held}")


def context_warning(plan, context_tokens: int) -> str | None:
    """A warning when a run's context (prompt + new tokens) passes the context the plan budgeted its KV
    cache for (``trunk.kv.context_tokens``, else ``budgets.context_tokens``): the paged cache then grows
    past the bytes the plan set aside (in VRAM for a GPU trunk). None when it fits or the plan says none."""
    kv = (plan.doc.get("trunk") or {}).get("kv") or {}
    planned = kv.get("context_tokens", (plan.doc.get("budgets") or {}).get("context_tokens"))
    if not is_whole(planned) or context_tokens <= planned:
        return None
    where = kv.get("device") or "cpu"
    return (f"this run's context ({context_tokens} tokens: prompt + new tokens) passes the {planned} the "
            f"plan budgeted its KV cache for (solve --context): the cache grows past the bytes set aside for "
            f"it on {where}; solve again with --context {context_tokens} or more, or run fewer tokens")


def machine_warning(plan, machine_fp: str | None) -> str | None:
    """A warning when the plan's profile was measured on another machine (None when they agree)."""
    plan_fp = plan.profile_fingerprint
    if plan_fp is None or machine_fp is None or plan_fp == machine_fp:
        return None
    return (f"the plan was made from a profile of another machine (profile fingerprint {plan_fp}, this "
            f"machine {machine_fp}); its predictions are for that machine")


def _ratio(pred: float | None, meas: float | None) -> float | None:
    if pred is None or meas is None or pred == 0:
        return None
    return meas / pred


def _report(d) -> RunReport:
    return d if isinstance(d, RunReport) else RunReport.from_dict(d)


def predicted_trunk(predicted) -> dict | None:
    """The plan's ``predicted.trunk`` ({device, dense_s_per_token, attention_s_per_token,
    host_roundtrip_s_per_token, kv_bytes}) when it has one (older plans do not)."""
    t = predicted.get("trunk") if isinstance(predicted, dict) else None
    return t if isinstance(t, dict) else None


def _num(v) -> float | None:
    return float(v) if is_number(v) else None


def _trunk_rows(predicted, p: RunReport, m: RunReport) -> list[tuple]:
    """Dense and attention apart, when the plan predicts the trunk or the run timed attention."""
    pt = predicted_trunk(predicted)
    if pt is None and m.attention_s_per_token is None:
        return []
    p_dense = _num(pt.get("dense_s_per_token")) if pt else p.dense_s_per_token
    p_attn = _num(pt.get("attention_s_per_token")) if pt else p.attention_s_per_token
    m_dense = m.dense_s_per_token if m.attention_s_per_token is not None else None
    rows = [("dense (trunk)", "s", p_dense, m_dense), ("attention", "s", p_attn, m.attention_s_per_token)]
    if pt and _num(pt.get("host_roundtrip_s_per_token")) is not None:
        rows.append(("host round trip (in dense)", "s", _num(pt["host_roundtrip_s_per_token"]), None))
    return rows


def predicted_prefill_at(predicted, prompt_tokens: int | None) -> float | None:
    """Predicted prefill seconds of a ``prompt_tokens`` prompt from the plan's ``predicted.prefill``: its
    own figure at its prompt length; else interpolated linearly in prompt tokens between the two nearest
    points of its ``curve`` (with the plan's own point; past the last, the last segment's slope); else,
    a plan without a curve, scaled per token. None when the plan or the run lacks the figures."""
    pre = predicted.get("prefill") if isinstance(predicted, dict) else None
    if not isinstance(pre, dict) or not prompt_tokens or _num(pre.get("prefill_s")) is None:
        return None
    n, at = int(prompt_tokens), int(pre["prompt_tokens"])
    if n == at:
        return float(pre["prefill_s"])
    known = [*(pre.get("curve") or []), (at, pre["prefill_s"])]
    pts = sorted({int(c[0]): float(c[1]) for c in known}.items())          # [(prompt tokens, s)] ascending
    if len(pts) < 2:
        return float(pre["prefill_s"]) * n / at
    i = next((k for k in range(1, len(pts)) if pts[k][0] >= n), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


def prefill_tok_s_ratio(predicted_s: float | None, measured_s: float | None) -> float | None:
    """The one prefill ratio verify reports (the comparison's prefill tok/s row and the verdict's
    ``prefill_ratio``): measured / predicted prefill tok/s of one prompt, which is predicted / measured
    seconds to the first token (the prompt length cancels). None when either time is missing or not > 0.
    E.g. predicted 2.0 s, measured 2.5 s: 0.8 (the run prefilled at 0.8x the predicted speed)."""
    if predicted_s is None or measured_s is None or predicted_s <= 0 or measured_s <= 0:
        return None
    return predicted_s / measured_s


def _prefill_rows(predicted, m: RunReport) -> list[dict]:
    """Two rows where the plan predicts the prefill and the run timed one: its tok/s at the run's prompt
    length, whose ratio is :func:`prefill_tok_s_ratio` (the verdict's), and the time to first token in
    seconds beside it, with no ratio of its own (it would be the inverse one)."""
    p_s = predicted_prefill_at(predicted, m.prompt_tokens)
    if p_s is None or m.prefill_s is None or not m.prompt_tokens:
        return []
    n = m.prompt_tokens
    tok_s = lambda s: n / s if s > 0 else None   # noqa: E731
    return [{"term": f"prefill tok/s ({n} prompt tokens)", "unit": "tok/s", "predicted": tok_s(p_s),
             "measured": tok_s(m.prefill_s), "ratio": prefill_tok_s_ratio(p_s, m.prefill_s)},
            {"term": "prefill time to first token", "unit": "s", "predicted": p_s, "measured": m.prefill_s,
             "ratio": None}]


def compare(predicted, measured) -> list[dict]:
    """Comparison rows ``{"term", "unit", "predicted", "measured", "ratio"|"diff_points"}``.

    Args:
        predicted: the plan's ``predicted`` section (or a RunReport); measured: a RunReport (or its dict).
    """
    p, m = _report(predicted), _report(measured)
    pc, mc = p.expert_compute_s_per_token, m.expert_compute_s_per_token
    rows = [("tok/s", "tok/s", p.tok_s, m.tok_s),
            ("decode s/token", "s", p.decode_s_per_token, m.decode_s_per_token),
            ("dense + attention", "s", (p.dense_s_per_token or 0.0) + (p.attention_s_per_token or 0.0),
             None if m.dense_s_per_token is None
             else m.dense_s_per_token + (m.attention_s_per_token or 0.0)),
            *_trunk_rows(predicted, p, m),
            ("expert layers (wall)", "s", p.expert_layers_s_per_token, m.expert_layers_s_per_token),
            ("expert compute cpu", "s", pc.get("cpu"), mc.get("cpu"))]
    for key in sorted((set(pc) | set(mc)) - {"cpu"}):
        rows.append((f"expert compute {key}", "s", pc.get(key), mc.get(key, 0.0)))
    rows += [("disk wait", "s", p.disk_wait_s_per_token, m.disk_wait_s_per_token),
             ("disk bytes/token", "B", p.disk_bytes_per_token, m.disk_bytes_per_token)]
    out = [{"term": t, "unit": u, "predicted": a, "measured": b, "ratio": _ratio(a, b)}
           for t, u, a, b in rows]
    out += _prefill_rows(predicted, m)
    hit_rows = [("hit rate (memory)", p.memory_hit_rate, m.memory_hit_rate)]
    hit_rows += [(f"share {k}", p.hit_rate[k], m.hit_rate[k]) for k in HIT_TIERS]
    hit_rows.append(("LRU hit rate (streamed)", p.lru_hit_rate or 0.0, m.lru_hit_rate or 0.0))
    out += [{"term": t, "unit": "share", "predicted": a, "measured": b, "diff_points": 100.0 * (b - a)}
            for t, a, b in hit_rows]
    return out


def prefill_verdict(predicted, measured) -> tuple[float | None, bool | None]:
    """(prefill_ratio, prefill_ok): :func:`prefill_tok_s_ratio` (measured / predicted prefill tok/s) at the
    run's prompt length and whether it is within the decode's ±25 %; (None, None) when the plan has no
    prefill prediction (``predicted`` a RunReport or an older plan), the run timed none, or either time
    is not > 0 (as the comparison's row). E.g. predicted 2.0 s, measured 2.4 s: ratio 0.833, within."""
    if not isinstance(predicted, dict):
        return None, None
    m = _report(measured)
    ratio = prefill_tok_s_ratio(predicted_prefill_at(predicted, m.prompt_tokens), m.prefill_s)
    if ratio is None:  # no prediction, no timed prefill, or a time not > 0 (a curve clamped to 0 s)
        return None, None
    return ratio, bool(abs(ratio - 1.0) <= TOK_S_TOLERANCE)


def make_verdict(predicted, measured, token_exact: bool | None) -> dict:
    """The verdict: token_exact, tok_s_ok (ratio within ±25 %), hit_rate_ok (±5 points), ok (all three),
    and beside them prefill_ratio / prefill_ok (:func:`prefill_verdict`; not part of ``ok``)."""
    p, m = _report(predicted), _report(measured)
    ratio = _ratio(p.tok_s, m.tok_s)
    diff = m.memory_hit_rate - p.memory_hit_rate
    tok_ok = ratio is not None and abs(ratio - 1.0) <= TOK_S_TOLERANCE
    hit_ok = abs(diff) <= HIT_RATE_TOLERANCE
    pre_ratio, pre_ok = prefill_verdict(predicted, measured)
    return {"token_exact": token_exact, "tok_s_ratio": ratio, "tok_s_ok": tok_ok,
            "hit_rate_diff_points": 100.0 * diff, "hit_rate_ok": hit_ok,
            "prefill_ratio": pre_ratio, "prefill_ok": pre_ok,
            "tolerances": {"tok_s": TOK_S_TOLERANCE, "hit_rate_points": 100 * HIT_RATE_TOLERANCE,
                           "prefill_tok_s": TOK_S_TOLERANCE},
            "ok": bool(token_exact is not False and tok_ok and hit_ok)}


def plan_coefficients(plan) -> dict | None:
    """The cost-model coefficients the plan's predictions were made with, if the plan records them."""
    for c in (plan.doc.get("coefficients"), plan.doc.get("predicted", {}).get("coefficients"),
              plan.doc.get("solver", {}).get("coefficients")):
        if isinstance(c, dict):
            return c
    return None


def verify_plan(plan, pack, prompt_ids, opts: RunOptions = VERIFY_DEFAULTS, *, plan_path: str = "",
                reference: bool = True, machine_fp: str | None = None, progress=None,
                warn=None) -> dict:
    """Run ``plan`` on ``pack`` and build the verify report (see the module docstring).

    Args:
        plan: a loaded :class:`colibri_plan.formats.plan.Plan`; pack: an open PackedModel.
        prompt_ids: prompt token ids.
        opts: ``tokens``: decode steps to time (>= 1): tokens + 1 new ids are generated, the first by the
            prefill; ``backend``: the host backend of RAM-resident and streamed experts (cpu or numpy);
            the rest as :func:`~colibri_plan.engine.runner.generate` reads it.
        reference: also run the all-RAM CPU reference for token-exactness (``token_exact`` is None
            otherwise).
        machine_fp: this machine's fingerprint (for the other-machine warning).
        progress, warn: optional ``fn(message)`` callbacks.

    Returns:
        The report body (save it with :func:`save_report`).

    Raises:
        MismatchError: the plan is for another model. Engine errors from the runs.
    """
    from colibri_plan.engine.runner import generate

    n_tokens, cpu_backend = opts.tokens, opts.backend
    say = progress or (lambda _m: None)
    check_plan_model(plan, pack)
    w = machine_warning(plan, machine_fp)  # the report's machine.warning
    for note in (w, dense_format_warning(plan, pack.path),
                 context_warning(plan, len(prompt_ids) + n_tokens + 1)):
        if note and warn:
            warn(note)
    # n_tokens decode steps are timed: the first of the n_tokens + 1 new ids comes from the prefill
    say(f"running the plan: {n_tokens} decode step{'s' if n_tokens != 1 else ''} ({n_tokens + 1} tokens)")
    run_opts = dataclasses.replace(opts, tokens=n_tokens + 1)
    run = generate(pack, prompt_ids, run_opts, plan=plan, progress=lambda m: say(f"  plan {m}"))
    ref = None
    if reference:
        say("running the all-RAM CPU reference")
        ref_run = generate(pack, prompt_ids, dataclasses.replace(run_opts, trunk="cpu"),
                           progress=lambda m: say(f"  reference {m}"))
        ref = {"tokens": ref_run.tokens, "tok_s": ref_run.tok_s,
               "decode_s_per_token": ref_run.decode_s_per_token}
    token_exact = None if ref is None else list(ref["tokens"]) == list(run.tokens)
    if token_exact is False:
        first = next(i for i, (a, b) in enumerate(zip(ref["tokens"], run.tokens)) if a != b)
        ref["first_difference"] = first
    predicted = plan.doc["predicted"]
    return {
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "plan": {"path": str(plan_path), "fingerprint": fingerprint(plan.doc),
                 "counts": plan.counts(), "coefficients": plan_coefficients(plan),
                 "n_decode_layers": len(plan.doc["layers"]), "budgets": plan.doc.get("budgets", {})},
        "model": {"path": str(pack.path), "name": plan.doc["model"].get("name"),
                  "fingerprint": plan.model_fingerprint},
        "machine": {"fingerprint": machine_fp, "plan_profile_fingerprint": plan.profile_fingerprint,
                    "warning": w},
        "settings": {"tokens": int(n_tokens), "prompt_ids": list(map(int, prompt_ids)),
                     "cpu_backend": cpu_backend, "read_threads": opts.read_threads or plan.read_threads,
                     "trunk_device": run.trunk_device,
                     "predicted_trunk_device": (predicted_trunk(plan.doc["predicted"]) or {}).get("device")},
        "predicted": predicted, "measured": run.to_dict(), "reference": ref,
        "comparison": compare(predicted, run),
        "verdict": make_verdict(predicted, run, token_exact)}


def _fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "share":
        return f"{100 * v:.1f}%"
    if unit == "B":
        return f"{v / 1e6:.1f} MB"
    if unit == "tok/s":
        return f"{v:.3f}"
    return f"{v * 1e3:.1f} ms"


def report_table(report: dict) -> list[list[str]]:
    """Rows (term, predicted, measured, ratio or diff) of a report's comparison, formatted for people."""
    rows = []
    for r in report["comparison"]:
        if "diff_points" in r:
            cmp_ = f"{r['diff_points']:+.1f} pts"
        else:
            cmp_ = "-" if r.get("ratio") is None else f"x{r['ratio']:.2f}"
        rows.append([r["term"], _fmt(r["predicted"], r["unit"]), _fmt(r["measured"], r["unit"]), cmp_])
    return rows


def verdict_line(v: dict) -> str:
    """One line: PASS/FAIL and its three parts, then the prefill's verdict where there is one (outside
    PASS/FAIL: the decode verdict is the primary one)."""
    exact = {True: "yes", False: "NO", None: "not checked"}[v["token_exact"]]
    ratio = "n/a" if v["tok_s_ratio"] is None else f"{v['tok_s_ratio']:.2f}"
    # --no-reference: a PASS without the token check must say so where it is read
    word = ("PASS" if v["token_exact"] is not None else "PASS (tokens not checked)") if v["ok"] else "FAIL"
    line = (f"verdict: {word} - token-exact {exact}; tok/s measured/predicted "
            f"{ratio} ({'within' if v['tok_s_ok'] else 'outside'} +-{100 * v['tolerances']['tok_s']:.0f}%); "
            f"hit rate {v['hit_rate_diff_points']:+.1f} pts ({'within' if v['hit_rate_ok'] else 'outside'} "
            f"+-{v['tolerances']['hit_rate_points']:.0f})")
    if v.get("prefill_ratio") is None:
        return line
    tol = 100 * (v.get("tolerances") or {}).get("prefill_tok_s", TOK_S_TOLERANCE)
    # the same ratio as the comparison's "prefill tok/s" row (prefill_tok_s_ratio), named as decode's
    return (f"{line}; prefill tok/s measured/predicted {v['prefill_ratio']:.2f} "
            f"({'within' if v['prefill_ok'] else 'outside'} +-{tol:.0f}%, not part of PASS/FAIL)")
