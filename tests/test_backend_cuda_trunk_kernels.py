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
