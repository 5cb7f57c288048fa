"""Refit the cost model's per-term coefficients from verify reports (``colibri-plan calibrate``).

Method (docs/calibration.md). Reports are read through :class:`colibri_plan.formats.report.RunReport`:
predicted and measured carry the plan's keys. Each report holds the plan's predicted terms, made with
coefficients ``c_old`` (recorded in the plan; 1.0 when absent), and the measured terms. The *raw*
roofline of a term is ``predicted / c_old``.

* ``cpu_expert`` and ``disk`` — least squares on the CPU path's time per token. In the cost model a
  layer's CPU path costs ``max(c_cpu · resident_raw + verify, c_disk · disk_raw) + c_cpu · stream_raw``
  (reads overlap the compute of resident experts, which shares the cores with the reads' crc32 checks,
  ``verify``, measured by the profile and not refitted; streamed experts are computed after their
  reads), so over the reports

      measured CPU-path s ≈ Σ_l w_l · (max(c_cpu · resident_l + verify_l, c_disk · disk_l) + c_cpu · stream_l)

  with the per-layer raw parts from the plan's ``predicted.cpu_path_layers``. This is piecewise linear in
  the two coefficients: it is minimised by bounded least squares (``scipy.optimize.least_squares``, c >= 0)
  started from the additive fit (nnls with the max replaced by the sum) and from the resident compute
  fully hidden (max replaced by the disk term), keeping the better. A report without
  ``cpu_path_layers`` (plans made before it existed) counts as one layer with no overlap: resident 0,
  stream = its CPU compute, disk = its disk term. The measured CPU-path time is the wall time inside
  the expert provider for runs without devices, and CPU compute + disk wait for runs with devices.
  Fitting the path's total, not each timer apart, makes ``c_disk`` carry everything streaming costs the
  CPU path (reads competing with compute, checksums, cache-cold weights). A coefficient whose raw
  column is zero in every report (e.g. no report streams) keeps its base value.
* ``dense`` — ratio of sums: Σ (measured dense − predicted attention) / Σ raw dense.
* ``gpu_call_s`` and ``gpu_expert`` — GPU time beyond the transfers: when the reports measure more device
  time than ``c_gpu`` (base) × the raw kernel time and their plans count their GPU layer calls
  (``predicted.terms.gpu_calls``), the excess is the host's per-layer call, ``gpu_call_s`` = Σ (device
  seconds − predicted transfers − c_gpu · raw device seconds) / Σ calls, and ``c_gpu`` keeps its base:
  on an H200 host a layer's call took 0.49 ms for 3.8 experts and 0.40 ms for 7.7 (the kernels are ~10%
  of it), so scaling the per-byte rate instead (the earlier fit, 3.8×) made the solver move hot experts
  off the GPU and cost 12% tok/s. Otherwise (faster than the profile, or older plans) ``c_gpu`` = Σ
  (device seconds − predicted transfers) / Σ raw device seconds.

``attention``, ``transfer`` and ``layer_overhead_s`` are not identified by these runs and keep their base
values (the base ``layer_overhead_s`` × MoE layers is taken out of the measured CPU-path time first).
The result is a JSON document kind ``"coefficients"`` (schema_version 1); ``solve --coefficients FILE`` uses
it, and a plan records the coefficients it was made with. Nothing reads it implicitly.
"""

from __future__ import annotations

import numpy as np

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats import fields
from colibri_plan.formats.fields import At

#: largest figure a report may hold (seconds per token, layers or calls per token): beyond it the
#: report is corrupt, and one such figure would swamp the least-squares fit
MAX_REPORT_FIGURE = 1e6
#: reports whose CPU/disk design rows are this close to proportional (smallest singular value of the
#: column-scaled design over the largest) cannot tell c_cpu from c_disk: both keep their base values
COLLINEAR_TOL = 1e-2


