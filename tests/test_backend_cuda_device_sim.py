"""The CUDA backend's device-activation ops (backends/cuda_device.py) on the simulated GPU of
``test_backend_cuda_sim.py``, through the cross-backend oracle of ``test_backends_device_ops.py``.

The stand-in ``cupy`` gains pool arrays in its device heap (``cp.empty``/``cp.zeros``), device-to-device
copies, events, and simulations of the trunk.cu and attention.cu kernels that read their arguments as the
GPU would: device addresses and scalars in the order ``cuda_device.py`` passes them. What runs for real
is the host side: DArray buffers and offsets, staging of ``d_put``/``d_get``, the matmul table entry and
padding feeding matmul.cu's ``mm``, launch grids and the split of attention's keys into slices. The
kernels' arithmetic is checked by ``test_backend_cuda.py`` (attention on the host) and, on a GPU, by
the oracle itself.
"""

from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest
from test_backends_device_ops import unfused_prologue  # the ops d_attention_prologue replaces

from colibri_plan.backends.device_ops import attention_ref, rope_ref
from colibri_plan.errors import InputError, UnsupportedError
from tests._cuda_graph_sim import GRAPH_KERNELS, add_pool, attention_at, route_fused
from tests.test_backend_cuda_sim import Sim, fake_cupy
from tests.test_backends_device_ops import (  # noqa: F401 - collected here with the simulated `be`
    test_a_gqa_layer_chain_stays_on_the_device,
    test_captured_attention_prologue_replays_the_eager_bits,
    test_d_attention,
    test_d_attention_prologue,
    test_d_expert_ffn,
    test_d_expert_ffn_edges,
    test_d_head_matmul,
    test_d_matmul,
    test_d_matmul_many,
    test_d_rmsnorm_add_silu_scale,
    test_d_rope,
    test_d_write_rows_into_a_column_block,
    test_device_arrays_of_another_backend_are_refused,
)

LOWEST = np.float32(-3.402823466e38)


def _f32(sim, ptr, n):
    return sim.mem(int(ptr), 4 * int(n)).view(np.float32)


