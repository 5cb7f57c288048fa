"""Refit the cost model's per-term coefficients from verify reports (``colibri-plan calibrate``).

Method (docs/calibration.md). Each report holds the plan's predicted terms, made with coefficients
``c_old`` (recorded in the plan; 1.0 when absent), and the measured terms. The *raw* roofline of a term is
``predicted / c_old``.

* ``cpu_expert`` and ``disk`` — non-negative least squares on the CPU path's time per token. In the cost
  model a layer's CPU path costs ``c_cpu · cpu_raw + c_disk · disk_raw``; summed over layers this is linear
  in the two coefficients, so over the reports

      measured CPU-path seconds ≈ c_cpu · Σ_l cpu_raw + c_disk · Σ_l disk_raw       (scipy nnls)

  where the measured CPU-path time is the wall time inside the expert provider for runs without devices,
  and CPU compute + disk wait for runs with devices. Fitting the path's total, not each timer apart, makes
  ``c_disk`` carry everything streaming costs the CPU path (waits that compute could not hide, checksums
  and reads competing with compute, cache-cold weights), which is what the decode time depends on. A
  coefficient whose raw column is zero in every report (e.g. no report streams) keeps its base value.
* ``dense`` — ratio of sums: Σ (measured dense − predicted attention) / Σ raw dense.
* ``gpu_expert`` — ratio of sums: Σ (device seconds − predicted transfer seconds) / Σ raw device seconds.

``attention``, ``transfer`` and ``layer_overhead_s`` are not identified by these runs and keep their base
values (the base ``layer_overhead_s`` × MoE layers is taken out of the measured CPU-path time first).
The result is a JSON document kind ``"coefficients"`` (schema_version 1); ``solve --coefficients FILE`` uses
it, and a plan records the coefficients it was made with. Nothing reads it implicitly.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import read_document, write_document

KIND = "coefficients"
SCHEMA_VERSION = 1


def _num(d: dict, key: str, where: str) -> float:
    v = d.get(key, 0.0)
    if v is None:
        return 0.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        raise FormatError(f"{where}: {key} must be a number, got {v!r}")
    return float(v)


def report_terms(report: dict, where: str = "report") -> dict:
    """The raw predicted and measured seconds per token of one verify report that calibration uses.

    Returns:
        {"cpu_raw", "disk_raw", "cpu_path_s", "dense_raw", "dense_s", "gpu_raw", "gpu_s", "devices": bool}.

    Raises:
        FormatError: a needed figure is missing or not a number (names the report and field).
    """
    from colibri_plan.planner.costmodel import Coefficients

    try:
        pred, meas = report["predicted"], report["measured"]
        pt, mt = pred["terms"], meas["terms"]
        comp = pt.get("expert_compute_s") or {}
        dev_meas = mt.get("device_s") or {}
    except (KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"{where}: not a verify report ({exc!r} missing); "
                          "re-run `colibri-plan verify`") from exc
    old = Coefficients.from_dict((report.get("plan") or {}).get("coefficients") or {})

    def raw(v: float, c: float) -> float:
        return v / c if c > 0 else 0.0

    gpu_pred = sum(_num(comp, k, where) for k in comp if k != "cpu")
    gpu_meas = sum(_num(dev_meas, k, where) for k in dev_meas)
    devices = gpu_pred > 0 or gpu_meas > 0
    cpu_path = (_num(mt, "expert_cpu_s", where) + _num(mt, "disk_wait_s", where) if devices
                else _num(mt, "expert_wall_s", where))
    n_layers = int((report.get("plan") or {}).get("n_decode_layers") or 0)
    return {"cpu_raw": raw(_num(comp, "cpu", where), old.cpu_expert), "n_layers": n_layers,
            "disk_raw": raw(_num(pt, "disk_wait_s", where), old.disk),
            "cpu_path_s": cpu_path,
            "dense_raw": raw(_num(pt, "dense_s", where), old.dense),
            "dense_s": _num(mt, "dense_s", where) - _num(pt, "attention_s", where),
            "gpu_raw": raw(gpu_pred, old.gpu_expert),
            "gpu_s": gpu_meas - _num(pt, "transfer_s", where),
            "devices": devices}


def fit_coefficients(reports: list[dict], base=None, names: list[str] | None = None) -> tuple:
    """Fit the coefficients (module docstring) over ``reports``.

    Args:
        base: Coefficients to start from (terms without data keep these values; default all 1.0).
        names: labels of the reports for error messages.

    Returns:
        (Coefficients, detail) — detail per fitted term: method, the sums or the residual, "fitted".

    Raises:
        InputError: no reports. FormatError: a malformed report.
    """
    from scipy.optimize import nnls

    from colibri_plan.planner.costmodel import Coefficients

    if not reports:
        raise InputError("calibrate needs at least one verify report")
    base = base or Coefficients()
    names = names or [f"report {i}" for i in range(len(reports))]
    terms = [report_terms(r, n) for r, n in zip(reports, names)]
    values = base.to_dict()
    detail: dict = {}
    # CPU path: nnls on the columns that carry information
    a = np.array([[t["cpu_raw"], t["disk_raw"]] for t in terms], dtype=np.float64)
    # the fixed per-layer overhead keeps its base value: take it out of the measured path time first
    y = np.array([t["cpu_path_s"] - t["n_layers"] * base.layer_overhead_s for t in terms], dtype=np.float64)
    live = [j for j in range(2) if np.any(a[:, j] > 0)]
    if live:
        # base values of columns without data are subtracted first, then the rest is fitted
        fixed = [j for j in range(2) if j not in live]
        keys = ("cpu_expert", "disk")
        y_fit = y - sum(a[:, j] * values[keys[j]] for j in fixed)
        x, resid = nnls(a[:, live], y_fit)
        for j, v in zip(live, x):
            values[keys[j]] = float(v)
        detail["cpu_path"] = {"method": "nnls: measured CPU-path s ~ c_cpu * raw cpu + c_disk * raw disk",
                              "reports": len(terms), "residual_s": float(resid),
                              "measured_s": y.tolist(), "raw_cpu_s": a[:, 0].tolist(),
                              "raw_disk_s": a[:, 1].tolist()}
    for k, col in (("cpu_expert", 0), ("disk", 1)):
        detail[k] = {"value": values[k], "fitted": col in live}
    for key, m_key, r_key in (("dense", "dense_s", "dense_raw"), ("gpu_expert", "gpu_s", "gpu_raw")):
        used = [t for t in terms if t[r_key] > 0]
        m, r = sum(t[m_key] for t in used), sum(t[r_key] for t in used)
        if used and r > 0:
            values[key] = max(0.0, m / r)
        detail[key] = {"method": "ratio of sums", "measured_sum_s": m, "raw_sum_s": r, "reports": len(used),
                       "value": values[key], "fitted": bool(used and r > 0)}
    return Coefficients.from_dict(values), detail


def save_coefficients(coef, path: str | os.PathLike, detail: dict | None = None,
                      sources: list[str] | None = None) -> Path:
    """Write a coefficients document atomically."""
    body = {"created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "method": "nnls on the CPU path, ratio of sums for dense and GPU terms (docs/calibration.md)",
            "coefficients": coef.to_dict(), "detail": detail or {}, "fitted_from": list(sources or [])}
    return write_document(path, KIND, SCHEMA_VERSION, body)


def load_coefficients(path: str | os.PathLike):
    """Read a coefficients document -> :class:`~colibri_plan.planner.costmodel.Coefficients`.

    Raises:
        InputError: missing file, unknown or negative coefficients. FormatError: bad document.
    """
    from colibri_plan.planner.costmodel import Coefficients

    doc = read_document(path, KIND, SCHEMA_VERSION)
    c = doc.get("coefficients")
    if not isinstance(c, dict):
        raise FormatError(f"{path}: no 'coefficients' object; re-create it with `colibri-plan calibrate`")
    try:
        return Coefficients.from_dict(c)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{path}: bad coefficient values ({exc}); re-create it") from exc