def _num(d: dict, key: str, where: str, section: str = "") -> float:
    """``d[key]`` as seconds (0.0 when absent or null). Raises FormatError naming ``where`` and the
    field's path (``section.key``) unless it is a finite number in 0..:data:`MAX_REPORT_FIGURE`."""
    at = At(where, "re-run `colibri-plan verify` to get a clean report", repr_values=True)
    v = fields.number(d, key, at / section if section else at, lo=0, hi=MAX_REPORT_FIGURE, optional=True)
    return 0.0 if v is None else float(v)


def report_terms(report: dict, where: str = "report") -> dict:
    """The raw predicted and measured seconds per token of one verify report that calibration uses.

    Both sections are read through :class:`colibri_plan.formats.report.RunReport` (one vocabulary: the
    plan's keys), which checks every figure.

    Returns:
        {"cpu_raw", "disk_raw", "layers" (float ``[rows, 5]``: weight, resident, stream, disk raw seconds,
        checksum seconds),
        "n_layers", "cpu_path_s", "dense_raw", "dense_s", "gpu_raw", "gpu_s", "devices": bool}.

    Raises:
        FormatError: a needed figure is missing or not a number (names the report and field).
    """
    from colibri_plan.formats.coefficients import Coefficients
    from colibri_plan.formats.report import RunReport

    if not isinstance(report, dict) or not all(isinstance(report.get(k), dict)
                                                for k in ("predicted", "measured")):
        raise FormatError(f"{where}: not a verify report (predicted and measured sections missing); "
                          "re-run `colibri-plan verify`")
    pred = RunReport.from_dict(report["predicted"], where, "predicted")
    meas = RunReport.from_dict(report["measured"], where, "measured")
    try:
        old = Coefficients.from_dict((report.get("plan") or {}).get("coefficients"),
                                     where=f"{where}: plan.coefficients")
    except InputError as exc:
        raise FormatError(str(exc)) from None

    def raw(v: float, c: float) -> float:
        return v / c if c > 0 else 0.0

    pc, mc = pred.expert_compute_s_per_token, meas.expert_compute_s_per_token
    gpu_pred = sum(v for k, v in pc.items() if k != "cpu")
    gpu_meas = sum(v for k, v in mc.items() if k != "cpu")
    devices = gpu_pred > 0 or gpu_meas > 0
    cpu_path = (mc.get("cpu", 0.0) + (meas.disk_wait_s_per_token or 0.0) if devices
                else meas.expert_layers_s_per_token or 0.0)
    n_layers = _num(report.get("plan") or {}, "n_decode_layers", where, "plan")
    calls = pred.gpu_calls_per_token or 0.0   # 0 in plans made before the term existed
    cpu_raw = raw(pc.get("cpu", 0.0), old.cpu_expert)
    parts = pred.cpu_path_layers
    if isinstance(parts, dict) and parts.get("disk_s") is not None:
        try:
            col = lambda k: np.asarray(parts[k], dtype=np.float64)   # noqa: E731
            c_cpu, c_disk = max(old.cpu_expert, 1e-300), max(old.disk, 1e-300)
            verify = col("verify_s") if parts.get("verify_s") is not None else 0.0 * col("weight")
            layers = np.stack([col("weight"), col("cpu_resident_s") / c_cpu, col("cpu_stream_s") / c_cpu,
                               col("disk_s") / c_disk, verify], axis=1)
            if layers.ndim != 2 or not np.all(np.isfinite(layers)) or np.any(layers < 0):
                raise ValueError("its figures must be finite numbers >= 0 in lists of one length")
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: predicted.cpu_path_layers is malformed ({exc}); re-solve the "
                              "plan and re-run `colibri-plan verify`") from exc
        if old.cpu_expert <= 0:
            layers[:, 1:3] = 0.0
        if old.disk <= 0:
            layers[:, 3] = 0.0
        disk_raw = float(np.sum(layers[:, 0] * layers[:, 3]))
        older = False
    else:   # an older plan: no per-layer parts, so no overlap is known
        older = True
        disk_raw = raw(pred.disk_wait_s_per_token or 0.0, old.disk)
        layers = np.array([[1.0, 0.0, cpu_raw, disk_raw, 0.0]])
    attention = pred.attention_s_per_token or 0.0
    return {"cpu_raw": cpu_raw, "n_layers": n_layers, "disk_raw": disk_raw,
            # [rows, 5]: weight, resident, stream, disk (raw seconds per token), checksums (seconds, fixed)
            "layers": layers,
            "cpu_path_s": cpu_path,
            "dense_raw": raw(pred.dense_s_per_token or 0.0, old.dense),
            # a run's dense time includes attention (not timed apart): take the predicted share out
            "dense_s": (meas.dense_s_per_token or 0.0) + (meas.attention_s_per_token or 0.0) - attention,
            "gpu_raw": raw(gpu_pred, old.gpu_expert),
            # measured device time less the predicted transfers (the old call overhead taken out of them)
            "gpu_s": gpu_meas - ((pred.transfer_s_per_token or 0.0) - old.gpu_call_s * calls),
            "gpu_calls": calls,
            "devices": devices,
            "older_plan": older}


