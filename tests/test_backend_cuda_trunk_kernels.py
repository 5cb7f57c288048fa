"""The CUDA device-activation kernels (``shaders/cuda/attention.cu`` attention_gqa/attention_combine,
``shaders/cuda/trunk.cu``) compiled with g++ and run on the host against the numpy references of
``backends/device_ops.py``: attention with a thread per CUDA thread (barriers for ``__syncthreads``,
shuffles through memory), the trunk kernels on one thread (their grid-stride loops cover everything). No
GPU needed; on a GPU the oracles (``test_backends_device_ops.py``, ``test_backends_oracle.py``) run the
same kernels for real.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from _cuda_host import HOST_PRELUDE
from test_backend_cuda import ATT_SOURCE, SOURCE, _host_build

# attention_gqa + attention_combine of attention.cu run on the host as they run on a GPU: one OS thread per
# CUDA thread, __syncthreads a barrier of the block, warp shuffles exchanged through memory between two
# barriers of the warp, the dynamic shared memory one static array
GQA_HARNESS = r"""
#include <barrier>
#include <thread>
#include <vector>
#include <cstdio>
#include <math.h>
#include <algorithm>
using std::min;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
#define __shared__ static
struct D3 { unsigned x, y, z; };
static thread_local D3 threadIdx;
static D3 blockIdx, blockDim;
static std::barrier<> *block_bar;
static std::vector<std::barrier<> *> warp_bar;
static float exch[1024];
static void __syncthreads() { block_bar->arrive_and_wait(); }
static float __shfl_xor_sync(unsigned, float v, int m) {
  const unsigned t = threadIdx.x; std::barrier<> &b = *warp_bar[t >> 5];
  exch[t] = v; b.arrive_and_wait(); const float r = exch[t ^ m]; b.arrive_and_wait(); return r; }
