"""The fused decode routing of the CUDA backend (backends/cuda/routing.py ``_d_route_fused``, graph.py
``d_router_indexed``): one ``route_fused`` launch for a decode token's router GEMV and top-k rule, and in a
captured step its experts' launch table too, against the separate launches (``routing.FUSED`` off:
mm_args, route_topk, tr_expert_table): ids, weights, the table and the layer's output bit for bit, in
eager and captured (replayed) steps, over every family's rule; two launches fewer per MoE layer of a
captured step, one fewer per eager decode routing. On the simulated GPU of test_backend_cuda_device_sim.py
(whose route_fused is the simulated mm_args, route_topk and tr_expert_table in one launch) and, where
CuPy sees one, on the real GPU (the kernel's own bits: tests/test_backend_cuda_route_fused_host.py)."""

from __future__ import annotations

import numpy as np
import pytest
import test_engine_decode_graph as _graph
from test_backends_routing import RULES, _gaps_ok

from colibri_plan.backends.cuda import routing as cuda_routing
from colibri_plan.backends.handles import DArray
from colibri_plan.backends.routing import route_ref
from colibri_plan.quant import quantize

be, fx = _graph.be, _graph.fx  # fixtures: the simulated GPU and the real one (else skipped), the pack
H, I = 256, 64  # hidden (rows of in_pad: x read in place), expert width


def _launches(be) -> int:
    return be.sim.launches if be.sim is not None else 0


def _n_experts(rule) -> int:
    return 32 if rule.n_group == 32 else 64


def _router(be, rule, seed: int, hidden: int = H, fmt: str = "f32"):
    """(router weight, bias DArray or None, x DArray [1, hidden], host logits [1, E]) with the decisions of
    the float64 logits clear of near-ties."""
    E = _n_experts(rule)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        w = (rng.standard_normal((E, hidden)) * 0.25).astype(np.float32)
        x = rng.standard_normal((1, hidden)).astype(np.float32)
        bias = (rng.standard_normal(E) * 0.02).astype(np.float32) if rule.scoring == "sigmoid" else None
        logits = (x.astype(np.float64) @ w.T.astype(np.float64)).astype(np.float32)
        if _gaps_ok(logits, bias, rule):
            break
    return (be.upload(quantize(w, fmt)), None if bias is None else be.d_put(bias), be.d_put(x), logits)


def _layer(be, E: int, seed: int, hidden: int = H, absent=()):
    """One MoE layer's experts (int8) and their device table; ``absent`` ids live off this GPU."""
    rng = np.random.default_rng(seed)
    shapes = ((I, hidden), (I, hidden), (hidden, I))
    ws = [be.upload_expert(*(quantize(rng.standard_normal(s).astype(np.float32) * 0.1, "int8")
                             for s in shapes)) for _ in range(E)]
    return ws, be.d_expert_table([None if e in absent else w for e, w in enumerate(ws)])


def _routing(be, ids, w):
    i, ww = be.d_get_routing(ids, w)
    return i.copy(), ww.view(np.uint32).copy()


@pytest.mark.parametrize("name", list(RULES))
def test_eager_decode_routing_is_one_launch_with_the_bits_of_two(be, name, monkeypatch):
    rule = RULES[name]
    w, bias, x, logits = _router(be, rule, seed=len(name))
    n0 = _launches(be)
    fused = _routing(be, *be.d_router_topk(x, w, bias, rule))
    n1 = _launches(be)
    monkeypatch.setattr(cuda_routing, "FUSED", False)
    two = _routing(be, *be.d_router_topk(x, w, bias, rule))
    n2 = _launches(be)
    np.testing.assert_array_equal(fused[0], two[0])
    np.testing.assert_array_equal(fused[1], two[1])
    ref_ids, ref_w = route_ref(logits, None if bias is None else be.d_get(bias), rule)
    np.testing.assert_array_equal(fused[0], ref_ids)
    np.testing.assert_allclose(fused[1].view(np.float32), ref_w, rtol=2e-5, atol=1e-6)
    if be.sim is not None:
        assert (n1 - n0, n2 - n1) == (1, 2)
        assert be.sim.route_fused_args[:4] == (_n_experts(rule), H, H, rule.top_k)


