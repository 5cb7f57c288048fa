"""Cross-backend oracle (the ggml ``test-backend-ops`` idea): one table of cases, every backend and device.

Each case runs on every device of every backend in ``BACKEND_NAMES`` and is compared with the numpy
float64 reference of :mod:`colibri_plan.quant` (the same quantized weights, so the only allowed error
is arithmetic): normalised error max|y − ref| / max|ref| under a bound per op, no NaN/Inf, the exact
output shape and dtype, inputs left untouched, NaN guard bands around the activations (a host kernel
that reads or writes past ``x`` turns the output NaN or breaks the band), and a canary weight uploaded
before the case whose result must not change (a device kernel writing past its buffers).
Unavailable backends and unsupported formats are skipped with their reason.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import BACKEND_NAMES, get_backend
from colibri_plan.backends.reference import attention_ref
from colibri_plan.errors import UnsupportedError


class Case(NamedTuple):
    """op: matmul | expert_ffn | rmsnorm | d_attention. matmul: W [out, in]. expert_ffn: gate/up
    [out, in] and down [in, out] (out = expert width I, in = hidden size H), ``experts`` experts per call,
    expert j gets max(1, tokens − j) tokens. rmsnorm: x [tokens, in]. d_attention: MLA's decode
    attention as the engine runs it, the query [1, out = H heads, rope + in] ([q_rope | q_abs], in =
    kv_lora_rank R) over one kv head whose keys and values are the same latent cache rows [tokens = T, 1,
    rope + R] ([k_rope | latent]), softmax scale sharp / sqrt(R + rope) (sharp ≫ 1: scores in the
    thousands, which overflow exp without the max)."""

    op: str
    fmt: str
    out: int
    in_: int
    tokens: int
    experts: int = 1
    rope: int = 0
    sharp: float = 1.0


GLM = ((2048, 6144), (6144, 2048))  # GLM-5.2 routed expert gate/up and down (out, in)
ODD = ((33, 67), (257, 131), (1, 5), (67, 33))  # not multiples of any work-group, row or group size
CASES = (
    [Case("matmul", f, o, i, t) for f in quant.FORMATS for (o, i), t in zip(ODD, (1, 3, 2, 5))]
    + [Case("matmul", f, 64, 256, 16) for f in quant.FORMATS]
    + [Case("matmul", f, o, i, t) for f in ("int4", "int4-g64") for o, i in GLM for t in (1, 4)]
    + [Case("matmul", f, 2048, 6144, 1) for f in ("int8", "int4-g32", "int4-g128", "int2")]
    + [Case("expert_ffn", f, 33, 67, 3, experts=3) for f in quant.FORMATS]
    + [Case("expert_ffn", "int4", 2048, 6144, 1, experts=2), Case("expert_ffn", "int4-g64", 2048, 6144, 3, 2)]
    # prefill (T > 1: CUDA's tensor-core kernels): ragged row tiles and token passes, 16 tokens at GLM shapes
    + [Case("matmul", f, 257, 131, 19) for f in quant.FORMATS]
    + [Case("matmul", f, 2048, 6144, 16) for f in ("int4", "int8", "int4-g32", "bf16")]
    + [Case("expert_ffn", f, 33, 67, 17, experts=3) for f in quant.FORMATS]
    + [Case("expert_ffn", f, 2048, 6144, 16, experts=2) for f in ("int4", "int8", "int4-g128")]
    + [Case("rmsnorm", "f32", 0, n, t) for n, t in ((67, 3), (6144, 1), (6144, 5))]
    # odd sizes; T = 1; T past one tile of cached rows (256 on the GPUs); rows of 1033 floats (past the
    # widest head the CUDA and Vulkan kernels take: UnsupportedError there, a skip) and of 603 (within
    # both, several channels a thread); DeepSeek-V3 decode (128 heads, kv_lora_rank 512, rope 64) at 1,
    # 64 and 1000 cached rows
    + [Case("d_attention", "f32", h, r, t, rope=d) for h, r, d, t in (
        (3, 67, 5, 1), (3, 67, 5, 257), (1, 5, 1, 3), (2, 1030, 3, 513), (2, 600, 3, 513),
        (128, 512, 64, 1), (128, 512, 64, 64), (128, 512, 64, 1000))]
    + [Case("d_attention", "f32", 3, 67, 300, rope=5, sharp=100.0)]
)
#: max|y - ref| / max|ref|; the reference uses the same quantized weights, so this bounds float32
#: accumulation (and, for expert_ffn, the float32 intermediate) only. The cpu backend's int8/int4
#: kernels also round the activations to int16 (one scale per token, max|x|/32767): per output at most
#: 0.5·(max|x|/32767)·Σ|w| (tests/test_backend_cpu_kernels.py checks that bound), 2-4e-5 here
BOUNDS = {"matmul": 1e-4, "expert_ffn": 5e-4, "rmsnorm": 1e-5, "d_attention": 1e-5}
GUARD = 64  # NaN floats before and after the activations; NaN cache rows past the keys


def _devices():
    params = []
    for name in BACKEND_NAMES:
        try:
            cls = get_backend(name)
            reason = cls.unavailable_reason()
            devices = [] if reason else cls.list_devices()
            if not reason and not devices:
                reason = "no devices found"
        except (ImportError, UnsupportedError) as exc:
            reason, devices = f"backend module cannot be imported: {exc}", []
        if reason:
            params.append(pytest.param((name, None, reason), id=f"{name}-unavailable"))
        params += [pytest.param((name, d.index, None), id=f"{name}:{d.index}") for d in devices]
    return params


@pytest.fixture(scope="module", params=_devices())
def be(request):
    name, index, reason = request.param
    if reason:
        pytest.skip(f"{name}: {reason}")
    b = get_backend(name).open(index)
    yield b
    b.close()


@functools.cache
def _weight(fmt: str, out: int, in_: int, seed: int) -> quant.QuantTensor:
    rng = np.random.default_rng([out, in_, seed])
    w = rng.standard_normal((out, in_), dtype=np.float32) / np.float32(np.sqrt(in_))  # y ~ N(0, 1)
    return quant.quantize(w, fmt)


def _guarded(x: np.ndarray):
    """A copy of x [T, n] as a contiguous view inside a buffer with GUARD NaNs on each side."""
    buf = np.full(x.size + 2 * GUARD, np.nan, np.float32)
    buf[GUARD:-GUARD] = x.ravel()
    return buf, buf[GUARD:-GUARD].reshape(x.shape)


@functools.cache
def _matmul_inputs(case: Case):
    """(x [T, in] float32, float64 reference [T, out]) of a matmul case, shared by every backend."""
    qt = _weight(case.fmt, case.out, case.in_, 0)
    x = np.random.default_rng([case.out, case.in_, case.tokens]).standard_normal(
        (case.tokens, case.in_), dtype=np.float32)
    return x, x.astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T


@functools.cache
def _ffn_inputs(case: Case):
    """(weights [(gate, up, down)], xs [x_j [T_j, H]], float64 references [T_j, H]) of an expert_ffn case."""
    I, H = case.out, case.in_
    rng = np.random.default_rng([I, H, case.tokens, case.experts])
    qts = [(_weight(case.fmt, I, H, 3 * e), _weight(case.fmt, I, H, 3 * e + 1),
            _weight(case.fmt, H, I, 3 * e + 2)) for e in range(case.experts)]
    xs, refs = [], []
    for j, (g, u, d) in enumerate(qts):
        x = rng.standard_normal((max(1, case.tokens - j), H), dtype=np.float32)
        x64 = x.astype(np.float64)
        h = _silu64(x64 @ quant.dequantize(g).astype(np.float64).T) * (x64 @ quant.dequantize(u).T)
        refs.append(h @ quant.dequantize(d).astype(np.float64).T)  # [T_j, H]
        xs.append(x)
    return qts, xs, refs


@functools.cache
def _attention_inputs(case: Case):
    """(q [1, H, rope + R], cache rows [T, 1, rope + R] float32, scale, reference [1, H·(rope + R)]) of
    a d_attention case: the arrays q_abs [H, R], q_rope [H, rope], latent [T, R], k_rope [T, rope] laid
    out as the engine's query and latent cache; the reference is ``attention_ref`` (float64, cast)."""
    H, R, Dr, T = case.out, case.in_, case.rope, case.tokens
    rng = np.random.default_rng([H, R, Dr, T])
    q_abs, q_rope, latent, k_rope = (rng.standard_normal(shape, dtype=np.float32)
                                     for shape in ((H, R), (H, Dr), (T, R), (T, Dr)))
    q = np.concatenate([q_rope, q_abs], axis=1)[None]  # [1, H, Dr + R]
    rows = np.concatenate([k_rope, latent], axis=1)[:, None]  # [T, 1, Dr + R]: keys and values
    scale = case.sharp / float(np.sqrt(R + Dr))
    return q, rows, scale, attention_ref(q, rows, rows, T, T - 1, scale).astype(np.float64)


