"""Cross-backend oracle of the device-activation ops (backends/device_ops.py): every op, every backend.

Each row runs on every device of every available backend and is compared with the float64 numpy
reference (``attention_ref``, ``rope_ref`` and plain numpy for the rest): normalised error
max|y − ref| / max|ref| under the row's bound, exact output shape, no NaN/Inf, and the host inputs left
untouched. A chain row runs a whole GQA decoder layer's worth of ops back to back without leaving the
device. Unavailable backends are skipped with their reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_backends_oracle import be  # noqa: F401 - the per-device fixture

from colibri_plan import quant
from colibri_plan.backends.device_ops import attention_ref, rope_ref, rope_table

RNG = np.random.default_rng(7)


def _r(*shape, scale=1.0):
    return (RNG.standard_normal(shape, dtype=np.float32) * np.float32(scale)).astype(np.float32)


def _err(y, ref):
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all(), "NaN/Inf in the output"
    return float(np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-30))


def _silu(g):
    return g / (1.0 + np.exp(-g))


@pytest.mark.parametrize("fmt,out,in_,t", [("f32", 33, 67, 1), ("int8", 257, 131, 3), ("int4", 64, 256, 1),
                                           ("int4-g32", 96, 128, 5), ("f16", 1, 5, 2), ("bf16", 67, 33, 1)])
def test_d_matmul(be, fmt, out, in_, t):  # noqa: F811
    w = quant.quantize(_r(out, in_, scale=in_ ** -0.5), fmt)
    if fmt not in be.formats:
        pytest.skip(f"{be.name} has no {fmt} kernel")
    x = _r(t, in_)
    ref = x.astype(np.float64) @ quant.dequantize(w).astype(np.float64).T
    y = be.d_get(be.d_matmul(be.d_put(x), be.upload(w)))
    assert y.shape == (t, out)
    assert _err(y, ref) < 1e-4


@pytest.mark.parametrize("fmts,outs,in_,t", [(("int8",) * 3, (64, 16, 16), 256, 1),
                                              (("int4", "int4", "int8"), (40, 40, 24), 200, 3)])
def test_d_matmul_many(be, fmts, outs, in_, t):  # noqa: F811
    """q/k/v-like weights of different heights read one x: each result is d_matmul's, bit for bit (one
    launch on GPU backends must not change a sum), and within the reference's bound."""
    if any(f not in be.formats for f in fmts):
        pytest.skip(f"{be.name} lacks one of {fmts}")
    qts = [quant.quantize(_r(o, in_, scale=in_ ** -0.5), f) for f, o in zip(fmts, outs)]
    x = _r(t, in_)
    dx, ws = be.d_put(x), [be.upload(q) for q in qts]
    ys = be.d_matmul_many(dx, ws)
    assert [y.shape for y in ys] == [(t, o) for o in outs]
    for q, w, y in zip(qts, ws, ys):
        got = be.d_get(y)
        np.testing.assert_array_equal(got, be.d_get(be.d_matmul(dx, w)))
        assert _err(got, x.astype(np.float64) @ quant.dequantize(q).astype(np.float64).T) < 1e-4


@pytest.mark.parametrize("n,d", [(1, 67), (3, 2048), (16, 128)])
def test_d_rmsnorm_add_silu_scale(be, n, d):  # noqa: F811
    x, w, b, bias = _r(n, d), _r(d), _r(n, d), _r(d)
    x0 = x.copy()
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(axis=1, keepdims=True) + 1e-6) * w
    dx = be.d_put(x)
    assert _err(be.d_get(be.d_rmsnorm(dx, be.d_put(w), 1e-6)), ref) < 1e-5
    assert _err(be.d_get(be.d_add(dx, be.d_put(b))), x64 + b) < 1e-6
    assert _err(be.d_get(be.d_add(dx, be.d_put(bias))), x64 + bias) < 1e-6
    assert _err(be.d_get(be.d_silu_mul(dx, be.d_put(b))), _silu(x64) * b) < 1e-5
    s = _r(n)
    assert _err(be.d_get(be.d_scale_rows(dx, s)), x64 * s[:, None]) < 1e-6
    # the residual add fused with the next norm (CUDA: one launch): h = x + b exactly, y = rmsnorm(h)
    h, y = be.d_add_rmsnorm(dx, be.d_put(b), be.d_put(w), 1e-6)
    h64 = x64 + b
    assert np.array_equal(be.d_get(h), (x + b).astype(np.float32))
    assert _err(be.d_get(y), h64 / np.sqrt((h64 * h64).mean(axis=1, keepdims=True) + 1e-6) * w) < 1e-5
    np.testing.assert_array_equal(be.d_get(y), be.d_get(be.d_rmsnorm(h, be.d_put(w), 1e-6)))
    assert np.array_equal(x, x0), "an op changed its input"


