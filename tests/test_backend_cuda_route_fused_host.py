"""``shaders/cuda/route_fused.cu``'s ``route_fused`` (a decode token's router GEMV, top-k rule and expert
launch table in one launch) compiled by g++ with matmul.cu and route.cu as NVRTC gets them, and run on the
host as the GPU runs it (tests/_cuda_host.py: an OS thread per CUDA thread, real warp shuffles; blocks one
after another, so the last block to finish is the last one run; ``__shared__`` arrays static, one per
block at a time; the dynamic shared memory a buffer of the host's). Against the three launches it
replaces, run in the same harness: matmul.cu's ``mm_args<F_F32, 1, 4, 1>`` (the f32 GEMV tuning), route.cu's
``route_topk`` on its logits and trunk.cu's ``tr_expert_table`` on its ids: logits, ids, weights and every
table entry bit for bit; and ids / weights against the numpy rule (``routing.route_ref``), near-ties
excluded by a margin."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
from _cuda_host import HOST_PRELUDE
from test_backend_cuda import SOURCE
from test_backends_routing import ROUTE_CU, RULES, _gaps_ok

from colibri_plan.backends.cuda.routing import FUSED_THREADS, fused_blocks
from colibri_plan.backends.routing import RouteRule, kernel_params, route_ref
from colibri_plan.quant import quantize

FUSED_CU = SOURCE.parent / "route_fused.cu"
TRUNK_CU = SOURCE.parent / "trunk.cu"
DYN = "extern __shared__ float4 smem4[];"

HARNESS = "#define COLIBRI_HOST_WARP\n" + HOST_PRELUDE + r"""
#undef __shared__
#define __shared__ static
static float4 host_dyn[16384];  // a block's dynamic shared memory (blocks run one after another)
static void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> T __ldcg(const T *p) { return *p; }
typedef unsigned long long tr_u64;
SOURCES
// nb blocks of nt threads, one block after another
template <class F> static void grid_run(int nb, int nt, F body) {
    blockDim = {(unsigned)nt, 1, 1}; gridDim = {(unsigned)nb, 1, 1};
    for (int blk = 0; blk < nb; blk++) {
        blockIdx = {(unsigned)blk, 0, 0};
        memset(host_dyn, 0xff, sizeof host_dyn);  // garbage: staging must write what it reads
        std::barrier<> bb(nt); block_bar = &bb;
        std::vector<std::barrier<> *> wb;
        for (int i = 0; i < nt / 32; i++) wb.push_back(new std::barrier<>(32));
        warp_bar = wb;
        std::vector<std::thread> ts;
        for (int t = 0; t < nt; t++) ts.emplace_back([=] { threadIdx = {(unsigned)t, 0, 0}; body(); });
        for (auto &t : ts) t.join();
        for (auto *p : wb) delete p;
    }
}
// d_matmul's GEMV of x [in_pad] (copied to an aligned buffer, as the device's pool arrays are)
extern "C" void run_mm(const float *W, const float *x, float *y, int E, int in_pad) {
    static float4 xa[4096]; memcpy(xa, x, 4 * in_pad);
    MMArgs t; memset(&t, 0, sizeof t);
    t.e[0] = (u64)W; t.e[1] = (u64)W; t.e[2] = (u64)xa; t.e[3] = (u64)y; t.e[4] = 1; t.e[5] = E; t.e[6] = E;
    grid_run(1, 256, [=] { mm_args<F_F32, 1, 4, 1>(t, E, in_pad, E, 0); });
}
extern "C" void run_route(const float *l, const float *b, int *ids, float *w, int E, int K, int sm, int g,
                          int tg, int gmax, int norm, float eps, float scale) {
    grid_run(1, 32, [=] { route_topk(l, b, ids, w, 1, E, K, sm, g, tg, gmax, norm, eps, scale); });
}
extern "C" void run_table(const int *ids, const float *w, const u64 *ex, u64 *out, int K, u64 x, u64 h,
                          u64 y, int hrow, int yrow) {
    grid_run(1, 32, [=] { tr_expert_table(ids, w, ex, out, K, x, h, y, hrow, yrow); });
}
extern "C" void run_fused(const float *W, const float *x, const float *b, float *lg, int *count, int *ids,
                          float *w, const u64 *ex, u64 *out, u64 xe, u64 h, u64 y, int hrow, int yrow, int E,
                          int H, int in_pad, int K, int sm, int g, int tg, int gmax, int norm, float eps,
                          float scale, int nt, int nb) {
    grid_run(nb, nt, [=] { route_fused(W, x, b, lg, count, ids, w, ex, out, xe, h, y, hrow, yrow, E, H,
                                       in_pad, K, sm, g, tg, gmax, norm, eps, scale); });
}
"""


def _table_kernel() -> str:
    """trunk.cu's tr_expert_table alone (the rest of trunk.cu is not this harness's)."""
    m = re.search(r'extern "C" __global__ void tr_expert_table\(.*?\n}\n', TRUNK_CU.read_text(), re.S)
    assert m, "no tr_expert_table in trunk.cu"
    return m.group(0)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the CUDA kernels are compiled for the host with it")
    sources = [SOURCE.read_text(), ROUTE_CU.read_text(), FUSED_CU.read_text(), _table_kernel()]
    assert DYN in sources[0] and DYN in sources[2]
    text = HARNESS.replace("SOURCES", "\n".join(s.replace(DYN, "float4 *smem4 = host_dyn;") for s in sources))
    d = tmp_path_factory.mktemp("route_fused")
    (d / "rf.cpp").write_text(text)
    build = subprocess.run([gxx, "-std=c++20", "-O1", "-w", "-shared", "-fPIC", "-pthread", "-o",
                            str(d / "rf.so"), str(d / "rf.cpp")], capture_output=True, text=True, timeout=300)
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"this g++ has no C++20 <barrier>: {build.stderr[:200]}")
    assert build.returncode == 0, build.stderr[:4000]
    return ctypes.CDLL(str(d / "rf.so"))


def _p(a):
    return None if a is None else a.ctypes.data_as(ctypes.c_void_p)


def _case(E: int, H: int, rule: RouteRule, seed: int):
    """A router W [E, H] (f32, rows padded to in_pad with zeros as uploaded), x [H] and bias, drawn until
    the float64 logits' decisions are clear of near-ties."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        w = (rng.standard_normal((E, H)) * 0.25).astype(np.float32)
        x = rng.standard_normal(H).astype(np.float32)
        bias = (rng.standard_normal(E) * 0.02).astype(np.float32) if rule.scoring == "sigmoid" else None
        if _gaps_ok((x.astype(np.float64) @ w.T.astype(np.float64))[None].astype(np.float32), bias, rule):
            break
    qt = quantize(w, "f32")
    in_pad = -(-H // 128) * 128
    wp = np.zeros((E, in_pad), np.float32)
    wp[:, :H] = np.asarray(qt.data, np.float32).reshape(E, -1)[:, :H]
    return wp, x, bias, in_pad


def _experts(E: int, seed: int) -> np.ndarray:
    """An expert table [E, 6] u64: even addresses, a few rows marked absent (bit 0 of gate W)."""
    rng = np.random.default_rng(seed)
    t = (rng.integers(1, 2**40, (E, 6), dtype=np.uint64) * np.uint64(2))
    t[rng.choice(E, max(1, E // 8), replace=False), 0] |= np.uint64(1)
    return t


def _run_three(lib, wp, x, bias, rule, in_pad, ex):
    """The three launches: mm_args logits [E], route_topk ids / weights [K], tr_expert_table's table."""
    E, H = wp.shape[0], x.shape[0]
    (e, k, sm, _, g, tg, gmax, norm), (eps, scale) = kernel_params(rule, E, bias is not None)
    xp = np.zeros(in_pad, np.float32)
    xp[:H] = x
    lg = np.full(E, np.nan, np.float32)
    lib.run_mm(_p(wp), _p(xp), _p(lg), E, in_pad)
    ids, w = np.full(k, -7, np.int32), np.full(k, np.nan, np.float32)
    lib.run_route(_p(lg), _p(bias), _p(ids), _p(w), e, k, sm, g, tg, gmax, norm, ctypes.c_float(eps),
                  ctypes.c_float(scale))
    out = np.zeros(17 * k, np.uint64)  # [2K entries of 8 | K gates (float32)]
    args = (ctypes.c_uint64(0x1000), ctypes.c_uint64(0x200000), ctypes.c_uint64(0x900000), 4 * 384, 4 * H)
    lib.run_table(_p(ids), _p(w), _p(ex), _p(out), k, *args)
    return lg, ids, w, out


def _run_fused(lib, wp, x, bias, rule, in_pad, ex, nt, nb):
    E, H = wp.shape[0], x.shape[0]
    (e, k, sm, _, g, tg, gmax, norm), (eps, scale) = kernel_params(rule, E, bias is not None)
    lg, count = np.full(E, np.nan, np.float32), np.zeros(1, np.int32)
    ids, w = np.full(k, -7, np.int32), np.full(k, np.nan, np.float32)
    out = np.zeros(17 * k, np.uint64)
    tab = (ctypes.c_uint64(0x1000), ctypes.c_uint64(0x200000), ctypes.c_uint64(0x900000), 4 * 384, 4 * H)
    lib.run_fused(_p(wp), _p(x), _p(bias), _p(lg), _p(count), _p(ids), _p(w), _p(ex),
                  _p(out) if ex is not None else None, *tab, E, H, in_pad, k, sm, g, tg, gmax, norm,
                  ctypes.c_float(eps), ctypes.c_float(scale), nt, nb)
    assert count[0] == 0  # the last block set it back for the next launch
    return lg, ids, w, out


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("E, H, nt, nb", [
    (64, 256, FUSED_THREADS, None),   # the launch's shape: 8 blocks of 8 warps, a row a warp
    (128, 200, FUSED_THREADS, None),  # x padded by the kernel (H < in_pad), 16 blocks
    (32, 1000, 64, 1),                # one block: no count; 16 rows a warp
    (160, 384, 128, 3),               # lanes without experts, rows not a multiple of the warps
])
def test_fused_kernel_has_the_bits_of_the_three_launches(lib, name, E, H, nt, nb):
    rule = RULES[name]
    if rule.n_group == 32:
        E = 32
    if rule.grouped and E % rule.n_group:
        E = 64
    nb = fused_blocks(E) if nb is None else nb
    wp, x, bias, in_pad = _case(E, H, rule, seed=E * 7 + H)
    ex = _experts(E, seed=E + H)
    lg3, ids3, w3, out3 = _run_three(lib, wp, x, bias, rule, in_pad, ex)
    lg, ids, w, out = _run_fused(lib, wp, x, bias, rule, in_pad, ex, nt, nb)
    np.testing.assert_array_equal(lg.view(np.uint32), lg3.view(np.uint32))  # the GEMV's bits
    np.testing.assert_array_equal(ids, ids3)
    np.testing.assert_array_equal(w.view(np.uint32), w3.view(np.uint32))
    np.testing.assert_array_equal(out, out3)  # every entry and gate as tr_expert_table writes them
    ref_ids, ref_w = route_ref((x.astype(np.float64) @ wp[:, :H].T.astype(np.float64))[None].astype(
        np.float32), bias, rule)
    np.testing.assert_array_equal(ids, ref_ids[0])  # the numpy rule (no near-ties by construction)
    np.testing.assert_allclose(w, ref_w[0], rtol=2e-5, atol=1e-7 * max(1.0, rule.routed_scaling_factor))
    gates = out[16 * rule.top_k:].view(np.float32)[: rule.top_k]
    absent = (ex[np.sort(ids), 0] & np.uint64(1)) != 0
    assert np.all(gates[absent] == 0) and np.all(gates[~absent] != 0)


def test_without_a_table_only_ids_and_weights_are_written(lib):
    """experts null (d_router_topk's eager decode call): the same ids and weights, no table."""
    rule = RULES["qwen3-softmax-norm"]
    wp, x, bias, in_pad = _case(128, 256, rule, seed=3)
    _, ids3, w3, _ = _run_three(lib, wp, x, bias, rule, in_pad, _experts(128, 1))
    _, ids, w, out = _run_fused(lib, wp, x, bias, rule, in_pad, None, FUSED_THREADS, fused_blocks(128))
    np.testing.assert_array_equal(ids, ids3)
    np.testing.assert_array_equal(w.view(np.uint32), w3.view(np.uint32))
    assert not out.any()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_fused_kernel_compiles_to_ptx_after_matmul_and_route(tmp_path):
    """matmul.cu + route.cu + route_fused.cu, the module launch.py compiles (C++14, no headers), builds for
    sm_90; its static shared memory leaves the dynamic x of FUSED_MAX_IN floats under 48 KiB."""
    from colibri_plan.backends.cuda.routing import FUSED_MAX_IN
    from tests._cuda_graph_sim import ROUTE_FUSED_STATIC_SMEM

    src = tmp_path / "rf.cu"
    src.write_text(SOURCE.read_text() + ROUTE_CU.read_text() + FUSED_CU.read_text())
    run = subprocess.run(["nvcc", "--cubin", "-std=c++14", "-arch=sm_90", "-Xptxas", "-v", "-o",
                          str(tmp_path / "rf.cubin"), str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    info = run.stderr[run.stderr.index("'route_fused'"):]
    smem = int(re.search(r"(\d+) bytes smem", info).group(1))
    assert smem == ROUTE_FUSED_STATIC_SMEM and smem + 4 * FUSED_MAX_IN <= 48 * 1024
    assert "0 bytes spill" in info.split("Compiling entry")[0]