def _snapshot(qts):
    return [(q.data.copy(), None if q.scales is None else q.scales.copy()) for q in qts]


def _unchanged(qts, snap):
    for q, (d, s) in zip(qts, snap):
        np.testing.assert_array_equal(q.data, d, err_msg="backend modified a weight's data")
        if s is not None:
            np.testing.assert_array_equal(q.scales, s, err_msg="backend modified a weight's scales")


def _silu64(g):
    return g / (1.0 + np.exp(-g))


def _check(y, ref, op, what=""):
    assert isinstance(y, np.ndarray) and y.dtype == np.float32, f"{what}: result must be float32"
    assert y.shape == ref.shape, f"{what}: shape {y.shape}, expected {ref.shape}"
    assert np.isfinite(y).all(), f"{what}: NaN/Inf in the result"
    err = float(np.max(np.abs(y.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))
    assert err <= BOUNDS[op], f"{what}: normalised error {err:.3g} > {BOUNDS[op]:g}"


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.op}-{c.fmt}-{c.out}x{c.in_}-t{c.tokens}"
                         + (f"-e{c.experts}" if c.experts > 1 else "") + (f"-r{c.rope}" if c.rope else "")
                         + (f"-x{c.sharp:g}" if c.sharp != 1.0 else ""))
def test_oracle(be, case: Case):
    if case.fmt not in be.formats:
        pytest.skip(f"{be.name} does not support {case.fmt}")
    rng = np.random.default_rng([case.out, case.in_, case.tokens])
    canary_qt = _weight("int4", 37, 53, 99)
    canary = be.upload(canary_qt)
    cx = rng.standard_normal((2, 53), dtype=np.float32)
    canary_y = be.matmul(cx, canary).copy()
    held = be.memory_used()
    try:
        if case.op == "matmul":
            _run_matmul(be, case, rng)
        elif case.op == "expert_ffn":
            _run_expert_ffn(be, case, rng)
        elif case.op == "rmsnorm":
            _run_rmsnorm(be, case, rng)
        else:
            _run_attention(be, case)
        assert be.memory_used() == held, "the op's uploads were not all freed"
        np.testing.assert_array_equal(be.matmul(cx, canary), canary_y,
                                      err_msg="canary weight changed: a kernel wrote past its buffers")
    except UnsupportedError as exc:
        pytest.skip(f"{be.name}: {exc}")
    finally:
        be.free(canary)


