"""cli/common: --json output is strict JSON; every command's file readers name folders and devices."""

from __future__ import annotations

import json
import math
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_fixtures import invoke, pack_and_profile, refused

from colibri_plan.cli.common import parse_prompt, to_json


def test_json_output_never_holds_nan(capsys):
    text = to_json({"a": {"tok_s": math.nan}, "b": [1.0, -math.inf], "c": "x"})
    assert json.loads(text) == {"a": {"tok_s": None}, "b": [1.0, None], "c": "x"}
    err = capsys.readouterr().err
    assert "a.tok_s (nan)" in err and "b[1] (-inf)" in err


def test_cli_readers_name_folders_and_devices(toy, tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    prof, model = toy / "profile.json", toy / "model.json"
    for args in (["plan", "show", d], ["heat", "show", d], ["calibrate", d, "--out", tmp_path / "c.json"],
                 ["solve", "--profile", prof, "--model", model, "--heat", "uniform", "--coefficients", d],
                 ["run", "--model", d, "--prompt-file", d]):
        refused(invoke(*args), str(d), "is a folder, expected a file")
    refused(invoke("solve", "--profile", prof, "--model", "/dev/null"), "/dev/null", "is not a regular file")
    refused(invoke("heat", "show", "/dev/null"), "/dev/null", "is not a regular file")


# ---- rich tables and progress (cli/common.table, Steps) --------------------------------------------------

def test_table_is_plain_aligned_text_in_a_pipe():
    from colibri_plan.cli.common import table

    text = table([[1, "1.70 (1.03-2.76)", "[bold]x[/bold]"], ["seq", "1.27", ""]],
                 ["QD", "read GB/s", "note"])
    lines = text.splitlines()
    assert lines[0].split() == ["QD", "read", "GB/s", "note"] and set(lines[1]) <= {"-", " "}
    assert "[bold]x[/bold]" in lines[2]  # cells are text, never rich markup
    assert "\x1b[" not in text and all(ln == ln.rstrip() for ln in lines)
    assert lines[2].index("1.70") == lines[3].index("1.27") == lines[0].index("read")  # aligned columns
    right = table([["a", "1.50 GB"], ["bb", "-0.26 GB"]], None, right=(1,), indent=2).splitlines()
    assert right == ["  a    1.50 GB", "  bb  -0.26 GB"]


def test_steps_in_a_log_are_the_plain_lines(capsys, monkeypatch):
    from colibri_plan.cli.common import PROGRESS_ENV, Steps

    monkeypatch.delenv(PROGRESS_ENV, raising=False)  # stderr is captured: not a terminal
    with Steps("packed experts", every_s=3600) as bar:
        assert bar.mode == "lines"
        for i in range(1, 6):
            bar.count(i, 5)
        bar.say("what-if ram 1 GB (1/7)")
        bar.say("  token 1/2", verbose_only=True)  # needs --verbose
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == ["packed experts 1/5", "packed experts 5/5", "what-if ram 1 GB (1/7)"]


def test_steps_as_bars_write_stderr_only(capsys, monkeypatch):
    from colibri_plan.cli.common import PROGRESS_ENV, Steps

    monkeypatch.setenv(PROGRESS_ENV, "bars")
    with Steps("what-if ram") as bar:
        for i in range(1, 4):
            bar.say(f"what-if ram {i} GB ({i}/3)")
    out, err = capsys.readouterr()
    assert out == "" and "3/3" in err and "ETA" in err
    monkeypatch.setenv(PROGRESS_ENV, "off")
    with Steps("x") as bar:
        bar.count(1, 1)
        bar.say("hello")
    assert capsys.readouterr() == ("", "")


# ---- --json stdout: one document, the same with progress bars on a terminal ------------------------------

EXE = Path(sys.executable).with_name("colibri-plan")
#: commands whose --json document holds no timing: byte-identical across runs
_STABLE = ("plan show", "model show", "heat show", "export")


def _run(args, tty: bool) -> tuple[str, str]:
    """``colibri-plan ARGS``: stdout always a pipe; stderr a pipe, or a pseudo-terminal with bars forced
    (COLIBRI_PLAN_PROGRESS=bars, so --json does not quieten them)."""
    env = {k: v for k, v in os.environ.items() if k != "COLIBRI_PLAN_PROGRESS"}
    if not tty:
        r = subprocess.run([str(EXE), *map(str, args)], capture_output=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr.decode()
        return r.stdout.decode(), r.stderr.decode()
    master, slave = pty.openpty()
    env.update(COLIBRI_PLAN_PROGRESS="bars", COLUMNS="120")
    p = subprocess.Popen([str(EXE), *map(str, args)], stdout=subprocess.PIPE, stderr=slave,
                         stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    out = p.stdout.read()
    p.stdout.close()
    assert p.wait(timeout=300) == 0, b"".join(chunks).decode(errors="replace")
    return out.decode(), b"".join(chunks).decode(errors="replace")


def _shape(x):
    """The document's structure: keys, list lengths and value kinds (timings differ from run to run)."""
    if isinstance(x, dict):
        return {k: _shape(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_shape(v) for v in x]
    return x if isinstance(x, (bool, type(None))) else type(x).__name__.replace("int", "float")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = pack_and_profile(tmp_path_factory, "jsonout", plan=True)
    assert invoke("heat", "synth", d / "fx", "--out", d / "heat.json").exit_code == 0
    return d


def test_json_stdout_is_one_document_with_or_without_a_terminal(files, tmp_path):
    d = files
    commands = {
        "solve": ["solve", "--profile", d / "profile.json", "--model", d / "fx", "--heat", d / "heat.json",
                  "--compare", "--what-if", "ram"],
        "plan show": ["plan", "show", d / "plan.json", "--layers"],
        "model show": ["model", "show", "glm-5.2", "--quant", "int4-g64"],
        "heat show": ["heat", "show", d / "heat.json"],
        "export": ["export", d / "plan.json", "--to", "llama.cpp"],
        "verify": ["verify", "--plan", d / "plan.json", "--model", d / "fx", "--tokens", "2"],
        "fixture": ["model", "fixture", tmp_path / "fx", "--small", "--layers", "1", "--experts", "8",
                    "--top-k", "2", "--force"],
        "run": ["run", "--model", d / "fx", "--prompt-ids", "1,2,3", "--tokens", "3"],
    }
    for name, args in commands.items():
        if name == "verify":
            args = [*args, "--report", tmp_path / "v.json"]
        plain_out, plain_err = _run(["--json", *args], tty=False)
        tty_out, tty_err = _run(["--json", *args], tty=True)
        for out in (plain_out, tty_out):  # exactly one JSON document and nothing else
            doc = json.loads(out)
            assert out == to_json(doc) + "\n", name
        assert "\x1b[" not in plain_err and "\x1b[" not in plain_out and "\x1b[" not in tty_out, name
        if name in _STABLE:
            assert tty_out == plain_out, name
        else:
            assert _shape(json.loads(tty_out)) == _shape(json.loads(plain_out)), name
        if name in ("solve", "verify", "fixture", "run"):  # a long step drew its bar on the terminal
            assert "━" in tty_err and "ETA" in tty_err, (name, tty_err[-500:])


# ---- round 4 (issue 30): numbers as people type them, and options a backend cannot use ----------------

@pytest.mark.parametrize("value", ["1_0", "١٠", "１０", "²", "0x10", "1,5"])
def test_a_gb_figure_is_ascii_digits_only(value):
    from colibri_plan.errors import InputError
    from colibri_plan.planner.budgets import parse_gb

    with pytest.raises(InputError, match="digits 0-9"):
        parse_gb(value, "--ram")
    assert parse_gb(" 1.5 ", "--ram") == 1.5 and parse_gb("2e0", "--ram") == 2.0


@pytest.mark.parametrize("args, words", [
    (("solve", "--ram", "1_0"), ["--ram", "digits 0-9", "'1_0'"]),
    (("solve", "--ram", "١٠"), ["--ram", "digits 0-9"]),
    (("solve", "--ram", "4", "--vram", "１,0"), ["--vram", "digits 0-9"]),
    (("solve", "--ram", "4", "--queue-depth", "²"), ["--queue-depth", "1..64"]),
])
def test_solve_refuses_grouped_and_unicode_digits(toy, args, words):
    d = toy
    res = invoke(args[0], "--profile", d / "profile.json", "--model", d / "model.json", *args[1:])
    assert res.exit_code in (1, 2) and "Traceback" not in res.output, res.output
    assert all(w in res.output for w in words), res.output


@pytest.mark.parametrize("value", ["٣", "1_0"])
def test_prompt_ids_are_ascii_digits(value):
    from colibri_plan.errors import InputError

    with pytest.raises(InputError, match="is not a token id"):
        parse_prompt(f"1, {value}", "--prompt-ids")


@pytest.mark.parametrize("backend", ["cpu", "numpy"])
def test_run_device_on_a_host_backend_is_a_usage_error(tmp_path, backend):
    res = invoke("run", "--model", tmp_path / "nothing-needed", "--prompt-ids", "1", "--backend", backend,
                 "--device", "5")
    assert res.exit_code == 2 and "--device" in res.output and "runs on the host" in res.output, res.output
