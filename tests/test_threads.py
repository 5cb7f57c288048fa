"""The OpenBLAS thread default: importing colibri_plan shortens OpenBLAS's idle spin before numpy loads.

Each check runs in a fresh interpreter, because OpenBLAS reads OPENBLAS_THREAD_TIMEOUT once, when numpy
first loads it (docs/engine.md, "Threads on many-core hosts").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# the value OpenBLAS itself read at load time: its exported getter returns the parsed environment
# value (0 = unset, i.e. OpenBLAS's built-in 2^28-cycle spin); found through the loaded library's path
_PROBE = r"""
import ctypes, json, os, sys
first = sys.argv[1]
if first == "numpy":
    import numpy
    import colibri_plan
else:
    import colibri_plan
    import numpy
numpy.ones((2, 2)) @ numpy.ones((2, 2))
libs = [line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower() and ".so" in line]
read = None
if libs:
    lib = ctypes.CDLL(libs[0])
    if hasattr(lib, "openblas_thread_timeout"):
        lib.openblas_thread_timeout.restype = ctypes.c_uint
        read = lib.openblas_thread_timeout()
print(json.dumps({"env": os.environ.get("OPENBLAS_THREAD_TIMEOUT"), "openblas_read": read}))
"""


def _probe(first: str, user_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if user_value is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = user_value
    out = subprocess.run([sys.executable, "-c", _PROBE, first], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_sets_the_timeout_and_openblas_reads_it():
    got = _probe("colibri_plan", None)
    assert got["env"] == "4"
    if got["openblas_read"] is None:
        pytest.skip("numpy here is not linked to an OpenBLAS exporting openblas_thread_timeout")
    assert got["openblas_read"] == 4


def test_a_users_value_wins():
    got = _probe("colibri_plan", "7")
    assert got["env"] == "7"
    if got["openblas_read"] is not None:
        assert got["openblas_read"] == 7


def test_numpy_imported_first_keeps_openblas_default():
    # the documented caveat: the variable is set, but OpenBLAS loaded before it and never reads it
    got = _probe("numpy", None)
    assert got["env"] == "4"
    if got["openblas_read"] is None:
        pytest.skip("numpy here is not linked to an OpenBLAS exporting openblas_thread_timeout")
    assert got["openblas_read"] == 0


def test_console_entry_point_imports_the_package_first():
    # the CLI's module lives inside colibri_plan, so the package __init__ runs before anything else
    out = subprocess.run([sys.executable, "-c",
                          "import sys, colibri_plan.cli, os; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"],
                         env={k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"},
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "4"
