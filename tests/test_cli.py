"""The `colibri-plan` group (colibri_plan/cli/__init__.py): shell completion, as the README documents it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXE = Path(sys.executable).with_name("colibri-plan")


def _complete(var: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(EXE)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "_COLIBRI_PLAN_COMPLETE": var, **env})


@pytest.mark.parametrize("shell, marker", [("bash", "-F _colibri_plan_completion colibri-plan"),
                                           ("zsh", "#compdef colibri-plan"),
                                           ("fish", "complete --no-files --command colibri-plan")])
def test_completion_script_for_each_shell(shell, marker):
    r = _complete(f"{shell}_source")
    assert r.returncode == 0, r.stderr
    assert marker in r.stdout and "_COLIBRI_PLAN_COMPLETE" in r.stdout


def test_completion_completes_commands_and_options():
    r = _complete("bash_complete", COMP_WORDS="colibri-plan re", COMP_CWORD="1")
    assert r.returncode == 0 and "plain,report" in r.stdout.split()
    r = _complete("bash_complete", COMP_WORDS="colibri-plan model su", COMP_CWORD="2")
    assert "plain,support" in r.stdout.split()
    r = _complete("bash_complete", COMP_WORDS="colibri-plan report plan.json --no", COMP_CWORD="3")
    assert "plain,--no-what-if" in r.stdout.split()