@pytest.mark.parametrize("t,heads,d,rd,interleave,pos0", [
    (1, 4, 64, 64, False, 37), (3, 2, 68, 32, False, 0), (2, 3, 16, 16, True, 5), (5, 1, 128, 64, True, 100)])
def test_d_rope(be, t, heads, d, rd, interleave, pos0):  # noqa: F811
    inv = 1.0 / (10000.0 ** (np.arange(0, rd, 2, dtype=np.float32) / rd))
    table = rope_table(inv, 128, attention_factor=1.1)
    x = _r(t, heads, d)
    ref = rope_ref(x.astype(np.float64), table.astype(np.float64), pos0, rd, interleave)
    y = be.d_get(be.d_rope(be.d_put(x), be.d_put(table), pos0, rd, interleave))
    assert y.shape == x.shape
    assert _err(y, ref) < 1e-5


@pytest.mark.parametrize("t,hq,hkv,d,pos0,cap,window", [
    (1, 4, 2, 64, 9, 64, 0),        # decode, GQA groups of 2
    (5, 8, 1, 32, 0, 64, 0),        # prefill from an empty cache, MQA
    (3, 2, 2, 67, 300, 320, 0),     # odd head dim, past one 256-row tile
    (1, 16, 4, 128, 999, 1024, 0),  # a long decode
    (4, 4, 4, 16, 60, 128, 8),      # sliding window
    (1, 16, 1, 24, 9, 32, 0),       # MLA on the latent cache: one kv head, d = rope 8 + kv_lora_rank 16
    (3, 16, 1, 576, 40, 64, 0),     # DeepSeek-V3 / GLM-5 MLA: d = 64 + 512, past the 256 of GQA heads
])
def test_d_attention(be, t, hq, hkv, d, pos0, cap, window):  # noqa: F811
    n_keys = pos0 + t
    q, k, v = _r(t, hq, d), _r(cap, hkv, d, scale=2.0), _r(cap, hkv, d)
    scale = d ** -0.5
    ref = attention_ref(q, k, v, n_keys, pos0, scale, window)
    dk, dv = be.d_zeros((cap, hkv, d)), be.d_zeros((cap, hkv, d))
    be.d_write_rows(dk, 0, be.d_put(k[:n_keys]))  # the cache, filled in two writes as decode does
    be.d_write_rows(dv, 0, be.d_put(v[:n_keys - 1]))
    be.d_write_rows(dv, n_keys - 1, be.d_put(v[n_keys - 1: n_keys]))
    y = be.d_get(be.d_attention(be.d_put(q), dk, dv, n_keys, pos0, scale, window))
    assert y.shape == (t, hq * d)
    assert _err(y, ref.astype(np.float64)) < 1e-5


