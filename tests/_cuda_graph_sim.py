"""Simulations of the kernels a captured decode step adds (``shaders/cuda/trunk.cu`` tr_rope_at,
tr_copy_rows_at, tr_expert_table, tr_qkv_prologue(_at); ``attention.cu`` attention_gqa_at; ``route_fused.cu``
route_fused) for the stand-in cupy of ``test_backend_cuda_device_sim.py``, and its memory pool / allocator
context. Each reads the step's position from device memory when it runs (at replay, inside a captured
graph), as the GPU does."""

from __future__ import annotations

import contextlib
import types

import numpy as np


def _pos(sim, posp, delta) -> int:
    return int(sim.mem(int(posp), 4).view(np.int32)[0]) + int(delta)


def _rope_at(sim, grid, block, args, trunk_sim):
    x, table, y, n, heads, d, rd, posp, delta, inter = args
    trunk_sim(sim, "tr_rope", grid, block, (x, table, y, n, heads, d, rd, _pos(sim, posp, delta), inter))


def _slot(sim, slot) -> int:
    return int(sim.mem(int(slot), 8).view(np.uint64)[0])


def _copy_rows_at(sim, grid, block, args, trunk_sim):
    src, dst_slot, n, row, posp, delta = (int(a) for a in args)
    sim.mem(_slot(sim, dst_slot) + 4 * _pos(sim, posp, delta) * row, 4 * n)[:] = sim.mem(src, 4 * n).copy()


def _expert_table(sim, grid, block, args, trunk_sim):
    """tr_expert_table: the K choices by ascending id, matmul.cu's table entries and the gates (0 for a row
    marked absent: bit 0 of its gate W)."""
    ids, w, experts, out, K, x, h, y, hrow, yrow = (int(a) if i != 1 else a for i, a in enumerate(args))
    assert grid == (1, 1, 1) and block == (32,)
    got = sim.mem(ids, 4 * K).view(np.int32).copy()
    gates = sim.mem(int(w), 4 * K).view(np.float32).copy()
    order = np.argsort(got, kind="stable")
    tab = sim.mem(experts, 48 * (int(got.max()) + 1)).view(np.uint64).reshape(-1, 6)
    o = sim.mem(out, 128 * K + 4 * K)
    ent = o[: 128 * K].view(np.uint64).reshape(2 * K, 8)
    for j, i in enumerate(order):
        e = tab[got[i]]
        hj, yj = h + j * hrow, y + j * yrow
        ent[j] = [e[0] & ~np.uint64(1), e[1], e[2], e[3], x, hj, 1, 0]
        ent[K + j] = [e[4], e[5], hj, yj, 1, 0, 0, 0]
    absent = (tab[got[order], 0] & np.uint64(1)) != 0  # experts on the host: gate 0
    o[128 * K:].view(np.float32)[:] = np.where(absent, np.float32(0), gates[order])


ROUTE_FUSED_STATIC_SMEM = 6672  # route_fused's static shared bytes (nvcc -Xptxas -v, sm_90)


def route_fused(sim, grid, block, smem, args, route_sim):
    """route_fused: the f32 router GEMV as the simulated mm_args computes it (float64 products of the
    zero-padded x, rounded to float32) into the logits scratch, then the simulated route_topk on them and,
    experts not null, tr_expert_table's simulation on its ids and weights. The count of finished blocks is
    0 at every launch (the last block sets it back)."""
    from colibri_plan.backends.cuda.routing import FUSED_THREADS, fused_blocks

    wr, x, bias, logits, count, ids, w, experts, out, xe, h, y, hrow, yrow = (int(a) for a in args[:14])
    E, H, in_pad, K, sm, g, tg, gmax, norm = (int(a) for a in args[14:23])
    eps, scale = args[23:]
    assert grid == (fused_blocks(E), 1, 1) and block == (FUSED_THREADS,) and smem == 4 * in_pad
    assert smem + ROUTE_FUSED_STATIC_SMEM <= 48 * 1024 and in_pad % 128 == 0 and H <= in_pad
    assert sim.mem(count, 4).view(np.int32)[0] == 0
    sim.route_fused_args = (E, H, in_pad, K, sm, g, tg, gmax, norm, bool(experts))
    W = sim.mem(wr, 4 * E * in_pad).view(np.float32).reshape(E, in_pad).astype(np.float64)
    xx = np.zeros(in_pad, np.float64)
    xx[:H] = sim.mem(x, 4 * H).view(np.float32)
    sim.mem(logits, 4 * E).view(np.float32)[:] = xx @ W.T
    route_sim(sim, (1, 1, 1), (32,), (logits, bias, ids, w, 1, E, K, sm, g, tg, gmax, norm, eps, scale))
    if experts:
        _expert_table(sim, (1, 1, 1), (32,), (ids, w, experts, out, K, xe, h, y, hrow, yrow), None)


