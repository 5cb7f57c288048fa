"""Hand-edited input files and options fail with one typed line (file, field, what to do), not a traceback.

Each bad file is built from a good one (a plan solved on a toy profile, a saved verify report, a
calibrated coefficients file) by changing one field, the way a user editing it by hand would.
"""

import json
import math

import pytest
from _reports import toy_report
from _solver_fixtures import toy_profile, toy_spec
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.cli.common import to_json
from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.coefficients import Coefficients, load_coefficients, save_coefficients
from colibri_plan.formats.plan import load_plan, save_plan
from colibri_plan.formats.profile import load_profile, save_profile
from colibri_plan.model import save_model_spec
from colibri_plan.planner.calibrate import fit_coefficients
from colibri_plan.planner.costmodel import GpuResource, Resources
from colibri_plan.planner.make import make_plan
from colibri_plan.verify import save_report

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A folder with a toy profile, model spec and a plan solved from them (and the plan's document)."""
    d = tmp_path_factory.mktemp("good")
    prof = toy_profile(gpus=[GPU], ram_available_bytes=3 * 10**9)
    save_profile(prof, d / "profile.json")
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)
    save_model_spec(spec, d / "model.json")
    plan, _, _ = make_plan(prof, spec, None, ram="0.58", context_tokens=100)
    save_plan(plan, d / "plan.json")
    return d, json.loads((d / "plan.json").read_text()), prof


def cli_run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def edited(tmp_path, doc: dict, path: str, value, name: str = "bad.json"):
    """A copy of ``doc`` with the dotted ``path`` set to ``value`` (None deletes nothing: it writes null),
    written as JSON (NaN / Infinity as the bare words Python's json writes)."""
    doc = json.loads(json.dumps(doc))
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[int(last) if isinstance(node, list) else last] = value
    f = tmp_path / name
    f.write_text(json.dumps(doc))
    return f


def assert_one_line(res, *parts):
    """The command failed with exit 1 and one line on stderr that holds every part (no traceback)."""
    assert res.exit_code == 1, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for p in parts:
        assert p in lines[0], (p, lines[0])


# ---- 1. plans ----------------------------------------------------------------------------------
PLAN_CASES = [
    ("budgets", None, "budgets must be an object"),
    ("devices", [1, 2], "devices[0] must be an object"),
    ("budgets.ram_budget_bytes", math.inf, "budgets.ram_budget_bytes must be a finite number"),
    ("budgets.vram_budget_bytes.cuda:0", "big", "budgets.vram_budget_bytes.cuda:0 must be a finite"),
    ("predicted", {}, "predicted.tok_s is missing"),
    ("predicted", None, "predicted must be an object"),
    ("predicted.tok_s", "fast", "predicted.tok_s must be a finite number"),
    ("predicted.tok_s", math.nan, "predicted.tok_s must be a finite number"),
    ("predicted.terms.dense_s", -1.0, "predicted.terms.dense_s must be a finite number >= 0"),
    ("predicted.hit_rate.lru", 1.5, "predicted.hit_rate.lru must be a finite number in 0..1"),
    ("profile", None, "profile must be an object"),
    ("solver", None, "solver must be an object"),
    ("solver.seconds", "slow", "solver.seconds must be a finite number"),
    ("resources.disk_queue_depth", math.nan, "resources.disk_queue_depth must be a whole number in 1..64"),
    ("resources.disk_queue_depth", math.inf, "resources.disk_queue_depth must be a whole number in 1..64"),
    ("resources.disk_queue_depth", 0, "resources.disk_queue_depth must be a whole number in 1..64"),
    ("model.expert_bytes", -5, "model.expert_bytes must be a whole number >= 1"),
    ("heat", None, "heat must be an object"),
    ("coefficients.disk", True, "coefficients: disk must be a finite number >= 0"),
    ("coefficients", "x", "coefficients must be an object"),
]


@pytest.mark.parametrize("path, value, message", PLAN_CASES,
                         ids=[c[0] + "=" + repr(c[1]) for c in PLAN_CASES])
def test_bad_plan_field_is_a_format_error(tmp_path, good, path, value, message):
    _, doc, _ = good
    f = edited(tmp_path, doc, path, value)
    with pytest.raises(FormatError) as err:
        load_plan(f)
    text = str(err.value)
    assert message in text and str(f) in text and "colibri-plan solve" in text
    for command in (["plan", "show", f], ["plan", "show", f, "--json"],
                    ["export", f, "--to", "colibri", "--out", tmp_path / "x.env"]):
        assert_one_line(cli_run(*command), str(f), message)