def _run_matmul(be, case, rng):
    qt = _weight(case.fmt, case.out, case.in_, 0)
    snap = _snapshot([qt])
    x0, ref = _matmul_inputs(case)
    buf, x = _guarded(x0)
    xcopy = x.copy()
    w = be.upload(qt)
    try:
        y = be.matmul(x, w)
        _check(y, ref, "matmul", f"{be.name} matmul {case}")
        y2 = be.matmul(x, w)  # same inputs again: no state left behind by the first call
        np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6 * float(np.abs(y).max()))
    finally:
        be.free(w)
    np.testing.assert_array_equal(x, xcopy, err_msg="backend modified its activations")
    assert np.isnan(buf[:GUARD]).all() and np.isnan(buf[-GUARD:]).all(), "guard band overwritten"
    _unchanged([qt], snap)


def _run_expert_ffn(be, case, rng):
    qts, x0s, refs = _ffn_inputs(case)
    snap = _snapshot([q for e in qts for q in e])
    bufs, xs = zip(*[_guarded(x) for x in x0s])
    xcopies = [x.copy() for x in xs]
    experts = [be.upload_expert(*e) for e in qts]
    try:
        ys = be.expert_ffn(xs, experts)
        assert isinstance(ys, list) and len(ys) == len(xs), "one result per expert"
        for j, (y, ref) in enumerate(zip(ys, refs)):
            _check(y, ref, "expert_ffn", f"{be.name} expert_ffn {case} expert {j}")
    finally:
        for e in experts:
            for w in e:
                be.free(w)
    for x, xc, buf in zip(xs, xcopies, bufs):
        np.testing.assert_array_equal(x, xc, err_msg="backend modified its activations")
        assert np.isnan(buf[:GUARD]).all() and np.isnan(buf[-GUARD:]).all(), "guard band overwritten"
    _unchanged([q for e in qts for q in e], snap)


