"""The cpu backend's decode hot path without repeated work gives the bits of the path it replaced: one
quantization of a decode token shared by every selected expert of ``expert_ffn_sum`` (against n
quantized copies), one quantization of x shared by q/k/v-like weights of ``d_matmul_many`` (against
one ``d_matmul`` each), the ``d_rope`` kernel (against ``reference.rope_ref``) and the fused
``d_add_rmsnorm`` (against the numpy backend's add then norm)."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan.backends import get_backend
from colibri_plan.backends.reference import rope_ref, rope_table
from colibri_plan.quant import quantize

cpu_cls = get_backend("cpu")
pytestmark = pytest.mark.skipif(not cpu_cls.is_available(), reason="numba is not installed")


@pytest.fixture(scope="module")
def cpu():
    be = cpu_cls.open(0)
    yield be
    be.close()


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def _experts(be, fmt: str, n: int, hidden: int, inter: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [be.upload_expert(*(quantize(rng.standard_normal(s).astype(np.float32) * 0.05, fmt)
                               for s in ((inter, hidden), (inter, hidden), (hidden, inter))))
            for _ in range(n)]


class _CountXq:
    """Wraps the backend's activation quantization and counts the calls and the rows quantized."""

    def __init__(self, be):
        self.be, self.f, self.calls, self.rows = be, be._xq, 0, 0

    def __call__(self, x, hw):
        self.calls += 1
        self.rows += x.shape[0]
        return self.f(x, hw)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g32", "int4-g32h", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_shared_decode_quantization_gives_the_bits_of_n_copies(cpu, fmt, n, monkeypatch):
    hidden, inter = 512, 256
    experts = _experts(cpu, fmt, n, hidden, inter, seed=n)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1, hidden)).astype(np.float32)
    gates = rng.random(n).astype(np.float32)
    # distinct copies: the concatenated path, each row quantized on its own (the path before)
    ys = cpu.expert_ffn([x.copy() for _ in range(n)], experts)
    want = np.zeros_like(x)
    for y, g in zip(ys, gates):
        want += y * g
    count = _CountXq(cpu)
    ce = cpu.expert_ffn_sum.__self__  # the CpuExperts part, which holds its own _xq reference
    monkeypatch.setattr(ce, "_xq", count)
    got = cpu.expert_ffn_sum(x, experts, gates)
    assert np.array_equal(_bits(got), _bits(want))
    assert np.abs(want).max() > 0
    # gate/up read one quantized row, down the n rows of h: n + 1 rows, two calls
    assert (count.calls, count.rows) == (2, 1 + n)


@pytest.mark.parametrize("fmts,outs,in_", [(("int8",) * 3, (96, 32, 32), 512),
                                           (("int4-g32h",) * 2, (128, 128), 256),
                                           (("int4", "int8", "int4"), (40, 24, 40), 256),
                                           (("f32", "int8"), (16, 16), 128)])
@pytest.mark.parametrize("t", [1, 4])
def test_matmul_many_quantizes_x_once_per_layout(cpu, fmts, outs, in_, t, monkeypatch):
    rng = np.random.default_rng(t)
    ws = [cpu.upload(quantize(rng.standard_normal((o, in_)).astype(np.float32) * in_ ** -0.5, f))
          for f, o in zip(fmts, outs)]
    x = cpu.d_put(rng.standard_normal((t, in_)).astype(np.float32))
    want = [cpu.d_get(cpu.d_matmul(x, w)) for w in ws]
    count = _CountXq(cpu)
    monkeypatch.setattr(cpu, "_xq", count)
    got = [cpu.d_get(y) for y in cpu.d_matmul_many(x, ws)]
    assert all(np.array_equal(_bits(g), _bits(w)) for g, w in zip(got, want))
    assert count.calls == len({f for f in fmts if f.startswith("int")})  # one per integer layout


@pytest.mark.parametrize("t,heads,d,rd,interleave,pos0", [
    (1, 16, 128, 128, False, 0), (1, 4, 128, 128, False, 250), (3, 2, 68, 32, False, 5),
    (2, 3, 16, 16, True, 7), (5, 1, 128, 64, True, 100)])
def test_d_rope_kernel_is_rope_ref_bit_for_bit(cpu, t, heads, d, rd, interleave, pos0):
    rng = np.random.default_rng(rd + t)
    inv = 1.0 / (10000.0 ** (np.arange(0, rd, 2, dtype=np.float32) / rd))
    table = rope_table(inv, 256, attention_factor=1.1)
    x = (rng.standard_normal((t, heads, d)) * 3).astype(np.float32)
    x0 = x.copy()
    got = cpu.d_get(cpu.d_rope(cpu.d_put(x), cpu.d_put(table), pos0, rd, interleave))
    want = rope_ref(x, table, pos0, rd, interleave)
    assert np.array_equal(_bits(got), _bits(want))
    assert not np.array_equal(got[..., :rd], x[..., :rd]) and np.array_equal(x, x0)


@pytest.mark.parametrize("n,hidden", [(1, 2048), (3, 129)])
def test_d_add_rmsnorm_is_numpys_add_then_norm(cpu, n, hidden):
    rng = np.random.default_rng(hidden)
    a, b = (rng.standard_normal((n, hidden)).astype(np.float32) * 4 for _ in range(2))
    w = rng.standard_normal(hidden).astype(np.float32)
    ref = get_backend("numpy").open(0)
    try:
        h_ref = ref.d_add(ref.d_put(a), ref.d_put(b))
        y_ref = ref.d_get(ref.d_rmsnorm(h_ref, ref.d_put(w), 1e-6))
        h_ref = ref.d_get(h_ref)
    finally:
        ref.close()
    h, y = cpu.d_add_rmsnorm(cpu.d_put(a), cpu.d_put(b), cpu.d_put(w), 1e-6)
    assert np.array_equal(_bits(cpu.d_get(h)), _bits(h_ref))
    assert np.array_equal(_bits(cpu.d_get(y)), _bits(y_ref))
