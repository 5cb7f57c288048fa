"""Shared by the CLI and document tests: the files they run on (a small fixture pack with a toy profile, a
plan solved on a toy profile and spec, a tiny pack), the ``invoke`` helper and the checks of a refusal.

The builders are plain functions; each test module wraps the ones it needs in a module-scoped fixture."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from _reports import toy_report
from _solver_fixtures import toy_profile, toy_spec
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.formats.coefficients import Coefficients, save_coefficients
from colibri_plan.formats.heat import Heat, save_heat
from colibri_plan.formats.plan import save_plan
from colibri_plan.formats.profile import save_profile
from colibri_plan.model import save_model_spec
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions
from colibri_plan.verify import save_report

TINY = dict(layers=1, experts=8, top_k=2)
_GOOD_GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}


# ---- the files the tests run on ------------------------------------------------------------------------

def pack_and_profile(tmp_path_factory, name: str, *, plan: bool = False) -> Path:
    """A folder with a small fixture pack ``fx`` and a CPU-only toy ``profile.json``; with ``plan`` also a
    ``plan.json`` solved from them on synthesised heat."""
    d = tmp_path_factory.mktemp(name)
    build_fixture(d / "fx", FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    save_profile(toy_profile(ram_available_bytes=8 * 10**9, shape=(128, 256)), d / "profile.json")
    if plan:
        r = invoke("solve", "--profile", d / "profile.json", "--model", d / "fx", "--heat", "synth",
                   "--out", d / "plan.json")
        assert r.exit_code == 0, r.output
    return d


def good_plan(tmp_path_factory):
    """A folder with a toy profile (one GPU), model spec and a plan solved from them; the plan's document;
    the profile."""
    d = tmp_path_factory.mktemp("good")
    prof = toy_profile(gpus=[_GOOD_GPU], ram_available_bytes=3 * 10**9)
    save_profile(prof, d / "profile.json")
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)
    save_model_spec(spec, d / "model.json")
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="0.58", context_tokens=100, trunk="cpu"))
    save_plan(plan, d / "plan.json")
    return d, json.loads((d / "plan.json").read_text()), prof


def toy_plan(tmp_path_factory) -> Path:
    """A folder with a CPU-only profile, a model spec and a plan solved from them by ``solve``."""
    d = tmp_path_factory.mktemp("toy")
    save_profile(toy_profile(ram_available_bytes=3_100_000_000), d / "profile.json")
    save_model_spec(toy_spec(n_experts=16, hidden=2048, inter=1024), d / "model.json")
    res = invoke("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                 "--out", d / "plan.json")
    assert res.exit_code == 0, res.output
    return d


def tiny_pack_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pk") / "tiny"
    build_fixture(out, FixtureConfig.small(**TINY))
    return out


# ---- running a command and checking a refusal -----------------------------------------------------------

def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


cli_run = invoke


def refused(res, *expected):
    """A refusal, in one of two forms.

    ``refused(res, code, *words)``: exit ``code``, a SystemExit (no traceback), every word in the output.

    ``refused(res, *words)``: exit 1 with one ``Error: <message>`` line (no class name) naming every word,
    no traceback and no OSError; that line is returned."""
    if expected and isinstance(expected[0], int):
        code, *words = expected
        assert res.exit_code == code, res.output
        assert isinstance(res.exception, SystemExit), repr(res.exception)
        assert "Traceback" not in res.output
        for w in words:
            assert w in res.output, res.output
        return None
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and not isinstance(res.exception, OSError), res.output
    line = [ln for ln in res.output.splitlines() if ln.startswith("Error: ")]
    assert len(line) == 1, res.output
    assert not re.match(r"Error: \w+Error: ", line[0]), line[0]   # the message, never an internal class name
    for w in expected:
        assert w in line[0], (w, line[0])
    return line[0]


def assert_one_line(res, *parts):
    """The command failed with exit 1 and one line on stderr that holds every part (no traceback)."""
    assert res.exit_code == 1, (res.exit_code, res.output, res.exception)
    assert "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    for p in parts:
        assert p in lines[0], (p, lines[0])


def solve_json(files, *extra):
    r = invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r


def solve(files, *extra):
    return invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", "--heat", "synth",
                  *extra)


# ---- hand-edited documents ------------------------------------------------------------------------------

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


def heat_doc(tmp_path, **change) -> dict:
    h = Heat(n_experts=4, layers=(1, 2), counts=np.array([[5, 0, 4, 5], [3, 4, 3, 4]]), top_k=2, tokens=7,
             n_model_layers=3)
    doc = json.loads(save_heat(h, tmp_path / "good.json").read_text())
    doc.update(change)
    return doc


def write(path, doc) -> str:
    path.write_text(json.dumps(doc))   # json.dumps writes NaN as the bare token NaN, as a user file might
    return str(path)


def coef_file(tmp_path, **values):
    f = tmp_path / "coef.json"
    save_coefficients(Coefficients(), f)
    doc = json.loads(f.read_text())
    doc["coefficients"].update(values)
    f.write_text(json.dumps(doc))
    return f


def report(cpu: float = 0.2, disk: float = 0.3, model: str = "m1", machine: str = "hostA") -> dict:
    """A verify report: raw CPU ``cpu`` s and disk ``disk`` s per token, measured at exactly 2x and 0.5x."""
    return toy_report(cpu, disk, model, machine)


def write_reports(tmp_path, *reports):
    return [str(save_report(r, tmp_path / f"r{i}.json")) for i, r in enumerate(reports)]


def write_raw_report(path, rep: dict) -> str:
    """A report file as a hand edit leaves it (NaN / Infinity as bare words, which save_report refuses)."""
    path.write_text(json.dumps({"kind": "verify-report", "schema_version": 1, **rep}))
    return str(path)


# ---- outputs that must leave their inputs alone ---------------------------------------------------------

def hidden_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".old-" in p.name or ".tmp-" in p.name)


def same_bytes(path: Path, before: bytes) -> bool:
    return path.read_bytes() == before
