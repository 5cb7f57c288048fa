"""The ``cpu`` backend's integer kernels (backends/cpu_qkernels.py) and their weight layouts.

Every layout variant the upload can choose (int8 and per-row int4 blocks of each size and the padded
case; int4-g32/g64 transposed with each fold; int4-g128 blocks) is compared with the float64 reference
of the same quantized weights, under the error bound of int16 activation rounding. A prefill batch
must give bit for bit what its tokens give one at a time (the batch only changes the loop order).
"""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import get_backend

cpu_cls = get_backend("cpu")
pytestmark = pytest.mark.skipif(cpu_cls.unavailable_reason() is not None,
                                reason=str(cpu_cls.unavailable_reason()))


@pytest.fixture(scope="module")
def be():
    b = cpu_cls.open(0)
    yield b
    b.close()


def without_vnni(module, anchor: str, tmp_path):
    """A copy of numba kernel ``module`` compiled here with ``VNNI = False`` set at ``anchor`` (a line
    after the imports, so it shadows cpu_vnni's) and no file cache: the loops a host without AVX-512 VNNI
    runs. Raises AssertionError when ``anchor`` is not in the source."""
    import importlib.util

    src = open(module.__file__).read().replace("cache=True", "cache=False")
    assert anchor in src
    name = module.__name__.rsplit(".", 1)[-1] + "_plain"
    path = tmp_path / f"{name}.py"
    path.write_text(src.replace(anchor, "\nVNNI = False\n" + anchor))
    spec = importlib.util.spec_from_file_location(name, path)
    plain = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plain)
    return plain


def _bound(x: np.ndarray, qt: quant.QuantTensor) -> np.ndarray:
    """Per-output bound [T, out] of int16 activation rounding: 0.5 · (max|x_t| / 32767) · Σ|w|, plus
    float32 accumulation slack."""
    w = np.abs(quant.dequantize(qt).astype(np.float64))  # [out, in]
    sx = np.abs(x).max(axis=1, keepdims=True) / 32767.0  # [T, 1]
    ref_mag = np.abs(x).astype(np.float64) @ w.T
    return 0.5 * sx * w.sum(axis=1)[None, :] + 1e-6 * ref_mag + 1e-30


# (format, in_features, what the upload must choose): block bytes (int8/int4/g128) or, transposed,
# (J, fold) (int4 rows of 512·n bytes and int4-g128 of 16·n groups too: tests/test_backend_cpu_q4g.py)
LAYOUTS = [
    ("int8", 512, 256), ("int8", 192, 64), ("int8", 48, 16), ("int8", 37, 16),
    ("int4", 4096, (16, 128)), ("int4", 1024, (8, 64)), ("int4", 1536, 256), ("int4", 384, 64),
    ("int4", 96, 16), ("int4", 67, 16),
    ("int4-g32", 2048, (16, 1)), ("int4-g32", 6144, (16, 1)), ("int4-g32", 1024, (8, 2)),
    ("int4-g32", 512, (4, 4)),
    ("int4-g32", 67, (4, 4)),
    ("int4-g64", 4096, (16, 2)), ("int4-g64", 1024, (8, 4)), ("int4-g64", 131, (8, 4)),
    ("int4-g128", 2048, (16, 4)), ("int4-g128", 1024, 64), ("int4-g128", 300, 64),
]


@pytest.mark.parametrize("fmt,in_,layout", LAYOUTS, ids=lambda v: str(v))
def test_layout_and_result(be, fmt, in_, layout):
    rng = np.random.default_rng([in_, len(fmt)])
    out = 40  # not a multiple of the 32-row tile
    qt = quant.quantize(rng.standard_normal((out, in_), dtype=np.float32), fmt)
    w = be.upload(qt)
    hw = w.payload
    if isinstance(layout, tuple):
        J, fold = layout
        assert (hw.fold, hw.data3.shape[2]) == (fold, J)
        lanes = (qt.scales.shape[1] if qt.scales.ndim == 2 else 1) * fold  # per-row: one group
        assert hw.data3.shape[1] * hw.data3.shape[3] == lanes
        assert hw.data3.shape[3] == (64 if lanes % 64 == 0 else lanes)  # chunks of 64 lanes
    else:
        assert hw.fold == 0 and hw.data3.shape[2] == layout
    x = rng.standard_normal((3, in_), dtype=np.float32) * np.float32(3.0)
    x[1, 5] = 40.0  # one large activation: the int16 scale follows it
    y = be.matmul(x, w)
    ref = x.astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T
    err = np.abs(y - ref)
    assert (err <= _bound(x, qt)).all(), f"max error {err.max():.3g}"
    be.free(w)


