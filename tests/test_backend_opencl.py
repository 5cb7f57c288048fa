"""OpenCL backend specifics (the numeric oracle over every backend is tests/test_backends_oracle.py):
device listing, the program binary cache, out-of-memory handling, and the GPU work shape (a work-group
per row with a local reduction) exercised on whatever device is here."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.base import silu_mul_ref
from colibri_plan.errors import BackendUnavailableError, DeviceOutOfMemoryError

OpenCL = get_backend("opencl")
REASON = OpenCL.unavailable_reason()
needs_cl = pytest.mark.skipif(REASON is not None, reason=f"opencl: {REASON}")


def _qt(fmt: str, out: int, in_: int, seed: int = 0) -> quant.QuantTensor:
    rng = np.random.default_rng([out, in_, seed])
    return quant.quantize(rng.standard_normal((out, in_), dtype=np.float32), fmt)


def _x(T: int, n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng([T, n, seed]).standard_normal((T, n), dtype=np.float32)


def _nerr(y, ref) -> float:
    return float(np.abs(y.astype(np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_PLAN_CACHE_DIR", str(tmp_path))
    return tmp_path / "opencl"


def test_unavailable_without_pyopencl(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "pyopencl" else real(n, *a))
    assert "pyopencl is not installed" in OpenCL.unavailable_reason()
    assert OpenCL.list_devices() == []
    with pytest.raises(BackendUnavailableError, match="pyopencl"):
        OpenCL.open(0)


@needs_cl
def test_list_devices_matches_the_driver():
    import pyopencl as cl

    want = []
    for p in cl.get_platforms():
        try:
            want += [d.name.strip() for d in p.get_devices()]
        except cl.Error:
            pass
    devices = OpenCL.list_devices()
    assert [d.name for d in devices] == want
    for i, d in enumerate(devices):
        assert d.index == i and d.backend == "opencl"
        assert d.kind in ("cpu", "gpu", "igpu")
        assert d.unified_memory == (d.kind != "gpu")
        assert d.total_memory_bytes > 0 and d.driver
        assert set(d.formats) == set(quant.FORMATS)
    with pytest.raises(BackendUnavailableError, match="does not exist"):
        OpenCL.open(len(devices))


@needs_cl
def test_binary_cache_is_reused_and_survives_corruption(cache):
    qt, x = _qt("int4", 40, 70), _x(2, 70)
    ref = quant.matmul_ref(x, qt)
    with OpenCL.open(0) as be:
        y1 = be.matmul(x, be.upload(qt))
        assert be.cache_hits == 0
    bins = sorted(cache.glob("*.bin"))
    assert len(bins) == 1 and bins[0].stat().st_size > 0
    with OpenCL.open(0) as be:
        y2 = be.matmul(x, be.upload(qt))
        assert be.cache_hits == 1  # built from the cached binary, not from source
    np.testing.assert_array_equal(y1, y2)
    assert _nerr(y1, ref) < 1e-5
    bins[0].write_bytes(b"not a program binary")
    with OpenCL.open(0) as be:
        y3 = be.matmul(x, be.upload(qt))
        assert be.cache_hits == 0  # the broken binary was rebuilt from source ...
    np.testing.assert_array_equal(y1, y3)
    assert bins[0].read_bytes() != b"not a program binary"  # ... and replaced


@needs_cl
def test_upload_beyond_capacity_raises_typed_oom_and_holds_nothing(cache):
    with OpenCL.open(0) as be:
        small = be.upload(_qt("int8", 8, 16))
        held = be.memory_used()
        be.capacity_bytes = lambda: held + 100  # a device with 100 B left
        qt = _qt("int4", 64, 64)
        with pytest.raises(DeviceOutOfMemoryError) as info:
            be.upload(qt)
        assert info.value.requested_bytes == qt.nbytes and info.value.held_bytes == held
        assert be.memory_used() == held
        be.free(small)
        assert be.memory_used() == 0


@needs_cl
def test_driver_allocation_failure_becomes_oom_and_releases_partial_buffers(cache):
    import pyopencl as cl

    with OpenCL.open(0) as be:
        made, real = [], be._buffer

        def flaky(nbytes, flags=None):  # data buffer succeeds, scales buffer fails like a full device
            if made:
                rec = cl._cl._ErrorRecord("clCreateBuffer", cl.status_code.MEM_OBJECT_ALLOCATION_FAILURE, "")
                raise cl.MemoryError(rec)
            made.append(real(nbytes, flags))
            return made[-1]

        be._buffer = flaky
        qt = _qt("int4", 32, 64)
        with pytest.raises(DeviceOutOfMemoryError) as info:
            be.upload(qt)
        assert info.value.requested_bytes == qt.nbytes and info.value.held_bytes == 0
        assert be.memory_used() == 0
        with pytest.raises(cl.LogicError, match="double-unref"):  # the data buffer was released
            made[0].release()


@needs_cl
@pytest.mark.parametrize("fmt", ["int4", "int4-g32", "bf16", "int2", "f16"])
def test_gpu_work_shape_on_this_device(cache, fmt):
    """A work-group of 16 per row with a local-memory reduction and 4 tokens per item: the shape used on
    GPUs, checked here on whatever device exists (odd sizes, so padding and clamped tokens are hit)."""
    with OpenCL.open(0) as be:
        be.ls = 16
        H, I, Ts = 131, 67, (5, 1, 3)
        qts = [(_qt(fmt, I, H, 3 * j), _qt(fmt, I, H, 3 * j + 1), _qt(fmt, H, I, 3 * j + 2))
               for j in range(3)]
        xs = [_x(T, H, j) for j, T in enumerate(Ts)]
        ys = be.expert_ffn(xs, [be.upload_expert(*q) for q in qts])
        for x, (g, u, d), y in zip(xs, qts, ys):
            ref = quant.matmul_ref(silu_mul_ref(quant.matmul_ref(x, g), quant.matmul_ref(x, u)), d)
            assert y.shape == (x.shape[0], H) and _nerr(y, ref) < 1e-4
        w = be.upload(qts[0][2])
        assert _nerr(be.matmul(_x(5, I), w), quant.matmul_ref(_x(5, I), qts[0][2])) < 1e-4
        xn = _x(3, 300) * 3
        wn = _x(1, 300)[0]
        ref = xn / np.sqrt((xn.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * wn
        assert _nerr(be.rmsnorm(xn, wn), ref) < 1e-5


@needs_cl
def test_gpu_work_shape_of_attention_on_this_device(cache):
    """attention.cl with a work-group of 16 per head (the GPU shape: scores strided over items, local
    max/sum reductions, items over R), past one tile of 256 cached rows, checked on whatever device exists."""
    from colibri_plan.backends.numpy_ref import attention_absorb_ref

    rng = np.random.default_rng(7)
    with OpenCL.open(0) as be:
        be.ls = 16
        for H, R, Dr, T in ((3, 67, 5, 300), (2, 20, 3, 1)):
            arrays = [rng.standard_normal(s, dtype=np.float32) for s in ((H, R), (H, Dr), (T, R), (T, Dr))]
            ref = attention_absorb_ref(*arrays, 0.3).astype(np.float64)
            assert _nerr(be.attention_absorb(*arrays, 0.3), ref) < 1e-5