def _attention_sim(sim, grid, block, smem, args):
    """attention_gqa: each (row t, head h, slice) as the kernel's contract says, float64."""
    q, k, v, out, part, hq, hkv, d, pos0, window, scale, splits = args
    hq, hkv, d, pos0, window, splits = (int(a) for a in (hq, hkv, d, pos0, window, splits))
    T, g = grid[0], hq // hkv
    sim.attention_grid = grid
    threads = max(256, -(-d // 32) * 32)  # a thread per channel past head_dim 256 (MLA's 576)
    assert grid == (T, hkv * -(-g // 8), splits) and block == (threads,) and d <= 608
    assert smem == 4 * (8 * (d + 256 + threads) + 24) <= 48 * 1024
    n = pos0 + T  # rows the kernel may read
    qq = _f32(sim, q, T * hq * d).reshape(T, hq, d).astype(np.float64)
    kk = _f32(sim, k, n * hkv * d).reshape(n, hkv, d).astype(np.float64)
    vv = _f32(sim, v, n * hkv * d).reshape(n, hkv, d).astype(np.float64)
    y = _f32(sim, out, T * hq * d).reshape(T, hq, d) if splits == 1 else None
    pp = _f32(sim, part, T * hq * splits * (d + 2)).reshape(T, hq, splits, d + 2) if splits > 1 else None
    for t in range(T):
        qpos = pos0 + t
        lo0 = max(0, qpos - window + 1) if window > 0 else 0
        per = -(-(qpos + 1 - lo0) // splits)
        for h in range(hq):
            for s in range(splits):
                lo, hi = lo0 + s * per, min(qpos + 1, lo0 + (s + 1) * per)
                sc = float(scale) * (kk[lo:hi, h // g] @ qq[t, h])
                m = sc.max() if hi > lo else float(LOWEST)
                e = np.exp(sc - m)
                acc, ll = e @ vv[lo:hi, h // g], e.sum()
                if splits == 1:
                    y[t, h] = acc / ll
                else:
                    pp[t, h, s, :d], pp[t, h, s, d], pp[t, h, s, d + 1] = acc, m, ll


def _combine_sim(sim, grid, args):
    part, out, d, splits = args
    d, splits, rows = int(d), int(splits), grid[0]
    pp = _f32(sim, part, rows * splits * (d + 2)).reshape(rows, splits, d + 2).astype(np.float64)
    w = np.exp(pp[:, :, d] - pp[:, :, d].max(axis=1, keepdims=True))  # [rows, splits]
    y = np.einsum("rs,rsc->rc", w, pp[:, :, :d]) / (w * pp[:, :, d + 1]).sum(axis=1, keepdims=True)
    _f32(sim, out, rows * d)[:] = y.reshape(-1)


def _route_sim(sim, grid, block, args):
    """route_topk: the host rule (routing.route_ref) on the logits its arguments point at."""
    from colibri_plan.backends.routing import RouteRule, route_ref

    logits, bias, ids, w, T, E, K, softmax, g, tg, gmax, norm, eps, scale = args
    T, E, K, g = int(T), int(E), int(K), int(g)
    assert grid[0] * block[0] >= T
    sim.route_args = tuple(int(a) for a in args[:12])
    rule = RouteRule("softmax" if int(softmax) else "sigmoid", K, g, int(tg),
                     "max" if int(gmax) else "top2_sum", bool(int(norm)), float(scale))
    b = _f32(sim, bias, E).copy() if int(bias) else None
    i, ww = route_ref(_f32(sim, logits, T * E).reshape(T, E).copy(), b, rule)
    sim.mem(int(ids), 4 * T * K).view(np.int32)[:] = i.reshape(-1)
    _f32(sim, w, T * K)[:] = ww.reshape(-1)


def _trunk_sim(sim, name, grid, block, args):
    """trunk.cu kernels and matmul.cu's rmsnorm on device addresses (rmsnorm: one warp per short row)."""
    from colibri_plan.backends.cuda.device import rms_threads

    assert block == ((rms_threads(int(args[5])),) if name == "rmsnorm" else (256,))
    if name == "tr_add":
        a, b, y, n, d, bcast = args
        n, d = int(n), int(d)
        bb = np.tile(_f32(sim, b, d), n // d) if int(bcast) else _f32(sim, b, n)
        _f32(sim, y, n)[:] = _f32(sim, a, n) + bb
    elif name == "tr_silu_mul":
        g, u, y, n = args
        gg = _f32(sim, g, int(n)).astype(np.float64)
        _f32(sim, y, int(n))[:] = gg / (1 + np.exp(-gg)) * _f32(sim, u, int(n))
    elif name == "tr_scale_rows":
        a, s, s0, y, n, d = args
        rows = int(n) // int(d)
        scales = _f32(sim, s, rows) if int(s) else np.full(rows, np.float32(s0))
        _f32(sim, y, int(n))[:] = (_f32(sim, a, int(n)).reshape(rows, -1) * scales[:, None]).reshape(-1)
    elif name == "tr_rope":
        x, table, y, n, heads, d, rd, pos0, inter = (int(a) if i > 2 else a for i, a in enumerate(args))
        T = n // (heads * d)
        tab = _f32(sim, table, (pos0 + T) * rd).reshape(pos0 + T, rd // 2, 2)
        xx = _f32(sim, x, n).reshape(T, heads, d)
        _f32(sim, y, n)[:] = rope_ref(xx, tab, pos0, rd, bool(inter)).reshape(-1)
    elif name == "tr_pad_rows":
        x, xp, T, n_in, in_pad = (int(a) for a in args)
        assert grid[0] * 256 >= min(T * in_pad, 65535 * 256)
        dst = _f32(sim, xp, T * in_pad).reshape(T, in_pad)
        dst[:, :n_in], dst[:, n_in:] = _f32(sim, x, T * n_in).reshape(T, n_in), 0.0
    elif name == "tr_expert_sum":
        ys, g, y, n, k = args
        n, k = int(n), int(k)
        yy, gg, acc = _f32(sim, ys, k * n).reshape(k, n), _f32(sim, g, k), np.zeros(n, np.float32)
        for j in range(k):  # the kernel's order and float32 roundings
            acc = acc + gg[j] * yy[j]
        _f32(sim, y, n)[:] = acc
    elif name == "tr_expert_scatter":
        ys, pos, g, y, n, H, k = args
        n, H, k = int(n), int(H), int(k)
        T = n // H
        pp = sim.mem(int(pos), 4 * k * T).view(np.int32).reshape(k, T)
        gg = _f32(sim, g, k * T).reshape(k, T)
        yy = _f32(sim, ys, (int(pp.max()) + 1) * H).reshape(-1, H)
        acc = np.zeros((T, H), np.float32)
        for j in range(k):  # the kernel's order and float32 roundings
            for t in np.flatnonzero(pp[j] >= 0):
                acc[t] = acc[t] + gg[j, t] * yy[pp[j, t]]
        _f32(sim, y, n)[:] = acc.reshape(-1)
    elif name == "rmsnorm":
        x, b, w, y, h, H, eps = args
        rows, H = grid[0], int(H)
        xs = _f32(sim, x, rows * H)
        if int(b):  # fused with the residual add: h = x + b (float32), normalised
            xs = xs + _f32(sim, b, rows * H)
            _f32(sim, h, rows * H)[:] = xs
        xx = xs.reshape(rows, H).astype(np.float64)
        ref = xx / np.sqrt((xx ** 2).mean(axis=1, keepdims=True) + float(eps)) * _f32(sim, w, H)
        _f32(sim, y, rows * H)[:] = ref.reshape(-1)
    else:
        raise AssertionError(f"unexpected kernel {name}")


def device_cupy(sim: Sim):
    cp = fake_cupy(sim)
    cuda, rt = cp.cuda, cp.cuda.runtime
    base_module, base_memcpy = cp.RawModule, rt.memcpyAsync

    class Kernel:
        def __init__(self, name, fallback):
            self.__name__, self.fallback = name, fallback
            self.kinds, self.kernel = fallback.kinds, fallback.kernel
            sim.functions[self.kernel.ptr] = self  # driver launches reach the simulation

        def __call__(self, grid, block, args, shared_mem=0):
            name = self.__name__
            if name == "rmsnorm" and not isinstance(args[0], np.uint64):
                return self.fallback(grid, block, args, shared_mem=shared_mem)  # the host-staged path
            if name == "attention_gqa":
                op = lambda: _attention_sim(sim, grid, block, shared_mem, args)  # noqa: E731
            elif name == "attention_gqa_at":  # a captured step's: the position read when it runs
                op = lambda: attention_at(sim, grid, block, shared_mem, args, _attention_sim)  # noqa: E731
            elif name in GRAPH_KERNELS:
                op = lambda: GRAPH_KERNELS[name](sim, grid, block, args, _trunk_sim)  # noqa: E731
            elif name == "attention_combine":
                op = lambda: _combine_sim(sim, grid, args)  # noqa: E731
            elif name == "route_topk":
                op = lambda: _route_sim(sim, grid, block, args)  # noqa: E731
            elif name == "route_fused":
                op = lambda: route_fused(sim, grid, block, shared_mem, args, _route_sim)  # noqa: E731
            else:
                op = lambda: _trunk_sim(sim, name, grid, block, args)  # noqa: E731
            sim.launches += 1
            sim.run(op)

    class RawModule(base_module):
        def get_function(self, name):
            fn = super().get_function(name)
            return fn if "<" in name else Kernel(name, fn)

    def memcpy(dst, src, n, kind, stream):
        if kind in (3, 4):  # device to device, or cudaMemcpyDefault between unified addresses
            sim.run(lambda: sim.mem(dst, n).__setitem__(slice(None), sim.mem(src, n).copy()))
        else:
            base_memcpy(dst, src, n, kind, stream)

    def memcpy2d(dst, dpitch, src, spitch, width, height, kind, stream):
        """cudaMemcpy2DAsync device to device: ``height`` rows of ``width`` bytes, pitches in bytes."""
        assert kind == 3 and stream == sim.stream_ptr and width <= min(dpitch, spitch)

        def op():
            for r in range(height):
                sim.mem(dst + r * dpitch, width)[:] = sim.mem(src + r * spitch, width).copy()
        sim.run(op)

    class Blas:
        """cuBLAS's column-major sgemmStridedBatched (host pointer mode: alpha, beta host addresses)."""

        CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_POINTER_MODE_HOST = 0, 1, 0

        def __init__(self):
            self.stream, self.mode = None, None

        def setStream(self, handle, stream):
            self.stream = stream

        def setPointerMode(self, handle, mode):
            self.mode = mode

        def sgemmStridedBatched(self, handle, ta, tb, m, n, k, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc,
                                sc, count):
            assert self.stream == sim.stream_ptr and self.mode == 0 and (ta, tb) == (1, 0)
            al, be = (np.frombuffer(ctypes.string_at(p, 4), np.float32)[0] for p in (alpha, beta))
            sim.gemms += 1

            def op():
                for b in range(count):  # op(A) = A^T: A is k x m (ld lda); B is k x n (ld ldb); C m x n
                    a = np.stack([_f32(sim, A + 4 * (b * sa + j * lda), k) for j in range(m)], 1)
                    bb = np.stack([_f32(sim, B + 4 * (b * sb + j * ldb), k) for j in range(n)], 1)
                    c = al * (a.T.astype(np.float64) @ bb)  # [m, n]
                    for j in range(n):
                        col = _f32(sim, C + 4 * (b * sc + j * ldc), m)
                        col[:] = c[:, j] + (be * col if be else 0.0)
            sim.run(op)

    class Event:
        def __init__(self, block=False, disable_timing=False, interprocess=False):
            self.recorded = False

        def record(self, stream=None):
            self.recorded = True

        def synchronize(self):
            assert self.recorded

    def empty(shape, dtype):
        assert sim.current_stream == sim.stream_ptr, "pool memory of another stream: not stream-ordered"
        dt, shape = np.dtype(dtype), tuple(np.atleast_1d(shape))
        nbytes = int(np.prod(shape)) * dt.itemsize
        ptr = sim.alloc(max(nbytes, 1))
        a = sim.mem(ptr, nbytes).view(dt).reshape(shape)  # fresh heap bytes: NaN garbage
        return types.SimpleNamespace(a=a, data=types.SimpleNamespace(ptr=ptr), size=a.size)

    def zeros(shape, dtype):
        out = empty(shape, dtype)
        sim.run(lambda: out.a.fill(0))
        return out

    cp.RawModule, cuda.Event, rt.memcpyAsync, rt.memcpyDeviceToDevice = RawModule, Event, memcpy, 3
    rt.memcpy2DAsync, cuda.cublas, sim.gemms = memcpy2d, Blas(), 0
    cuda.device = types.SimpleNamespace(get_cublas_handle=lambda: 11)
    cp.empty, cp.zeros, cp.uint8 = empty, zeros, np.uint8
    cp.ndarray = empty  # cuda_device.py allocates with cupy.ndarray(shape, dtype) itself
    add_pool(cp)  # a captured step's private pool (backends/cuda/graph.py)
    return cp


@pytest.fixture
def be(monkeypatch):
    sim = Sim()
    monkeypatch.setitem(sys.modules, "cupy", device_cupy(sim))
    from colibri_plan.backends import get_backend

    b = get_backend("cuda").open(0)
    b.sim = sim
    yield b
    b.close()


def test_a_matmul_reads_x_in_place_when_already_padded(be):
    """in = 256 (a multiple of 128): one launch, its table entry (a kernel argument) points at x itself;
    in = 200: x is first padded into the work buffer (a second launch), which the entry then names."""
    from colibri_plan import quant

    for n_in in (256, 200):
        qt = quant.quantize(np.random.default_rng(n_in).standard_normal((40, n_in), dtype=np.float32), "int8")
        x, w = be.d_put(np.ones((2, n_in), np.float32)), be.upload(qt)
        before = be.sim.launches
        y = be.d_matmul(x, w)
        assert be.sim.launches - before == (1 if n_in == 256 else 2)
        np.testing.assert_allclose(be.d_get(y), quant.matmul_ref(np.ones((2, n_in), np.float32), qt),
                                   rtol=1e-5, atol=1e-5)
        entry = be.sim.last_table[0]
        assert (int(entry[2]) == x.buf.data.ptr) == (n_in == 256)
        assert [int(v) for v in entry[3:7]] == [y.buf.data.ptr, 2, 40, 40]  # y, T, rows, y stride


def test_matmul_many_is_one_launch_per_format(be):
    """q/k/v-like weights of 48, 8 and 8 rows (T = 3, so each y's own row stride matters) run as one
    launch of three table entries; a fifth weight past the four an mm_args launch carries, and one of
    another format, take launches of their own. Every result equals its own d_matmul reference."""
    from colibri_plan import quant

    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 128), dtype=np.float32)
    dx = be.d_put(x)
    for fmts, launches in ((("int8", "int8", "int8"), 1), (("int4",) * 5, 2), (("int8", "int4", "int4"), 2)):
        qts = [quant.quantize(rng.standard_normal((48 if i == 0 else 8, 128), dtype=np.float32), f)
               for i, f in enumerate(fmts)]
        before = be.sim.launches
        ys = be.d_matmul_many(dx, [be.upload(q) for q in qts])
        assert be.sim.launches - before == launches
        for q, y in zip(qts, ys):
            assert y.shape == (3, q.out_features)
            np.testing.assert_allclose(be.d_get(y), quant.matmul_ref(x, q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T, pos0, window, splits", [(1, 999, 0, 8), (1, 200, 0, 4), (64, 0, 0, 1),
                                                      (1, 300, 32, 1)])
def test_attention_splits_the_keys_when_blocks_are_few(be, monkeypatch, T, pos0, window, splits):
    """4 SMs (simulated), 2 kv heads: one decode row makes 2 (row, kv head) blocks, so its keys go in
    slices of at least 64 keys, up to 4 blocks per SM: 1000 keys -> 8 slices, 201 keys -> 4; 64 prefill
    rows fill the SMs unsplit; a window of 32 keys is one slice. Split results are merged (a second
    launch) and equal the reference."""
    from colibri_plan.backends.cuda import device

    monkeypatch.setattr(device, "_ATT_MIN_KEYS", 64)  # the hand counts' slice floor
    rng = np.random.default_rng(T + pos0)
    hq, hkv, d = 4, 2, 16
    n = pos0 + T
    q, k, v = (rng.standard_normal(s, dtype=np.float32) for s in ((T, hq, d), (n, hkv, d), (n, hkv, d)))
    before = be.sim.launches
    y = be.d_get(be.d_attention(be.d_put(q), be.d_put(k), be.d_put(v), n, pos0, 0.25, window))
    assert be.sim.attention_grid == (T, hkv, splits)
    assert be.sim.launches - before == (1 if splits == 1 else 2)
    np.testing.assert_allclose(y, attention_ref(q, k, v, n, pos0, 0.25, window), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hidden", [256, 200])
def test_expert_ffn_on_the_device_x_is_three_launches_and_one_copy_up(be, hidden):
    """d_expert_ffn of 3 int8 experts: gate_up and mm over all of them and tr_expert_sum (a pad launch
    first when x's rows are not already H_pad floats), one host-to-device copy (the table and gates) and
    none down; gate_up's entries read x itself (hidden 256) and the down entries write consecutive
    [T, H] outputs; the result equals the host combine of the simulated expert_ffn."""
    from colibri_plan import quant

    rng = np.random.default_rng(hidden)
    qts = [tuple(quant.quantize(rng.standard_normal(s, dtype=np.float32) * np.float32(0.1), "int8")
                 for s in ((48, hidden), (48, hidden), (hidden, 48))) for _ in range(3)]
    ws = [be.upload_expert(*q) for q in qts]
    x, gates = rng.standard_normal((1, hidden), dtype=np.float32), np.array([0.5, 0.3, 0.2], np.float32)
    dx = be.d_put(x)
    copies, base = [], be.cp.cuda.runtime.memcpyAsync

    def count(dst, src, n, kind, stream):
        copies.append(kind)
        return base(dst, src, n, kind, stream)

    be.cp.cuda.runtime.memcpyAsync = count
    before = be.sim.launches
    dy = be.d_expert_ffn(dx, ws, gates)
    be.cp.cuda.runtime.memcpyAsync = base
    assert be.sim.launches - before == (3 if hidden == 256 else 4)
    assert copies == [1]   # host to device, once
    want = np.zeros((1, hidden), np.float32)
    for y, g in zip(be.expert_ffn([x] * 3, ws), gates):
        want += y * g
    np.testing.assert_allclose(be.d_get(dy), want, rtol=1e-5, atol=1e-6)


def test_mla_device_ops_are_one_driver_call_each(be, monkeypatch):
    """d_head_matmul is one cuBLAS strided-batched SGEMM on the stream (no kernel launch of ours), a block
    write one cudaMemcpy2DAsync, and attention over a 576-wide MLA head one launch of 576 threads (its
    9 keys unsplit: slices of 64 keys at least)."""
    from colibri_plan.backends.cuda import device

    monkeypatch.setattr(device, "_ATT_MIN_KEYS", 64)
    rng = np.random.default_rng(9)
    x, w = (rng.standard_normal(s, dtype=np.float32) for s in ((3, 16, 24), (16, 8, 24)))
    dx, dw = be.d_put(x), be.d_put(w)
    launches, gemms = be.sim.launches, be.sim.gemms
    y = be.d_head_matmul(dx, dw)
    assert (be.sim.launches, be.sim.gemms) == (launches, gemms + 1)
    np.testing.assert_allclose(be.d_get(y), np.einsum("tbk,bnk->tbn", x, w), rtol=1e-5, atol=1e-5)
    dst = be.d_zeros((6, 24))
    calls, base = [], be.cp.cuda.runtime.memcpy2DAsync
    be.cp.cuda.runtime.memcpy2DAsync = lambda *a: calls.append((a[0], a[1], *a[3:6])) or base(*a)
    be.d_write_rows(dst, 2, be.d_put(np.ones((2, 16), np.float32)), 8)
    be.cp.cuda.runtime.memcpy2DAsync = base
    # dst at row 2, column 8; its pitch, src's pitch and the width in bytes; 2 rows
    assert calls == [(dst.buf.data.ptr + 4 * (2 * 24 + 8), 96, 64, 64, 2)]
    ref = np.zeros((6, 24), np.float32)
    ref[2:4, 8:] = 1.0
    np.testing.assert_array_equal(be.d_get(dst), ref)
    q, kv = (rng.standard_normal(s, dtype=np.float32) for s in ((1, 16, 576), (9, 1, 576)))
    before = be.sim.launches
    out = be.d_get(be.d_attention(be.d_put(q), be.d_put(kv), be.d_put(kv), 9, 8, 0.05))
    assert be.sim.launches - before == 1 and be.sim.attention_grid == (1, 2, 1)  # 16 heads in chunks of 8
    np.testing.assert_allclose(out, attention_ref(q, kv, kv, 9, 8, 0.05), rtol=1e-5, atol=1e-6)
    with pytest.raises(UnsupportedError, match="head_dim 609"):
        z = be.d_put(np.zeros((1, 1, 609), np.float32))
        be.d_attention(z, z, z, 1, 0, 1.0)


@pytest.mark.parametrize("rows, d", [(1, 2048), (3, 128)])
def test_add_rmsnorm_is_one_launch_with_the_bits_of_add_then_norm(be, rows, d):
    """d_add_rmsnorm on the CUDA backend: one rmsnorm launch (its b and h set) for both outputs, equal to
    d_add then d_rmsnorm (two launches) bit for bit; mismatched shapes are a typed error."""
    rng = np.random.default_rng(rows)
    a, b = rng.standard_normal((2, rows, d), dtype=np.float32)
    w = rng.standard_normal(d, dtype=np.float32)
    da, db, dw = be.d_put(a), be.d_put(b), be.d_put(w)
    before = be.sim.launches
    h, x = be.d_add_rmsnorm(da, db, dw, 1e-6)
    assert be.sim.launches - before == 1 and h.shape == x.shape == (rows, d)
    h2 = be.d_add(da, db)
    x2 = be.d_rmsnorm(h2, dw, 1e-6)
    assert be.sim.launches - before == 3
    np.testing.assert_array_equal(be.d_get(h), a + b)
    np.testing.assert_array_equal(be.d_get(x), be.d_get(x2))
    with pytest.raises(InputError, match="d_add_rmsnorm"):
        be.d_add_rmsnorm(da, be.d_put(b[:, :-1].copy()), dw, 1e-6)


def test_a_mapped_expert_lives_in_pinned_host_memory_and_computes_the_same_bits(be):
    """upload_expert_mapped: the weights' addresses are pinned host buffers (no device heap used), the
    kernels read them there, so expert_ffn gives the VRAM copy's bits; the bytes count as mapped, not as
    device memory held, and free returns them."""
    from colibri_plan import quant

    rng = np.random.default_rng(5)
    qts = [quant.quantize(rng.standard_normal(s, dtype=np.float32), "int8") for s in ((64, 128), (64, 128),
                                                                                       (128, 64))]
    dev = be.upload_expert(*qts)
    held, top = be.held_bytes, be.sim.top
    mapped = be.upload_expert_mapped(*qts)
    assert be.sim.top == top and be.held_bytes == held and be.mapped_bytes == sum(q.nbytes for q in qts)
    pinned = [(a.ctypes.data, a.ctypes.data + a.size) for a in be.sim.pinned]
    assert all(w.host_mapped and any(p0 <= w.payload.data < p1 for p0, p1 in pinned) for w in mapped)
    x = rng.standard_normal((1, 128), dtype=np.float32)
    np.testing.assert_array_equal(be.expert_ffn([x], [mapped])[0], be.expert_ffn([x], [dev])[0])
    for w in mapped:
        be.free(w)
    assert be.mapped_bytes == 0 and be.held_bytes == held
    with pytest.raises(InputError, match="not a QuantTensor"):
        be.upload_expert_mapped(qts[0], qts[1], "down")


def test_a_prefill_copies_its_busy_mapped_experts_to_vram_first(be, monkeypatch):
    """d_expert_ffn_rows with mapped experts: one with more than STAGE_MIN_TOKENS rows is copied up
    first (one host-to-device copy per matrix, from its mapped address), one with few rows is read in
    place; the result has the bits of the same experts in VRAM."""
    from colibri_plan import quant
    from colibri_plan.backends.cuda.experts import STAGE_MIN_TOKENS

    rng = np.random.default_rng(9)
    shapes = ((64, 128), (64, 128), (128, 64))
    qts = [[quant.quantize(rng.standard_normal(s, dtype=np.float32), "int8") for s in shapes]
           for _ in range(2)]
    dev = [be.upload_expert(*q) for q in qts]
    mapped = [be.upload_expert_mapped(*q) for q in qts]
    T = STAGE_MIN_TOKENS + 8
    x = be.d_put(rng.standard_normal((T, 128), dtype=np.float32))
    rows = [np.arange(T), np.array([1, 4])]
    gates = [np.full(T, 0.5, np.float32), np.array([0.25, 0.75], np.float32)]
    want = be.d_get(be.d_expert_ffn_rows(x, dev, rows, gates))
    sources, copy = [], be.rt.memcpyAsync
    monkeypatch.setattr(be.rt, "memcpyAsync",
                        lambda d, s, n, k, st: (sources.append(s), copy(d, s, n, k, st)))
    got = be.d_get(be.d_expert_ffn_rows(x, mapped, rows, gates))
    np.testing.assert_array_equal(got, want)
    staged = [w.payload.data for w in mapped[0]]
    assert [s for s in sources if s in staged] == staged
    assert not {w.payload.data for w in mapped[1]} & set(sources)


def test_captured_step_brings_adjacent_outputs_down_in_one_copy(be, monkeypatch):
    """A captured body's routings are cut back to back from the step's region (``graph.take``), so the
    logits and three layers' routings come down in two device-to-host copies, not four; the replayed
    outputs are what the body wrote. ``_runs`` merges exactly the adjacent parts."""
    from colibri_plan.backends.cuda.graph import _runs
    from colibri_plan.backends.handles import DArray

    assert _runs([(100, 8), (108, 4), (200, 4), (204, 0), (300, 4)]) == [(100, 12), (200, 4), (300, 4)]
    rt = be.cp.cuda.runtime
    kinds, real = [], rt.memcpyAsync

    def counted(dst, src, n, kind, stream):
        kinds.append(kind)
        return real(dst, src, n, kind, stream)

    monkeypatch.setattr(rt, "memcpyAsync", counted)

    from colibri_plan import quant
    from colibri_plan.backends.routing import RouteRule

    rng = np.random.default_rng(3)
    routers = [be.upload(quant.quantize(rng.standard_normal((6, 16), dtype=np.float32), "f32"))
               for _ in range(3)]
    rule = RouteRule("softmax", 2, 1, 1, "max", True, 1.0)
    x = rng.standard_normal(16, dtype=np.float32)

    def body(inp):
        outs = [be.d_add(be.d_view(inp, (1, 16)), be.d_view(inp, (1, 16)))]  # "logits" [1, 16]: 2 x
        for w in routers:  # each layer's routing [ids | weights], as decode_graph.py returns them
            ids, _ = be.d_router_topk(be.d_view(inp, (1, 16)), w, None, rule)
            outs.append(DArray((4,), ids.buf, ids.owner, ids.offset))
        return outs

    step = be.d_capture_step(16, 16 + 3 * 4, body, 0, [])
    assert kinds.count(2) == 2  # the logits, then the three routings in one copy
    got = step.run(x, 0, [])
    np.testing.assert_array_equal(got[0], 2 * x)
    for w, r in zip(routers, got[1:]):
        ids, wts = be.d_router_topk(be.d_put(x[None]), w, None, rule)  # eager, the same kernels
        assert r[:2].view(np.int32).tolist() == be.d_get_ids(ids).reshape(-1).tolist()
        np.testing.assert_array_equal(r[2:], be.d_get(wts).reshape(-1))


def test_captured_attention_slices_follow_doublings_of_the_context(be, monkeypatch):
    """A captured step holds its slice count: at 4 SMs (simulated), 2 kv heads of 4 query heads, 130 keys
    are 3 slices for 2 query rows (64 keys each at least) but 4 for a decode row (the 256 above them, an
    eager step as a captured one), as every context up to 256 is, so one graph serves them; "fill" takes
    the most the SMs allow (8) at any context and "exact" the eager count."""
    from colibri_plan.backends.cuda import device

    monkeypatch.setattr(device, "_ATT_MIN_KEYS", 64)  # the hand counts' slice floor
    assert be.dops.attention_splits(2, 4, 2, 130) == 3  # prefill rows: their own count
    assert be.dops.attention_splits(1, 4, 2, 130) == 4  # an eager decode step: a replay's (the same bits)
    assert {be.d_attention_splits(1, 4, 2, n) for n in range(129, 257)} == {4}
    assert be.d_attention_splits(1, 4, 2, 257) == 8
    monkeypatch.setattr(device, "_ATT_CAPTURED", "fill")
    assert {be.d_attention_splits(1, 4, 2, n) for n in (1, 17, 130, 5000)} == {8}
    monkeypatch.setattr(device, "_ATT_CAPTURED", "exact")
    assert be.d_attention_splits(1, 4, 2, 130) == 3


@pytest.mark.parametrize("T, gemms", [(15, 0), (16, 1)])
def test_float32_router_at_prefill_is_one_sgemm(be, T, gemms):
    """A float32 weight (a router, 6 x 40: padded to 40) at 16 tokens or more is one cuBLAS SGEMM on the
    padded x, below that the GEMV kernel; both equal the float32 reference."""
    from colibri_plan import quant

    rng = np.random.default_rng(T)
    qt = quant.quantize(rng.standard_normal((6, 37), dtype=np.float32), "f32")
    x = rng.standard_normal((T, 37), dtype=np.float32)
    before = be.sim.gemms
    y = be.d_get(be.d_matmul(be.d_put(x), be.upload(qt)))
    assert be.sim.gemms - before == gemms
    np.testing.assert_allclose(y, quant.matmul_ref(x, qt), rtol=1e-5, atol=1e-5)


def _prologue_case(be, T, d, rd, inter, normed, seed):
    """Host inputs of a prologue: q [T, 4, d], k, v [T, 2, d], norm weights [d], a RoPE table of 32 rows."""
    from colibri_plan.backends.device_ops import rope_table

    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s, dtype=np.float32) * 2 for s in ((T, 4, d), (T, 2, d), (T, 2, d)))
    wq, wk = (rng.standard_normal(d, dtype=np.float32) for _ in range(2))
    inv = 1.0 / (1e4 ** (np.arange(0, rd, 2) / max(rd, 1)))
    norms = (be.d_put(wq), be.d_put(wk)) if normed else None
    rope = (be.d_put(rope_table(inv, 32, attention_factor=1.0)), rd, inter) if rd else None
    return q, k, v, norms, rope


@pytest.mark.parametrize("T, d, rd, inter, normed", [(1, 16, 16, False, True), (3, 16, 8, True, True),
                                                     (2, 12, 12, False, False), (1, 18, 0, False, True)])
def test_fused_attention_prologue_gives_the_unfused_bits_in_one_launch(be, T, d, rd, inter, normed):
    """d_attention_prologue: one tr_qkv_prologue launch for the 4 of the unfused ops (2 rmsnorm + 2 tr_rope;
    the eager cache append is two copies), the same roped q and the same cache rows (k roped, v as it is;
    the other rows untouched), bit for bit: per-head norms or none, rotate_half or interleaved pairs, a
    partial rotary_dim or none, prefill rows. Rows past the cache and a head wider than one warp's
    buffer are typed errors."""
    from colibri_plan.backends.cuda.prologue import PRO_MAX_HEAD_DIM

    assert be.supports("d_attention_prologue")
    q, k, v, norms, rope = _prologue_case(be, T, d, rd, inter, normed, T * d)
    dq, dk, dv = be.d_put(q), be.d_put(k), be.d_put(v)
    kc1, vc1, kc2, vc2 = (be.d_zeros((9, 2, d)) for _ in range(4))
    before = be.sim.launches
    want = be.d_get(unfused_prologue(be, dq, dk, dv, norms, rope, kc1, vc1, 5))
    assert be.sim.launches - before == 2 * normed + 2 * bool(rd)
    before = be.sim.launches
    got = be.d_attention_prologue(dq, dk, dv, norms, 1e-6, rope, kc2, vc2, 5)
    assert be.sim.launches - before == 1 and got.shape == (T, 4, d)
    np.testing.assert_array_equal(be.d_get(got), want)
    np.testing.assert_array_equal(be.d_get(kc2), be.d_get(kc1))
    np.testing.assert_array_equal(be.d_get(vc2), be.d_get(vc1))
    assert not be.d_get(kc2)[:5].any() and np.array_equal(be.d_get(vc2)[5:5 + T], v)
    if normed and rd:  # the kernel really normed and roped (not a copy)
        assert not np.array_equal(be.d_get(kc2)[5:5 + T], k)
    with pytest.raises(InputError, match="do not fit the cache"):
        be.d_attention_prologue(dq, dk, dv, norms, 1e-6, rope, kc2, vc2, 9 - T + 1)
    wide = be.d_zeros((1, 1, PRO_MAX_HEAD_DIM + 4))
    with pytest.raises(UnsupportedError, match="head_dim"):
        be.d_attention_prologue(wide, wide, wide, None, 1e-6, None, be.d_zeros((2, 1, PRO_MAX_HEAD_DIM + 4)),
                                be.d_zeros((2, 1, PRO_MAX_HEAD_DIM + 4)), 0)


@pytest.mark.parametrize("normed, rd", [(True, 16), (False, 8)])
def test_captured_prologue_reads_position_and_caches_on_the_device(be, normed, rd):
    """Inside a captured step the fused prologue is one tr_qkv_prologue_at launch where the unfused ops are
    six (2 rmsnorm, 2 tr_rope_at, 2 tr_copy_rows_at; four without norms); replayed at another position
    and into other caches (their slots), both give the eager unfused step's q and cache rows bit for
    bit."""
    from colibri_plan.backends.handles import DArray

    T, d = 1, 16
    q, k, v, norms, rope = _prologue_case(be, T, d, rd, False, normed, 7)
    n_in = (4 + 2 + 2) * d
    inputs = np.concatenate([q.reshape(-1), k.reshape(-1), v.reshape(-1)])
    kc0, vc0 = be.d_zeros((9, 2, d)), be.d_zeros((9, 2, d))  # the capture's caches
    eager_k, eager_v = be.d_zeros((9, 2, d)), be.d_zeros((9, 2, d))
    want = be.d_get(unfused_prologue(be, be.d_put(q), be.d_put(k), be.d_put(v), norms, rope, eager_k, eager_v,
                                     6))
    ptr = be.dops._ptr
    for fused, launches in ((True, 1), (False, 2 * normed + 2 + 2)):  # (norms,) ropes, row copies
        def body(inp, fused=fused):
            qq, kk, vv = (DArray(s, inp.buf, inp.owner, inp.offset + o) for s, o in
                          (((T, 4, d), 0), ((T, 2, d), 4 * d), ((T, 2, d), 6 * d)))
            if fused:
                return [be.d_attention_prologue(qq, kk, vv, norms, 1e-6, rope, kc0, vc0, 2)]
            return [unfused_prologue(be, qq, kk, vv, norms, rope, kc0, vc0, 2)]

        before = be.sim.launches
        step = be.d_capture_step(n_in, 4 * d, body, 2, [ptr(kc0), ptr(vc0)])
        assert be.sim.launches - before == launches
        kc, vc = be.d_zeros((9, 2, d)), be.d_zeros((9, 2, d))  # replayed into these, at row 6
        (got,) = step.run(inputs, 6, [ptr(kc), ptr(vc)])
        np.testing.assert_array_equal(got.reshape(T, 4, d), want)
        np.testing.assert_array_equal(be.d_get(kc), be.d_get(eager_k))
        np.testing.assert_array_equal(be.d_get(vc), be.d_get(eager_v))
        assert not be.d_get(kc0).any()  # the capture itself wrote nothing
