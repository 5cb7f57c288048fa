"""The backend contract's value types (:class:`DeviceInfo`, :class:`DeviceWeight`, :class:`ExpertWeights`,
:class:`DArray`) and the per-call readiness test of the checked ops; exported by
:mod:`colibri_plan.backends` (the contract itself: :mod:`~colibri_plan.backends.contract`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np


@dataclass(frozen=True)
class DeviceInfo:
    """One device of a backend.

    Attributes:
        backend: backend name ("numpy", "opencl", ...).
        index: index to pass to ``open``.
        name: the driver's device name.
        kind: "cpu", "gpu" (discrete) or "igpu" (integrated).
        total_memory_bytes: device memory (host RAM for CPU devices).
        free_memory_bytes: free memory when the driver reports it, else None.
        unified_memory: True when the device computes on host memory without a copy.
        formats: quant formats its kernels support.
        driver: driver / platform version string.
    """

    backend: str
    index: int
    name: str
    kind: str
    total_memory_bytes: int
    free_memory_bytes: int | None
    unified_memory: bool
    formats: tuple[str, ...]
    driver: str

    def to_dict(self) -> dict:
        """JSON-ready dict (formats as a list)."""
        d = dict(self.__dict__)
        d["formats"] = list(self.formats)
        return d


@dataclass(eq=False)
class DeviceWeight:
    """A weight resident on a device. ``payload`` is the backend's own buffer object(s); ``host_mapped``:
    held in mapped page-locked host memory the device reads over the bus (``upload_expert_mapped``), not
    in device memory (counted in ``Backend.mapped_bytes``, not ``held_bytes``)."""

    fmt: str
    out_features: int
    in_features: int
    nbytes: int
    payload: Any = field(repr=False)
    owner: int = field(repr=False, default=0)
    freed: bool = field(repr=False, default=False)
    host_mapped: bool = field(repr=False, default=False)


class ExpertWeights(NamedTuple):
    """The three matrices of one SwiGLU expert: gate [I, H], up [I, H], down [H, I]."""

    gate: DeviceWeight
    up: DeviceWeight
    down: DeviceWeight


@dataclass
class DArray:
    """A float32 activation on a backend's device (C-contiguous, row-major).

    Attributes:
        shape: the logical shape (metadata: ``d_view`` reshapes for free).
        buf: the backend's buffer (a numpy array for host backends, a CuPy array, an OpenCL buffer...).
        owner: ``id`` of the backend that made it (ops refuse another backend's arrays).
        offset: element offset of this view into ``buf`` (0 unless the backend makes sub-views).
    """

    shape: tuple[int, ...]
    buf: Any
    owner: int
    offset: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.size


def ready_x(x, w, owner: int) -> bool:
    """True when ``x`` and ``w`` pass ``Backend._check_x`` unchanged: w a live DeviceWeight of backend
    ``owner``, x a C-contiguous float32 ndarray [T ≥ 1, w.in_features] (the per-call fast path of
    ``matmul`` and ``expert_ffn``; the checks that raise run only when this is False)."""
    return (type(w) is DeviceWeight and w.owner == owner and not w.freed and type(x) is np.ndarray
            and x.dtype == _F32 and x.ndim == 2 and x.shape[1] == w.in_features and x.shape[0] > 0
            and x.flags.c_contiguous)


_F32 = np.dtype(np.float32)
