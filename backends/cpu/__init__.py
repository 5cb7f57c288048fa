"""The ``cpu`` backend: numba kernels on every core of the host (:mod:`.backend`; weight layouts
:mod:`.layout`, routed experts :mod:`.experts`, kernels :mod:`.kernels`, :mod:`.qkernels`, :mod:`.q4t`,
:mod:`.q4g`, :mod:`.vnni`, :mod:`.attention`). Importing this package imports no numba."""

from colibri_plan.backends.cpu.backend import CpuBackend

BACKEND = CpuBackend
