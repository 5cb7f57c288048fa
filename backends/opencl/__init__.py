"""The ``opencl`` backend (pyopencl): :mod:`.backend` (programs, weights, host ops) and its device-activation
part :mod:`.device`. Importing this package imports no pyopencl."""

from colibri_plan.backends.opencl.backend import OpenCLBackend

BACKEND = OpenCLBackend
