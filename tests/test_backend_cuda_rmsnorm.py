"""matmul.cu's ``rmsnorm`` compiled with g++ and run on the host as on a GPU: one OS thread per CUDA
thread, real warp shuffles and ``__syncthreads`` (tests/_cuda_host.py with ``COLIBRI_HOST_WARP``), one
block per row with the threads ``backends/cuda/device.py`` launches (:func:`rms_threads`): the row held in
float4 registers (one warp for rows up to 1024, 256 threads beyond), and the strided fallback (a width not a
multiple of 4, a misaligned row, a row wider than the registers hold); against the float64 reference."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from _cuda_host import HOST_PRELUDE
from test_backend_cuda import SOURCE, _host_build

from colibri_plan.backends.cuda.device import rms_threads

HARNESS = "#define COLIBRI_HOST_WARP\n" + HOST_PRELUDE + r"""
#define RMS_SHARED static  // one block at a time: a block's shared memory is one static array
#include "MATMUL"
// reads: rows H threads eps off fused, then x [rows, H], (fused) b [rows, H], w [H]; the arrays sit off
// floats past an aligned start (off 1: every row misaligned); prints y [rows, H], then (fused) h
int main() {
  int rows, H, nt, off, fused; float eps;
  if (scanf("%d %d %d %f %d %d", &rows, &H, &nt, &eps, &off, &fused) != 6) return 2;
  std::vector<float4> xs((size_t)rows * H / 4 + 2), ws(H / 4 + 2), ys(xs.size());
  std::vector<float4> bs(xs.size()), hs(xs.size());
  float *x = (float *)xs.data() + off, *w = (float *)ws.data() + off, *y = (float *)ys.data() + off;
  float *b = fused ? (float *)bs.data() + off : nullptr, *h = (float *)hs.data() + off;
  for (size_t i = 0; i < (size_t)rows * H; i++) if (scanf("%f", &x[i]) != 1) return 3;
  if (fused) for (size_t i = 0; i < (size_t)rows * H; i++) if (scanf("%f", &b[i]) != 1) return 3;
  for (int i = 0; i < H; i++) if (scanf("%f", &w[i]) != 1) return 4;
  blockDim = {(unsigned)nt, 1, 1}; gridDim = {(unsigned)rows, 1, 1};
  for (int r = 0; r < rows; r++) {
    blockIdx = {(unsigned)r, 0, 0};
    std::barrier<> bb(nt); block_bar = &bb;
    std::vector<std::barrier<> *> wb;
    for (int i = 0; i < nt / 32; i++) wb.push_back(new std::barrier<>(32));
    warp_bar = wb;
    std::vector<std::thread> ts;
    for (int t = 0; t < nt; t++) ts.emplace_back([&, t] { threadIdx = {(unsigned)t, 0, 0};
                                                         rmsnorm(x, b, w, y, h, H, eps); });
    for (auto &t : ts) t.join();
    for (auto *p : wb) delete p;
  }
  for (size_t i = 0; i < (size_t)rows * H; i++) printf("%.9g\n", y[i]);
  if (fused) for (size_t i = 0; i < (size_t)rows * H; i++) printf("%.9g\n", h[i]);
  return 0;
}
"""


@pytest.fixture(scope="module")
def rms_harness(tmp_path_factory):
    exe, build = _host_build(tmp_path_factory, HARNESS.replace("MATMUL", str(SOURCE)), "-std=c++20",
                             "-pthread")
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"this g++ has no C++20 <barrier>: {build.stderr[:200]}")
    assert build.returncode == 0, build.stderr
    return exe


def _run(exe, x, w, threads, eps=1e-6, off=0, b=None):
    """y [rows, H] float64 (and, b given: the fused kernel's h as float32)."""
    rows, h = x.shape
    text = " ".join([f"{rows} {h} {threads} {eps!r} {off} {int(b is not None)}",
                     *(" ".join(repr(float(v)) for v in a.reshape(-1)) for a in (x, b, w) if a is not None)])
    run = subprocess.run([str(exe)], input=text, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = np.array(run.stdout.split(), np.float64)
    if b is None:
        return out.reshape(rows, h)
    return out[: rows * h].reshape(rows, h), out[rows * h:].reshape(rows, h).astype(np.float32)


@pytest.mark.parametrize("rows, h, threads, off", [
    (6, 128, None, 0),     # Qwen3 q_norm / k_norm rows: one warp, a float4 per lane
    (2, 1000, None, 0),    # one warp, 8 float4s for some lanes and 7 for the rest
    (1, 2048, None, 0),    # a decode row of 2048: 256 threads, 2 float4s each
    (2, 7168, None, 0),    # 7 float4s per thread (DeepSeek's hidden width)
    (1, 2048, 64, 0),      # 2 warps, 8 float4s each: the shared-memory step over two sums
    (3, 130, None, 0),     # a width not a multiple of 4: the strided loops
    (2, 256, None, 1),     # misaligned rows: the strided loops
    (1, 8200, 256, 0),     # wider than 256 threads' registers hold: the strided loops
])
def test_rmsnorm_kernel_on_the_host(rms_harness, rows, h, threads, off):
    threads = threads or rms_threads(h)
    rng = np.random.default_rng([rows, h, threads, off])
    x = (rng.standard_normal((rows, h)) * 3).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    got = _run(rms_harness, x, w, threads, off=off)
    xx = x.astype(np.float64)
    ref = xx / np.sqrt((xx ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.mark.parametrize("rows, h, off", [(3, 128, 0), (1, 2048, 0), (2, 130, 0), (2, 256, 1)])
def test_fused_add_rmsnorm_is_the_add_then_the_norm(rms_harness, rows, h, off):
    """b given: h = x + b exactly (float32) and y bit for bit what the plain kernel makes of that h (the
    registers path and the strided one)."""
    threads = rms_threads(h)
    rng = np.random.default_rng([rows, h, off, 1])
    x, b = (rng.standard_normal((2, rows, h)) * 3).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32)
    y, hh = _run(rms_harness, x, w, threads, off=off, b=b)
    np.testing.assert_array_equal(hh, x + b)
    np.testing.assert_array_equal(y, _run(rms_harness, x + b, w, threads, off=off))


def test_rms_threads():
    assert [rms_threads(d) for d in (128, 512, 1024, 1025, 2048, 7168)] == [32, 32, 32, 256, 256, 256]
