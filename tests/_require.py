"""Backends a test run must have (a pytest plugin, loaded by conftest.py).

Without a requirement a test of a backend that cannot run here skips with the backend's own
``unavailable_reason()``, so a machine without PoCL or lavapipe still passes. CI must not: with
``CI=true`` (what the CI runner sets) or ``COLIBRI_REQUIRE_BACKENDS=numpy,cpu,opencl,vulkan`` a missing
required backend fails the run at its start, with that reason, before any test runs. A required
``vulkan`` includes the Khronos validation layer (Debian's ``vulkan-validationlayers``, which
``scripts/setup.sh`` installs beside the Vulkan driver), so the synchronization-validation test runs
there instead of skipping.

``COLIBRI_REQUIRE_BACKENDS`` wins over ``CI`` when set; set to an empty string it requires nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

ENV = "COLIBRI_REQUIRE_BACKENDS"
#: what CI requires: the host backends and the two GPU backends that run on CPU drivers (PoCL, lavapipe)
CI_BACKENDS = ("numpy", "cpu", "opencl", "vulkan")
VALIDATION_LAYER = "VK_LAYER_KHRONOS_validation"


def required_backends(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The backend names this run must have: ``COLIBRI_REQUIRE_BACKENDS`` (comma-separated) when set,
    else :data:`CI_BACKENDS` when ``CI`` is true-ish (``true``, ``1``, ``yes``), else none.

    Raises:
        pytest.UsageError: a name that is not a backend (a typo must not require nothing).
    """
    from colibri_plan.backends import BACKEND_NAMES

    env = os.environ if environ is None else environ
    raw = env.get(ENV)
    if raw is None:
        return CI_BACKENDS if env.get("CI", "").strip().lower() in ("1", "true", "yes") else ()
    names = tuple(dict.fromkeys(n.strip() for n in raw.split(",") if n.strip()))
    unknown = [n for n in names if n not in BACKEND_NAMES]
    if unknown:
        raise pytest.UsageError(f"{ENV} names unknown backend(s) {', '.join(unknown)}; use names from "
                                f"{', '.join(BACKEND_NAMES)}, comma-separated")
    return names


def validation_layer_problem() -> str | None:
    """Why the Khronos validation layer cannot be used here, or None when the Vulkan loader lists it
    (call only where the vulkan backend is available: it imports the vulkan package)."""
    import vulkan as vk

    if any(p.layerName == VALIDATION_LAYER for p in vk.vkEnumerateInstanceLayerProperties()):
        return None
    return f"{VALIDATION_LAYER} is not installed (apt-get install vulkan-validationlayers)"


def missing(names: tuple[str, ...]) -> list[str]:
    """One line per required backend that cannot run here: ``name: reason``."""
    from colibri_plan.backends import get_backend

    out = []
    for name in names:
        reason = get_backend(name).unavailable_reason()
        if reason is None and name == "vulkan":
            reason = validation_layer_problem()
        if reason is not None:
            out.append(f"{name}: {reason}")
    return out


def skip_or_fail(name: str, reason: str) -> None:
    """Skip the calling test because backend ``name`` cannot run (``reason``), or fail it when the run
    requires that backend (a test's own finer check, such as the validation layer's)."""
    if name in required_backends():
        pytest.fail(f"required backend {name} ({ENV} / CI): {reason}", pytrace=False)
    pytest.skip(reason)


def pytest_sessionstart(session) -> None:
    """Fail the run at once when a required backend is missing: a skip would let CI pass without it."""
    names = required_backends()
    gone = missing(names)
    if gone:
        source = f"{ENV}={os.environ[ENV]}" if ENV in os.environ else "CI=true"
        pytest.exit(f"required backend(s) unavailable ({','.join(names)}, from {source}): " + "; ".join(gone)
                    + f". Install them (bash scripts/setup.sh test, as root with apt), or set {ENV} to the "
                    "backends this machine must have.", returncode=pytest.ExitCode.TESTS_FAILED)
