"""The ``cuda`` backend (CuPy, NVRTC): :mod:`.backend` (driver context, weights, host-staged ops), its parts
:mod:`.launch` (kernel instances, launch shapes and their tuning tables), :mod:`.device` (the ``d_*`` ops)
and :mod:`.experts` (routed experts on the device). Importing this package imports no CuPy."""

from colibri_plan.backends.cuda.backend import CUDABackend

BACKEND = CUDABackend