@pytest.mark.parametrize("fmt,in_,tokens", [
    ("int8", 1024, 16), ("int4", 1024, 16), ("int4-g64", 1024, 16), ("int4-g128", 1024, 16),
    # int4-g32 at 4, 8 and 16 bytes per lane; 7 tokens run the prefill loop in groups of 4, 2 and 1
    ("int4-g32", 1024, 16), ("int4-g32", 512, 7), ("int4-g32", 2048, 7), ("int4-g32", 67, 5)])
def test_prefill_batch_equals_single_tokens(be, fmt, in_, tokens):
    rng = np.random.default_rng(3)
    qt = quant.quantize(rng.standard_normal((70, in_), dtype=np.float32), fmt)
    w = be.upload(qt)
    x = rng.standard_normal((tokens, in_), dtype=np.float32)
    batch = be.matmul(x, w)
    single = np.concatenate([be.matmul(x[t:t + 1], w) for t in range(tokens)])
    np.testing.assert_array_equal(batch, single)
    ref = x.astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T
    assert (np.abs(batch - ref) <= _bound(x, qt)).all()
    be.free(w)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g32", "int4-g64"])
def test_fused_gate_up_matches_three_matmuls(be, fmt):
    rng = np.random.default_rng(4)
    H, inter = 512, 96
    qts = [quant.quantize(rng.standard_normal(s, dtype=np.float32) * np.float32(s[1] ** -0.5), fmt)
           for s in ((inter, H), (inter, H), (H, inter))]
    e = be.upload_expert(*qts)
    x = rng.standard_normal((5, H), dtype=np.float32)
    (y,) = be.expert_ffn([x], [e])
    g, u = (x @ quant.dequantize(q).T.astype(np.float64) for q in qts[:2])
    h = g / (1 + np.exp(-g)) * u
    ref = h @ quant.dequantize(qts[2]).T.astype(np.float64)
    assert np.abs(y - ref).max() / np.abs(ref).max() < 5e-4


def test_zero_and_extreme_activations(be):
    rng = np.random.default_rng(5)
    qt = quant.quantize(rng.standard_normal((33, 256), dtype=np.float32), "int8")
    w = be.upload(qt)
    x = np.zeros((2, 256), np.float32)
    x[1, 7] = -1e30  # one huge value: scale 1e30/32767, still finite
    y = be.matmul(x, w)
    assert (y[0] == 0).all()
    ref = -1e30 * quant.dequantize(qt)[:, 7].astype(np.float64)
    np.testing.assert_allclose(y[1], ref, rtol=1e-6)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g32h"])