def _run_rmsnorm(be, case, rng):
    buf, x = _guarded(np.float32(3.0) * rng.standard_normal((case.tokens, case.in_), dtype=np.float32))
    weight = rng.standard_normal(case.in_, dtype=np.float32)
    xcopy, wcopy = x.copy(), weight.copy()
    eps = 1e-6
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64**2, axis=1, keepdims=True) + eps) * weight
    y = be.rmsnorm(x, weight, eps)
    _check(y, ref, "rmsnorm", f"{be.name} rmsnorm {case}")
    np.testing.assert_array_equal(x, xcopy, err_msg="backend modified its activations")
    np.testing.assert_array_equal(weight, wcopy, err_msg="backend modified the norm weight")
    assert np.isnan(buf[:GUARD]).all() and np.isnan(buf[-GUARD:]).all(), "guard band overwritten"


def _run_attention(be, case):
    """The query at position T − 1 over all T cache rows (decode), k and v one DArray as the engine's
    latent cache passes them; NaN rows after the T keys (a kernel reading past n_keys turns the output
    NaN)."""
    q, rows, scale, ref = _attention_inputs(case)
    cache = np.full((case.tokens + GUARD, *rows.shape[1:]), np.nan, np.float32)  # [T + GUARD, 1, Dr + R]
    cache[:case.tokens] = rows
    dq, dc = be.d_put(q), be.d_put(cache)
    y = be.d_get(be.d_attention(dq, dc, dc, case.tokens, case.tokens - 1, scale))  # [1, H·(Dr + R)]
    _check(y, ref, "d_attention", f"{be.name} d_attention {case}")
    y2 = be.d_get(be.d_attention(dq, dc, dc, case.tokens, case.tokens - 1, scale))  # no state left behind
    np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6 * float(np.abs(y).max()))
    np.testing.assert_array_equal(be.d_get(dq), q, err_msg="backend modified the query")
    np.testing.assert_array_equal(be.d_get(dc), cache, err_msg="backend modified the cache or its NaN rows")


def test_table_covers_every_format_and_op():
    assert {c.fmt for c in CASES if c.op == "matmul"} == set(quant.FORMATS)
    assert {c.fmt for c in CASES if c.op == "expert_ffn"} == set(quant.FORMATS)
    assert {(c.out, c.in_) for c in CASES if c.fmt == "int4"} >= set(GLM)
    assert {c.op for c in CASES} == {"matmul", "expert_ffn", "rmsnorm", "d_attention"}
    assert {(c.out, c.in_, c.rope, c.tokens) for c in CASES if c.op == "d_attention"} >= {
        (128, 512, 64, t) for t in (1, 64, 1000)}


@pytest.mark.parametrize("case", [c for c in CASES if c.op == "d_attention"], ids=lambda c: f"{c.out}x{c.in_}"
                         f"-t{c.tokens}-r{c.rope}-x{c.sharp:g}")
def test_mla_rows_are_the_absorbed_attention_they_replaced(case):
    """The d_attention rows assert the weight-absorbed MLA maths: the reference's latent columns are
    Σ_t softmax_t(scale · (q_abs·latent[t] + q_rope·k_rope[t])) · latent[t] per head, in float64."""
    q, rows, scale, ref = _attention_inputs(case)
    H, R, Dr = case.out, case.in_, case.rope
    q_rope, q_abs = q[0, :, :Dr].astype(np.float64), q[0, :, Dr:].astype(np.float64)
    k_rope, latent = rows[:, 0, :Dr].astype(np.float64), rows[:, 0, Dr:].astype(np.float64)
    s = scale * (q_abs @ latent.T + q_rope @ k_rope.T)  # [H, T]
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want = (p / p.sum(axis=1, keepdims=True)) @ latent  # [H, R]
    np.testing.assert_allclose(ref.reshape(H, Dr + R)[:, Dr:], want, rtol=0, atol=1e-6 * np.abs(want).max())
