"""Vulkan device activations (backends/vulkan/device.py, batch.py): what is particular to Vulkan.

The numbers of every op on every backend are checked by the cross-backend oracle
(test_backends_device_ops.py); here: that a Vulkan DArray is a Vulkan buffer, that a chain of ops is
one submission, the device-only memory path (update, staging and read-back, as on a discrete GPU)
exercised on whatever device is present, buffer reuse, batches past their op limit, freeing a weight a
recorded op reads, the attention shader's edges (head_dim 256 and 576, tile boundaries, windows, long
prefill, key slices), and a chain of every op under the Khronos validation layer with synchronization
validation.
Skipped with the reason when no Vulkan device (lavapipe counts) or no validation layer is there.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.device_ops import attention_ref, rope_ref, rope_table
from colibri_plan.backends.vulkan import batch as vb
from colibri_plan.backends.vulkan import device as vd
from colibri_plan.errors import InputError, UnsupportedError

RNG = np.random.default_rng(11)


def _r(*shape, scale=1.0):
    return (RNG.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


def _err(y, ref):
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all()
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


@pytest.fixture(params=[(True, True), (False, True), (False, False)], ids=["mapped", "device-only", "sets"])
def be(request, tmp_path, monkeypatch):
    """An open backend (closed after the test): host-visible memory mapped or treated as device-only;
    push descriptors where the device has them, or ("sets") a descriptor set per dispatch."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cls = get_backend("vulkan")
    reason = cls.unavailable_reason()
    if reason is not None:
        pytest.skip(f"vulkan unavailable: {reason}")
    monkeypatch.setattr(cls, "push_descriptors", request.param[1])
    b = cls.open(0)
    try:
        assert b._d.push == (request.param[1] and b.facts.push_descriptor)
        b.d_map_host_visible = request.param[0]
        yield b
    finally:
        b.close()


def _count_submits(be, monkeypatch) -> list:
    calls, real = [], be._d.submit
    monkeypatch.setattr(be._d, "submit", lambda *a, **k: (calls.append(1), real(*a, **k)))
    return calls


def test_a_device_array_is_a_vulkan_buffer(be):
    x = _r(3, 8)
    a = be.d_put(x)
    assert isinstance(a.buf, vb.VkArray) and not isinstance(a.buf, np.ndarray)
    assert be.vk.ffi.typeof(a.buf.b.buf) is be.vk.ffi.typeof("VkBuffer")
    assert a.offset == 0 and a.buf.b.size >= x.nbytes
    assert (a.buf.b.map is not None) == (be.d_map_host_visible and be.device.kind != "gpu")
    v = be.d_view(a, (24,))
    assert v.buf is a.buf
    np.testing.assert_array_equal(be.d_get(v), x.reshape(-1))


def test_a_layer_chain_is_one_submission(be, monkeypatch):
    H, hq, hkv, d = 128, 4, 2, 32
    wq = quant.quantize(_r(hq * d, H, scale=H ** -0.5), "int8")
    wk = quant.quantize(_r(hkv * d, H, scale=H ** -0.5), "int4")
    uq, uk = be.upload(wq), be.upload(wk)
    table = rope_table(1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d)), 16)
    x, norm, s = _r(1, H), _r(H), _r(1)
    dt, dn = be.d_put(table), be.d_put(norm)
    kc, vc = be.d_zeros((16, hkv, d)), be.d_zeros((16, hkv, d))
    be.synchronize()
    calls = _count_submits(be, monkeypatch)
    dx = be.d_put(x)  # decode: the hidden state goes up inside the batch
    xn = be.d_scale_rows(be.d_rmsnorm(dx, dn, 1e-6), s)
    q = be.d_rope(be.d_view(be.d_matmul(xn, uq), (1, hq, d)), dt, 5, d, False)
    k = be.d_rope(be.d_view(be.d_matmul(xn, uk), (1, hkv, d)), dt, 5, d, False)
    be.d_write_rows(kc, 5, k)
    be.d_write_rows(vc, 5, k)
    bias = _r(hq * d)
    o = be.d_add(be.d_attention(q, kc, vc, 6, 5, d ** -0.5), be.d_put(bias))
    assert calls == []  # nothing submitted before the host asks
    y = be.d_get(o)
    assert len(calls) == 1
    # numpy, float64: cache rows 0..4 are zeros, row 5 is this token's k (also written as v)
    xx = x.astype(np.float64)
    xx = xx / np.sqrt((xx * xx).mean() + 1e-6) * norm * s[0]
    t64 = table.astype(np.float64)
    qq = rope_ref((xx @ quant.dequantize(wq).T).reshape(1, hq, d), t64, 5, d, False)
    kk = rope_ref((xx @ quant.dequantize(wk).T).reshape(1, hkv, d), t64, 5, d, False)
    cache = np.zeros((16, hkv, d))
    cache[5] = kk[0]
    ref = attention_ref(qq, cache, cache, 6, 5, d ** -0.5).astype(np.float64) + bias
    assert _err(y, ref) < 1e-4


