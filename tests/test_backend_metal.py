"""Metal backend: off macOS it must say why it cannot run (the backend is unverified on our machines);
on a Mac with PyObjC the oracle (tests/test_backends_oracle.py) checks its numbers, and this file its
device listing and out-of-memory path."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.errors import BackendUnavailableError, DeviceOutOfMemoryError

Metal = get_backend("metal")
REASON = Metal.unavailable_reason()


@pytest.mark.skipif(sys.platform == "darwin", reason="this checks the message off macOS")
def test_off_macos_says_what_metal_needs():
    assert REASON == "Metal needs macOS with PyObjC (pyobjc-framework-Metal)"
    assert Metal.is_available() is False
    assert Metal.list_devices() == []
    with pytest.raises(BackendUnavailableError, match="Metal needs macOS"):
        Metal.open(0)


@pytest.mark.skipif(REASON is not None, reason=f"metal: {REASON}")
def test_devices_and_oom():
    devices = Metal.list_devices()
    assert devices and all(d.kind in ("gpu", "igpu") and d.total_memory_bytes > 0 for d in devices)
    with Metal.open(0) as be:
        be.capacity_bytes = lambda: 100
        with pytest.raises(DeviceOutOfMemoryError):
            be.upload(quant.quantize(np.ones((64, 64), np.float32), "int4"))
        assert be.memory_used() == 0
