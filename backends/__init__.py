"""Compute backends behind one contract (:mod:`colibri_plan.backends.base`).

Backend modules are imported lazily by :func:`get_backend`, so listing backends never imports pyopencl,
vulkan, cupy or PyObjC unless asked to.
"""

from __future__ import annotations

import importlib

from colibri_plan.backends.device_ops import DArray, rope_table  # noqa: F401 - the engine's import surface
from colibri_plan.errors import UnsupportedError

#: backend name -> module under colibri_plan.backends holding a class ``BACKEND``.
BACKEND_MODULES = {
    "numpy": "numpy_ref",
    "cpu": "cpu",
    "opencl": "opencl",
    "vulkan": "vulkan",
    "cuda": "cuda",
    "metal": "metal",
}
BACKEND_NAMES = tuple(BACKEND_MODULES)
#: backends that compute on host memory (their "device" ops are numpy/numba on RAM, run synchronously)
HOST_BACKENDS = ("cpu", "numpy")


def get_backend(name: str):
    """The backend class called ``name`` (a subclass of ``base.Backend``); importing it is cheap.

    Raises:
        UnsupportedError: unknown backend name.
    """
    if name not in BACKEND_MODULES:
        raise UnsupportedError(f"unknown backend {name!r}; use one of {', '.join(BACKEND_NAMES)}")
    module = importlib.import_module(f"colibri_plan.backends.{BACKEND_MODULES[name]}")
    return module.BACKEND