@pytest.mark.parametrize("n,hidden,width,t", [(3, 256, 128, 1), (9, 200, 72, 1), (2, 128, 96, 3)])
def test_d_expert_ffn_runs_in_the_batch_and_equals_the_host_combine(be, monkeypatch, n, hidden, width, t):
    """The routed experts on a device x add no submission (no fence wait) to the batch and never take the
    host path; the result is the host path's (expert_ffn, then 0 + y_0·g_0 + ...) bit for bit: the same
    pipelines, and the gated sum's float32 products and sums in the same order, unfused. Rows: more
    experts than one dispatch takes (MAXE), H and I off the 128-float padding, a prefill of 3 tokens."""
    qts = [tuple(quant.quantize(_r(*s, scale=s[1] ** -0.5), "int8") for s in
                 ((width, hidden), (width, hidden), (hidden, width))) for _ in range(n)]
    ws = [be.upload_expert(*q) for q in qts]
    x, gates = _r(t, hidden), np.abs(_r(n)) + np.float32(0.05)
    host = np.zeros((t, hidden), np.float32)
    for yi, g in zip(be.expert_ffn([x] * n, ws), gates):
        host += yi * g
    dx = be.d_put(_r(t, hidden))  # an earlier op of the batch, overwritten below
    be.synchronize()
    calls = _count_submits(be, monkeypatch)
    monkeypatch.setattr(be, "expert_ffn", lambda *a: pytest.fail("d_expert_ffn took the host path"))
    dx = be.d_put(x)
    dy = be.d_add(be.d_expert_ffn(dx, ws, gates), dx)  # the residual add follows in the same batch
    assert calls == []  # recorded only: nothing submitted, nothing waited for
    y = be.d_get(dy)
    assert len(calls) == 1
    np.testing.assert_array_equal(y, host + x)
    ref = np.zeros((t, hidden))
    for (gq, uq, dq), g in zip(qts, gates):
        gg, uu, dd = (quant.dequantize(q).astype(np.float64) for q in (gq, uq, dq))
        h = x.astype(np.float64) @ gg.T
        ref += float(g) * ((h / (1 + np.exp(-h)) * (x @ uu.T)) @ dd.T)
    assert _err(y - x, ref) < 1e-4


def test_d_expert_ffn_of_mixed_formats_takes_the_host_path(be, monkeypatch):
    """Experts of two formats (the fused pipelines read one): the contract's host path, whose x comes
    down (a submission and wait) and whose numbers are the host combine's."""
    shapes = ((64, 128), (64, 128), (128, 64))
    ws = [be.upload_expert(*(quant.quantize(_r(*s, scale=0.1), fmt) for s in shapes))
          for fmt in ("int8", "int4")]
    x, gates = _r(1, 128), np.array([0.75, 0.5], np.float32)
    host = np.zeros((1, 128), np.float32)
    for yi, g in zip(be.expert_ffn([x] * 2, ws), gates):
        host += yi * g
    dx = be.d_put(x)
    be.synchronize()
    calls = _count_submits(be, monkeypatch)
    dy = be.d_expert_ffn(dx, ws, gates)
    assert len(calls) >= 2  # x down, then the experts
    np.testing.assert_array_equal(be.d_get(dy), host)


def test_descriptors_are_pushed_where_the_device_can(be):
    """With VK_KHR_push_descriptor a dispatch allocates no descriptor set; without it, one per dispatch."""
    x = be.d_put(_r(2, 64))
    y = be.d_silu_mul(be.d_add(x, x), be.d_scale_rows(x, np.ones(2, np.float32)))
    assert len(be.batch.current.sets) == (0 if be._d.push else 3)
    x64 = be.d_get(x).astype(np.float64)
    np.testing.assert_allclose(be.d_get(y), 2 * x64 / (1 + np.exp(-2 * x64)) * x64, rtol=1e-5, atol=1e-6)
    # the command buffer is kept for the next batch
    assert be.batch.current is None and be.batch.spare is not None and be.batch.spare.sets == []