def test_serial_kernels_equal_parallel(be, fmt):
    # small matmuls run the single-thread kernels (cpu.serial_bytes): same tiles, same numbers
    rng = np.random.default_rng(6)
    qt = quant.quantize(rng.standard_normal((70, 1024), dtype=np.float32), fmt)
    w = be.upload(qt)
    tokens = min(4, be.serial_limit(w.payload) // qt.nbytes)  # the default takes the serial path here
    assert tokens >= 1
    x = rng.standard_normal((tokens, 1024), dtype=np.float32)
    assert (w.payload.serial is None) == (fmt == "int4-g128")  # g128: a parallel kernel only
    serial = be.matmul(x, w)
    old, be.serial_bytes = be.serial_bytes, 0
    try:
        parallel = be.matmul(x, w)
    finally:
        be.serial_bytes = old
    np.testing.assert_array_equal(serial, parallel)
    ref = x.astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T
    assert (np.abs(serial - ref) <= _bound(x, qt)).all()
    be.free(w)


def test_int4t_without_vnni_matches_bound(be, tmp_path):
    # hosts without AVX-512 VNNI compile cpu_q4t's numba loops instead of the vpdpwssd intrinsics
    # (cpu_q4t.VNNI is a compile-time constant): a copy of the module with it off, compiled here
    from colibri_plan.backends.cpu import q4t as cpu_q4t
    from colibri_plan.backends.cpu.layout import lane_scales, unbytes_layout

    plain = without_vnni(cpu_q4t, "\n#: rows per parallel step", tmp_path)
    rng = np.random.default_rng(7)
    qt = quant.quantize(rng.standard_normal((70, 2048), dtype=np.float32), "int4-g32")
    w = be.upload(qt)
    hw = w.payload
    for tokens in (1, 6):
        x = rng.standard_normal((tokens, 2048), dtype=np.float32)
        y = np.empty((tokens, 70), np.float32)
        # the upload stores vnni.byte_dots' byte layout and the group scales on VNNI hosts; the numba
        # loops read the lanes and one scale per lane
        wt = unbytes_layout(hw.data3) if cpu_q4t.VNNI else hw.data3
        plain.i4t_matmul_1(wt, lane_scales(hw), *be._xq(x, hw), y)
        ref = x.astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T
        assert (np.abs(y - ref) <= _bound(x, qt)).all()
        fast = be.matmul(x, w)  # the compiled module: the same integers, its own float32 sum order
        np.testing.assert_allclose(y, fast, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    be.free(w)


def test_q4t_names_the_vnni_source_it_was_compiled_against():
    # numba caches cpu_q4t's kernels by that file's contents: cpu_vnni's intrinsics are compiled into
    # them, so a change of cpu_vnni must come with a change of cpu_q4t.VNNI_SOURCE, or stale code runs
    import hashlib

    from colibri_plan.backends.cpu import q4t as cpu_q4t
    from colibri_plan.backends.cpu import vnni as cpu_vnni

    digest = hashlib.sha256(open(cpu_vnni.__file__, "rb").read()).hexdigest()[:16]
    assert cpu_q4t.VNNI_SOURCE == digest, f"set cpu_q4t.VNNI_SOURCE = {digest!r}"
    # the same for cpu_qkernels, whose int8 block dot is vnni's intrinsic
    from colibri_plan.backends.cpu import qkernels as cpu_qkernels

    assert cpu_qkernels.VNNI_SOURCE == digest, f"set cpu_qkernels.VNNI_SOURCE = {digest!r}"
    # and the multi-row int8 dots of cpu_vnni8, compiled into cpu_qkernels' int8 tiles
    from colibri_plan.backends.cpu import vnni8 as cpu_vnni8

    digest8 = hashlib.sha256(open(cpu_vnni8.__file__, "rb").read()).hexdigest()[:16]
    assert cpu_qkernels.VNNI8_SOURCE == digest8, f"set cpu_qkernels.VNNI8_SOURCE = {digest8!r}"


@pytest.mark.parametrize("shape,tokens", [((70, 1024), 1), ((300, 2048), 4), ((33, 67), 3)])
def test_int4_g32h_runs_the_int4_g32_kernels_bit_for_bit(be, shape, tokens):
    # float16 scales widen exactly at upload: the same kernel products as the int4-g32 tensor of the
    # same values (quant.widen_scales), for the serial, parallel and padded (odd width) layouts
    rng = np.random.default_rng(list(shape) + [tokens])
    qt = quant.quantize(rng.standard_normal(shape, dtype=np.float32), "int4-g32h")
    x = rng.standard_normal((tokens, shape[1]), dtype=np.float32)
    h, g = be.upload(qt), be.upload(quant.widen_scales(qt))
    assert h.nbytes == qt.nbytes < g.nbytes  # accounted at the stored 4.5 bits a weight
    np.testing.assert_array_equal(be.matmul(x, h), be.matmul(x, g))


def test_the_vnni_int8_block_dot_is_the_exact_integer_sum():
    """vnni._dot8_vnni (vpmovsxbw + vpdpwssd): Σ int32(w)·int32(x) over blocks of 32·k int8 weights and
    int16 activations, equal to numpy's int64 sum (|sum| < 2^31 at qkernels' 256-column blocks)."""
    from colibri_plan.backends.cpu import vnni as cpu_vnni

    if not cpu_vnni.VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI: the int8 kernels keep their loop")
    from numba import njit

    dot = cpu_vnni._dot8_vnni

    @njit
    def blocks(w3, x3, out):
        for r in range(w3.shape[0]):
            for b in range(w3.shape[1]):
                out[r, b] = dot(w3, (r * w3.shape[1] + b) * w3.shape[2], x3, b * w3.shape[2], w3.shape[2])

    rng = np.random.default_rng(7)
    for bb in (32, 64, 256):
        w3 = rng.integers(-127, 128, (5, 3, bb), dtype=np.int8)
        w3[0, 0, :] = -127  # the extremes of both operands
        x3 = rng.integers(-32767, 32768, (1, 3, bb), dtype=np.int16)
        x3[0, 0, :] = 32767
        out = np.zeros((5, 3), np.int32)
        blocks(w3, x3, out)
        ref = np.einsum("rbj,bj->rb", w3.astype(np.int64), x3[0].astype(np.int64))
        assert np.array_equal(out.astype(np.int64), ref), bb


def test_the_vnni8_row_dots_are_the_one_row_float_sums():
    """vnni8's 4-row, 2-row and 1-row int8 dots (prefetching, block sums reduced together): per row the
    float32 sum over blocks of each block's exact int32 dot, in block order, the bits of qkernels._row8;
    the int32 block sums at the operands' extremes equal numpy's int64 ones."""
    from colibri_plan.backends.cpu import qkernels as cpu_qkernels
    from colibri_plan.backends.cpu import vnni as cpu_vnni
    from colibri_plan.backends.cpu.vnni8 import _rows8x1, _rows8x2, _rows8x4

    if not cpu_vnni.VNNI:
        pytest.skip("this CPU has no AVX-512 VNNI: the int8 kernels keep their loop")
    from numba import njit

    @njit
    def dots(w3, x3, t, out4, out2, out1, ref):
        n = w3.shape[1] * w3.shape[2]
        for r in range(0, w3.shape[0] - 3, 4):
            a = _rows8x4(w3, r * n, n, x3, t * n, w3.shape[1], w3.shape[2])
            for i in range(4):
                out4[r + i] = a[i]
        for r in range(0, w3.shape[0] - 1, 2):
            out2[r], out2[r + 1] = _rows8x2(w3, r * n, n, x3, t * n, w3.shape[1], w3.shape[2])
        for r in range(w3.shape[0]):
            out1[r] = _rows8x1(w3, r * n, n, x3, t * n, w3.shape[1], w3.shape[2])[0]
            ref[r] = cpu_qkernels._row8(w3, r, x3, t)

    rng = np.random.default_rng(8)
    for rows, blocks, bb in ((8, 3, 64), (12, 8, 256), (4, 1, 256)):
        w3 = rng.integers(-127, 128, (rows, blocks, bb), dtype=np.int8)
        w3[0] = -127  # the extremes of both operands: |block sum| = 256·127·32767 < 2^31
        x3 = rng.integers(-32767, 32768, (2, blocks, bb), dtype=np.int16)
        x3[1] = 32767
        for t in (0, 1):
            out4, out2, out1, ref = (np.zeros(rows, np.float32) for _ in range(4))
            dots(w3, x3, t, out4, out2, out1, ref)
            np.testing.assert_array_equal(out4, ref)
            np.testing.assert_array_equal(out2, ref)
            np.testing.assert_array_equal(out1, ref)
            exact = np.einsum("rbj,bj->rb", w3.astype(np.int64), x3[t].astype(np.int64))
            f32 = np.zeros(rows, np.float32)
            for b in range(blocks):  # the float32 sum of the exact block sums, in block order
                f32 = f32 + exact[:, b].astype(np.float32)
            np.testing.assert_array_equal(ref, f32)
