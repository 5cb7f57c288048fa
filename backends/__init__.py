"""Compute backends behind one contract (:mod:`colibri_plan.backends.contract`), one folder each.

The engine imports from here only: :func:`get_backend`, :data:`BACKEND_NAMES`, :data:`HOST_BACKENDS` and
the contract's types. These imports are cheap (numpy only): a backend's package is imported by
:func:`get_backend`, and its driver stack (pyopencl, vulkan, cupy, PyObjC) only when it opens.
"""

from __future__ import annotations

import importlib

from colibri_plan.backends.base import Backend
from colibri_plan.backends.handles import DArray, DeviceInfo, DeviceWeight, ExpertWeights
from colibri_plan.backends.reference import rope_table
from colibri_plan.errors import UnsupportedError

__all__ = ["BACKEND_NAMES", "HOST_BACKENDS", "Backend", "DArray", "DeviceInfo", "DeviceWeight",
           "ExpertWeights", "get_backend", "rope_table"]

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


def get_backend(name: str) -> type[Backend]:
    """The backend class called ``name`` (a subclass of :class:`Backend`); importing it is cheap.

    Raises:
        UnsupportedError: unknown backend name.
    """
    if name not in BACKEND_MODULES:
        raise UnsupportedError(f"unknown backend {name!r}; use one of {', '.join(BACKEND_NAMES)}")
    module = importlib.import_module(f"colibri_plan.backends.{BACKEND_MODULES[name]}")
    return module.BACKEND