def cpu_path_seconds(layers: np.ndarray, c_cpu: float, c_disk: float, overlap: float = 1.0) -> float:
    """Σ_l w_l · :func:`colibri_plan.planner.costmodel.cpu_path_seconds` of the layer's parts scaled by
    these coefficients (resident and stream x c_cpu, disk x c_disk, checksums fixed), for ``layers``
    ``[rows, 5]`` (weight, resident, stream, disk raw seconds, checksum seconds): the model calibrate
    fits, the cost model's CPU path itself."""
    from colibri_plan.planner import costmodel

    w, res, stream, disk, verify = layers.T
    return float(np.sum(w * costmodel.cpu_path_seconds(c_cpu * res, c_cpu * stream, c_disk * disk, verify,
                                                       overlap)))


def _fit_cpu_path(terms: list[dict], y: np.ndarray, base) -> tuple[dict, float, list]:
    """(c_cpu, c_disk, overlap) minimising Σ (cpu_path_seconds - y)^2; columns without data keep base
    values, and ``overlap`` is fitted only when more reports than the other free coefficients have both
    CPU work and reads in some layer (it is not identified otherwise)."""
    from scipy.optimize import least_squares, nnls

    has_cpu = any(np.any(t["layers"][:, 1:3] > 0) for t in terms)
    has_disk = any(np.any(t["layers"][:, 3] > 0) for t in terms)
    both = sum(bool(np.any((t["layers"][:, 1] + t["layers"][:, 4] > 0) & (t["layers"][:, 3] > 0)))
               for t in terms)
    x0 = np.array([base.cpu_expert, base.disk, base.overlap], dtype=np.float64)
    free = [j for j, ok in enumerate((has_cpu, has_disk)) if ok]
    if len(free) == 2 and design_rank(terms) < 2:   # one report, or the same shares: not identified
        return {"cpu_expert": x0[0], "disk": x0[1], "overlap": x0[2]}, 0.0, [], True
    if both and len(terms) > len(free):
        free.append(2)
    if not free:
        return {"cpu_expert": x0[0], "disk": x0[1], "overlap": x0[2]}, 0.0, [], False

    def model(v: np.ndarray) -> np.ndarray:
        x = x0.copy()
        x[free] = v
        return np.array([cpu_path_seconds(t["layers"], *x) for t in terms]) - y

    # starts: the additive form (max -> sum) and the fully hidden form (max -> disk), both nnls, at
    # overlap 0 and 1 where it is free
    starts = []
    two = [j for j in free if j < 2]
    for hide in (False, True):
        cols = np.array([[np.sum(w * (stream + (0 if hide else res))), np.sum(w * disk)]
                         for w, res, stream, disk, _ in (t["layers"].T for t in terms)])
        fixed = 0.0 if hide else np.array([np.sum(t["layers"][:, 0] * t["layers"][:, 4]) for t in terms])
        yy = y - fixed - sum(cols[:, j] * x0[j] for j in range(2) if j not in free)
        s0 = np.maximum(nnls(cols[:, two], yy)[0], 1e-9) if two else np.zeros(0)
        starts.append(np.append(s0, 1.0 if hide else 0.0) if 2 in free else s0)
    hi = [np.inf if j < 2 else 1.0 for j in free]
    best = None
    for s0 in starts:
        r = least_squares(model, np.minimum(s0, hi), bounds=(0.0, hi), method="trf")
        if best is None or r.cost < best.cost:
            best = r
    x = x0.copy()
    x[free] = best.x
    return ({"cpu_expert": float(x[0]), "disk": float(x[1]), "overlap": float(x[2])},
            float(np.sqrt(2 * best.cost)), free, False)


