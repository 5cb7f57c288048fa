"""The quant formats: sizes, packing order and round-trip error bounds."""

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.errors import FormatError, UnsupportedError


def test_glm52_expert_bytes_match_colibri():
    # gate/up [2048, 6144], down [6144, 2048]; colibri's published 18.92 MB (int4 row) and 21.23 MB (g64)
    def expert(fmt):
        return 2 * quant.tensor_bytes(fmt, 2048, 6144) + quant.tensor_bytes(fmt, 6144, 2048)

    assert expert("int4") == 18_874_368 + 40_960
    assert expert("int4-g64") == 18_874_368 + 2_359_296
    assert expert("int4-g32h") == 18_874_368 + 2_359_296  # float16 per 32: the bytes of int4-g64


def test_int4_g32h_is_q4_0_bytes_with_float16_scales():
    # 18 bytes per 32 weights (16 of codes + a float16 scale): 4.5 bits, Q4_0's; one partial group pads
    assert quant.tensor_bytes("int4-g32h", 4, 64) == 4 * 2 * 18
    assert quant.tensor_bytes("int4-g32h", 1, 33) == 17 + 2 * 2
    assert quant.group_size("int4-g32h") == 32 and quant.bits("int4-g32h") == 4
    assert quant.scale_dtype("int4-g32h") == np.float16 and quant.scale_dtype("int4-g32") == np.float32
    assert quant.scale_dtype("bf16") is None
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 70)).astype(np.float32)
    qt = quant.quantize(w, "int4-g32h")
    assert qt.scales.dtype == np.float16 and qt.scales.shape == (5, 3) and qt.nbytes == 5 * 35 + 5 * 3 * 2
    wide = quant.widen_scales(qt)  # the int4-g32 tensor of the same values: what float32 kernels read
    assert wide.fmt == "int4-g32" and wide.scales.dtype == np.float32 and wide.data is qt.data
    np.testing.assert_array_equal(quant.dequantize(wide), quant.dequantize(qt))
    codes = _codes(qt).astype(np.float32) - 8
    np.testing.assert_array_equal(quant.dequantize(qt), codes * np.repeat(qt.scales.astype(np.float32), 32,
                                                                          axis=1)[:, :70])
    # the codes fit the stored (rounded) scale: never worse than int4-g32's codes under that scale
    g32 = quant.quantize(w, "int4-g32")
    assert np.abs(quant.dequantize(qt) - w).mean() <= np.abs(quant.dequantize(g32) - w).mean() * 1.01
    with pytest.raises(FormatError, match="holds float16 scales"):  # a QuantTensor keeps the format's dtype
        quant.QuantTensor("int4-g32h", 5, 70, qt.data, qt.scales.astype(np.float32))


def test_int4_g32h_refuses_scales_past_float16():
    w = np.ones((1, 32), np.float32)
    w[0, 0] = 1e6  # scale 1e6 / 8 > 65504
    with pytest.raises(FormatError, match="use int4-g32"):
        quant.quantize(w, "int4-g32h")
    assert quant.quantize(w, "int4-g32").scales[0, 0] == np.float32(-1e6 / 8)


def test_int4_low_nibble_first():
    w = np.array([[-4.0, 3.5, 0.0]], np.float32)  # m = -4: scale -4 / -8 = 0.5 -> codes 0, 15, 8
    qt = quant.quantize(w, "int4")
    assert qt.scales.tolist() == [0.5]
    assert qt.data.tolist() == [[0x0 | (0xF << 4), 0x8 | (0x8 << 4)]]  # padding = zero code 8
    np.testing.assert_array_equal(quant.dequantize(qt), w)


def _codes(qt):
    return quant.unpack_codes(qt.fmt, qt.data, qt.in_features)


@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int4", "int4-g32h"])
def test_int4_all_sixteen_codes_exact(fmt):
    # row 0: (c - 8)·d for c = 0..15, twice: its largest magnitude -8·d is negative -> scale +d, codes
    # 0..15; row 1 the negation: largest magnitude +8·d -> scale -d, (c - 8)·(-d) = (8 - c)·d: codes 0..15
    d = np.float32(0.125 if fmt.endswith("h") else 0.1)  # float16 scales: a d that float16 holds
    block = (np.arange(16, dtype=np.float32) - 8) * d
    w = np.stack([np.tile(block, 2), -np.tile(block, 2)])  # [2, 32]
    qt = quant.quantize(w, fmt)
    assert _codes(qt).tolist() == [list(range(16)) * 2] * 2
    assert qt.scales.ravel().tolist() == [d, -d]
    np.testing.assert_array_equal(quant.dequantize(qt), w)  # bit-exact: every value is on the grid


def test_int4_clipping_candidate_by_hand():
    # 31 ones and a 9 in a group of 32. k = 8: scale -9/8, each 1 -> code 7 (value 1.125): error
    # 31 · 0.125² = 0.484. k = 8.5: scale -9/8.5, 1 -> code 7 (1.0588), 9 -> -8.5 -> code 0 (8.4706):
    # 31 · 0.0588² + 0.5294² = 0.388. k = 9: ones exact, 9 clipped to 8: error 1. So k = 8.5 wins.
    w = np.ones((1, 32), np.float32)
    w[0, 5] = 9.0
    qt = quant.quantize(w, "int4-g32")
    assert qt.scales[0, 0] == np.float32(9.0) / np.float32(-8.5)
    want = [7] * 32
    want[5] = 0
    assert _codes(qt).tolist() == [want]
    err = float(((quant.dequantize(qt) - w).astype(np.float64) ** 2).sum())
    assert err == pytest.approx(31 * (9 / 8.5 - 1) ** 2 + (9 - 8 * 9 / 8.5) ** 2, rel=1e-5)


