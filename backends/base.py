"""The one base class of every backend, :class:`Backend`: discovery, lifecycle, the checked public API
(host ops here, device ops in :class:`~colibri_plan.backends.device_ops.DeviceOps`), memory accounting,
timed calls and the declaration of optional ops (:meth:`Backend.supports`).

A backend subclasses it once and is built by composition: its ``_open`` creates the driver context and
the parts it needs (staging, work-buffer pools, batched experts, device-op hooks; the shared ones in
``staging``, ``pools``, ``batched``, ``reference``) and binds their hooks to the instance with
:meth:`Backend.bind` — once, so a call costs one attribute lookup as a method would. The contract (ops,
shapes, dtypes): :mod:`colibri_plan.backends.contract`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from colibri_plan.backends.batched import three_matmuls
from colibri_plan.backends.contract import OPTIONAL_OPS, REQUIRED_OPS
from colibri_plan.backends.device_ops import DeviceOps
from colibri_plan.backends.handles import DeviceInfo, DeviceWeight, ExpertWeights, ready_x
from colibri_plan.backends.reference import silu_mul_ref  # noqa: F401 - exported (__all__)
from colibri_plan.errors import (
    BackendUnavailableError,
    ColibriError,
    DeviceOutOfMemoryError,
    InputError,
)
from colibri_plan.quant import FORMATS, QuantTensor

__all__ = ["Backend", "DeviceInfo", "DeviceWeight", "ExpertWeights", "silu_mul_ref"]


class Backend(DeviceOps):
    """Base class of every backend (see the module docstring)."""

    name: ClassVar[str] = "base"
    #: formats this backend's kernels implement
    formats: ClassVar[tuple[str, ...]] = FORMATS
    #: the optional ops (``contract.OPTIONAL_OPS``) this backend has; :meth:`supports` reads it
    optional_ops: ClassVar[frozenset[str]] = frozenset()

    # ---- discovery (class methods; cheap; never raise) -------------------------------------------
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (missing package, driver, device), or None if it can."""
        raise NotImplementedError

    @classmethod
    def is_available(cls) -> bool:
        """True when :meth:`unavailable_reason` is None. Never raises."""
        try:
            return cls.unavailable_reason() is None
        except Exception:  # noqa: BLE001 - discovery must never raise
            return False

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        """Devices of this backend (empty when unavailable): ``_devices()``, whose failures (a broken
        driver stack raises many kinds) become no devices. Never raises."""
        try:
            return [] if cls.unavailable_reason() is not None else cls._devices()
        except Exception:  # noqa: BLE001 - discovery never raises
            return []

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        """The devices, asked of the driver (may raise; only called when available)."""
        raise NotImplementedError

    @classmethod
    def device_info(cls, index: int, name: str, kind: str, total: int, free: int | None,
                    driver: str) -> DeviceInfo:
        """DeviceInfo of device ``index`` (bytes); kind "cpu" and "igpu" compute on host memory (unified)."""
        return DeviceInfo(cls.name, index, name, kind, int(total), None if free is None else int(free),
                          kind != "gpu", cls.formats, driver)

    @classmethod
    def supports(cls, op: str) -> bool:
        """Whether this backend has op ``op``: True for every op of the contract's Protocol, and for an
        optional op (``contract.OPTIONAL_OPS``) when this class declares it in ``optional_ops``.

        Raises:
            InputError: ``op`` is not an op of the contract (a misspelt name would silently read False).
        """
        if op in OPTIONAL_OPS:
            return op in cls.optional_ops
        if op in REQUIRED_OPS:
            return True
        raise InputError(f"supports: {op!r} is not an op of the backend contract; optional ops: "
                         f"{', '.join(sorted(OPTIONAL_OPS))}")

    @classmethod
    def open(cls, index: int = 0) -> Backend:
        """Open device ``index``.

        Raises:
            BackendUnavailableError: the backend or the device cannot be used; says why.
        """
        reason = cls.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"{cls.name} backend unavailable: {reason}")
        devices = cls.list_devices()
        if not 0 <= index < len(devices):
            raise BackendUnavailableError(
                f"{cls.name} has {len(devices)} device(s); device index {index} does not exist")
        return cls(devices[index])

    def __init__(self, device: DeviceInfo):
        self.device = device
        self.held_bytes = 0
        self.mapped_bytes = 0  # weights in mapped host memory (upload_expert_mapped): not device memory
        self.closed = False
        #: True: after each op, ``last_device_seconds`` holds the device's own time of it (CUDA events,
        #: Vulkan timestamps), which separates kernel time from host overhead in benchmarks
        self.timing = False
        self.last_device_seconds: float | None = None
        self._open()

    # ---- hooks for subclasses ------------------------------------------------------------------
    def _open(self) -> None:
        """Create contexts/queues/pipelines (heavy imports go here)."""

    def _upload(self, qt: QuantTensor) -> Any:
        """Copy ``qt`` to the device; return the payload. Raise DeviceOutOfMemoryError when full."""
        raise NotImplementedError

    def _matmul(self, x: np.ndarray, w: DeviceWeight) -> np.ndarray:
        raise NotImplementedError

    def _expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        """Default: three matmuls per expert (a backend binds fused kernels: ``batched.BatchedExperts``)."""
        return three_matmuls(self._matmul, xs, experts)

    def _free(self, w: DeviceWeight) -> None:
        """Release the payload's device memory."""

    def _synchronize(self) -> None:
        """Wait for all queued device work."""

    def _close(self) -> None:
        """Release contexts and queues."""

    def _device_seconds(self) -> float | None:
        """Device time in seconds of the last op, measured on the device; None when not measured."""
        return None

    def capacity_bytes(self) -> int | None:
        """Usable device memory for weights, or None when unbounded/unknown (host RAM)."""
        return None

    # ---- composition ---------------------------------------------------------------------------
    def bind(self, part: Any, names: Sequence[str] | None = None) -> Any:
        """Bind ``part``'s methods ``names`` (default: its ``HOOKS``) to this instance under the same
        names, once at open: a call then costs one instance lookup, as a method of the class would (a
        ``__getattr__`` fallback here would slow every attribute access of the hot path: none is kept).
        Returns ``part``."""
        for n in part.HOOKS if names is None else names:
            setattr(self, n, getattr(part, n))
        return part

    def _oom(self, what: str, requested_bytes: int) -> DeviceOutOfMemoryError:
        """The typed error of an allocation the device refused; ``what`` says which and why."""
        return DeviceOutOfMemoryError(
            f"{self.name} device {self.device.name!r}: {what} ({self.held_bytes} B of weights held); "
            "place fewer experts on this device", requested_bytes=requested_bytes,
            held_bytes=self.held_bytes, capacity_bytes=self.capacity_bytes())

    # ---- public contract -----------------------------------------------------------------------
    def upload(self, qt: QuantTensor) -> DeviceWeight:
        """Place a weight on the device, once.

        Raises:
            InputError: ``qt`` is not a QuantTensor, or its format is unsupported here.
            DeviceOutOfMemoryError: it would exceed the device's memory (``requested_bytes``,
                ``held_bytes``); nothing is left allocated.
        """
        self._check_open()
        if not isinstance(qt, QuantTensor):
            raise InputError(f"upload expects a QuantTensor, got {type(qt).__name__}")
        if qt.fmt not in self.formats:
            raise InputError(f"{self.name} does not support format {qt.fmt}; it supports "
                             f"{', '.join(self.formats)}")
        cap = self.capacity_bytes()
        if cap is not None and self.held_bytes + qt.nbytes > cap:
            raise DeviceOutOfMemoryError(
                f"{self.name} device {self.device.name!r}: upload of {qt.nbytes} B does not fit "
                f"({self.held_bytes} B held of {cap} B); place fewer experts on this device",
                requested_bytes=qt.nbytes, held_bytes=self.held_bytes, capacity_bytes=cap)
        payload = self._upload(qt)
        self.held_bytes += qt.nbytes
        return DeviceWeight(qt.fmt, qt.out_features, qt.in_features, qt.nbytes, payload, id(self))

    def upload_expert(self, gate: QuantTensor, up: QuantTensor, down: QuantTensor) -> ExpertWeights:
        """Upload the three matrices of an expert; on failure frees what was uploaded and re-raises."""
        done: list[DeviceWeight] = []
        try:
            for qt in (gate, up, down):
                done.append(self.upload(qt))
        except ColibriError:
            for w in done:
                self.free(w)
            raise
        return ExpertWeights(*done)

    def matmul(self, x: np.ndarray, w: DeviceWeight) -> np.ndarray:
        """y [T, out] = x [T, in] · Wᵀ, float32.

        Raises:
            InputError: wrong shape/dtype of x, or a weight freed or owned by another backend.
        """
        if self.closed or not ready_x(x, w, id(self)):  # the checks that raise; a ready call skips them
            self._check_open()
            x = self._check_x(x, w)
        return self._timed_op(self._matmul(x, w))

    def expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        """For each expert i: y_i [T_i, H] = down_i(SiLU(gate_i x_i) · up_i x_i), x_i [T_i, H] float32.

        Raises:
            InputError: lengths differ, or shapes do not chain (gate/up [I, H], down [H, I]).
        """
        checked = self._check_experts(xs, experts)
        if not checked:
            return []
        return self._timed_op(self._expert_ffn(checked, experts))

    def _check_experts(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        """:meth:`expert_ffn`'s checks (its errors); returns the xs as C-contiguous float32 arrays."""
        self._check_open()
        if len(xs) != len(experts):
            raise InputError(f"expert_ffn: {len(xs)} inputs for {len(experts)} experts")
        me = id(self)
        checked = list(xs)
        for i, (x, e) in enumerate(zip(xs, experts)):
            g, u, d = e.gate, e.up, e.down
            if (ready_x(x, g, me) and type(u) is type(d) is DeviceWeight and u.owner == d.owner == me
                    and not (u.freed or d.freed) and g.out_features == u.out_features == d.in_features
                    and g.in_features == u.in_features == d.out_features):
                continue  # a decode step's experts: ready as given (the checks below would pass)
            if not (e.gate.out_features == e.up.out_features == e.down.in_features
                    and e.gate.in_features == e.up.in_features == e.down.out_features):
                raise InputError("expert_ffn: gate/up must be [I, H] and down [H, I]")
            checked[i] = self._check_x(x, e.gate)
            self._check_weight(e.up)
            self._check_weight(e.down)
        return checked

    # ---- timed calls ---------------------------------------------------------------------------
    def _timed_calls(self, op: Callable, *args, repeats: int = 5) -> list[float]:
        """Seconds per call of ``op(*args)``, a public op of this backend (``self.matmul``,
        ``self.expert_ffn``), ``repeats`` times after one warm-up (host wall clock, synchronized after
        each call): the code path inference uses, so the profiler measures what will run."""
        op(*args)
        self.synchronize()
        times = []
        for _ in range(max(1, int(repeats))):
            t0 = time.perf_counter()
            op(*args)
            self.synchronize()
            times.append(time.perf_counter() - t0)
        return times

    def time_matmul(self, x: np.ndarray, w: DeviceWeight, repeats: int = 5) -> list[float]:
        """Seconds per :meth:`matmul` call (see :meth:`_timed_calls`)."""
        return self._timed_calls(self.matmul, x, w, repeats=repeats)

    def time_expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights],
                        repeats: int = 5) -> list[float]:
        """Seconds per :meth:`expert_ffn` call over the same batch (see :meth:`_timed_calls`)."""
        return self._timed_calls(self.expert_ffn, xs, experts, repeats=repeats)

    def last_gpu_seconds(self) -> float | None:
        """Device time of the last op (matmul, expert_ffn, ...), without the host's share; None when
        this backend or device does not measure it (CUDA: only with ``timing`` on)."""
        return self._device_seconds()

    def _timed_op(self, result):
        if self.timing:
            self.last_device_seconds = self._device_seconds()
        return result

    def free(self, w: DeviceWeight) -> None:
        """Release a weight; freeing twice is an InputError."""
        self._check_weight(w)
        self._free(w)
        w.freed = True
        w.payload = None
        if w.host_mapped:
            self.mapped_bytes -= w.nbytes
        else:
            self.held_bytes -= w.nbytes

    def memory_used(self) -> int:
        """Bytes of weights this backend instance holds."""
        return self.held_bytes

    def synchronize(self) -> None:
        """Wait for all queued work on the device."""
        self._check_open()
        self._synchronize()

    def close(self) -> None:
        """Release everything; further calls raise InputError. Closing twice is harmless."""
        if not self.closed:
            self._close()
            self.closed = True
            self.held_bytes = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- shared checks -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise InputError(f"{self.name} backend is closed")

    def _check_weight(self, w: DeviceWeight) -> None:
        if not isinstance(w, DeviceWeight) or w.owner != id(self):
            raise InputError(f"weight was not uploaded by this {self.name} backend")
        if w.freed:
            raise InputError("weight was already freed")

    def _check_x(self, x: np.ndarray, w: DeviceWeight) -> np.ndarray:
        self._check_weight(w)
        x = np.asarray(x)
        if x.ndim != 2 or x.shape[1] != w.in_features:
            raise InputError(f"activations must be [T, {w.in_features}], got {x.shape}")
        if x.shape[0] == 0:
            raise InputError("activations have no tokens (T = 0)")
        return np.ascontiguousarray(x, dtype=np.float32)