def design_rank(terms: list[dict]) -> int:
    """Numerical rank of the CPU path's design matrix over the reports: one row per report, columns its
    raw CPU seconds (resident + stream) and raw disk seconds (weighted over layers), each column scaled to
    unit length; singular values under :data:`COLLINEAR_TOL` of the largest do not count. Reports of one
    placement (or of placements with the same CPU/disk shares) give proportional rows: rank 1."""
    a = np.array([[np.sum(w * (res + stream)), np.sum(w * disk)]
                  for w, res, stream, disk, _ in (t["layers"].T for t in terms)], dtype=np.float64)
    norms = np.linalg.norm(a, axis=0)
    a = a / np.where(norms > 0, norms, 1.0)
    sv = np.linalg.svd(a, compute_uv=False)
    return int(np.sum(sv > COLLINEAR_TOL * sv[0])) if sv.size and sv[0] > 0 else 0


def _fingerprint_of(report: dict, section: str) -> str | None:
    v = report.get(section)
    v = v.get("fingerprint") if isinstance(v, dict) else None
    return v if isinstance(v, str) and v else None


def check_sources(reports: list[dict], names: list[str]) -> tuple[list[str], list[str]]:
    """Check the reports belong in one fit.

    Returns:
        (machine fingerprints the reports were measured on, sorted; warnings: reports from several
        machines, the same report given twice).

    Raises:
        InputError: the reports come from different models (``model.fingerprint``): a fit over them mixes
        unrelated expert sizes and routing.
    """
    from colibri_plan.fileio import fingerprint

    by_model: dict[str, list[str]] = {}
    for r, n in zip(reports, names):
        fp = _fingerprint_of(r, "model")
        if fp:
            by_model.setdefault(fp, []).append(n)
    if len(by_model) > 1:
        parts = "; ".join(f"model {fp}: {', '.join(ns)}" for fp, ns in sorted(by_model.items()))
        raise InputError(f"calibrate: the reports come from different models ({parts}); calibrate each "
                         "model's reports on their own")
    warnings = []
    machines = sorted({m for m in (_fingerprint_of(r, "machine") for r in reports) if m})
    if len(machines) > 1:
        warnings.append(f"the reports were measured on {len(machines)} different machines "
                        f"({', '.join(machines)}): the coefficients average them; calibrate each machine's "
                        "reports on their own for its plans")
    seen: dict[str, str] = {}
    for r, n in zip(reports, names):
        try:
            key = fingerprint(r)
        except (TypeError, ValueError):
            continue
        if key in seen:
            warnings.append(f"{n} is the same report as {seen[key]}: it counts twice in the fit; "
                            "give each report once")
        seen.setdefault(key, n)
    return machines, warnings


