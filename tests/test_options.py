"""The options dataclasses hold the CLI's defaults (issue 32): SolveOptions for `solve`, ProfileOptions for
`profile`, RunOptions for `run` and `verify`; the CLI builds them from its flags and passes them whole; no
function of the toolkit takes more than 10 parameters."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
from _cli_fixtures import invoke

import colibri_plan
from colibri_plan.cli.model_pack import FIXTURE_FIELDS, fixture
from colibri_plan.cli.profile import profile
from colibri_plan.cli.run import run
from colibri_plan.cli.solve import solve
from colibri_plan.cli.verify import verify
from colibri_plan.engine.fixture import FixtureConfig
from colibri_plan.errors import ColibriError
from colibri_plan.planner.options import SolveOptions, default_prompt_tokens
from colibri_plan.profiler.options import ProfileOptions
from colibri_plan.run_options import VERIFY_DEFAULTS, RunOptions


def _fields(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _flag_defaults(command, cls, *required) -> dict:
    """{field: the value click gives it when the flag is left out} of the command's options named after
    ``cls``'s fields (``required``: the arguments the command cannot parse without)."""
    ctx = command.make_context(command.name, [str(a) for a in required])
    return {k: v for k, v in ctx.params.items() if k in _fields(cls)}


@pytest.mark.parametrize("command, defaults, required, unset", [
    (solve, SolveOptions(), ("--profile", "p", "--model", "m"), {"coef"}),   # coef: --coefficients FILE
    (run, RunOptions(), ("--model", "m"), set()),
    (verify, VERIFY_DEFAULTS, ("--plan", "p", "--model", "m"),
     {"device_index", "quant", "read_threads", "trunk"}),                    # flags run has alone
], ids=["solve", "run", "verify"])
def test_click_defaults_are_the_dataclass_defaults(command, defaults, required, unset):
    flags = _flag_defaults(command, type(defaults), *required)
    assert set(_fields(type(defaults))) - set(flags) == unset       # every other field is a flag
    assert flags == {k: getattr(defaults, k) for k in flags}


def test_profile_flags_left_out_keep_the_field_defaults():
    """`profile`'s flags left out are None (the field's default then applies: the mode's sizes, all probes,
    the formats) or the field's default itself."""
    flags = _flag_defaults(profile, ProfileOptions)
    assert set(_fields(ProfileOptions)) - set(flags) == {"model_arch", "step_runner"}   # --model's, not flags
    for name, value in flags.items():
        assert value is None or value == getattr(ProfileOptions(), name), name
    assert ProfileOptions().formats == ("int4", "int4-g64") and "trunk" in ProfileOptions().probes


def test_fixture_flags_are_fixture_config_fields():
    assert set(FIXTURE_FIELDS) <= set(_fields(FixtureConfig))
    assert {p.name for p in fixture.params} & set(_fields(FixtureConfig)) == set(FIXTURE_FIELDS)


class _Stop(ColibriError):
    """Raised by a stand-in to end a command after it was handed its options."""


def test_solve_hands_make_plan_its_options_whole(monkeypatch, good):
    d, _, _ = good
    seen = []

    def fake(profile, spec, heat, opts, profile_source=""):
        seen.append(opts)
        raise _Stop("stop")

    monkeypatch.setattr("colibri_plan.planner.make.make_plan", fake)
    r = invoke("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--context", 300,
               "--ram", "0.5", "--time-limit", 2)
    assert r.exit_code == 1 and "Error: stop" in r.output, r.output
    # the prompt the KV budget holds: 300 tokens (not the default 512)
    assert seen == [SolveOptions(context_tokens=300, ram="0.5", time_limit_s=2.0,
                                 prompt_tokens=default_prompt_tokens(300))]
    assert seen[0].prompt_tokens == 300 and default_prompt_tokens(4096) == 512


def test_profile_hands_run_profile_its_options_whole(monkeypatch, tmp_path):
    seen = []

    def fake(opts, progress=None):
        seen.append(opts)
        raise _Stop("stop")

    monkeypatch.setattr("colibri_plan.profiler.run.run_profile", fake)
    r = invoke("profile", "--quick", "--probes", "ram", "--ram-bytes", "16MiB", "--backends", "numpy",
               "--out", tmp_path / "p.json")
    assert r.exit_code == 1 and "Error: stop" in r.output, r.output
    assert seen == [ProfileOptions(quick=True, probes=["ram"], ram_bytes=16 << 20, backends=["numpy"])]
    assert not (tmp_path / "p.json").exists()


def test_options_are_frozen():
    for cls in (SolveOptions, ProfileOptions, RunOptions):
        with pytest.raises(dataclasses.FrozenInstanceError):
            cls().__setattr__(dataclasses.fields(cls)[0].name, None)


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    n = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if names and names[0] in ("self", "cls") else 0)


def test_no_toolkit_function_takes_more_than_ten_parameters():
    root = Path(colibri_plan.__file__).parent
    wide = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _params(node) > 10:
                wide.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({_params(node)})")
    assert not wide, "take an options object or fewer parameters: " + ", ".join(wide)