template <class T> T __ldg(const T *p) { return *p; }
using std::max;
static void __syncwarp() { warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
static float smem_host[1 << 16];
#define GQA_SMEM float *sm = smem_host
#include "SOURCE"
// reads: T Hq Hkv d C pos0 window splits threads scale, then q, k, v; prints out [T, Hq * d]
int main() {
  int T, Hq, Hkv, d, C, pos0, window, splits, threads; float scale;
  if (scanf("%d %d %d %d %d %d %d %d %d %f", &T, &Hq, &Hkv, &d, &C, &pos0, &window, &splits, &threads, &scale)
      != 10) return 2;
  std::vector<float> q((size_t)T * Hq * d), k((size_t)C * Hkv * d), v(k.size()), out(q.size(), NAN);
  std::vector<float> part((size_t)T * Hq * splits * (d + 2), NAN);
  for (auto *a : {&q, &k, &v}) for (auto &x : *a) if (scanf("%f", &x) != 1) return 3;
  const int chunks = (Hq / Hkv + GQA_HEADS - 1) / GQA_HEADS;
  blockDim.x = threads;
  for (unsigned z = 0; z < (unsigned)splits; z++) for (unsigned y = 0; y < (unsigned)(Hkv * chunks); y++)
    for (unsigned x = 0; x < (unsigned)T; x++) {
      blockIdx = {x, y, z};
      std::barrier<> bb(threads); block_bar = &bb;
      warp_bar.clear();
      for (int w = 0; w < threads / 32; w++) warp_bar.push_back(new std::barrier<>(32));
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; t++) ts.emplace_back([&, t] {
        threadIdx.x = t;
        attention_gqa(q.data(), k.data(), v.data(), out.data(), part.data(), Hq, Hkv, d, pos0, window, scale,
                      splits); });
      for (auto &t : ts) t.join();
      for (auto *b : warp_bar) delete b;
    }
  if (splits > 1) {
    blockDim.x = 32;
    for (unsigned b = 0; b < (unsigned)(T * Hq); b++) {
      blockIdx = {b, 0, 0};
      for (unsigned t = 0; t < 32; t++) {
        threadIdx.x = t;
        attention_combine(part.data(), out.data(), d, splits); }
    }
  }
  for (float x : out) printf("%.9g\n", x);
  return 0;
}
"""


@pytest.fixture(scope="module")
def gqa_harness(tmp_path_factory):
    exe, build = _host_build(tmp_path_factory, GQA_HARNESS.replace("SOURCE", str(ATT_SOURCE)), "-std=c++20",
                             "-pthread", "-DATT_TILE=8", "-DGQA_HEADS=3")  # small tiles and head chunks
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"this g++ has no C++20 <barrier>: {build.stderr[:200]}")
    assert build.returncode == 0, build.stderr
    return exe


@pytest.mark.parametrize("T, hq, hkv, d, pos0, window, splits, threads", [
    (1, 4, 2, 16, 20, 0, 1, 32),     # decode, one slice over three tiles of 8 keys (the last partial)
    (1, 8, 2, 67, 30, 0, 4, 96),     # odd head dim (96 threads: one row group, 29 idle), 4 slices merged
    (3, 7, 1, 12, 5, 0, 3, 64),      # MQA, 7 heads in chunks of 3 (3, 3, 1), 5 row groups, empty slices
    (4, 2, 2, 20, 17, 6, 2, 64),     # sliding window of 6 keys, prefill rows at 17..20
    (2, 16, 1, 24, 7, 0, 2, 32),     # MLA on its latent cache: 16 heads on one kv head (chunks of 3)
])
def test_gqa_attention_kernel_on_the_host(gqa_harness, T, hq, hkv, d, pos0, window, splits, threads):
    """attention_gqa with tiles of 8 keys and blocks of at most 3 query heads: the key range per query row
    (causal, sliding window), its split into slices and their merge (attention_combine), the per-head
    online softmax across tiles, row groups of the P.V sums, odd sizes; against the float64 reference."""
    from colibri_plan.backends.device_ops import attention_ref

    rng = np.random.default_rng([T, hq, d, splits])
    C = pos0 + T + 3
    q = rng.standard_normal((T, hq, d), dtype=np.float32)
    k = rng.standard_normal((C, hkv, d), dtype=np.float32) * np.float32(2.0)
    v = rng.standard_normal((C, hkv, d), dtype=np.float32)
    scale = d ** -0.5
    text = " ".join([f"{T} {hq} {hkv} {d} {C} {pos0} {window} {splits} {threads} {scale!r}",
                     " ".join(repr(float(x)) for a in (q, k, v) for x in a.reshape(-1))])
    run = subprocess.run([str(gqa_harness)], input=text, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    got = np.array(run.stdout.split(), np.float64).reshape(T, hq * d)
    ref = attention_ref(q, k, v, pos0 + T, pos0, scale, window).astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


# trunk.cu's kernels on the host: one thread of one block (their grid-stride loops then cover everything)
TRUNK_HARNESS = r"""
#include <cstdio>
#include <cmath>
#include <cstring>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
// the device intrinsics trunk.cu uses: IEEE round-to-nearest add/multiply, never contracted to an FMA
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
struct D3 { unsigned x, y, z; };
static D3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
#define __shared__ static
static void __syncthreads() {}  // one thread (tr_expert_table, which needs a block, is not run here)
// tr_qkv_prologue's warp built-ins, for the compile only (it runs in PROLOGUE_HARNESS, 32 lanes a warp)
struct float4 { float x, y, z, w; };
static float __shfl_xor_sync(unsigned, float v, int) { return v; }
static void __syncwarp() {}
static float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
#include "SOURCE"
static std::vector<float> rd(size_t n) {
  std::vector<float> v(n); for (auto &x : v) scanf("%f", &x); return v; }
