"""The ``metal`` backend (PyObjC, unverified: no macOS here): :mod:`.backend`. Importing this package
imports no PyObjC."""

from colibri_plan.backends.metal.backend import MetalBackend

BACKEND = MetalBackend
