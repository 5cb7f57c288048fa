"""`calibrate`: the fit recovers known coefficients from synthetic verify reports (checkable by hand)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.coefficients import Coefficients, load_coefficients, save_coefficients
from colibri_plan.formats.report import save_report
from colibri_plan.planner.calibrate import fit_coefficients


def _report(raw: dict, true: dict, old: dict | None = None, layers: int = 3, device: bool = False) -> dict:
    """A verify report whose measured times are exactly ``true`` coefficients x raw roofline seconds and whose
    predictions were made with coefficients ``old``. With ``device``: a GPU ran 0.1 raw seconds."""
    old = old or {}
    c = {k: old.get(k, 1.0) for k in ("dense", "cpu_expert", "disk", "gpu_expert")}
    meas_cpu, meas_disk = true["cpu_expert"] * raw["cpu"], true["disk"] * raw["disk"]
    comp = {"cpu": c["cpu_expert"] * raw["cpu"]}
    dev = {}
    if device:
        comp["cuda:0"] = c["gpu_expert"] * 0.1
        dev["cuda:0"] = true.get("gpu_expert", 1.0) * 0.1 + 0.002     # + the predicted transfer time
    pred_total = c["dense"] * raw["dense"] + comp["cpu"] + c["disk"] * raw["disk"]
    return {
        "plan": {"coefficients": old or None, "n_decode_layers": layers},
        "predicted": {"decode_s_per_token": pred_total, "tok_s": 1 / pred_total,
                      "terms": {"dense_s": c["dense"] * raw["dense"], "attention_s": 0.01,
                                "expert_compute_s": comp, "disk_wait_s": c["disk"] * raw["disk"],
                                "transfer_s": 0.002 if device else 0.0}},
        "measured": {"decode_s_per_token": 1.0, "tok_s": 1.0,
                     "terms": {"dense_s": true["dense"] * raw["dense"] + 0.01,
                               # the wall time of the CPU path; its split between timers must not matter
                               "expert_compute_s": {"cpu": meas_cpu + 0.5 * meas_disk, **dev},
                               "disk_wait_s": 0.5 * meas_disk, "expert_layers_s": meas_cpu + meas_disk}},
        "verdict": {}}


TRUE = {"dense": 1.5, "cpu_expert": 2.0, "disk": 0.5}


def test_recovers_known_coefficients_by_hand():
    # A streams nothing: 0.2 s raw CPU measured 0.4 s -> c_cpu 2.0; B adds 0.3 s raw disk and measures
    # 0.55 s -> c_disk (0.55 - 0.4) / 0.3 = 0.5; dense 0.1 s raw measured 0.15 s (twice) -> 1.5
    a = _report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, TRUE)
    b = _report({"dense": 0.1, "cpu": 0.2, "disk": 0.3}, TRUE)
    assert b["measured"]["terms"]["expert_layers_s"] == pytest.approx(0.55)
    c, detail = fit_coefficients([a, b])
    assert (c.dense, c.cpu_expert, c.disk) == pytest.approx((1.5, 2.0, 0.5))
    assert detail["cpu_path"]["residual_s"] == pytest.approx(0.0, abs=1e-12)
    assert detail["dense"]["measured_sum_s"] == pytest.approx(0.3) and detail["dense"]["raw_sum_s"] == 0.2
    # no device in any report: gpu_expert keeps its base value and says so
    assert c.gpu_expert == 1.0 and detail["gpu_expert"]["fitted"] is False


def test_old_coefficients_are_divided_out():
    # A was predicted with c_cpu = 4 (predicted 0.4 s, raw 0.1 s) and measured 0.2 s: still c_cpu = 2.0
    a = _report({"dense": 0.1, "cpu": 0.1, "disk": 0.0}, TRUE, old={"cpu_expert": 4.0, "disk": 3.0})
    assert a["predicted"]["terms"]["expert_compute_s"]["cpu"] == pytest.approx(0.4)
    b = _report({"dense": 0.1, "cpu": 0.3, "disk": 0.2}, TRUE, old={"disk": 3.0})
    c, _ = fit_coefficients([a, b])
    assert (c.cpu_expert, c.disk) == pytest.approx((2.0, 0.5))


def test_least_squares_over_noisy_reports():
    # three reports, measured CPU path 0.41, 0.55, 0.74 s for raw (cpu, disk) (0.2, 0), (0.2, 0.3),
    # (0.3, 0.3): min |A c - y| gives c_cpu, c_disk; checked against numpy's lstsq
    raws = ((0.2, 0), (0.2, 0.3), (0.3, 0.3))
    reps = [_report({"dense": 0.1, "cpu": cc, "disk": dd}, TRUE) for cc, dd in raws]
    for r, y in zip(reps, (0.41, 0.55, 0.74)):
        r["measured"]["terms"]["expert_layers_s"] = y
    c, _ = fit_coefficients(reps)
    want = np.linalg.lstsq(np.array(raws), np.array([0.41, 0.55, 0.74]), rcond=None)[0]
    assert want.min() > 0          # the unconstrained optimum is feasible, so nnls must find it
    assert (c.cpu_expert, c.disk) == pytest.approx(tuple(want))


def test_gpu_ratio_and_cpu_path_with_devices():
    true = {**TRUE, "gpu_expert": 0.8}
    c, detail = fit_coefficients([_report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, true, device=True),
                                  _report({"dense": 0.1, "cpu": 0.2, "disk": 0.3}, true, device=True)])
    assert c.gpu_expert == pytest.approx(0.8) and detail["gpu_expert"]["fitted"]
    assert (c.cpu_expert, c.disk) == pytest.approx((2.0, 0.5))   # from CPU compute + disk wait


def _with_calls(report: dict, calls: float, call_s: float) -> dict:
    """The report's plan counted ``calls`` GPU layer calls per token, and each took ``call_s`` more."""
    report["predicted"]["terms"]["gpu_calls"] = calls
    report["measured"]["terms"]["expert_compute_s"]["cuda:0"] += calls * call_s
    return report


