"""Routing on the device (``d_router_topk``): every family's top-k rule on every backend that declares the
op equals the host rule (``engine.moe.route`` = ``backends.routing.route_ref``) over random logits, near-ties
excluded by a margin (hypothesis); the CUDA kernel itself runs here compiled by g++ (tests/_cuda_host.py's
stand-ins) and its launch on the simulated GPU. Unavailable backends skip with their reason."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from colibri_plan.backends import get_backend
from colibri_plan.backends.cuda.routing import ROUTE_THREADS
from colibri_plan.backends.routing import MAX_EXPERTS, RouteRule, route_ref
from colibri_plan.errors import InputError, UnsupportedError
from colibri_plan.quant import quantize
from tests._backend_params import backend_params

#: one rule per family kind (engine/moe.py's module docstring; colibri_plan/families/)
RULES = {
    "qwen3-softmax-norm": RouteRule("softmax", 8),
    "qwen2-softmax-raw": RouteRule("softmax", 4, norm_topk_prob=False),
    "deepseek-v3-sigmoid-bias-top2-groups": RouteRule("sigmoid", 8, 8, 4, "top2_sum", True, 2.5),
    "deepseek-v2-softmax-max-groups": RouteRule("softmax", 6, 8, 3, "max", False, 16.0),
    "glm-sigmoid-bias-flat": RouteRule("sigmoid", 4, norm_topk_prob=True, routed_scaling_factor=1.8),
    "top1-groups-of-one": RouteRule("sigmoid", 1, 32, 2, "top2_sum", False, 1.0),  # E = 32 drawn
}
MARGIN = 1e-5  # smallest relative gap of a routing decision of a drawn row (float64)
PROPERTY = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
ROUTE_CU = Path(__file__).resolve().parents[1] / "shaders" / "cuda" / "route.cu"


def _gaps_ok(logits: np.ndarray, bias: np.ndarray | None, rule: RouteRule) -> bool:
    """True when the decisions of every row are clear by MARGIN (relative) in float64: the kept groups
    (the topk_group-th best group score against the next) and the top_k + 1 best choice scores of the
    kept experts (their order and the cut): then float32 rounding on any device cannot change them."""
    x = logits.astype(np.float64)
    if rule.scoring == "softmax":
        z = np.exp(x - x.max(axis=1, keepdims=True))
        s = z / z.sum(axis=1, keepdims=True)
    else:
        s = 1 / (1 + np.exp(-x))
    c = s if bias is None else s + bias

    def clear(a, b):
        return np.all(a - b > MARGIN * np.maximum(np.abs(a), 1e-3))

    if rule.grouped:
        g = np.sort(c.reshape(c.shape[0], rule.n_group, -1), axis=2)
        gs = g[:, :, -1] if rule.group_score == "max" or g.shape[2] == 1 else g[:, :, -1] + g[:, :, -2]
        gsorted = -np.sort(-gs, axis=1)
        if not clear(gsorted[:, rule.topk_group - 1], gsorted[:, rule.topk_group]):
            return False
        keep = gs >= gsorted[:, rule.topk_group - 1: rule.topk_group]
        c = np.where(np.repeat(keep, c.shape[1] // rule.n_group, axis=1), c, -np.inf)
    top = -np.sort(-c, axis=1)[:, : rule.top_k + 1]
    top = top[:, np.isfinite(top).all(axis=0)]
    return all(clear(top[:, j], top[:, j + 1]) for j in range(top.shape[1] - 1))


def _draw(data, rule: RouteRule) -> tuple[np.ndarray, np.ndarray | None]:
    e = data.draw(st.sampled_from([32] if rule.n_group == 32 else [64, 128] if rule.grouped
                                  else [16, 64, 128, 256]))
    t = data.draw(st.integers(1, 4))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    spread = data.draw(st.sampled_from([1.0, 4.0, 12.0]))
    logits = (rng.standard_normal((t, e)) * spread).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.02).astype(np.float32) if rule.scoring == "sigmoid" else None
    assume(_gaps_ok(logits, bias, rule))
    return logits, bias


def _check_same(ids, weights, logits, bias, rule):
    ref_ids, ref_w = route_ref(logits, bias, rule)
    assert ids.dtype == np.int32 and ids.shape == ref_ids.shape
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(weights, ref_w, rtol=2e-6, atol=1e-7 * max(1.0, rule.routed_scaling_factor))


@pytest.fixture(scope="module", params=backend_params())
def be(request):
    b = get_backend(request.param).open(0)
    if not b.supports("d_router_topk"):
        b.close()
        pytest.skip(f"{request.param} does not declare d_router_topk")
    yield b
    b.close()


@pytest.mark.parametrize("name", list(RULES))
@PROPERTY
@given(data=st.data())
def test_device_rule_equals_host_rule(be, name, data):
    """x = the logits and an identity router (x·Iᵀ is exact on every device): only the rule is compared."""
    rule = RULES[name]
    logits, bias = _draw(data, rule)
    eye = be.upload(quantize(np.eye(logits.shape[1], dtype=np.float32), "f32"))
    try:
        ids, w = be.d_router_topk(be.d_put(logits), eye, None if bias is None else be.d_put(bias), rule)
        assert ids.shape == w.shape == (logits.shape[0], rule.top_k)
        _check_same(*be.d_get_routing(ids, w), logits, bias, rule)
        _check_same(be.d_get_ids(ids), be.d_get(w), logits, bias, rule)  # each on its own: the same
    finally:
        be.free(eye)


def test_router_gemv_and_rule_on_a_real_router(be):
    """A [128, 96] router and x [3, 96]: ids equal the host rule on the host's logits (x · Wᵀ; seeded,
    checked free of near-ties), weights within float32 rounding."""
    rng = np.random.default_rng(7)
    x, wr = rng.standard_normal((3, 96), dtype=np.float32), rng.standard_normal((128, 96), dtype=np.float32)
    logits = x @ wr.T
    rule = RULES["qwen3-softmax-norm"]
    assert _gaps_ok(logits, None, rule)
    w = be.upload(quantize(wr, "f32"))
    try:
        ids, wt = be.d_router_topk(be.d_put(x), w, None, rule)
        ref_ids, ref_w = route_ref(logits, None, rule)
        np.testing.assert_array_equal(be.d_get_ids(ids), ref_ids)
        np.testing.assert_allclose(be.d_get(wt), ref_w, rtol=1e-5, atol=1e-7)
    finally:
        be.free(w)


def test_bad_arguments_are_typed_errors(be):
    w = be.upload(quantize(np.eye(16, dtype=np.float32), "f32"))
    x = be.d_put(np.zeros((1, 16), np.float32))
    try:
        with pytest.raises(InputError, match="router wants"):
            be.d_router_topk(be.d_put(np.zeros((1, 8), np.float32)), w, None, RouteRule("softmax", 2))
        with pytest.raises(InputError, match="bias"):
            be.d_router_topk(x, w, be.d_put(np.zeros(4, np.float32)), RouteRule("sigmoid", 2))
        with pytest.raises(InputError, match="top_k 17"):
            be.d_router_topk(x, w, None, RouteRule("softmax", 17))
        with pytest.raises(InputError, match="fewer than top_k"):
            be.d_router_topk(x, w, None, RouteRule("softmax", 8, 4, 1))
        with pytest.raises(InputError, match="split 16 experts"):
            be.d_router_topk(x, w, None, RouteRule("softmax", 2, 3, 1))
    finally:
        be.free(w)


def test_a_router_wider_than_the_kernels_is_unsupported_on_gpus(be):
    """E > MAX_EXPERTS: the GPU kernels refuse (the engine routes on the host); host backends run it."""
    e = MAX_EXPERTS + 8
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((1, e), dtype=np.float32)
    eye = be.upload(quantize(np.eye(e, dtype=np.float32), "f32"))
    try:
        if be.name in ("numpy", "cpu"):
            ids, _ = be.d_router_topk(be.d_put(logits), eye, None, RouteRule("softmax", 4))
            ref = route_ref(logits, None, RouteRule("softmax", 4))[0]
            np.testing.assert_array_equal(be.d_get_ids(ids), ref)
        else:
            with pytest.raises(UnsupportedError, match="at most 512"):
                be.d_router_topk(be.d_put(logits), eye, None, RouteRule("softmax", 4))
    finally:
        be.free(eye)


# ---- the CUDA kernel on the host (g++) ---------------------------------------------------------------
HARNESS = r"""
#undef __shared__
#define __shared__ static
ROUTE
// nb blocks of nt OS threads each (one after another), warps of 32 with their own barriers: the shuffles
// and __syncwarp of tests/_cuda_host.py's COLIBRI_HOST_WARP
extern "C" void run_route(const float *l, const float *b, int *ids, float *w, int T, int E, int K, int sm,
                          int g, int tg, int gmax, int norm, float eps, float scale, int nt, int nb) {
    blockDim = {(unsigned)nt, 1, 1}; gridDim = {(unsigned)nb, 1, 1};
    for (int blk = 0; blk < nb; blk++) {
        blockIdx = {(unsigned)blk, 0, 0};
        std::barrier<> bb(nt); block_bar = &bb;
        std::vector<std::barrier<> *> wb;
        for (int i = 0; i < nt / 32; i++) wb.push_back(new std::barrier<>(32));
        warp_bar = wb;
        std::vector<std::thread> ts;
        for (int t = 0; t < nt; t++) ts.emplace_back([=] {
            threadIdx = {(unsigned)t, 0, 0};
            route_topk(l, b, ids, w, T, E, K, sm, g, tg, gmax, norm, eps, scale); });
        for (auto &t : ts) t.join();
        for (auto *p : wb) delete p;
    }
}
// the int and float warp shuffles themselves: out[t] = the value lane t ^ m held (one warp)
extern "C" void run_shfl(const int *in_i, const float *in_f, int *out_i, float *out_f, int m) {
    blockDim = {32, 1, 1};
    std::barrier<> wb(32); warp_bar = {&wb};
    std::vector<std::thread> ts;
    for (int t = 0; t < 32; t++) ts.emplace_back([=] {
        threadIdx = {(unsigned)t, 0, 0};
        out_i[t] = __shfl_xor_sync(0xffffffffu, in_i[t], m);
        out_f[t] = __shfl_xor_sync(0xffffffffu, in_f[t], m); });
    for (auto &t : ts) t.join();
}
"""


@pytest.fixture(scope="module")
def cuda_route(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the CUDA route kernel is compiled for the host with it")
    from tests._cuda_host import HOST_PRELUDE

    d = tmp_path_factory.mktemp("route")
    (d / "route.cpp").write_text("#define COLIBRI_HOST_WARP\n" + HOST_PRELUDE
                                 + HARNESS.replace("ROUTE", ROUTE_CU.read_text()))
    build = subprocess.run([gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o",
                            str(d / "route.so"),
                            str(d / "route.cpp")], capture_output=True, text=True)
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"this g++ has no C++20 <barrier>: {build.stderr[:200]}")
    assert build.returncode == 0, build.stderr
    return ctypes.CDLL(str(d / "route.so"))


def _run_cuda_route(lib, logits, bias, rule, threads: int = ROUTE_THREADS, blocks: int = 1):
    from colibri_plan.backends.routing import kernel_params

    (e, k, sm, _, g, tg, gmax, norm), (eps, scale) = kernel_params(rule, logits.shape[1], bias is not None)
    t = logits.shape[0]
    ids, w = np.full((t, k), -7, np.int32), np.full((t, k), np.nan, np.float32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.run_route(ptr(logits), None if bias is None else ptr(bias), ptr(ids), ptr(w), t, e, k, sm, g, tg,
                  gmax, norm, ctypes.c_float(eps), ctypes.c_float(scale), threads, blocks)
    return ids, w


def test_host_warp_shuffles_exchange_lanes(cuda_route):
    """The harness's shuffles are real: lane t gets lane t ^ m's int and float (a no-op would fail)."""
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    vi = (np.arange(32, dtype=np.int32) * 7 - 100)
    vf = np.arange(32, dtype=np.float32) * np.float32(0.5) + np.float32(0.25)
    for m in (1, 2, 4, 8, 16, 5):
        oi, of = np.zeros(32, np.int32), np.zeros(32, np.float32)
        cuda_route.run_shfl(ptr(vi), ptr(vf), ptr(oi), ptr(of), m)
        lanes = np.arange(32) ^ m
        np.testing.assert_array_equal(oi, vi[lanes])
        np.testing.assert_array_equal(of, vf[lanes])


@pytest.mark.parametrize("name", list(RULES))
@PROPERTY
@given(data=st.data())
def test_cuda_kernel_rule_equals_host_rule(cuda_route, name, data):
    """One warp per row: a block of the launch's one warp, or of 2 / 4 warps (rows per block), over 1 or
    2 blocks (rows grid-strided)."""
    rule = RULES[name]
    logits, bias = _draw(data, rule)
    threads = data.draw(st.sampled_from([ROUTE_THREADS, 64, 128]))
    blocks = data.draw(st.sampled_from([1, 2]))
    ids, w = _run_cuda_route(cuda_route, np.ascontiguousarray(logits), bias, rule, threads, blocks)
    _check_same(ids, w, logits, bias, rule)


@PROPERTY
@given(data=st.data())
def test_cuda_kernel_on_every_router_width(cuda_route, data):
    """E of 32 .. 512 (16 experts per lane at 512, lanes without experts at 160), K 1..8, softmax and
    sigmoid with a bias, flat or grouped (n_group a divisor of E, lanes scoring groups), T of 1..5 rows;
    near-ties excluded by the margin."""
    e = data.draw(st.sampled_from([32, 64, 128, 160, 256, 512]))
    k = data.draw(st.integers(1, 8))
    scoring = data.draw(st.sampled_from(["softmax", "sigmoid"]))
    groups = [g for g in (1, 2, 4, 8, 16, 32) if e % g == 0]
    g = data.draw(st.sampled_from(groups))
    tg = data.draw(st.integers(1, g))
    assume(g == 1 or tg == g or tg * (e // g) >= k)
    rule = RouteRule(scoring, k, g, tg if g > 1 else 1, data.draw(st.sampled_from(["top2_sum", "max"])),
                     data.draw(st.booleans()), data.draw(st.sampled_from([1.0, 2.5])))
    t = data.draw(st.integers(1, 5))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = (rng.standard_normal((t, e)) * data.draw(st.sampled_from([1.0, 4.0]))).astype(np.float32)
    bias = (rng.standard_normal(e) * 0.02).astype(np.float32) if scoring == "sigmoid" else None
    assume(_gaps_ok(logits, bias, rule))
    ids, w = _run_cuda_route(cuda_route, logits, bias, rule, data.draw(st.sampled_from([32, 64])))
    _check_same(ids, w, logits, bias, rule)


def test_cuda_kernel_breaks_ties_to_the_lower_id(cuda_route):
    """Equal logits: the stable sort's order (lower id first), groups too; ties within a lane (3 and 35,
    67), across lanes (3, 9, 12) and between groups."""
    logits = np.zeros((2, 128), np.float32)
    logits[0, [3, 9, 12]] = 2.0
    logits[1, [67, 35, 3, 100]] = 1.5
    for rule in (RouteRule("softmax", 5), RouteRule("sigmoid", 4, 4, 2, "max", True, 1.0),
                 RouteRule("sigmoid", 6, 8, 3, "top2_sum", False, 1.0)):
        for threads in (ROUTE_THREADS, 64):
            ids, w = _run_cuda_route(cuda_route, logits, None, rule, threads)
            _check_same(ids, w, logits, None, rule)
    logits = np.zeros((1, 16), np.float32)  # fewer experts than lanes
    logits[0, [3, 9, 12]] = 2.0
    ids, w = _run_cuda_route(cuda_route, logits, None, RouteRule("softmax", 5))
    _check_same(ids, w, logits, None, RouteRule("softmax", 5))


def test_cuda_launch_on_the_simulated_gpu(monkeypatch):
    """The CUDA backend's hook: one route_topk launch after the router GEMV, no host wait, ids and weights
    where the simulated kernel (the host rule on the launch's arguments) wrote them."""
    from tests.test_backend_cuda_device_sim import Sim, device_cupy

    sim = Sim()
    monkeypatch.setitem(sys.modules, "cupy", device_cupy(sim))
    b = get_backend("cuda").open(0)
    try:
        assert b.supports("d_router_topk")
        rng = np.random.default_rng(11)
        logits = rng.standard_normal((2, 128), dtype=np.float32) * 4  # rows of 128: x read in place
        bias = (rng.standard_normal(128) * 0.02).astype(np.float32)
        rule = RULES["deepseek-v3-sigmoid-bias-top2-groups"]
        eye = b.upload(quantize(np.eye(128, dtype=np.float32), "f32"))
        dx, db = b.d_put(logits), b.d_put(bias)
        before = sim.launches
        ids, w = b.d_router_topk(dx, eye, db, rule)
        assert sim.launches - before == 2 and sim.route_args[4:8] == (2, 128, 8, 0)  # GEMV, route
        _check_same(b.d_get_ids(ids), b.d_get(w), logits, bias, rule)
    finally:
        b.close()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_cuda_route_kernel_compiles_to_ptx(tmp_path):
    """route.cu as NVRTC gets it (no headers, C++14) builds for sm_90 with its one entry."""
    run = subprocess.run(["nvcc", "--ptx", "-std=c++14", "-arch=sm_90", "-o", str(tmp_path / "r.ptx"),
                          str(ROUTE_CU)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ptx = (tmp_path / "r.ptx").read_text()
    assert ptx.count(".entry") == 1 and ".entry route_topk(" in ptx