@pytest.mark.parametrize("c,d,t,w,row0,col0", [
    (9, 30, 3, 7, 4, 11),       # odd sizes inside the rows
    (5, 24, 1, 8, 4, 0),        # an MLA cache row's k_rope (rope 8) at the start of a [k_rope | latent] row
    (5, 24, 1, 16, 4, 8),       # ... and its latent (kv_lora_rank 16) after it
    (4, 5, 4, 1, 0, 4),         # the last column of every row
    (70, 576, 5, 512, 64, 64),  # DeepSeek-V3's latent of a 5-token prefill, the last rows of the cache
])
def test_d_write_rows_into_a_column_block(be, c, d, t, w, row0, col0):  # noqa: F811
    """dst[row0:row0+T, col0:col0+W] = src, in place: the block equal to src bit for bit and every other
    float of dst (the guard around the block) unchanged; a block that does not fit is an InputError."""
    from colibri_plan.errors import InputError

    dst, src = _r(c, d), _r(t, w)
    ref = dst.copy()
    ref[row0:row0 + t, col0:col0 + w] = src
    dd = be.d_put(dst)
    be.d_write_rows(dd, row0, be.d_put(src), col0)
    np.testing.assert_array_equal(be.d_get(dd), ref)
    with pytest.raises(InputError, match="do not fit"):
        be.d_write_rows(dd, row0, be.d_put(src), d - w + 1)


@pytest.mark.parametrize("t,b,k,n", [
    (1, 3, 67, 5),       # odd sizes, decode
    (17, 4, 33, 19),     # a prefill past one 16-token tile, N past one 16-output tile
    (5, 16, 24, 8),      # a tiny MLA model: 16 heads, latent 16 + rope 8
    (1, 128, 128, 512),  # DeepSeek-V3 decode: q_nope [128 heads, 128] through W_UK to the 512 latent
    (2, 128, 512, 128),  # ... and the attention output through W_UV back to 128 per head
])
def test_d_head_matmul(be, t, b, k, n):  # noqa: F811
    """y[t, b] = w[b] · x[t, b] for x [T, B, K] and w [B, N, K] against float64 numpy; the inputs untouched;
    a B or K that does not match is an InputError."""
    from colibri_plan.errors import InputError

    x, w = _r(t, b, k), _r(b, n, k, scale=k ** -0.5)
    x0, w0 = x.copy(), w.copy()
    ref = np.einsum("tbk,bnk->tbn", x.astype(np.float64), w.astype(np.float64))
    dx, dw = be.d_put(x), be.d_put(w)
    y = be.d_get(be.d_head_matmul(dx, dw))
    assert y.shape == (t, b, n)
    assert _err(y, ref) < 1e-5
    assert np.array_equal(be.d_get(dx), x0) and np.array_equal(be.d_get(dw), w0), "an op changed its input"
    with pytest.raises(InputError, match="per-head weights"):
        be.d_head_matmul(dx, be.d_put(_r(b + 1, 1, k)))


def test_a_gqa_layer_chain_stays_on_the_device(be):  # noqa: F811
    """norm -> q/k/v -> rope -> cache -> attention -> o -> residual -> SwiGLU, against numpy."""
    H, hq, hkv, d, inter, t = 96, 4, 2, 24, 80, 3
    ws = {n: quant.quantize(_r(o, i, scale=i ** -0.5), "int8")
          for n, o, i in (("q", hq * d, H), ("k", hkv * d, H), ("v", hkv * d, H), ("o", H, hq * d),
                          ("g", inter, H), ("u", inter, H), ("dn", H, inter))}
    dq = {n: quant.dequantize(w).astype(np.float64) for n, w in ws.items()}
    up = {n: be.upload(w) for n, w in ws.items()}
    norm = _r(H)
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d))
    table = rope_table(inv, 64)
    x = _r(t, H)
    # numpy float64
    xn = x.astype(np.float64)
    xn = xn / np.sqrt((xn * xn).mean(axis=1, keepdims=True) + 1e-6) * norm
    q = rope_ref((xn @ dq["q"].T).reshape(t, hq, d), table.astype(np.float64), 0, d, False)
    k = rope_ref((xn @ dq["k"].T).reshape(t, hkv, d), table.astype(np.float64), 0, d, False)
    v = (xn @ dq["v"].T).reshape(t, hkv, d)
    h = x + attention_ref(q, k, v, t, 0, d ** -0.5).astype(np.float64) @ dq["o"].T
    ref = h + (_silu(h @ dq["g"].T) * (h @ dq["u"].T)) @ dq["dn"].T
    # device
    dx = be.d_put(x)
    xa = be.d_rmsnorm(dx, be.d_put(norm), 1e-6)
    dt = be.d_put(table)
    dq_ = be.d_rope(be.d_view(be.d_matmul(xa, up["q"]), (t, hq, d)), dt, 0, d, False)
    dk_ = be.d_rope(be.d_view(be.d_matmul(xa, up["k"]), (t, hkv, d)), dt, 0, d, False)
    dv_ = be.d_view(be.d_matmul(xa, up["v"]), (t, hkv, d))
    kc, vc = be.d_zeros((64, hkv, d)), be.d_zeros((64, hkv, d))
    be.d_write_rows(kc, 0, dk_)
    be.d_write_rows(vc, 0, dv_)
    dh = be.d_add(dx, be.d_matmul(be.d_attention(dq_, kc, vc, t, 0, d ** -0.5), up["o"]))
    y = be.d_add(dh, be.d_matmul(be.d_silu_mul(be.d_matmul(dh, up["g"]), be.d_matmul(dh, up["u"])), up["dn"]))
    assert _err(be.d_get(y), ref) < 1e-4