@pytest.mark.parametrize("name", list(RULES))
def test_indexed_routing_writes_tr_expert_tables_table(be, name, monkeypatch):
    """d_router_indexed with the layer's table (two experts off this GPU): ids, weights, the launch table
    and d_expert_ffn_indexed's output equal the separate launches' bit for bit; the layer is 4 launches
    (route_fused, gate_up, mm, tr_expert_sum), not 6."""
    from colibri_plan.backends.cuda.graph import CudaStepGraphs

    rule = RULES[name]
    E, K = _n_experts(rule), rule.top_k
    w, bias, x, _ = _router(be, rule, seed=3 * len(name))
    ws, table = _layer(be, E, seed=5, absent=(1, 6))
    n0 = _launches(be)
    ids, wt, prep = be.d_router_indexed(x, w, bias, rule, table)
    assert prep is not None and prep.table is table
    got_table = be.d_get(DArray((33 * K,), prep.args, id(be))).view(np.uint32)
    y = be.d_get(be.d_expert_ffn_indexed(x, ids, wt, table, prep))
    n1 = _launches(be)
    monkeypatch.setattr(cuda_routing, "FUSED", False)
    ids2, wt2, prep2 = be.d_router_indexed(x, w, bias, rule, table)
    assert prep2 is None
    y2 = be.d_get(be.d_expert_ffn_indexed(x, ids2, wt2, table))
    n2 = _launches(be)
    np.testing.assert_array_equal(_routing(be, ids, wt)[0], _routing(be, ids2, wt2)[0])
    np.testing.assert_array_equal(_routing(be, ids, wt)[1], _routing(be, ids2, wt2)[1])
    np.testing.assert_array_equal(y.view(np.uint32), y2.view(np.uint32))
    # tr_expert_table itself on the unfused ids, into the same buffers
    ops, args = be.dops, be.dops._d_empty(33 * K)
    assert isinstance(be.d_router_indexed.__self__, CudaStepGraphs)
    xp, h, yb = be.d_router_indexed.__self__.ex._buffers(x, [table.first], K)
    assert (xp, h, yb) == (prep.x, prep.h, prep.y)
    ops._d_kernel("tr_expert_table")(1, 1, 1, 32, 0, ops._dstate["sptr"], ops._ptr(ids2), ops._ptr(wt2),
                                     table.dev.data.ptr, args.data.ptr, K, xp, h, yb,
                                     4 * table.first.down.payload.in_pad, 4 * H)
    want_table = be.d_get(DArray((33 * K,), args, id(be))).view(np.uint32)
    np.testing.assert_array_equal(got_table, want_table)
    chosen = _routing(be, ids, wt)[0][0]
    gates = got_table[32 * K:].view(np.float32)
    assert np.all((gates == 0) == np.isin(np.sort(chosen), [1, 6]))  # absent experts: gate 0
    if be.sim is not None:
        assert (n1 - n0, n2 - n1) == (4, 6)


def _capture(be, layers, rule, n_layers: int):
    """A captured 'step' of ``n_layers`` MoE layers on its input x [H] (x_{l+1} = x_l + experts(x_l)):
    (the CapturedStep, launches while capturing). Outputs: the last x, then each layer's [ids | weights]."""

    def body(inp):
        xl, routes = be.d_view(inp, (1, H)), []
        for w, bias, table in layers[:n_layers]:
            ids, wt, prep = be.d_router_indexed(xl, w, bias, rule, table)
            routes.append(DArray((2 * rule.top_k,), ids.buf, ids.owner, ids.offset))
            xl = be.d_add(xl, be.d_expert_ffn_indexed(xl, ids, wt, table, prep))
        return [be.d_view(xl, (H,)), *routes]

    n0 = _launches(be)
    step = be.d_capture_step(H, H + 2 * rule.top_k * n_layers, body, 0, [])
    return step, _launches(be) - n0, body


@pytest.mark.parametrize("name", ["qwen3-softmax-norm", "qwen2-softmax-raw",
                                  "deepseek-v3-sigmoid-bias-top2-groups", "glm-sigmoid-bias-flat"])
def test_captured_layers_launch_two_fewer_kernels_each_and_replay_the_eager_bits(be, name, monkeypatch):
    """Three layers captured with the fused routing and with the separate launches: the capture has 2
    launches fewer per layer; replays of both (over several inputs) equal each other and the eager run of
    the same body bit for bit (x and every layer's routing)."""
    rule = RULES[name]
    E = _n_experts(rule)
    layers = []
    for n in range(3):
        w, bias, _, _ = _router(be, rule, seed=11 + n)
        layers.append((w, bias, _layer(be, E, seed=20 + n, absent=(n,))[1]))
    fused, n_fused, body = _capture(be, layers, rule, 3)
    monkeypatch.setattr(cuda_routing, "FUSED", False)
    split, n_split, _ = _capture(be, layers, rule, 3)
    if be.sim is not None:
        assert n_split - n_fused == 2 * 3 and n_fused == 3 * (4 + 1)  # route_fused + 3 experts + add
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.standard_normal(H).astype(np.float32)
        a, b = fused.run(x, 0, []), split.run(x, 0, [])
        monkeypatch.setattr(cuda_routing, "FUSED", True)
        eager = [be.d_get(o) for o in body(be.d_put(x))]
        monkeypatch.setattr(cuda_routing, "FUSED", False)
        for u, v, e in zip(a, b, eager):
            np.testing.assert_array_equal(u.view(np.uint32), v.view(np.uint32))
            np.testing.assert_array_equal(u.view(np.uint32), e.view(np.uint32))