def test_the_chain_matches_numpy_op_by_op(be):
    """The same ops as above checked value by value (the chain test counts submissions only)."""
    x, b = _r(4, 200), _r(200)
    dx = be.d_put(x)
    np.testing.assert_allclose(be.d_get(be.d_add(dx, be.d_put(b))), x + b, rtol=1e-6)
    np.testing.assert_allclose(be.d_get(be.d_scale_rows(dx, np.arange(4, dtype=np.float32))),
                               x * np.arange(4, dtype=np.float32)[:, None], rtol=1e-6)
    z = be.d_zeros((5, 3, 7))
    be.d_write_rows(z, 2, be.d_put(np.ones((2, 3, 7), np.float32)))
    ref = np.zeros((5, 3, 7), np.float32)
    ref[2:4] = 1.0
    np.testing.assert_array_equal(be.d_get(z), ref)


def test_large_uploads_are_staged_and_read_back_exactly(be):
    big = _r(2 * vb.INLINE_BYTES // 4 + 3)  # over the inline limit: staged on device-only memory
    small = _r(vb.UPDATE_BYTES // 4 + 5)  # two vkCmdUpdateBuffer chunks there
    a, s = be.d_put(big), be.d_put(small)
    np.testing.assert_array_equal(be.d_get(a), big)
    np.testing.assert_array_equal(be.d_get(s), small)
    np.testing.assert_array_equal(be.d_get(be.d_put(np.zeros((0, 4), np.float32))), np.zeros((0, 4)))


def test_freed_buffers_are_reused(be):
    a = be.d_put(_r(64, 64))
    handle = a.buf.b.buf
    be.synchronize()  # a device-only upload is recorded: its batch holds the buffer until it runs
    del a
    b = be.d_put(_r(60, 64))  # the same size class
    assert b.buf.b.buf == handle
    assert be.batch.pool.free_bytes == 0
    big = be.d_zeros((vb.POOL_MAX_BUFFER // 4 + 1,))  # a KV page: the bytes asked, not a size class
    assert big.buf.b.size == vb.POOL_MAX_BUFFER + 4
    del big
    be.synchronize()  # the recorded fill holds it until then
    assert be.batch.pool.free_bytes == 0  # released, not kept


def test_batches_past_the_op_limit_and_freed_weights(be, monkeypatch):
    monkeypatch.setattr(vb, "MAX_OPS", 3)
    calls = _count_submits(be, monkeypatch)
    x = _r(2, 40)
    acc, dx = be.d_put(x), be.d_put(x)
    for _ in range(10):
        acc = be.d_add(acc, dx)
    np.testing.assert_allclose(be.d_get(acc), 11 * x, rtol=1e-5)
    mapped = dx.buf.b.map is not None  # else the two uploads are recorded ops too
    assert len(calls) == (4 if mapped else 5)  # batches of 3 ops, then the read
    qt = quant.quantize(_r(33, 40), "f32")
    w = be.upload(qt)
    y = be.d_matmul(be.d_put(x), w)
    be.free(w)  # the recorded matmul runs before the weight's buffer goes
    np.testing.assert_allclose(be.d_get(y), x @ quant.dequantize(qt).T, rtol=1e-4, atol=1e-5)


def test_more_rows_than_one_grid_dimension(be, monkeypatch):
    monkeypatch.setattr(vd, "MAX_GROUPS", 7)  # as 65535 is on every device, without 65536 rows
    x, w = _r(30, 67), _r(67)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + 1e-6) * w
    assert _err(be.d_get(be.d_rmsnorm(be.d_put(x), be.d_put(w), 1e-6)), ref) < 1e-5  # a 7 x 5 grid
    np.testing.assert_allclose(be.d_get(be.d_silu_mul(be.d_put(x), be.d_put(x))), x / (1 + np.exp(-x)) * x,
                               rtol=1e-5, atol=1e-6)  # 7 workgroups loop over 2010 floats


@pytest.mark.parametrize("out,in_,t", [(40, 256, 1), (40, 256, 9), (17, 100, 9)])
def test_d_matmul_with_and_without_the_padded_copy(be, out, in_, t):
    qt = quant.quantize(_r(out, in_, scale=in_ ** -0.5), "int4-g32")
    x = _r(t, in_)
    y = be.d_get(be.d_matmul(be.d_put(x), be.upload(qt)))
    assert _err(y, x.astype(np.float64) @ quant.dequantize(qt).T.astype(np.float64)) < 1e-4


@pytest.mark.parametrize("t,hq,hkv,d,pos0,window", [
    (1, 2, 1, 256, 200, 0),    # the largest head_dim, one query over 4 tiles of 64 keys
    (70, 4, 1, 40, 0, 0),      # a prefill longer than a tile from an empty cache, groups of 4
    (2, 3, 3, 1, 63, 0),       # head_dim 1; the second query starts a new tile
    (3, 2, 1, 48, 129, 1),     # window 1: each query sees itself only
    (2, 2, 2, 24, 5, 500),     # a window wider than the history
    (1, 12, 1, 64, 100, 0),    # 12 query heads per kv head: 2 workgroups of 6
    (2, 32, 2, 128, 70, 0),    # 16 per kv head: 2 workgroups of 8 (the most) per kv head
    (3, 6, 2, 67, 40, 16),     # groups of 3, odd head_dim, a window
    (2, 16, 1, 576, 90, 0),    # MLA's 64 + 512 on one kv head: MAXD 640, 2 heads a workgroup
    (1, 3, 1, 1024, 70, 0),    # the widest head_dim, 3 heads of it (1 a workgroup)
])
def test_d_attention_edges(be, t, hq, hkv, d, pos0, window):
    n_keys = pos0 + t
    q, k, v = _r(t, hq, d), _r(n_keys + 3, hkv, d, scale=3.0), _r(n_keys + 3, hkv, d)
    ref = attention_ref(q, k, v, n_keys, pos0, 0.3, window).astype(np.float64)
    y = be.d_get(be.d_attention(be.d_put(q), be.d_put(k), be.d_put(v), n_keys, pos0, 0.3, window))
    assert y.shape == (t, hq * d)
    assert _err(y, ref) < 1e-5
    if window == 1:
        np.testing.assert_allclose(y.reshape(t, hq, d), v[pos0:pos0 + t][:, [0, 0]], rtol=1e-6)


def test_unsupported_head_dim_and_a_closed_backend_are_refused(be):
    q = be.d_put(np.zeros((1, 1, vd.MAX_HEAD_DIM + 1), np.float32))
    with pytest.raises(UnsupportedError, match=f"head_dim {vd.MAX_HEAD_DIM + 1}"):
        be.d_attention(q, q, q, 1, 0, 1.0)
    be.close()
    with pytest.raises(InputError, match="closed"):
        be.d_put(np.zeros(3, np.float32))


def test_device_time_of_a_batch(be):
    a = be.d_put(_r(8, 256))
    be.d_get(be.d_silu_mul(a, a))
    gpu = be.last_gpu_seconds()
    if gpu is None:
        pytest.skip(f"{be.device.name}: its compute queue has no timestamps")
    assert gpu > 0


@pytest.mark.parametrize("t,hq,hkv,d,pos0,window,min_keys", [
    (1, 4, 2, 64, 300, 0, 64),    # decode: 5 slices of 61 keys
    (20, 2, 1, 16, 0, 0, 1),      # prefill of 20 rows in 20 slices: row 0's slices 1..19 are empty
    (3, 2, 2, 33, 90, 40, 8),     # slices of a sliding window
])
def test_d_attention_key_slices_are_merged(be, monkeypatch, t, hq, hkv, d, pos0, window, min_keys):
    monkeypatch.setattr(vd, "ATT_MIN_KEYS", min_keys)
    be.d_att_workgroups = {be.device.kind: 10 ** 6}  # as many slices as ATT_MIN_KEYS allows
    grids, real = [], be.batch.dispatch
    monkeypatch.setattr(be.batch, "dispatch", lambda *a, **k: (grids.append(a[4:]), real(*a, **k)))
    n_keys = pos0 + t
    q, k, v = _r(t, hq, d), _r(n_keys, hkv, d, scale=3.0), _r(n_keys, hkv, d)
    ref = attention_ref(q, k, v, n_keys, pos0, 0.25, window).astype(np.float64)
    y = be.d_get(be.d_attention(be.d_put(q), be.d_put(k), be.d_put(v), n_keys, pos0, 0.25, window))
    keys = min(n_keys, window) if window else n_keys
    hg = max(n for n in range(1, min(hq // hkv, vd.ATT_MAX_HG) + 1) if (hq // hkv) % n == 0)
    assert grids == [(hq // hg, t, -(-keys // min_keys)), (t * hq,)]  # slices, then the merge
    assert _err(y, ref) < 1e-5


_VALIDATED_CHAIN = """
import numpy as np
from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.device_ops import rope_table
be = get_backend("vulkan").open(0)
be.d_att_workgroups = {be.device.kind: 10 ** 6}  # attention in key slices, then the merge
rng = np.random.default_rng(0)
for mapped in (True, False):
    be.d_map_host_visible = mapped
    be.batch.pool.trim()
    ones = be.d_put(np.ones(100, np.float32))
    x = be.d_put(rng.standard_normal((3, 100), np.float32))
    w = be.upload(quant.quantize(rng.standard_normal((64, 100), np.float32), "int4"))
    h = be.d_rmsnorm(be.d_add(x, ones), ones, 1e-6)
    g = be.d_scale_rows(be.d_silu_mul(be.d_matmul(h, w), be.d_matmul(h, w)), np.ones(3, np.float32))
    q = be.d_rope(be.d_view(g, (3, 4, 16)), be.d_put(rope_table(np.ones(8, np.float32), 8)), 2, 16, True)
    kc = be.d_zeros((8, 2, 16))
    be.d_write_rows(kc, 2, be.d_put(rng.standard_normal((3, 2, 16), np.float32)))
    be.d_get(be.d_attention(q, kc, kc, 5, 2, 0.25))
    be.d_write_rows(be.d_view(kc, (8, 32)), 6, be.d_put(rng.standard_normal((2, 8), np.float32)), 24)
    be.d_get(be.d_head_matmul(q, be.d_put(rng.standard_normal((4, 5, 16), np.float32))))
    ml = be.d_view(be.d_zeros((8, 1, 40)), (8, 40))  # an MLA latent cache: attention over MAXD 640
    be.d_write_rows(ml, 0, be.d_put(rng.standard_normal((3, 40), np.float32)))
    be.d_get(be.d_attention(be.d_put(rng.standard_normal((1, 2, 300), np.float32)),
                            *[be.d_put(rng.standard_normal((4, 1, 300), np.float32))] * 2, 4, 3, 0.1))
    be.d_get(be.d_put(rng.standard_normal(300000).astype(np.float32)))  # staged when device-only
    ex = [be.upload_expert(*(quant.quantize(rng.standard_normal(s, np.float32), "int8") for s in
                             ((40, 100), (40, 100), (100, 40)))) for _ in range(2)]
    for t in (1, 3):  # x padded, then read by every expert (decode) or repeated per expert (prefill)
        xe = be.d_rmsnorm(be.d_put(rng.standard_normal((t, 100), np.float32)), ones, 1e-6)
        be.d_get(be.d_expert_ffn(xe, ex, np.array([0.5, 0.25], np.float32)))
    be.free(w)
be.close()
print("done")
"""


def test_a_chain_is_clean_under_the_khronos_validation_layer(tmp_path):
    """Every op, in both memory modes, under VK_LAYER_KHRONOS_validation with synchronization validation:
    barriers that lavapipe forgives (it runs commands in order) would be races on a GPU."""
    import os
    import subprocess
    import sys

    from _require import skip_or_fail, validation_layer_problem

    reason = get_backend("vulkan").unavailable_reason() or validation_layer_problem()
    if reason is not None:  # a failure, not a skip, where the run requires vulkan (CI)
        skip_or_fail("vulkan", f"vulkan unavailable: {reason}")
    env = dict(os.environ, VK_INSTANCE_LAYERS="VK_LAYER_KHRONOS_validation", XDG_CACHE_HOME=str(tmp_path),
               VK_LAYER_ENABLES="VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT")
    run = subprocess.run([sys.executable, "-c", _VALIDATED_CHAIN], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("done")
    assert "Validation" not in run.stdout + run.stderr, (run.stdout + run.stderr)[:3000]