@pytest.mark.parametrize("fmt,n,hidden,width,t", [("int8", 3, 256, 96, 1), ("int4-g32", 2, 128, 64, 2),
                                                   ("f32", 1, 67, 33, 1), ("int4", 4, 200, 130, 1),
                                                   ("int8", 8, 2048, 768, 1)])
def test_d_expert_ffn(be, fmt, n, hidden, width, t):  # noqa: F811
    """Σ gates[i]·down_i(SiLU(gate_i·x) ⊙ up_i·x) on the device x against float64 numpy, and against the
    engine's host combine (expert_ffn, then 0 + y_0·g_0 + y_1·g_1 ... in float32): bit for bit on host
    backends (the contract's default path is that combine), within float32 summation order on GPUs."""
    if fmt not in be.formats:
        pytest.skip(f"{be.name} has no {fmt} kernel")
    qts = [(quant.quantize(_r(width, hidden, scale=hidden ** -0.5), fmt),
            quant.quantize(_r(width, hidden, scale=hidden ** -0.5), fmt),
            quant.quantize(_r(hidden, width, scale=width ** -0.5), fmt)) for _ in range(n)]
    x, gates = _r(t, hidden), np.abs(_r(n)) + np.float32(0.05)
    x0, g0 = x.copy(), gates.copy()
    x64, ref = x.astype(np.float64), np.zeros((t, hidden))
    for (g, u, d), gate in zip(qts, gates):
        dg, du, dd = (quant.dequantize(q).astype(np.float64) for q in (g, u, d))
        ref += float(gate) * ((_silu(x64 @ dg.T) * (x64 @ du.T)) @ dd.T)
    ws = [be.upload_expert(*q) for q in qts]
    y = be.d_get(be.d_expert_ffn(be.d_put(x), ws, gates))
    assert y.shape == (t, hidden)
    assert _err(y, ref) < 5e-4  # two chained matmuls (the cpu backend's on int16 activations)
    host = np.zeros((t, hidden), np.float32)
    for yi, gate in zip(be.expert_ffn([x] * n, ws), gates):
        host += yi * gate
    if be.name in ("numpy", "cpu"):
        np.testing.assert_array_equal(y, host)
    else:
        assert _err(y, host.astype(np.float64)) < 1e-5
    assert np.array_equal(x, x0) and np.array_equal(gates, g0), "the op changed its input"


def test_d_expert_ffn_edges(be):  # noqa: F811
    """No experts: zeros; a gate count that does not match, a non-finite gate or an expert whose width
    does not chain with x: InputError."""
    from colibri_plan.errors import InputError

    q = [quant.quantize(_r(*s), "int8") for s in ((16, 128), (16, 128), (128, 16))]
    w, dx = be.upload_expert(*q), be.d_put(_r(1, 128))
    assert np.array_equal(be.d_get(be.d_expert_ffn(dx, [], np.zeros(0, np.float32))), np.zeros((1, 128)))
    with pytest.raises(InputError, match="2 gates for 1 experts"):
        be.d_expert_ffn(dx, [w], np.ones(2, np.float32))
    with pytest.raises(InputError, match="finite"):
        be.d_expert_ffn(dx, [w], np.array([np.nan], np.float32))
    with pytest.raises(InputError, match=r"\[I, 64\]"):
        be.d_expert_ffn(be.d_put(_r(1, 64)), [w], np.ones(1, np.float32))