def test_calls_the_fused_kernel_does_not_take_run_the_separate_launches(be, monkeypatch):
    """x not rows of the experts' in_pad (H 200): routing fused, the table by tr_expert_table (a pad and a
    table launch); a non-f32 router, a prefill (T 2), a router wider than FUSED_MAX_IN: two launches; the
    results equal the separate launches'."""
    rule = RULES["qwen3-softmax-norm"]
    w, bias, x, _ = _router(be, rule, seed=2, hidden=200)
    _, table = _layer(be, 64, seed=9, hidden=200)
    n0 = _launches(be)
    ids, wt, prep = be.d_router_indexed(x, w, bias, rule, table)
    y = be.d_get(be.d_expert_ffn_indexed(x, ids, wt, table, prep))
    n1 = _launches(be)
    assert prep is None
    monkeypatch.setattr(cuda_routing, "FUSED", False)
    ids2, wt2, _ = be.d_router_indexed(x, w, bias, rule, table)
    y2 = be.d_get(be.d_expert_ffn_indexed(x, ids2, wt2, table))
    n2 = _launches(be)
    np.testing.assert_array_equal(y.view(np.uint32), y2.view(np.uint32))
    np.testing.assert_array_equal(_routing(be, ids, wt)[0], _routing(be, ids2, wt2)[0])
    monkeypatch.setattr(cuda_routing, "FUSED", True)
    w8, _, x8, _ = _router(be, rule, seed=4, fmt="int8")
    x2 = be.d_put(np.ones((2, H), np.float32))
    wf, _, xf, _ = _router(be, rule, seed=5)
    n3 = _launches(be)
    be.d_router_topk(x8, w8, None, rule)
    be.d_router_topk(x2, wf, None, rule)
    monkeypatch.setattr(cuda_routing, "FUSED_MAX_IN", 128)
    be.d_router_topk(xf, wf, None, rule)
    n4 = _launches(be)
    if be.sim is not None:
        # fused: route_fused, then pad, tr_expert_table, gate_up, mm, sum; separate: pad, mm_args,
        # route_topk, then the same five; then three calls of mm_args and route_topk
        assert (n1 - n0, n2 - n1, n4 - n3) == (6, 8, 3 * 2)


def test_the_count_of_finished_blocks_is_made_once_outside_captures(be):
    """Eager calls keep one count buffer (0 between launches: the simulated kernel checks it)."""
    rule = RULES["glm-sigmoid-bias-flat"]
    w, bias, x, _ = _router(be, rule, seed=8)
    part = be._d_route_fused.__self__
    be.d_router_topk(x, w, bias, rule)
    count = part._count
    assert count is not None
    be.d_router_topk(x, w, bias, rule)
    assert part._count is count
    np.testing.assert_array_equal(be.d_get(DArray((1,), count, id(be))).view(np.int32), [0])


@pytest.mark.parametrize("local", [None, range(8)])
def test_decode_steps_are_the_same_with_the_fused_routing_and_capture_two_launches_fewer(fx, be, monkeypatch,
                                                                                         local):
    """The engine's decode (tests/test_engine_decode_graph.py's fixture and run, EVERY + 6 steps, all
    experts in VRAM or half of them on the host: segments) with the fused routing and with the separate
    launches: the same tokens, logits bit for bit, recorded routing and tier uses; each capture has two
    launches fewer per MoE layer."""
    from test_engine_decode_graph import EVERY, _decode

    from colibri_plan.engine.pack import open_pack

    captured: list[int] = []
    for op in ("d_capture_step", "d_capture_segments"):
        def wrap(*a, _fn=getattr(be, op), **k):
            n0 = _launches(be)
            out = _fn(*a, **k)
            captured.append(_launches(be) - n0)
            return out
        setattr(be, op, wrap)
    with open_pack(fx) as pack:
        on = _decode(pack, be, monkeypatch, True, EVERY + 6, local=local)
        fused_captures = captured[:]
        captured.clear()
        monkeypatch.setattr(cuda_routing, "FUSED", False)
        off = _decode(pack, be, monkeypatch, True, EVERY + 6, local=local)
        n_moe = len(pack.arch.moe_layers)
    assert on[4][0] is None and on[0] == off[0]
    np.testing.assert_array_equal(on[1], off[1])
    np.testing.assert_array_equal(on[3], off[3])
    assert on[2] == off[2] and on[5] == off[5]
    assert len(fused_captures) == len(captured) >= 2
    if be.sim is not None:
        assert [b - a for a, b in zip(fused_captures, captured)] == [2 * n_moe] * len(captured)
