"""Verify a plan: run it, compare every predicted term with what was measured, and give a verdict.

:func:`verify_plan` checks that the plan was made for this pack (model fingerprint), runs the plan on
the engine (:func:`colibri_plan.engine.session.run_placement`), runs the all-RAM CPU reference on the
same prompt, and builds a *verify report* (JSON document kind ``"verify-report"``, schema_version 1):
the plan's predictions, the run's measurements, one comparison row per term, and the verdict:

* token-exact: the plan's generated ids equal the reference's;
* tok/s within ±25 % of the prediction (``measured / predicted`` in [0.75, 1.25]);
* hit rate within ±5 points: the share of expert uses served from memory (VRAM, pinned or LRU, i.e.
  1 − disk share) predicted against measured.

Term names follow the plan (``docs/plan-format.md``): predicted ``dense_s + attention_s`` is compared with
the measured ``dense_s`` (all decode time outside the expert provider), ``expert_compute_s.cpu`` with the
CPU backend's expert time, ``expert_compute_s[<device>]`` with the device's share (activation transfers
included), ``disk_wait_s`` with the time the CPU path waited for reads, ``expert_layers_s`` with the
wall time inside the expert provider. ``calibrate`` (:mod:`colibri_plan.planner.calibrate`) refits the
cost model's coefficients from these reports.
"""

from __future__ import annotations

import math
import os
from datetime import datetime, timezone
from pathlib import Path

from colibri_plan.errors import FormatError
from colibri_plan.fileio import fingerprint, read_document, write_document

KIND = "verify-report"
SCHEMA_VERSION = 1
#: verdict tolerances (issue 8): tok/s ratio band and hit-rate points
TOK_S_TOLERANCE = 0.25
HIT_RATE_TOLERANCE = 0.05
#: largest seconds per token a report may hold (beyond it the report is corrupt)
MAX_S_PER_TOKEN = 1e6
_HIT_TIERS = (("vram", "vram"), ("ram_pinned", "pinned"), ("lru", "lru"), ("disk", "disk"))


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


def memory_hit_rate(shares: dict, disk_key: str = "disk") -> float:
    """Share of expert uses served without a disk read: 1 − the disk share."""
    return 1.0 - float(shares.get(disk_key, 0.0))


def compare(predicted: dict, measured: dict) -> list[dict]:
    """Comparison rows ``{"term", "unit", "predicted", "measured", "ratio"|"diff_points"}``.

    Args:
        predicted: the plan's ``predicted`` section (decode_s_per_token, tok_s, terms, hit_rate, ...).
        measured: a RunReport as a dict (``RunReport.to_dict()``).
    """
    pt, mt = predicted.get("terms", {}), measured.get("terms", {})
    comp = pt.get("expert_compute_s", {}) or {}
    rows = [("tok/s", "tok/s", predicted.get("tok_s"), measured.get("tok_s")),
            ("decode s/token", "s", predicted.get("decode_s_per_token"), measured.get("decode_s_per_token")),
            ("dense + attention", "s", pt.get("dense_s", 0.0) + pt.get("attention_s", 0.0),
             mt.get("dense_s")),
            ("expert layers (wall)", "s", pt.get("expert_layers_s"), mt.get("expert_wall_s")),
            ("expert compute cpu", "s", comp.get("cpu"), mt.get("expert_cpu_s"))]
    dev_meas = mt.get("device_s", {}) or {}
    for key in sorted(set(comp) - {"cpu"} | set(dev_meas)):
        rows.append((f"expert compute {key}", "s", comp.get(key), dev_meas.get(key, 0.0)))
    rows += [("disk wait", "s", pt.get("disk_wait_s"), mt.get("disk_wait_s")),
             ("disk bytes/token", "B", predicted.get("disk_bytes_per_token"),
              measured.get("disk_bytes_per_token"))]
    out = [{"term": t, "unit": u, "predicted": p, "measured": m, "ratio": _ratio(p, m)}
           for t, u, p, m in rows]
    ph, mh = predicted.get("hit_rate", {}) or {}, measured.get("hit_rates", {}) or {}
    hit_rows = [("hit rate (memory)", memory_hit_rate(ph), memory_hit_rate(mh))]
    hit_rows += [(f"share {pk}", float(ph.get(pk, 0.0)), float(mh.get(mk, 0.0))) for pk, mk in _HIT_TIERS]
    lru_pred = ph.get("lru", 0.0) + ph.get("disk", 0.0)
    hit_rows.append(("LRU hit rate (streamed)", ph.get("lru", 0.0) / lru_pred if lru_pred else 0.0,
                     measured.get("lru_hit_rate", 0.0)))
    out += [{"term": t, "unit": "share", "predicted": p, "measured": m, "diff_points": 100.0 * (m - p)}
            for t, p, m in hit_rows]
    return out


def make_verdict(predicted: dict, measured: dict, token_exact: bool | None) -> dict:
    """The verdict: token_exact, tok_s_ok (ratio within ±25 %), hit_rate_ok (±5 points), ok (all)."""
    ratio = _ratio(predicted.get("tok_s"), measured.get("tok_s"))
    diff = memory_hit_rate(measured.get("hit_rates", {})) - memory_hit_rate(predicted.get("hit_rate", {}))
    tok_ok = ratio is not None and abs(ratio - 1.0) <= TOK_S_TOLERANCE
    hit_ok = abs(diff) <= HIT_RATE_TOLERANCE
    return {"token_exact": token_exact, "tok_s_ratio": ratio, "tok_s_ok": tok_ok,
            "hit_rate_diff_points": 100.0 * diff, "hit_rate_ok": hit_ok,
            "tolerances": {"tok_s": TOK_S_TOLERANCE, "hit_rate_points": 100 * HIT_RATE_TOLERANCE},
            "ok": bool(token_exact is not False and tok_ok and hit_ok)}