def test_gpu_time_beyond_the_kernel_rate_is_per_call_overhead():
    # raw GPU 0.1 s per token, measured 0.1 + 3 calls x 0.02 s (+ the 0.002 s of predicted transfers)
    reps = [_with_calls(_report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, TRUE, device=True), 3, 0.02)
            for _ in range(2)]
    c, detail = fit_coefficients(reps)
    assert c.gpu_call_s == pytest.approx(0.02) and c.gpu_expert == 1.0
    assert detail["gpu_call_s"]["calls_sum"] == pytest.approx(6.0) and not detail["gpu_expert"]["fitted"]
    # a plan made with that overhead predicts it inside transfer_s: refitting its own report changes nothing
    rep = _report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, TRUE, old={"gpu_call_s": 0.02}, device=True)
    rep = _with_calls(rep, 3, 0.02)
    rep["predicted"]["terms"]["transfer_s"] += 3 * 0.02
    c2, _ = fit_coefficients([rep])
    assert c2.gpu_call_s == pytest.approx(0.02) and c2.gpu_expert == 1.0


def test_gpu_faster_than_profiled_scales_the_rate_not_the_calls():
    true = {**TRUE, "gpu_expert": 0.8}
    reps = [_with_calls(_report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, true, device=True), 3, 0.0)]
    c, detail = fit_coefficients(reps)
    assert c.gpu_expert == pytest.approx(0.8) and c.gpu_call_s == 0.0 and "gpu_call_s" not in detail


def test_base_coefficients_are_kept_where_there_is_no_data():
    base = Coefficients(disk=0.7, transfer=1.3)
    c, detail = fit_coefficients([_report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, TRUE)], base=base)
    assert c.disk == 0.7 and c.transfer == 1.3 and c.cpu_expert == pytest.approx(2.0)
    assert detail["disk"]["fitted"] is False


def test_round_trip_and_cli(tmp_path):
    paths = []
    raws = ({"dense": 0.1, "cpu": 0.2, "disk": 0.3}, {"dense": 0.2, "cpu": 0.1, "disk": 0.0})
    for i, raw in enumerate(raws):
        paths.append(str(save_report(_report(raw, TRUE), tmp_path / f"r{i}.json")))
    out = tmp_path / "coef.json"
    res = CliRunner().invoke(cli, ["calibrate", *paths, "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["coefficients"]["cpu_expert"] == pytest.approx(2.0)
    c = load_coefficients(out)
    assert (c.dense, c.cpu_expert, c.disk) == pytest.approx((1.5, 2.0, 0.5))
    save_coefficients(Coefficients(disk=3.0), tmp_path / "c2.json")
    assert load_coefficients(tmp_path / "c2.json").disk == 3.0


def test_bad_inputs():
    with pytest.raises(InputError, match="at least one"):
        fit_coefficients([])
    rep = _report({"dense": 0.1, "cpu": 0.2, "disk": 0.3}, TRUE)
    rep["measured"]["terms"]["expert_layers_s"] = "fast"
    with pytest.raises(FormatError, match="expert_layers_s"):
        fit_coefficients([rep], names=["r.json"])
    with pytest.raises(FormatError, match="not a verify report"):
        fit_coefficients([{"plan": {}}])


def test_bad_coefficients_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"kind": "coefficients", "schema_version": 1, "coefficients": {"warp": 2}}))
    with pytest.raises(InputError, match="unknown cost coefficient"):
        load_coefficients(p)
    p.write_text(json.dumps({"kind": "coefficients", "schema_version": 1, "coefficients": {"disk": -1}}))
    with pytest.raises(InputError, match=">= 0"):
        load_coefficients(p)