def test_good_plan_still_loads_and_reads_its_queue_depth(good):
    d, doc, _ = good
    plan = load_plan(d / "plan.json")
    assert plan.read_threads == doc["resources"]["disk_queue_depth"] >= 1
    r = cli_run("plan", "show", d / "plan.json", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["predicted"]["tok_s"] == doc["predicted"]["tok_s"]


def test_verify_and_run_refuse_a_bad_plan_before_any_work(tmp_path, good):
    _, doc, _ = good
    f = edited(tmp_path, doc, "predicted.terms", None)
    # verify: no pack at all, the plan must be refused before anything looks for one
    assert_one_line(cli_run("verify", "--plan", f, "--model", tmp_path / "no-pack"), str(f),
                    "predicted.terms must be an object")
    # run: a tiny pack (of another model: the plan is refused before it is even compared with it)
    assert cli_run("model", "fixture", tmp_path / "pack", "--small", "--layers", "2", "--experts", "8",
                   "--top-k", "2").exit_code == 0
    r = cli_run("run", "--model", tmp_path / "pack", "--plan", f, "--prompt-ids", "1,2", "--tokens", "2")
    assert_one_line(r, str(f), "predicted.terms must be an object")


# ---- 2. --json output is strict JSON -----------------------------------------------------------
def test_json_output_never_holds_nan(capsys):
    text = to_json({"a": {"tok_s": math.nan}, "b": [1.0, -math.inf], "c": "x"})
    assert json.loads(text) == {"a": {"tok_s": None}, "b": [1.0, None], "c": "x"}
    err = capsys.readouterr().err
    assert "a.tok_s (nan)" in err and "b[1] (-inf)" in err


# ---- 3. coefficients ---------------------------------------------------------------------------
def coef_file(tmp_path, **values):
    f = tmp_path / "coef.json"
    save_coefficients(Coefficients(), f)
    doc = json.loads(f.read_text())
    doc["coefficients"].update(values)
    f.write_text(json.dumps(doc))
    return f


@pytest.mark.parametrize("key, value, message", [
    ("disk", math.nan, "disk must be a finite number >= 0 and <= 1000"),
    ("disk", math.inf, "disk must be a finite number"),
    ("disk", 1e300, "disk must be a finite number >= 0 and <= 1000"),
    ("disk", True, "disk must be a finite number"),
    ("cpu_expert", -0.5, "cpu_expert must be a finite number >= 0"),
    ("gpu_call_s", 2.0, "gpu_call_s must be a finite number >= 0 and <= 1 s"),
    ("dense", "1.0", "dense must be a finite number"),
])
def test_bad_coefficient_names_file_and_key(tmp_path, good, key, value, message):
    d, _, _ = good
    f = coef_file(tmp_path, **{key: value})
    with pytest.raises(FormatError) as err:
        load_coefficients(f)
    assert message in str(err.value) and str(f) in str(err.value) and "Coefficients(" not in str(err.value)
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                "--coefficients", f)
    assert_one_line(r, str(f), message)


def test_all_zero_coefficients_are_refused(tmp_path):
    zero = {k: 0.0 for k in Coefficients().to_dict()}
    with pytest.raises(FormatError, match="every coefficient is 0"):
        load_coefficients(coef_file(tmp_path, **zero))


def test_string_coefficients_in_a_report_name_the_report(tmp_path):
    rep = report()
    rep["plan"]["coefficients"] = "x"
    with pytest.raises(FormatError, match=r"r\.json: plan\.coefficients must be an object"):
        fit_coefficients([rep], names=["r.json"])


# ---- 4. calibrate ------------------------------------------------------------------------------
def report(cpu: float = 0.2, disk: float = 0.3, model: str = "m1", machine: str = "hostA") -> dict:
    """A verify report: raw CPU ``cpu`` s and disk ``disk`` s per token, measured at exactly 2x and 0.5x."""
    return toy_report(cpu, disk, model, machine)


def write_reports(tmp_path, *reports):
    return [str(save_report(r, tmp_path / f"r{i}.json")) for i, r in enumerate(reports)]


def write_raw_report(path, rep: dict) -> str:
    """A report file as a hand edit leaves it (NaN / Infinity as bare words, which save_report refuses)."""
    path.write_text(json.dumps({"kind": "verify-report", "schema_version": 1, **rep}))
    return str(path)


def test_two_unknowns_from_one_report_warn(tmp_path):
    paths = write_reports(tmp_path, report())
    r = cli_run("calibrate", *paths, "--out", tmp_path / "c.json")
    assert r.exit_code == 0, r.output
    assert "fitted from 1 report(s)" in r.stderr
    # two reports with different disk shares determine both: c_cpu 2, c_disk 0.5, no warning
    paths = write_reports(tmp_path, report(disk=0.0), report())
    r = cli_run("calibrate", *paths, "--out", tmp_path / "c.json", "--json")
    # (these reports' plans lack per-layer parts: only that warning, one per report, may appear)
    others = [ln for ln in r.stderr.splitlines() if "warning" in ln and "predates per-layer" not in ln]
    assert r.exit_code == 0 and not others, r.stderr
    c = json.loads(r.stdout)["coefficients"]
    assert c["cpu_expert"] == pytest.approx(2.0) and c["disk"] == pytest.approx(0.5)