def test_device_arrays_of_another_backend_are_refused(be):  # noqa: F811
    from colibri_plan.backends import get_backend
    from colibri_plan.errors import InputError

    other = get_backend("numpy").open(0)
    with pytest.raises(InputError, match="DArray of this backend"):
        be.d_get(other.d_put(np.zeros(3, np.float32)))
    with pytest.raises(InputError, match="positions"):
        be.d_rope(be.d_put(np.zeros((2, 1, 4), np.float32)), be.d_put(np.zeros((1, 2, 2), np.float32)), 0, 4,
                  False)


def prologue_inputs(be, t, hq, hkv, d, rd, interleave, normed):  # noqa: F811 - a backend, not the fixture
    """Host q [t, hq, d], k and v [t, hkv, d], norm weights [2, d] and a RoPE table [64, rd/2, 2], with
    the device (norms, rope) arguments of d_attention_prologue (None where off)."""
    q, k, v = _r(t, hq, d, scale=3.0), _r(t, hkv, d, scale=3.0), _r(t, hkv, d)
    w = _r(2, d)
    table = rope_table(1.0 / (1e4 ** (np.arange(0, rd, 2) / max(rd, 1))), 64, attention_factor=1.0)
    norms = (be.d_put(w[0]), be.d_put(w[1])) if normed else None
    rope = (be.d_put(table), rd, interleave) if rd else None
    return (q, k, v, w, table), norms, rope


def unfused_prologue(be, q, k, v, norms, rope, kc, vc, row0):  # noqa: F811 - a backend, not the fixture
    """What d_attention_prologue fuses, as the trunk ran it: d_rmsnorm of each head row, d_rope of q and
    k, the cache append (d_write_rows of k and v): the roped q [T, Hq, d]."""
    (t, hq, d), hkv = q.shape, k.shape[1]
    if norms is not None:
        q = be.d_view(be.d_rmsnorm(be.d_view(q, (t * hq, d)), norms[0], 1e-6), (t, hq, d))
        k = be.d_view(be.d_rmsnorm(be.d_view(k, (t * hkv, d)), norms[1], 1e-6), (t, hkv, d))
    if rope is not None:
        q, k = (be.d_rope(m, rope[0], row0, rope[1], rope[2]) for m in (q, k))
    be.d_write_rows(kc, row0, k)
    be.d_write_rows(vc, row0, v)
    return q


@pytest.mark.parametrize("t,hq,hkv,d,rd,interleave,normed,pos0", [
    (1, 16, 4, 128, 128, False, True, 37),  # Qwen3's decode: heads of 128, q/k norms, full RoPE
    (5, 8, 2, 128, 64, False, True, 0),     # a prefill, partial rotary_dim (GLM-4)
    (2, 4, 2, 64, 64, True, True, 3),       # interleaved pairs
    (1, 4, 1, 80, 40, False, False, 9),     # no norms: RoPE and the append
    (3, 6, 2, 36, 0, False, True, 1),       # no RoPE: the norms and the append
    (2, 4, 2, 18, 18, False, True, 5),      # a head not a multiple of 4 floats: the norm's strided sums
])
def test_d_attention_prologue(be, t, hq, hkv, d, rd, interleave, normed, pos0):  # noqa: F811
    """The optional fused prologue (per-head q/k RMSNorm, RoPE, cache append) where a backend declares it:
    against the float64 reference, and bit for bit the backend's own unfused ops (q and both caches)."""
    if not be.supports("d_attention_prologue"):
        pytest.skip(f"{be.name} declares no d_attention_prologue")
    (q, k, v, w, table), norms, rope = prologue_inputs(be, t, hq, hkv, d, rd, interleave, normed)
    dq, dk, dv = be.d_put(q), be.d_put(k), be.d_put(v)
    cap = pos0 + t + 2
    kc, vc, kc2, vc2 = (be.d_zeros((cap, hkv, d)) for _ in range(4))
    y = be.d_get(be.d_attention_prologue(dq, dk, dv, norms, 1e-6, rope, kc, vc, pos0))

    def ref(x, wi):
        xx = x.astype(np.float64)
        if normed:
            xx = xx / np.sqrt((xx ** 2).mean(axis=2, keepdims=True) + 1e-6) * wi
        return rope_ref(xx, table.astype(np.float64), pos0, rd, interleave) if rd else xx

    assert y.shape == (t, hq, d) and _err(y, ref(q, w[0])) < 1e-5
    keys, values = be.d_get(kc), be.d_get(vc)
    assert _err(keys[pos0:pos0 + t], ref(k, w[1])) < 1e-5
    np.testing.assert_array_equal(values[pos0:pos0 + t], v)
    assert not keys[:pos0].any() and not keys[pos0 + t:].any() and not values[pos0 + t:].any()
    want = be.d_get(unfused_prologue(be, dq, dk, dv, norms, rope, kc2, vc2, pos0))
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(keys, be.d_get(kc2))
    np.testing.assert_array_equal(values, be.d_get(vc2))