def test_int4_zero_group_and_padding():
    w = np.zeros((1, 40), np.float32)
    w[0, 35] = -1.0  # group 0 all zero; group 1 (8 columns + 24 of padding) has -1 -> scale 1/8
    qt = quant.quantize(w, "int4-g32")
    assert qt.scales.tolist() == [[0.0, 0.125]] and not np.signbit(qt.scales[0, 0])  # +0.0, not -0.0
    codes = _codes(qt)[0]
    assert codes[35] == 0 and set(codes[:35].tolist()) | set(codes[36:].tolist()) == {8}
    np.testing.assert_array_equal(quant.dequantize(qt), w)


def _q4_0_block_err(blocks, half=False):
    # ggml's Q4_0 rule per block [.., G]: s = m / -8 (m the value of largest magnitude; ``half``: rounded
    # to float16 as Q4_0 stores it), code = clip(round(w / s) + 8, 0, 15); squared error of (code - 8)·s
    m = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)
    s = m / -8.0
    if half:
        s = s.astype(np.float16).astype(np.float64)
    q = np.clip(np.rint(blocks / np.where(s == 0, 1, s)), -8, 7)
    return ((blocks - q * s) ** 2).sum(axis=-1)


def test_int2_codes_and_padding():
    w = np.array([[-2.0, -1.0, 0.0, 1.0, 2.0]], np.float32)  # scale 1; 2.0 clips to code 3 (value 1)
    qt = quant.quantize(w, "int2")
    assert qt.data.shape == (1, 2)
    assert int(qt.data[0, 0]) == (0 | 1 << 2 | 2 << 4 | 3 << 6)
    assert int(qt.data[0, 1]) == (3 | 2 << 2 | 2 << 4 | 2 << 6)  # padding holds the zero code 2
    np.testing.assert_array_equal(quant.dequantize(qt), [[-2, -1, 0, 1, 1]])


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("shape", [(7, 33), (64, 130), (3, 1)])
def test_round_trip_error_bound(fmt, shape):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32)
    qt = quant.quantize(w, fmt)
    assert qt.nbytes == quant.tensor_bytes(fmt, *shape)
    err = np.abs(quant.dequantize(qt) - w)
    if fmt == "f32":
        assert err.max() == 0
    elif fmt in ("f16", "bf16"):
        rel = 2.0 ** (-11 if fmt == "f16" else -8)
        assert np.all(err <= np.abs(w) * rel + 1e-7)
    elif fmt == "int2":
        # positive values above scale clip to +1 step: error at most half the row's absmax
        assert np.all(err <= np.abs(w).max(axis=1, keepdims=True) * 0.5 + 1e-6)
    elif fmt == "int8":
        assert np.all(err <= qt.scales[:, None] * 0.5 + 1e-6)
    else:  # int4, int4-gG: blocks of G columns (a whole row for int4), zero-padded like the quantizer
        g = quant.group_size(fmt) or shape[1]
        ng = -(-shape[1] // g)
        wb, eb = (np.pad(a.astype(np.float64), ((0, 0), (0, ng * g - shape[1]))).reshape(shape[0], ng, g)
                  for a in (w, err))
        s = np.abs(qt.scales.astype(np.float64)).reshape(shape[0], ng, 1)
        amax = np.abs(wb).max(axis=2, keepdims=True)
        half = fmt in quant.HALF_GROUP_FORMATS  # float16 scales round by up to 2^-11 relative
        # |s| = amax / k with k >= 8: a step no coarser than Q4_0's; the value of largest magnitude sits at
        # -k·s and clips to -8·s, one of the other sign at up to +k·s clips to 7·s: |error| <= amax - 7·|s|
        assert np.all(s <= amax / 8 * (1 + (2.0 ** -11 if half else 1e-6)))
        assert np.all(eb <= amax - 7 * s + 1e-6)
        # the chosen scale's squared error per block is at most that of the Q4_0 rule (one of the candidates;
        # 1e-4: the reference rounds a float64 scale, the quantizer a float32 one)
        assert np.all((eb ** 2).sum(axis=2) <= _q4_0_block_err(wb, half) * (1 + 1e-4))


def test_matmul_ref_matches_dense():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((5, 9)).astype(np.float32)
    x = rng.standard_normal((3, 9)).astype(np.float32)
    np.testing.assert_allclose(quant.matmul_ref(x, quant.quantize(w, "f32")), x @ w.T, rtol=1e-5)


def test_bad_input():
    with pytest.raises(UnsupportedError, match="int5"):
        quant.quantize(np.ones((2, 2)), "int5")
    with pytest.raises(FormatError, match="NaN"):
        quant.quantize(np.array([[np.nan]]), "int8")
    with pytest.raises(FormatError, match="2-D"):
        quant.quantize(np.ones(3), "int8")


def test_int4_subnormal_block():
    # a block of subnormals: its scale m / -k is subnormal too (1/s would overflow); codes stay 0..15
    w = np.zeros((1, 64), np.float32)
    w[0, 3], w[0, 40], w[0, 41] = 1e-44, -3e-39, 2e-39
    for fmt in ("int4-g32", "int4"):
        qt = quant.quantize(w, fmt)
        d = quant.dequantize(qt)
        assert np.all(np.isfinite(qt.scales)) and np.all(np.isfinite(d))
        assert np.all(np.abs(d - w) <= np.abs(w).max() / 8)