def test_coefficient_fitted_to_zero_warns():
    reps = [report(disk=0.0), report(cpu=0.1)]
    for rep in reps:
        rep["measured"]["terms"]["dense_s"] = 0.01      # all of it is attention: c_dense fits to 0
    _, detail = fit_coefficients(reps)
    assert any("dense fitted to 0" in w for w in detail["warnings"])


@pytest.mark.parametrize("field, value", [("dense_s", -5), ("expert_wall_s", math.inf),
                                          ("disk_wait_s", math.nan)])
def test_bad_measured_time_is_a_format_error(tmp_path, field, value):
    rep = report()
    rep["measured"]["terms"][field] = value
    f = write_raw_report(tmp_path / "r.json", rep)
    r = cli_run("calibrate", f, "--out", tmp_path / "c.json")
    assert_one_line(r, f, f"measured.terms.{field} must be a finite number >= 0")
    assert not (tmp_path / "c.json").exists()


def test_mixed_models_refused_mixed_machines_and_duplicates_warn(tmp_path):
    paths = write_reports(tmp_path, report(model="m1"), report(model="m2", disk=0.0))
    assert_one_line(cli_run("calibrate", *paths, "--out", tmp_path / "c.json"), "different models",
                    paths[0], paths[1])
    paths = write_reports(tmp_path, report(machine="hostA"), report(machine="hostB", disk=0.0))
    r = cli_run("calibrate", *paths, "--out", tmp_path / "c.json")
    assert r.exit_code == 0 and "2 different machines" in r.stderr
    assert json.loads((tmp_path / "c.json").read_text())["machine_fingerprints"] == ["hostA", "hostB"]
    paths = write_reports(tmp_path, report(), report(disk=0.0))
    r = cli_run("calibrate", paths[0], paths[1], paths[0], "--out", tmp_path / "c.json")
    assert r.exit_code == 0 and "same report" in r.stderr


def test_solve_warns_when_coefficients_come_from_another_machine(tmp_path, good):
    d, _, prof = good
    out = tmp_path / "c.json"
    paths = write_reports(tmp_path, report(machine="elsewhere"), report(machine="elsewhere", disk=0.0))
    assert cli_run("calibrate", *paths, "--out", out).exit_code == 0
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                "--coefficients", out)
    assert r.exit_code == 0, r.output
    assert "fitted on machine(s) elsewhere" in r.stderr and prof.fingerprint in r.stderr
    paths = write_reports(tmp_path, report(machine=prof.fingerprint), report(machine=prof.fingerprint,
                                                                              disk=0.0))
    assert cli_run("calibrate", *paths, "--out", out).exit_code == 0
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                "--coefficients", out)
    assert r.exit_code == 0 and "fitted on machine" not in r.stderr


# ---- 5. solve options --------------------------------------------------------------------------
@pytest.mark.parametrize("option, value", [("--vram-reserve", "nan"), ("--vram-reserve", "inf"),
                                           ("--time-limit", "nan"), ("--time-limit", "inf")])
def test_solve_refuses_non_finite_options(good, option, value):
    d, _, _ = good
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                option, value)
    assert_one_line(r, f"{option} must be a finite number")


# ---- 6. profiles -------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [("total_memory_bytes", "lots"), ("index", -1),
                                          ("unified_memory", "no"), ("name", 5)])
def test_bad_device_entry_is_a_format_error(tmp_path, good, field, value):
    d, _, _ = good
    doc = json.loads((d / "profile.json").read_text())
    f = edited(tmp_path, doc, f"devices.1.{field}", value, "profile.json")
    with pytest.raises(FormatError, match=rf"devices\[1\]: {field} must be"):
        load_profile(f)
    r = cli_run("solve", "--profile", f, "--model", d / "model.json")
    assert_one_line(r, str(f), f"devices[1]: {field} must be")


def test_zero_machine_figure_is_named():
    with pytest.raises(InputError, match=r"disk random-read 0\.0 GB/s") as err:
        Resources(cpu_matmul_gbps=21.58, ram_read_gbps=53.23, disk_read_gbps=0.0)
    assert "CPU expert matmul" not in str(err.value)
    with pytest.raises(InputError, match=r"cuda:1 GPU expert matmul nan GB/s"):
        Resources(cpu_matmul_gbps=1, ram_read_gbps=1,
                  gpus=(GpuResource("cuda:0", 5.0, 1, 1), GpuResource("cuda:1", math.nan, 1, 1)))