def replay_prologue(be, q, k, v, norms, rope, captured: tuple, pos_captured: int, caches: tuple,  # noqa: F811
                    pos: int):  # be: a backend, not the fixture
    """One decode row's d_attention_prologue captured (``d_capture_step``) at ``pos_captured`` into the
    caches ``captured`` (k, v), then replayed at ``pos`` into ``caches`` through their slots: q [1, Hq, d]
    (host float32) as the replay returns it."""
    from colibri_plan.backends.handles import DArray

    (_, hq, d), hkv, ptr = q.shape, k.shape[1], be.dops._ptr

    def body(inp):
        qq, kk, vv = (DArray(s, inp.buf, inp.owner, inp.offset + o) for s, o in
                      (((1, hq, d), 0), ((1, hkv, d), hq * d), ((1, hkv, d), (hq + hkv) * d)))
        return [be.d_attention_prologue(qq, kk, vv, norms, 1e-6, rope, *captured, pos_captured)]

    step = be.d_capture_step((hq + 2 * hkv) * d, hq * d, body, pos_captured, [ptr(a) for a in captured])
    (got,) = step.run(np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)]), pos,
                      [ptr(a) for a in caches])
    return got


@pytest.mark.parametrize("normed, rd", [(True, 128), (False, 64)])
def test_captured_attention_prologue_replays_the_eager_bits(be, normed, rd):  # noqa: F811
    """Where a backend also captures decode steps: the fused prologue captured at position 2 and replayed
    at 40 into other caches (read through their slots) gives the eager unfused ops' q and cache rows."""
    if not (be.supports("d_attention_prologue") and be.supports("d_capture_step")):
        pytest.skip(f"{be.name} does not capture a fused prologue")
    hq, hkv, d = 16, 4, 128
    (q, k, v, _, _), norms, rope = prologue_inputs(be, 1, hq, hkv, d, rd, False, normed)
    ek, ev = be.d_zeros((48, hkv, d)), be.d_zeros((48, hkv, d))
    want = be.d_get(unfused_prologue(be, be.d_put(q), be.d_put(k), be.d_put(v), norms, rope, ek, ev, 40))
    kc0, vc0 = be.d_zeros((48, hkv, d)), be.d_zeros((48, hkv, d))
    kc, vc = be.d_zeros((48, hkv, d)), be.d_zeros((48, hkv, d))
    got = replay_prologue(be, q, k, v, norms, rope, (kc0, vc0), 2, (kc, vc), 40)
    np.testing.assert_array_equal(got.reshape(1, hq, d), want)
    np.testing.assert_array_equal(be.d_get(kc), be.d_get(ek))
    np.testing.assert_array_equal(be.d_get(vc), be.d_get(ev))
    assert not be.d_get(kc0).any()
