"""Vulkan backend lifetime: one VkInstance per process shared by every backend, each backend's VkDevice
destroyed by close() or, when a backend is dropped unclosed, by garbage collection.

Drivers limit the instances one process may create (an NVIDIA driver answers vkCreateInstance with
VK_ERROR_INCOMPATIBLE_DRIVER after a few dozen), so a test session that opens many backends must not
make an instance per backend. Skipped with the reason when no Vulkan device (lavapipe counts).
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.vulkan import util as vu


@pytest.fixture
def cls(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    c = get_backend("vulkan")
    if c.unavailable_reason() is not None:
        pytest.skip(f"vulkan unavailable: {c.unavailable_reason()}")
    return c


@pytest.fixture
def no_new_instance(monkeypatch):
    """Fails the test when anything creates a VkInstance (the probe made the process's one already)."""
    made = []
    monkeypatch.setattr(vu, "create_instance", lambda vk: made.append(1) or pytest.fail("a new VkInstance"))
    return made


def test_64_backends_opened_and_closed_share_the_process_instance(cls, no_new_instance):
    import vulkan as vk

    inst, base = vu.instance(vk)[0], vu.live_devices()
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    for i in range(64):
        be = cls.open(0)
        assert vu.live_devices() == base + 1
        np.testing.assert_array_equal(be.d_get(be.d_add(be.d_put(x), be.d_put(x))), 2 * x)
        if i % 2:  # a weight and an array alive at close: close destroys them with the device
            w, alive = be.upload(quant.quantize(x, "f32")), be.d_put(x)
            np.testing.assert_allclose(be.d_get(be.d_matmul(alive, w)), x @ x.T, rtol=1e-6)
        be.close()
        assert vu.live_devices() == base
    assert vu.instance(vk)[0] == inst and no_new_instance == []


def test_backends_dropped_unclosed_are_destroyed_by_the_collector(cls, no_new_instance):
    gc.collect()  # backends other tests dropped go now, not during the counts below
    base = vu.live_devices()
    refs, kept = [], []
    for i in range(16):
        be = cls.open(0)
        a = be.d_put(np.full((2, 5), i, np.float32))
        y = be.d_get(be.d_scale_rows(a, np.ones(2, np.float32)))
        np.testing.assert_array_equal(y, np.full((2, 5), i))
        if i % 4 == 0:
            kept.append(a)  # a device array outliving its backend's use keeps the backend alive
        refs.append(weakref.ref(be))
        del be, a
    assert vu.live_devices() <= base + 16
    gc.collect()
    assert vu.live_devices() == base + 4  # the four backends whose arrays are still held
    assert sum(r() is not None for r in refs) == 4
    kept.clear()  # their arrays go: then their backends and devices
    gc.collect()
    assert vu.live_devices() == base
    assert all(r() is None for r in refs)


def test_an_array_collected_after_close_does_nothing(cls):
    be = cls.open(0)
    a = be.d_put(np.ones((4, 4), np.float32))
    be.close()
    be.close()  # twice: harmless
    del a
    gc.collect()
    assert be._d.dev is None and be._d.buffers == {}
