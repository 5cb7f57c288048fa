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


def test_int4_low_nibble_first():
    w = np.array([[-3.5, 3.5, 0.0]], np.float32)  # scale = 3.5/7 = 0.5 -> codes 1, 15, 8
    qt = quant.quantize(w, "int4")
    assert qt.scales[0] == pytest.approx(0.5)
    assert qt.data.tolist() == [[0x1 | (0xF << 4), 0x8 | (0x8 << 4)]]  # padding = zero code 8
    np.testing.assert_array_equal(quant.dequantize(qt), w)


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
    else:
        g = quant.group_size(fmt)
        step = qt.scales if g is None else np.repeat(qt.scales, g, axis=1)[:, : shape[1]]
        step = step[:, None] if g is None else step
        assert np.all(err <= step * 0.5 + 1e-6)


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
