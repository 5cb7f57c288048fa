"""The ``cpu`` backend's grouped int4 kernels (backends/cpu_q4g.py): per-row int4, int4-g64 and
int4-g128 on the transposed layout, each group's lanes summed in int32 before one float scale.

Each layout the upload can choose is compared with the float64 reference of the same quantized weights
under the bound of int16 activation rounding; a token must give the same bits alone, in a batch (4, 2
and 1 tokens per weight load), serially, in parallel and in the batched expert kernels; the numba-loop
fallback of hosts without AVX-512 VNNI is compiled here and checked too.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from test_backend_cpu_kernels import be, pytestmark, without_vnni  # noqa: F401 - fixture, skip reason

from colibri_plan import quant


def _ref_and_bound(x: np.ndarray, qt: quant.QuantTensor):
    """(float64 reference [T, out], per-output bound of int16 activation rounding plus float32 slack)."""
    w = quant.dequantize(qt).astype(np.float64)  # [out, in]
    sx = np.abs(x).max(axis=1, keepdims=True) / 32767.0  # [T, 1]
    bound = 0.5 * sx * np.abs(w).sum(axis=1)[None, :] + 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(w).T)
    return x.astype(np.float64) @ w.T, bound + 1e-30


# (format, in_features, (bytes per lane J, fold = lanes per group)): the transposed layouts of cpu_q4g
GROUPED = [
    ("int4", 4096, (16, 128)), ("int4", 3072, (8, 192)), ("int4", 1024, (8, 64)), ("int4", 8192, (16, 256)),
    ("int4-g64", 4096, (16, 2)), ("int4-g64", 1024, (8, 4)), ("int4-g64", 2048, (16, 2)),
    ("int4-g128", 2048, (16, 4)), ("int4-g128", 6144, (16, 4)),
]


@pytest.mark.parametrize("fmt,in_,layout", GROUPED, ids=lambda v: str(v))
def test_grouped_layout_batch_serial_parallel(be, fmt, in_, layout):  # noqa: F811 - the fixture
    rng = np.random.default_rng([in_, len(fmt)])
    out = 150  # two 128-row steps, the second partial; RB = 4 does not divide it either
    qt = quant.quantize(rng.standard_normal((out, in_), dtype=np.float32), fmt)
    w = be.upload(qt)
    hw = w.payload
    assert hw.kernel is be._k.i4g_matmul and hw.serial is be._k.i4g_matmul_1
    assert (hw.data3.shape[2], hw.fold) == layout and hw.data3.shape[3] == 64
    groups = 1 if qt.scales.ndim == 1 else qt.scales.shape[1]
    assert hw.data3.shape[1] * 64 == groups * hw.fold  # chunks of 64 lanes
    assert hw.scales2.shape == (out, groups)  # the scales as stored, not one per lane
    # the payload keeps the transposed copy only, not the packed rows too (same logical size)
    assert hw.qt.data.strides == (0, 0) and hw.qt.nbytes == qt.nbytes == w.nbytes
    x = rng.standard_normal((7, in_), dtype=np.float32) * np.float32(3.0)
    x[2, 5] = -40.0  # one large activation: the int16 scale follows it
    batch = be.matmul(x, w)  # 7 tokens: weight loads of 4, 2 and 1 tokens
    single = np.concatenate([be.matmul(x[t:t + 1], w) for t in range(7)])
    np.testing.assert_array_equal(batch, single)
    old = be.serial_bytes
    try:
        be.serial_bytes = 0  # every call on the parallel kernel
        parallel = be.matmul(x, w)
        be.serial_bytes = 1 << 40  # every call on the calling thread's twin
        serial = be.matmul(x, w)
    finally:
        be.serial_bytes = old
    np.testing.assert_array_equal(batch, parallel)
    np.testing.assert_array_equal(batch, serial)
    ref, bound = _ref_and_bound(x, qt)
    err = np.abs(batch - ref)
    assert (err <= bound).all(), f"max error {err.max():.3g}"
    be.free(w)


@pytest.mark.parametrize("fmt,in_,blocks", [("int4", 1536, 256), ("int4", 67, 16), ("int4-g128", 1024, 64),
                                            ("int4-g128", 300, 64)])
def test_other_lengths_keep_blocked_kernels(be, fmt, in_, blocks):  # noqa: F811 - the fixture
    # rows not of 512·n bytes (per-row) or 16·n groups (g128) keep cpu_qkernels' blocked layout
    rng = np.random.default_rng(11)
    qt = quant.quantize(rng.standard_normal((40, in_), dtype=np.float32), fmt)
    w = be.upload(qt)
    assert w.payload.fold == 0 and w.payload.data3.shape[2] == blocks
    x = rng.standard_normal((2, in_), dtype=np.float32)
    ref, bound = _ref_and_bound(x, qt)
    assert (np.abs(be.matmul(x, w) - ref) <= bound).all()
    be.free(w)


@pytest.mark.parametrize("fmt", ["int4", "int4-g128"])
def test_every_code_and_full_scale_activations_are_exact(be, fmt):  # noqa: F811 - the fixture
    # all 16 codes with negative and positive scales against activations at ±32767 (xq's full range):
    # the int32 group sums must not wrap; 8192 columns per row is the longest the old blocks summed
    n, out = 8192, 32
    rng = np.random.default_rng(12)
    qt = quant.quantize(rng.standard_normal((out, n), dtype=np.float32), fmt)
    data = np.tile(np.arange(256, dtype=np.uint8), (out, n // 2 // 256))  # every (low, high) code pair
    data[: out // 2] = 0x00  # code 0 everywhere: (0 − 8)·scale, the largest magnitude
    scales = np.abs(qt.scales) * np.where(np.arange(out) % 3 == 0, -1.0, 1.0).reshape(
        (out,) + (1,) * (qt.scales.ndim - 1)).astype(np.float32)
    qt = quant.QuantTensor(fmt, out, n, data, scales.astype(np.float32))
    w = be.upload(qt)
    assert w.payload.fold > 0
    x = np.full((3, n), 1.0, np.float32)
    x[1, ::2] = -1.0
    x[2] = rng.standard_normal(n).astype(np.float32)
    y = be.matmul(x, w)
    ref, bound = _ref_and_bound(x, qt)
    assert (np.abs(y - ref) <= bound).all(), f"max error {np.abs(y - ref).max():.3g}"
    be.free(w)


@pytest.mark.parametrize("fmt", ["int4", "int4-g64", "int4-g128"])
def test_batched_experts_bit_equal_per_token(be, fmt):  # noqa: F811 - the fixture
    # the batched expert kernels (cpu_q4g.experts_*_g) run the same rows: each token's output alone
    # equals its row of a 5-token batch, and the result matches the float64 reference
    rng = np.random.default_rng(13)
    H, inter = 2048, 1024
    shapes = ((inter, H), (inter, H), (H, inter))
    qts = [quant.quantize(rng.standard_normal(s, dtype=np.float32) * np.float32(s[1] ** -0.5), fmt)
           for s in shapes]
    e = be.upload_expert(*qts)
    assert e.gate.payload.experts == (be._k.experts_gate_up_g, be._k.experts_matmul_g)
    x = rng.standard_normal((5, H), dtype=np.float32)
    (y,) = be.expert_ffn([x], [e])
    for t in range(5):
        (yt,) = be.expert_ffn([x[t:t + 1]], [e])
        np.testing.assert_array_equal(yt, y[t:t + 1])
    g, u = (x @ quant.dequantize(q).T.astype(np.float64) for q in qts[:2])
    ref = (g / (1 + np.exp(-g)) * u) @ quant.dequantize(qts[2]).T.astype(np.float64)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 5e-4
    # a decode step's weighted sum over two experts, one call, against the per-expert outputs
    e2 = be.upload_expert(*[quant.quantize(rng.standard_normal(s, dtype=np.float32)
                                           * np.float32(s[1] ** -0.5), fmt) for s in shapes])
    gates = np.array([0.7, 0.3], np.float32)
    s = be.expert_ffn_sum(x[:1], [e, e2], gates)
    y1, y2 = be.expert_ffn([x[:1], x[:1]], [e, e2])
    np.testing.assert_array_equal(s, np.float32(0.0) + y1 * gates[0] + y2 * gates[1])


def test_grouped_without_vnni_matches_bound(be, tmp_path):  # noqa: F811 - the fixture
    # hosts without AVX-512 VNNI compile cpu_q4g's numba loops (VNNI a compile-time constant): a copy
    # of the module with it off, compiled here, for every entry width (R = 4 per-row and g128, R = 2 g64)
    from colibri_plan.backends.cpu import q4g as cpu_q4g

    plain = without_vnni(cpu_q4g, "\n#: sha256 (16 hex digits each)", tmp_path)
    rng = np.random.default_rng(14)
    for fmt, n in (("int4", 2048), ("int4-g64", 2048), ("int4-g64", 1024), ("int4-g128", 2048)):
        qt = quant.quantize(rng.standard_normal((70, n), dtype=np.float32), fmt)
        w = be.upload(qt)
        hw = w.payload
        x = rng.standard_normal((6, n), dtype=np.float32)
        ys = []
        for tokens in (6, 1):
            y = np.empty((tokens, 70), np.float32)
            plain.i4g_matmul_1(hw.data3, hw.scales2, *be._xq(x[:tokens], hw), y)
            ys.append(y)
        np.testing.assert_array_equal(ys[0][:1], ys[1])  # batch and single token: same bits
        ref, bound = _ref_and_bound(x, qt)
        assert (np.abs(ys[0] - ref) <= bound).all(), fmt
        fast = be.matmul(x, w)  # the compiled module: the same integers, its own float32 sum order
        np.testing.assert_allclose(ys[0], fast, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        be.free(w)


def test_q4g_names_the_sources_it_was_compiled_against():
    # numba caches cpu_q4g's kernels by that file's contents: cpu_vnni's intrinsics and cpu_q4t's inlined
    # functions are compiled into them, so a change of either must come with KERNEL_SOURCES updated
    from colibri_plan.backends.cpu import q4g as cpu_q4g
    from colibri_plan.backends.cpu import q4t as cpu_q4t
    from colibri_plan.backends.cpu import vnni as cpu_vnni

    digests = tuple(hashlib.sha256(open(m.__file__, "rb").read()).hexdigest()[:16]
                    for m in (cpu_vnni, cpu_q4t))
    assert cpu_q4g.KERNEL_SOURCES == digests, f"set cpu_q4g.KERNEL_SOURCES = {digests!r}"