def test_fit_uses_the_overlapped_cpu_path_per_layer():
    # Plans record the CPU path's parts per layer; the path is max(c_cpu resident, c_disk disk) + c_cpu
    # stream. A (all resident, raw 0.2 s) measured 0.4 s -> c_cpu 2.0. B (one layer: resident 0.05 s,
    # stream 0.05 s, disk 0.6 s raw) measured 0.4 s: the read hides the resident compute, so
    # 0.4 = c_disk 0.6 + 2.0 x 0.05 -> c_disk 0.5 (the additive form would give (0.4 - 0.2) / 0.6 = 0.33)
    a = _report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, TRUE)
    a["predicted"]["cpu_path_layers"] = {"weight": [1, 1], "cpu_resident_s": [0.1, 0.1],
                                         "cpu_stream_s": [0.0, 0.0], "disk_s": [0.0, 0.0]}
    b = _report({"dense": 0.1, "cpu": 0.1, "disk": 0.6}, TRUE, old={"disk": 2.0})
    b["predicted"]["cpu_path_layers"] = {"weight": [1.0], "cpu_resident_s": [0.05], "cpu_stream_s": [0.05],
                                         "disk_s": [1.2]}              # predicted with c_disk 2: raw 0.6
    b["measured"]["terms"]["expert_layers_s"] = 0.4
    c, detail = fit_coefficients([a, b])
    assert (c.cpu_expert, c.disk) == pytest.approx((2.0, 0.5), rel=1e-4)
    assert detail["cpu_path"]["residual_s"] == pytest.approx(0.0, abs=1e-6)


def test_cpu_path_with_checksum_column_by_hand():
    from colibri_plan.planner.calibrate import cpu_path_seconds

    # one layer: resident 0.1, stream 0.05, disk 0.3 raw s, checks 0.2 s; c_cpu 2, c_disk 0.5:
    # max(2 * 0.1 + 0.2, 0.5 * 0.3) + 2 * 0.05 = 0.4 + 0.1
    layers = np.array([[1.0, 0.1, 0.05, 0.3, 0.2]])
    assert cpu_path_seconds(layers, 2.0, 0.5) == pytest.approx(0.5)
    assert cpu_path_seconds(layers, 2.0, 2.0) == pytest.approx(0.6 + 0.1)    # now the disk is slower


def test_overlap_is_fitted_from_a_report_with_both_compute_and_reads():
    # A: all resident (raw 0.2 s) measured 0.4 -> c_cpu 2. B: only reads (disk raw 0.6 s) measured 0.3 ->
    # c_disk 0.5. C: resident 0.1 s raw (0.2 s at c_cpu 2) and disk 0.8 s raw (0.4 s), no stream; with
    # overlap o: max(0.2, 0.4) + (1 - o) 0.2 = 0.5 measured -> o = 0.5
    def with_layers(rep, res, disk, wall):
        rep["predicted"]["cpu_path_layers"] = {"weight": [1.0], "cpu_resident_s": [res],
                                               "cpu_stream_s": [0.0], "disk_s": [disk], "verify_s": [0.0]}
        rep["measured"]["terms"]["expert_layers_s"] = wall
        return rep

    a = with_layers(_report({"dense": 0.1, "cpu": 0.2, "disk": 0.0}, TRUE), 0.2, 0.0, 0.4)
    b = with_layers(_report({"dense": 0.1, "cpu": 0.0, "disk": 0.6}, TRUE), 0.0, 0.6, 0.3)
    c = with_layers(_report({"dense": 0.1, "cpu": 0.1, "disk": 0.8}, TRUE), 0.1, 0.8, 0.5)
    coef, detail = fit_coefficients([a, b, c])
    assert (coef.cpu_expert, coef.disk, coef.overlap) == pytest.approx((2.0, 0.5, 0.5), rel=1e-4)
    assert detail["overlap"]["fitted"]
    # with A and B alone nothing tells how much hides: overlap keeps its base value
    coef2, detail2 = fit_coefficients([a, b])
    assert coef2.overlap == 1.0 and not detail2["overlap"]["fitted"]