def attention_at(sim, grid, block, smem, args, attention_sim):
    q, k_slot, v_slot, out, part, hq, hkv, d, posp, delta, window, scale, splits = args
    k, v = _slot(sim, k_slot), _slot(sim, v_slot)
    attention_sim(sim, grid, block, smem, (q, k, v, out, part, hq, hkv, d, _pos(sim, posp, delta), window,
                                           scale, splits))


def _prologue(sim, grid, block, args, trunk_sim):
    """tr_qkv_prologue(_at): the unfused sequence it replaces, on the same simulations: rmsnorm of each q
    and k head row (weights set), tr_rope of q and k (a table and rotary_dim set), the roped q into qo,
    the roped k and the v rows into the caches at the position (the _at form: read from device memory,
    the caches' addresses from their slots)."""
    from colibri_plan.backends.cuda.device import rms_threads

    q, k, v, qw, kw, table, qo, kc, vc, T, hq, hkv, d, rd, inter, eps = args[:16]
    T, hq, hkv, d, rd = (int(a) for a in (T, hq, hkv, d, rd))
    if len(args) == 18:  # tr_qkv_prologue_at
        pos0, kc, vc = _pos(sim, args[16], args[17]), _slot(sim, kc), _slot(sim, vc)
    else:
        pos0 = int(args[16])
    rows = T * (hq + 2 * hkv)
    assert block == (128,) and grid == (min(-(-rows // 4), 65535), 1, 1)
    at = 4 * pos0 * hkv * d  # bytes to the caches' row pos0
    for x, w, heads, dst in ((q, qw, hq, int(qo)), (k, kw, hkv, int(kc) + at)):
        n, src = T * heads * d, int(x)
        if int(w):  # into scratch memory, as rmsnorm's output would be
            src = sim.alloc(4 * n)
            trunk_sim(sim, "rmsnorm", (T * heads, 1, 1), (rms_threads(d),), (x, 0, w, src, 0, d, eps))
        if int(table) and rd:
            trunk_sim(sim, "tr_rope", (1, 1, 1), (256,), (src, table, dst, n, heads, d, rd, pos0, inter))
        else:
            sim.mem(dst, 4 * n)[:] = sim.mem(src, 4 * n).copy()
    nv = 4 * T * hkv * d
    sim.mem(int(vc) + at, nv)[:] = sim.mem(int(v), nv).copy()


#: kernel name -> fn(sim, grid, block, args, trunk_sim)
GRAPH_KERNELS = {"tr_rope_at": _rope_at, "tr_copy_rows_at": _copy_rows_at, "tr_expert_table": _expert_table,
                 "tr_qkv_prologue": _prologue, "tr_qkv_prologue_at": _prologue}


def add_pool(cp) -> None:
    """cupy.cuda.MemoryPool and using_allocator: the simulated heap never reuses memory, so a pool of
    the graph's own is only a name here."""
    cp.cuda.MemoryPool = lambda: types.SimpleNamespace(malloc=None)
    cp.cuda.using_allocator = lambda malloc=None: contextlib.nullcontext()