def plan_coefficients(plan) -> dict | None:
    """The cost-model coefficients the plan's predictions were made with, if the plan records them."""
    for c in (plan.doc.get("coefficients"), plan.doc.get("predicted", {}).get("coefficients"),
              plan.doc.get("solver", {}).get("coefficients")):
        if isinstance(c, dict):
            return c
    return None


def verify_plan(plan, pack, prompt_ids, n_tokens: int, *, plan_path: str = "", cpu_backend: str = "cpu",
                reference: bool = True, machine_fp: str | None = None, progress=None,
                warn=None) -> dict:
    """Run ``plan`` on ``pack`` and build the verify report (see the module docstring).

    Args:
        plan: a loaded :class:`colibri_plan.formats.plan.Plan`; pack: an open PackedModel.
        prompt_ids: prompt token ids; n_tokens: decode steps to time (>= 1): n_tokens + 1 new ids are
            generated, the first by the prefill.
        reference: also run the all-RAM CPU reference for token-exactness (``token_exact`` is None
            otherwise).
        machine_fp: this machine's fingerprint (for the other-machine warning).
        progress, warn: optional ``fn(message)`` callbacks.

    Returns:
        The report body (save it with :func:`save_report`).

    Raises:
        MismatchError: the plan is for another model. Engine errors from the runs.
    """
    from colibri_plan.engine.placement import Placement
    from colibri_plan.engine.session import run_placement

    say = progress or (lambda _m: None)
    check_plan_model(plan, pack)
    w = machine_warning(plan, machine_fp)
    if w and warn:
        warn(w)
    placement = Placement.from_layers(plan.doc["layers"])
    # n_tokens decode steps are timed: the first of the n_tokens + 1 new ids comes from the prefill
    say(f"running the plan: {n_tokens} decode step{'s' if n_tokens != 1 else ''} ({n_tokens + 1} tokens)")
    run = run_placement(pack, placement, prompt_ids, n_tokens + 1, cpu_backend=cpu_backend,
                        read_threads=plan.read_threads, progress=lambda m: say(f"  plan {m}"))
    measured = run.to_dict()
    ref = None
    if reference:
        say("running the all-RAM CPU reference")
        arch = pack.arch
        ref_run = run_placement(pack, Placement.all_ram(arch.moe_layers, arch.n_experts), prompt_ids,
                                n_tokens + 1, cpu_backend=cpu_backend,
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
                     "cpu_backend": cpu_backend, "read_threads": plan.read_threads},
        "predicted": predicted, "measured": measured, "reference": ref,
        "comparison": compare(predicted, measured),
        "verdict": make_verdict(predicted, measured, token_exact)}


def save_report(report: dict, path: str | os.PathLike) -> Path:
    """Write a verify report atomically (kind "verify-report", schema_version 1)."""
    body = {k: v for k, v in report.items() if k not in ("kind", "schema_version")}
    return write_document(path, KIND, SCHEMA_VERSION, body)


def load_report(path: str | os.PathLike) -> dict:
    """Read and check a verify report.

    Raises:
        InputError: missing file. FormatError: bad JSON/kind/version, or a section calibrate needs is
        missing or not numeric (the message names it).
    """
    doc = read_document(path, KIND, SCHEMA_VERSION)
    for section in ("predicted", "measured", "plan", "verdict"):
        if not isinstance(doc.get(section), dict):
            raise FormatError(f"verify report {path} lacks its {section!r} section; "
                              "re-run `colibri-plan verify`")
    for section, keys in (("predicted", ("decode_s_per_token", "tok_s")),
                          ("measured", ("decode_s_per_token", "tok_s"))):
        for k in keys:
            v = doc[section].get(k)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                    or (k == "decode_s_per_token" and v > MAX_S_PER_TOKEN)):
                bound = f">= 0 and <= {MAX_S_PER_TOKEN:g}" if k == "decode_s_per_token" else ">= 0"
                raise FormatError(f"verify report {path}: {section}.{k} must be a finite number {bound}, "
                                  f"got {v!r}")
        if not isinstance(doc[section].get("terms"), dict):
            raise FormatError(f"verify report {path}: {section}.terms is missing; "
                              "re-run `colibri-plan verify`")
        for k, v in doc[section]["terms"].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not (
                    math.isfinite(v) and 0 <= v <= MAX_S_PER_TOKEN):
                raise FormatError(f"verify report {path}: {section}.terms.{k} must be a finite number >= 0 "
                                  f"and <= {MAX_S_PER_TOKEN:g}, got {v!r}")
    return doc


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
    """One line: PASS/FAIL and its three parts."""
    exact = {True: "yes", False: "NO", None: "not checked"}[v["token_exact"]]
    ratio = "n/a" if v["tok_s_ratio"] is None else f"{v['tok_s_ratio']:.2f}"
    return (f"verdict: {'PASS' if v['ok'] else 'FAIL'} - token-exact {exact}; tok/s measured/predicted "
            f"{ratio} ({'within' if v['tok_s_ok'] else 'outside'} +-{100 * v['tolerances']['tok_s']:.0f}%); "
            f"hit rate {v['hit_rate_diff_points']:+.1f} pts ({'within' if v['hit_rate_ok'] else 'outside'} "
            f"+-{v['tolerances']['hit_rate_points']:.0f})")
