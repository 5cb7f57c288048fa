"""CI fails on a machine without a backend it must run (tests/_require.py), instead of skipping.

Each backend is hidden the way a clean machine lacks it: no OpenCL ICD (an empty ``OCL_ICD_VENDORS``
folder: no PoCL), no Vulkan driver (``VK_ICD_FILENAMES`` naming no file: no lavapipe), no validation
layer (an empty ``VK_LAYER_PATH``). A pytest run of one passing test in a subprocess, with the plugin,
must then fail with the backend's reason under ``CI=true``, and pass when the requirement leaves the
hidden backend out.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _require import CI_BACKENDS, ENV, required_backends

from colibri_plan.backends import get_backend

TESTS = Path(__file__).resolve().parent


def test_requirement_comes_from_the_variable_then_ci():
    assert required_backends({}) == ()
    assert required_backends({"CI": "true"}) == CI_BACKENDS
    assert required_backends({"CI": "false"}) == ()
    assert required_backends({"CI": "true", ENV: ""}) == ()              # set: it wins, even empty
    assert required_backends({ENV: " cpu, numpy,cpu"}) == ("cpu", "numpy")
    with pytest.raises(pytest.UsageError, match="openlc"):
        required_backends({ENV: "numpy,openlc"})


def _run(tmp_path: Path, hide: dict, **env) -> subprocess.CompletedProcess:
    """pytest on one passing test with the plugin, ``hide`` and ``env`` added to this environment."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert sum([1, 2]) == 3\n")
    full = {k: v for k, v in os.environ.items() if k not in ("CI", ENV)}
    full.update(hide, **env, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_require",
                           "--rootdir", str(tmp_path), str(tmp_path / "test_one.py")],
                          cwd=tmp_path, env=full, capture_output=True, text=True, timeout=300)


HIDDEN = {  # backend -> environment that hides it, and words of the reason it then gives
    "opencl": (lambda d: {"OCL_ICD_VENDORS": str(d)}, "no OpenCL platform found"),
    "vulkan": (lambda d: {"VK_ICD_FILENAMES": str(d / "none.json"), "VK_DRIVER_FILES": str(d / "none.json")},
               "found no driver"),
    "vulkan-validation": (lambda d: {"VK_LAYER_PATH": str(d)},
                          "VK_LAYER_KHRONOS_validation is not installed"),
}


@pytest.mark.parametrize("hidden", list(HIDDEN))
def test_ci_fails_when_a_required_backend_is_hidden(tmp_path, hidden):
    name = hidden.split("-")[0]
    reason = get_backend(name).unavailable_reason()
    if reason is not None:
        pytest.skip(f"{name} is unavailable here already ({reason}): nothing to hide")
    empty = tmp_path / "empty"
    empty.mkdir()
    env, words = HIDDEN[hidden]
    run = _run(tmp_path, env(empty), CI="true")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "required backend(s) unavailable" in out and f"{name}: " in out and words in out, out
    assert "1 passed" not in out                     # it failed before any test ran
    rest = ",".join(b for b in CI_BACKENDS if b != name)
    run = _run(tmp_path, env(empty), CI="true", **{ENV: rest})  # not required: the test runs and passes
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


def test_nothing_required_passes_with_every_gpu_backend_hidden(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    hide = {**HIDDEN["opencl"][0](d), **HIDDEN["vulkan"][0](d)}
    run = _run(tmp_path, hide)
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
