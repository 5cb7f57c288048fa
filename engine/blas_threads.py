"""Limit numpy's OpenBLAS to one thread while the cpu backend's numba kernels run the experts.

On the ``cpu`` backend the experts and the quantized trunk matmuls run in numba's thread pool, and the
float ops left to numpy BLAS (router, attention scores, float trunk tensors) are tiny. A second OpenBLAS
thread then only competes with numba's threads for the cores: on a 2-core host the router matmul
[1, 2048] · [2048, 32] took ~56 ms per layer with 2 BLAS threads instead of microseconds
(bench/peer_llamacpp.py). :class:`BlasLimit` sets OpenBLAS's thread count to 1 through its own C API
(``openblas_set_num_threads``; numpy's bundled build names it ``scipy_openblas_set_num_threads64_``),
found in the libraries this process has loaded, and :meth:`BlasLimit.restore` puts the previous count
back. Works at run time, after numpy was imported (unlike ``OPENBLAS_NUM_THREADS``, read once at load).

Where no OpenBLAS is loaded (another BLAS, or a platform without ``/proc/self/maps``) nothing is changed:
``BlasLimit.applied`` is False.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["BlasLimit", "openblas_threads"]

# (get, set) symbol pairs, numpy's bundled build first
_SYMBOLS = (("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
            ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
            ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
            ("openblas_get_num_threads", "openblas_set_num_threads"))
_api: list | None = None  # [(get, set)] per loaded OpenBLAS, found once
_lock = threading.Lock()
_holders = 0  # live BlasLimit objects: the first sets 1 thread, the last restores
_saved: list[int] = []


def _openblas() -> list:
    """(get, set) ctypes functions of every OpenBLAS this process has loaded (numpy's, scipy's)."""
    global _api
    if _api is None:
        import numpy  # noqa: F401 - loads numpy's OpenBLAS, the one to limit

        found = []
        try:
            with open("/proc/self/maps") as f:
                paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
        except OSError:
            paths = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for get_name, set_name in _SYMBOLS:
                if hasattr(lib, get_name) and hasattr(lib, set_name):
                    get, put = getattr(lib, get_name), getattr(lib, set_name)
                    get.restype, get.argtypes = ctypes.c_int, []
                    put.restype, put.argtypes = None, [ctypes.c_int]
                    found.append((get, put))
                    break
        _api = found
    return _api


def openblas_threads() -> list[int]:
    """Thread count of each loaded OpenBLAS (empty when none is found)."""
    return [get() for get, _ in _openblas()]


class BlasLimit:
    """Holds OpenBLAS at one thread until :meth:`restore` (idempotent; nests: the count is restored
    when the last live limit is released).

    Attributes:
        applied: True when an OpenBLAS was found and limited.
    """

    def __init__(self):
        global _holders
        api = _openblas()
        with _lock:
            if _holders == 0:
                _saved[:] = [get() for get, _ in api]
            for _, put in api:  # every time: a caller may have raised the count since the first limit
                put(1)
            _holders += 1
        self.applied = bool(api)
        self._live = True

    def restore(self) -> None:
        """Give back the limit; the last one restores the thread counts found by the first."""
        global _holders
        if not self._live:
            return
        self._live = False
        with _lock:
            _holders -= 1
            if _holders == 0:
                for (_, put), n in zip(_openblas(), _saved):
                    put(n)