def fit_coefficients(reports: list[dict], base=None, names: list[str] | None = None) -> tuple:
    """Fit the coefficients (module docstring) over ``reports``.

    Args:
        base: Coefficients to start from (terms without data keep these values; default all 1.0).
        names: labels of the reports for error messages.

    Returns:
        (Coefficients, detail) — detail per fitted term: method, the sums or the residual, "fitted";
        detail["machine_fingerprints"] (the machines the reports were measured on) and
        detail["warnings"] (a fit the reports cannot determine, a coefficient fitted to 0, mixed
        machines, a report given twice: for the caller to show).

    Raises:
        InputError: no reports, or reports of different models. FormatError: a malformed report.
    """
    from colibri_plan.formats.coefficients import Coefficients

    if not reports:
        raise InputError("calibrate needs at least one verify report")
    base = base or Coefficients()
    names = names or [f"report {i}" for i in range(len(reports))]
    terms = [report_terms(r, n) for r, n in zip(reports, names)]
    machines, warnings = check_sources(reports, names)
    for n, t in zip(names, terms):
        if t["older_plan"]:
            warnings.append(f"{n}: its plan predates per-layer CPU-path parts (no "
                            "predicted.cpu_path_layers); the older additive form (one layer, no overlap) "
                            "is used for it")
    values = base.to_dict()
    detail: dict = {}
    # CPU path: least squares of the piecewise-linear path on the columns that carry information
    # (the fixed per-layer overhead keeps its base value: take it out of the measured path time first)
    y = np.array([t["cpu_path_s"] - t["n_layers"] * base.layer_overhead_s for t in terms], dtype=np.float64)
    fitted, resid, live, undetermined = _fit_cpu_path(terms, y, base)
    values.update(fitted)
    if live:
        detail["cpu_path"] = {"method": "least squares: measured CPU-path s ~ sum_l w_l (max(a_l, d_l) + "
                                        "(1 - c_overlap) min(a_l, d_l) + c_cpu stream_l), a_l = c_cpu "
                                        "resident_l + checks_l, d_l = c_disk disk_l",
                              "reports": len(terms), "residual_s": resid, "measured_s": y.tolist(),
                              "raw_cpu_s": [t["cpu_raw"] for t in terms],
                              "raw_disk_s": [t["disk_raw"] for t in terms]}
    for k, col in (("cpu_expert", 0), ("disk", 1), ("overlap", 2)):
        detail[k] = {"value": values[k], "fitted": col in live}
    for key, m_key, r_key in (("dense", "dense_s", "dense_raw"), ("gpu_expert", "gpu_s", "gpu_raw")):
        used = [t for t in terms if t[r_key] > 0]
        m, r = sum(t[m_key] for t in used), sum(t[r_key] for t in used)
        calls = sum(t.get("gpu_calls", 0.0) for t in used) if key == "gpu_expert" else 0.0
        if used and r > 0 and calls > 0 and m > base.gpu_expert * r:
            # device time beyond the profiled kernel rate is the host's per-layer call, not a slower rate
            values["gpu_call_s"] = (m - base.gpu_expert * r) / calls
            detail["gpu_call_s"] = {"method": "(measured - c_gpu raw) / GPU layer calls, sums over reports",
                                    "measured_sum_s": m, "raw_sum_s": r, "calls_sum": calls,
                                    "value": values["gpu_call_s"], "fitted": True}
        elif used and r > 0:
            values[key] = max(0.0, m / r)
        detail[key] = {"method": "ratio of sums", "measured_sum_s": m, "raw_sum_s": r, "reports": len(used),
                       "value": values[key], "fitted": bool(used and r > 0) and "gpu_call_s" not in detail}
    if undetermined:
        warnings.append(f"the CPU path's coefficients (cpu_expert, disk) cannot be fitted from these "
                        f"{len(terms)} report(s): their placements have the same CPU and disk shares (one "
                        "report cannot tell them apart, nor can runs of one plan); both keep their base "
                        f"values ({base.cpu_expert:g}, {base.disk:g}); verify plans with different disk "
                        "shares (e.g. solve with a smaller --ram) and calibrate over all the reports")
    zero = [k for k in ("cpu_expert", "disk", "dense", "gpu_expert", "gpu_call_s")
            if detail.get(k, {}).get("fitted") and values[k] == 0]
    if zero:
        warnings.append(f"{', '.join(zero)} fitted to 0: the reports do not determine "
                        f"{'it' if len(zero) == 1 else 'them'} (plans solved with these coefficients would "
                        "treat that time as free); add reports that exercise it, or start from --base")
    detail["machine_fingerprints"] = machines
    detail["warnings"] = warnings
    try:
        return Coefficients.from_dict(values, where="fitted coefficients"), detail
    except InputError as exc:
        raise InputError(f"{exc} (from reports {', '.join(names)}): the reports do not determine the "
                         "coefficients; check them or start from --base") from None
