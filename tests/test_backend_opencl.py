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


# ---- device activations (d_* ops): the numeric oracle is tests/test_backends_device_ops.py -----------
def _attn_case(be, rng, t, hq, hkv, d, pos0, window, cap=None):
    from colibri_plan.backends.device_ops import attention_ref

    n_keys = pos0 + t
    cap = cap or n_keys
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((t, hq, d), (cap, hkv, d), (cap, hkv, d)))
    ref = attention_ref(q, k, v, n_keys, pos0, d ** -0.5, window).astype(np.float64)
    y = be.d_get(be.d_attention(be.d_put(q), be.d_put(k), be.d_put(v), n_keys, pos0, d ** -0.5, window))
    assert y.shape == (t, hq * d) and _nerr(y, ref) < 1e-5, (t, hq, hkv, d, pos0, window)


def _layer_chain(be, rng):
    """Every d_* op once on ``be`` (a GQA layer's worth); returns the DArrays made and the host result."""
    from colibri_plan.backends.device_ops import rope_table

    H, d, t = 200, 16, 2  # H not a multiple of 128: matmul pads x on the device
    w = be.upload(_qt("int4-g32", 4 * d, H))
    x = be.d_put(_x(t, H))
    xn = be.d_rmsnorm(x, be.d_put(_x(1, H)[0]), 1e-6)
    table = be.d_put(rope_table(np.ones(d // 2), 8))
    q = be.d_rope(be.d_view(be.d_matmul(xn, w), (t, 4, d)), table, 0, d, True)
    kc = be.d_zeros((8, 4, d))
    be.d_write_rows(kc, 0, q)
    a = be.d_attention(q, kc, kc, t, 0, 0.25, 0)
    bias = be.d_put(rng.standard_normal(4 * d, dtype=np.float32))
    s = be.d_scale_rows(be.d_add(be.d_silu_mul(a, a), bias), np.array([0.5, 2.0], np.float32))
    return (x, xn, q, kc, a, s), be.d_get(s)


@needs_cl
def test_device_ops_run_the_opencl_kernels_not_the_numpy_reference(cache, monkeypatch):
    """Every d_* result is a pyopencl buffer, and a layer's chain of every op gives the numpy backend's
    result with the reference hooks disabled (each of them reads its inputs through HostArrays._host)."""
    import pyopencl as cl

    from colibri_plan.backends.reference import HostArrays

    _, ref = _layer_chain(get_backend("numpy").open(0), np.random.default_rng(3))

    def no_host(self, a):
        raise AssertionError("a numpy reference hook ran on the opencl backend")

    monkeypatch.setattr(HostArrays, "_host", no_host)
    with OpenCL.open(0) as be:
        arrays, y = _layer_chain(be, np.random.default_rng(3))
        for arr in arrays:
            assert isinstance(arr.buf, cl.MemoryObjectHolder) and arr.owner == id(be)
    assert y.shape == (2, 64) and _nerr(y, ref.astype(np.float64)) < 1e-5


@needs_cl
def test_d_put_copies_at_call_time_and_empty_arrays_work(cache):
    with OpenCL.open(0) as be:
        host = np.arange(12, dtype=np.float32).reshape(3, 4)
        a = be.d_put(host)
        s = np.array([2.0, 3.0, 4.0], np.float32)
        b = be.d_scale_rows(a, s)
        host[:] = -1.0  # the caller reuses its arrays at once: the uploads must not see this
        s[:] = 0.0
        want = np.arange(12, dtype=np.float32).reshape(3, 4)
        np.testing.assert_array_equal(be.d_get(a), want)
        np.testing.assert_array_equal(be.d_get(b), want * np.array([[2.0], [3.0], [4.0]], np.float32))
        assert be.d_get(be.d_zeros((0, 4))).shape == (0, 4)
        np.testing.assert_array_equal(be.d_get(be.d_zeros((2, 3))), np.zeros((2, 3), np.float32))
        y = be.d_matmul(be.d_put(np.zeros((0, 40), np.float32)), be.upload(_qt("int8", 8, 40)))
        assert be.d_get(y).shape == (0, 8)


@needs_cl
def test_device_ops_read_views_at_an_offset(cache):
    """DArrays may be sub-views (offset > 0) of a larger buffer: every op reads from the offset."""
    from colibri_plan.backends.device_ops import DArray, attention_ref, rope_ref, rope_table

    rng = np.random.default_rng(5)
    with OpenCL.open(0) as be:
        big = rng.standard_normal((5, 128), dtype=np.float32)
        whole = be.d_put(big)
        view = DArray((2, 128), whole.buf, whole.owner, offset=2 * 128)  # rows 2..3
        x = big[2:4].astype(np.float64)
        qt = _qt("int8", 24, 128)
        assert _nerr(be.d_get(be.d_matmul(view, be.upload(qt))), quant.matmul_ref(big[2:4], qt)) < 1e-5
        v7 = DArray((2, 128), whole.buf, whole.owner, offset=7)  # not 32-byte aligned, read in place
        x7 = big.reshape(-1)[7:263].reshape(2, 128)
        assert _nerr(be.d_get(be.d_matmul(v7, be.upload(qt))), quant.matmul_ref(x7, qt)) < 1e-5
        v60 = DArray((2, 60), whole.buf, whole.owner, offset=7)  # unaligned, and padded for matmul
        qt60 = _qt("int4", 9, 60)
        x60 = big.reshape(-1)[7:127].reshape(2, 60)
        assert _nerr(be.d_get(be.d_matmul(v60, be.upload(qt60))), quant.matmul_ref(x60, qt60)) < 1e-5
        wn = rng.standard_normal(128, dtype=np.float32)
        ref = x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-6) * wn
        assert _nerr(be.d_get(be.d_rmsnorm(view, be.d_put(wn), 1e-6)), ref) < 1e-5
        bias = DArray((128,), whole.buf, whole.owner, offset=0)
        assert _nerr(be.d_get(be.d_add(view, bias)), x + big[0]) < 1e-6
        up = DArray((2, 128), whole.buf, whole.owner, offset=128)  # rows 1..2, overlapping the view
        assert _nerr(be.d_get(be.d_silu_mul(view, up)), x / (1 + np.exp(-x)) * big[1:3]) < 1e-5
        table = rope_table(1.0 / (100.0 ** (np.arange(0, 8, 2) / 8)), 16)
        tv = be.d_put(np.concatenate([np.zeros(3, np.float32), table.reshape(-1)]))
        tview = DArray(table.shape, tv.buf, tv.owner, offset=3)
        r = be.d_rope(be.d_view(view, (2, 8, 16)), tview, 4, 8, False)
        assert _nerr(be.d_get(r), rope_ref(big[2:4].reshape(2, 8, 16), table, 4, 8, False)) < 1e-5
        q, kv = be.d_view(view, (2, 4, 32)), DArray((5, 2, 32), whole.buf, whole.owner, offset=0)
        kv_host = big.reshape(-1)[:320].reshape(5, 2, 32)  # the first 320 floats of `whole`
        ref = attention_ref(big[2:4].reshape(2, 4, 32), kv_host, kv_host, 5, 3, 0.2).astype(np.float64)
        assert _nerr(be.d_get(be.d_attention(q, kv, kv, 5, 3, 0.2)), ref) < 1e-5
        dst = be.d_zeros((6, 128))
        be.d_write_rows(dst, 3, view)
        got = be.d_get(dst)
        np.testing.assert_array_equal(got[3:5], big[2:4])
        assert not got[:3].any() and not got[5:].any()


@needs_cl
@pytest.mark.parametrize("ls,tile,splits", [(1, 64, None), (16, 64, None), (16, 5, 3), (64, 7, None),
                                           (1, 64, 7), (16, 16, 40)])
def test_attention_work_shapes_on_this_device(cache, ls, tile, splits):
    """attention_gqa with one item per group (CPU shape) and groups of 16/64 (GPU shapes: NACC > 1 and
    NACC = 1 channel per item, strided scores, local reductions), whole and short tiles (many tiles, a
    partial last one), keys split over work-groups and merged by attention_combine (some splits empty),
    head_dim up to 256 and odd, GQA/MQA, sliding windows, prefill and decode."""
    rng = np.random.default_rng(ls * 100 + tile)
    with OpenCL.open(0) as be:
        be.ls, be.attn_tile, be.attn_splits = ls, tile, splits
        for case in ((1, 8, 2, 256, 130, 0), (3, 6, 3, 255, 70, 0), (4, 2, 1, 67, 0, 0), (2, 4, 4, 1, 20, 0),
                     (5, 4, 2, 40, 90, 9), (1, 2, 2, 128, 300, 1), (6, 3, 1, 24, 2, 100)):
            _attn_case(be, rng, *case)


@needs_cl
def test_trunk_gpu_work_shape_on_this_device(cache):
    """d_matmul (x padded on the device) and d_rmsnorm with a work-group of 16 per row."""
    with OpenCL.open(0) as be:
        be.ls = 16
        for fmt, out, in_, T in (("int4", 33, 200, 1), ("int8", 40, 256, 5), ("bf16", 7, 131, 3)):
            qt, x = _qt(fmt, out, in_), _x(T, in_)
            assert _nerr(be.d_get(be.d_matmul(be.d_put(x), be.upload(qt))), quant.matmul_ref(x, qt)) < 1e-5
        xn, wn = _x(3, 300) * 3, _x(1, 300)[0]
        ref = xn / np.sqrt((xn.astype(np.float64) ** 2).mean(1, keepdims=True) + 1e-6) * wn
        assert _nerr(be.d_get(be.d_rmsnorm(be.d_put(xn), be.d_put(wn), 1e-6)), ref) < 1e-5


@needs_cl
def test_attention_head_dim_beyond_local_memory_is_refused(cache):
    from colibri_plan.errors import UnsupportedError

    with OpenCL.open(0) as be:
        d = be.dev.local_mem_size // 8  # one K row plus the query already fill local memory
        q = be.d_zeros((1, 1, d))
        with pytest.raises(UnsupportedError, match="local memory"):
            be.d_attention(q, q, q, 1, 0, 1.0)


def _experts(be, specs, seed=0):
    """Uploaded experts of (gate/up fmt, down fmt, I, H) each, and their quantized tensors."""
    qts = [(_qt(f, i, h, seed + 3 * k), _qt(f, i, h, seed + 3 * k + 1), _qt(fd, h, i, seed + 3 * k + 2))
           for k, (f, fd, i, h) in enumerate(specs)]
    return [be.upload_expert(*q) for q in qts], qts


@needs_cl
@pytest.mark.parametrize("ls", [1, 16])
def test_d_expert_ffn_runs_on_the_device_without_a_host_transfer(cache, monkeypatch, ls):
    """Experts of mixed formats and widths on a device x (a view at an offset, H = 200 padded on the
    device): the only copy is the gates' upload (non-blocking, n floats), nothing is read back, the
    result is a pyopencl buffer, and it equals the host combine (expert_ffn, 0 + y_0·g_0 + ...) bit for
    bit, since the kernels are the host path's and expert_sum keeps its float32 order."""
    import pyopencl as cl

    from colibri_plan.backends.handles import DArray
    from colibri_plan.backends.reference import HostArrays

    with OpenCL.open(0) as be:
        be.ls = ls
        H, T = 200, 2
        ws, _ = _experts(be, [("int8", "int8", 96, H), ("int4-g32", "int4", 64, H), ("int8", "int8", 96, H)])
        big = _x(T + 1, H, 4)
        whole = be.d_put(big)
        dx = DArray((T, H), whole.buf, whole.owner, offset=H)  # rows 1..2
        gates = np.float32([0.5, 0.25, 1.5])
        be.synchronize()
        copies = []
        real_copy = cl.enqueue_copy

        def counted(queue, dest, src, **kw):
            copies.append((type(dest).__name__, type(src).__name__, getattr(src, "nbytes", None),
                           kw.get("is_blocking", True)))
            return real_copy(queue, dest, src, **kw)

        def no_host(*a, **k):
            raise AssertionError("d_expert_ffn read device memory back to the host")

        with monkeypatch.context() as m:  # only around the call: the cache fixture's setting stays
            m.setattr(cl, "enqueue_copy", counted)
            m.setattr(HostArrays, "_host", no_host)
            m.setattr(be, "_d_get", no_host)
            y = be.d_expert_ffn(dx, ws, gates)
        assert isinstance(y.buf, cl.MemoryObjectHolder) and y.shape == (T, H)
        assert copies == [("PooledBuffer", "ndarray", 12, False)]  # the 3 gates, up, not waited on
        host = np.zeros((T, H), np.float32)
        for yi, g in zip(be.expert_ffn([big[1:]] * 3, ws), gates):
            host += yi * g
        np.testing.assert_array_equal(be.d_get(y), host)


@needs_cl
def test_d_expert_ffn_unfusable_expert_takes_the_host_path(cache):
    """An expert whose gate and up formats differ: the contract's host path, same result as the host."""
    with OpenCL.open(0) as be:
        q = (_qt("int8", 32, 128), _qt("int4", 32, 128, 1), _qt("int8", 128, 32, 2))
        w, x = be.upload_expert(*q), _x(1, 128)
        y = be.d_get(be.d_expert_ffn(be.d_put(x), [w], np.float32([2.0])))
        np.testing.assert_array_equal(y, np.float32(0) + be.expert_ffn([x], [w])[0] * np.float32(2.0))


@needs_cl
@pytest.mark.parametrize("ls", [1, 16])
def test_d_matmul_many_stacks_weights_in_one_launch(cache, monkeypatch, ls):
    """Six weights (two formats, x padded from 200 columns): one matmul_many launch per format and group
    of up to four (a lone weight: matmul), and every result equals d_matmul's bit for bit."""
    with OpenCL.open(0) as be:
        be.ls = ls
        shapes = [("int8", 64), ("int8", 16), ("int4", 40), ("int8", 16), ("int8", 8), ("int8", 24)]
        ws = [be.upload(_qt(f, o, 200, k)) for k, (f, o) in enumerate(shapes)]
        dx = be.d_put(_x(3, 200, 9))
        launched = []
        real = be._launch
        with monkeypatch.context() as m:
            m.setattr(be, "_launch", lambda knl, *a: launched.append(knl.function_name) or real(knl, *a))
            ys = be.d_matmul_many(dx, ws)
        assert launched == ["matmul_many", "matmul", "matmul"]  # int8: 4 + 1 weights, int4: 1
        for w, y, (_, o) in zip(ws, ys, shapes):
            assert y.shape == (3, o)
            np.testing.assert_array_equal(be.d_get(y), be.d_get(be.d_matmul(dx, w)))