static void put(const std::vector<float> &v) { for (float x : v) printf("%.9g\n", x); }
int main() {
  char op[16]; int a, b, c, d, e, f, g;
  if (scanf("%15s %d %d %d %d %d %d %d", op, &a, &b, &c, &d, &e, &f, &g) != 8) return 2;
  if (!strcmp(op, "rope")) {  // T heads d rd P pos0 interleave
    const size_t n = (size_t)a * b * c;
    auto x = rd(n), table = rd((size_t)e * d); std::vector<float> y(n, NAN);
    tr_rope(x.data(), table.data(), y.data(), n, b, c, d, f, g); put(y);
  } else if (!strcmp(op, "pad")) {  // T in in_pad
    auto x = rd((size_t)a * b); std::vector<float> xp((size_t)a * c, NAN);
    tr_pad_rows(x.data(), xp.data(), a, b, c); put(xp);
  } else if (!strcmp(op, "add")) {  // rows d bcast
    const size_t n = (size_t)a * b;
    auto x = rd(n), y0 = rd(c ? b : n); std::vector<float> y(n, NAN);
    tr_add(x.data(), y0.data(), y.data(), n, b, c); put(y);
  } else {  // scale: rows d; silu: rows d
    const size_t n = (size_t)a * b;
    auto x = rd(n), s = rd(a); std::vector<float> y(n, NAN), z(n, NAN);
    tr_scale_rows(x.data(), a > 1 ? s.data() : nullptr, s[0], y.data(), n, b); put(y);
    tr_silu_mul(x.data(), y.data(), z.data(), n); put(z);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def trunk_harness(tmp_path_factory):
    src = SOURCE.parent.joinpath("trunk.cu")
    exe, build = _host_build(tmp_path_factory, TRUNK_HARNESS.replace("SOURCE", str(src)), "-std=c++17")
    assert build.returncode == 0, build.stderr
    return exe


def _run_harness(exe, head: str, *arrays) -> np.ndarray:
    text = " ".join([head] + [repr(float(v)) for a in arrays for v in np.asarray(a).reshape(-1)])
    run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return np.array(run.stdout.split(), np.float64).astype(np.float32)  # %.9g: float32 exactly


@pytest.mark.parametrize("T, heads, d, rd, pos0, interleave", [
    (2, 3, 10, 8, 5, False), (3, 2, 12, 12, 0, True), (1, 1, 6, 0, 2, False)])
def test_trunk_rope_on_the_host(trunk_harness, T, heads, d, rd, pos0, interleave):
    """tr_rope against rope_ref: both layouts, channels past rotary_dim copied, rotary_dim 0."""
    from colibri_plan.backends.device_ops import rope_ref, rope_table

    rng = np.random.default_rng([T, d, rd])
    x = rng.standard_normal((T, heads, d), dtype=np.float32)
    table = rope_table(1.0 / (100.0 ** (np.arange(0, rd, 2) / max(rd, 1))), 16, attention_factor=1.2)
    y = _run_harness(trunk_harness, f"rope {T} {heads} {d} {rd} 16 {pos0} {int(interleave)}", x, table)
    np.testing.assert_allclose(y.reshape(x.shape), rope_ref(x, table, pos0, rd, interleave), rtol=1e-6,
                               atol=1e-6)


def test_trunk_elementwise_and_matmul_prep_on_the_host(trunk_harness):
    """tr_pad_rows pads x [T, in] to [T, in_pad] with zeros (what mm_args reads); tr_add
    with and without the 1-D broadcast; tr_scale_rows with device scales and with the one scalar;
    tr_silu_mul."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 5), dtype=np.float32)
    out = _run_harness(trunk_harness, "pad 3 5 8 0 0 0 0", x)
    np.testing.assert_array_equal(out.reshape(3, 8), np.pad(x, ((0, 0), (0, 3))))
    b, bias = rng.standard_normal((3, 5), dtype=np.float32), rng.standard_normal(5, dtype=np.float32)
    for bcast, other in ((0, b), (1, bias)):
        y = _run_harness(trunk_harness, f"add 3 5 {bcast} 0 0 0 0", x, other).reshape(3, 5)
        np.testing.assert_array_equal(y, x + other)
    for rows in (3, 1):
        s = rng.standard_normal(rows, dtype=np.float32)
        y, z = _run_harness(trunk_harness, f"scale {rows} 5 0 0 0 0 0", x[:rows], s).reshape(2, rows, 5)
        np.testing.assert_allclose(y, x[:rows] * s[:, None], rtol=1e-6)
        np.testing.assert_allclose(z, x[:rows] / (1 + np.exp(-x[:rows])) * y, rtol=1e-5, atol=1e-6)


# tr_qkv_prologue against what it replaces, all on the host as on a GPU (tests/_cuda_host.py: an OS thread per
# lane, real warp shuffles): matmul.cu's rmsnorm of each head row (one block of one warp per row, as
# rms_threads launches it), then tr_rope; the fused kernel in blocks of PRO_WARPS warps
PROLOGUE_HARNESS = "#define COLIBRI_HOST_WARP\n" + HOST_PRELUDE + r"""
#define RMS_SHARED static  // one block at a time: a block's shared memory is one static array
#define PRO_SHARED static
static float __fadd_rn(float a, float b) { return a + b; }
static float __fmul_rn(float a, float b) { return a * b; }
#include "MATMUL"
#include "TRUNK"
static void run_block(unsigned nt, unsigned b, const std::function<void()> &f) {
  blockIdx = {b, 0, 0}; blockDim = {nt, 1, 1};
  std::barrier<> bb(nt); block_bar = &bb;
  std::vector<std::barrier<> *> wb;
  for (unsigned i = 0; i < nt / 32; i++) wb.push_back(new std::barrier<>(32));
  warp_bar = wb;
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < nt; t++) ts.emplace_back([&, t] { threadIdx = {t, 0, 0}; f(); });
  for (auto &t : ts) t.join();
  for (auto *p : wb) delete p;
}
static std::vector<float> rd(size_t n, size_t off) {  // n floats from index off (malloc: 16-byte aligned)
  std::vector<float> v(n + off + 8);
  for (size_t i = 0; i < n; i++) if (scanf("%f", &v[off + i]) != 1) exit(3);
  return v; }
// reads: T hq hkv d rd interleave normed pos0 P C off eps, then q, k, v, qw, kw, table [P, rd/2, 2];
// prints the unfused q [T, hq, d], k cache, v cache [C, hkv, d], then the fused kernel's three
int main() {
  int T, hq, hkv, d, rdim, inter, normed, pos0, P, C, off; float eps;
  if (scanf("%d %d %d %d %d %d %d %d %d %d %d %f", &T, &hq, &hkv, &d, &rdim, &inter, &normed, &pos0, &P, &C,
            &off, &eps) != 12) return 2;
  const size_t nq = (size_t)T * hq * d, nk = (size_t)T * hkv * d, nc = (size_t)C * hkv * d;
  auto q = rd(nq, off), k = rd(nk, off), v = rd(nk, 0), qw = rd(d, 0), kw = rd(d, 0);
  auto table = rd((size_t)P * rdim, 0);
  const float *Q = q.data() + off, *K = k.data() + off, *tb = rdim ? table.data() : nullptr;
  // unfused: rmsnorm rows (32 threads a row), tr_rope (one thread covers it), the rows copied
  std::vector<float4> qn4(nq / 4 + 2), kn4(nk / 4 + 2);
  float *qn = (float *)qn4.data(), *kn = (float *)kn4.data();
  std::vector<float> qr(nq), kc1(nc, 0.0f), vc1(nc, 0.0f), qo(nq, NAN), kc2(nc, 0.0f), vc2(nc, 0.0f);
  if (normed) {
    for (int r = 0; r < T * hq; r++)
      run_block(32, r, [&] { rmsnorm(Q, nullptr, qw.data(), qn, nullptr, d, eps); });
    for (int r = 0; r < T * hkv; r++)
      run_block(32, r, [&] { rmsnorm(K, nullptr, kw.data(), kn, nullptr, d, eps); });
  } else {
    std::copy(Q, Q + nq, qn); std::copy(K, K + nk, kn);
  }
  blockIdx = {0, 0, 0}; blockDim = {1, 1, 1}; gridDim = {1, 1, 1}; threadIdx = {0, 0, 0};
  float *kr = kc1.data() + (size_t)pos0 * hkv * d;
  if (rdim) {
    tr_rope(qn, tb, qr.data(), nq, hq, d, rdim, pos0, inter);
    tr_rope(kn, tb, kr, nk, hkv, d, rdim, pos0, inter);
  } else {
    std::copy(qn, qn + nq, qr.begin()); std::copy(kn, kn + nk, kr);
  }
  std::copy(v.begin(), v.begin() + nk, vc1.begin() + (size_t)pos0 * hkv * d);
  // fused: blocks of PRO_WARPS warps over the T * (hq + 2 hkv) rows
  const unsigned rows = T * (hq + 2 * hkv), blocks = (rows + PRO_WARPS - 1) / PRO_WARPS;
  gridDim = {blocks, 1, 1};
  for (unsigned b = 0; b < blocks; b++)
    run_block(32 * PRO_WARPS, b, [&] {
      tr_qkv_prologue(Q, K, v.data(), normed ? qw.data() : nullptr, normed ? kw.data() : nullptr, tb,
                      qo.data(), kc2.data(), vc2.data(), T, hq, hkv, d, rdim, inter, eps, pos0); });
  for (auto *a : {&qr, &kc1, &vc1, &qo, &kc2, &vc2}) for (float x : *a) printf("%.9g\n", x);
  return 0;
}
"""


@pytest.fixture(scope="module")
def prologue_harness(tmp_path_factory):
    text = PROLOGUE_HARNESS.replace("MATMUL", str(SOURCE)).replace("TRUNK", str(SOURCE.parent / "trunk.cu"))
    exe, build = _host_build(tmp_path_factory, "#include <functional>\n" + text, "-std=c++20", "-pthread")
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"this g++ has no C++20 <barrier>: {build.stderr[:200]}")
    assert build.returncode == 0, build.stderr
    return exe


@pytest.mark.parametrize("T, hq, hkv, d, rd, inter, normed, off", [
    (1, 4, 2, 128, 128, False, True, 0),   # Qwen3's decode: heads of 128, the norm's float4 path
    (3, 3, 1, 64, 32, True, True, 0),      # prefill rows, interleaved pairs, a partial rotary_dim
    (2, 2, 2, 40, 20, False, True, 1),     # misaligned rows: the norm's strided path (the order differs)
    (1, 5, 1, 18, 18, False, True, 0),     # a width not a multiple of 4, 7 rows: a partly idle block
    (2, 4, 2, 32, 16, False, False, 0),    # no norms: RoPE and the append alone
    (1, 2, 1, 36, 0, False, True, 0),      # no RoPE: the norms and the append alone
])
def test_fused_prologue_kernel_gives_the_unfused_bits_on_the_host(prologue_harness, T, hq, hkv, d, rd, inter,
                                                                  normed, off):
    """tr_qkv_prologue equals rmsnorm (one warp a row) + tr_rope + the row copies bit for bit: q out and
    both caches (rows other than pos0.. untouched), every path of the norm; and the float64 reference."""
    from colibri_plan.backends.device_ops import rope_ref, rope_table

    rng = np.random.default_rng([T, hq, d, rd, off])
    pos0, P, C, eps = 5, 16, 12, 1e-6
    q = (rng.standard_normal((T, hq, d)) * 3).astype(np.float32)
    k = (rng.standard_normal((T, hkv, d)) * 3).astype(np.float32)
    v = rng.standard_normal((T, hkv, d)).astype(np.float32)
    qw, kw = rng.standard_normal((2, d)).astype(np.float32)
    table = rope_table(1.0 / (1e4 ** (np.arange(0, rd, 2) / max(rd, 1))), P, attention_factor=1.0)
    head = f"{T} {hq} {hkv} {d} {rd} {int(inter)} {int(normed)} {pos0} {P} {C} {off} {eps!r}"
    text = " ".join([head] + [repr(float(x)) for a in (q, k, v, qw, kw, table) for x in a.reshape(-1)])
    run = subprocess.run([str(prologue_harness)], input=text, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = np.array(run.stdout.split(), np.float64).astype(np.float32)
    nq, nc = T * hq * d, C * hkv * d
    qr, kc1, vc1, qo, kc2, vc2 = np.split(out, np.cumsum([nq, nc, nc, nq, nc]))
    np.testing.assert_array_equal(qo, qr)
    np.testing.assert_array_equal(kc2, kc1)
    np.testing.assert_array_equal(vc2, vc1)

    def ref(x, w, heads):
        xx = x.astype(np.float64)
        if normed:
            xx = xx / np.sqrt((xx ** 2).mean(axis=2, keepdims=True) + eps) * w
        return rope_ref(xx.astype(np.float32), table, pos0, rd, inter) if rd else xx

    np.testing.assert_allclose(qo.reshape(T, hq, d), ref(q, qw, hq), rtol=1e-5, atol=1e-5)
    kc = kc2.reshape(C, hkv, d)
    np.testing.assert_allclose(kc[pos0:pos0 + T], ref(k, kw, hkv), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(vc2.reshape(C, hkv, d)[pos0:pos0 + T], v)
    assert not kc[:pos0].any() and not kc[pos0 + T:].any()
