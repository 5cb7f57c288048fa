"""CUDA backend specifics (the numeric oracle over every backend is tests/test_backends_oracle.py).

Without a GPU: the backend says cleanly why it is unavailable; ``shaders/cuda/matmul.cu`` compiles to
PTX with nvcc for every format instance; and its weight decoding and warp tiling are checked on the
host by compiling the device functions with g++ (shuffles as no-ops, lanes summed on the host) against
the quant-format semantics. With a GPU: out-of-memory handling, mixed batches and device timing.
"""

from __future__ import annotations

import importlib.resources
import shutil
import subprocess

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import get_backend
from colibri_plan.backends.base import silu_mul_ref
from colibri_plan.errors import BackendUnavailableError, DeviceOutOfMemoryError

CUDA = get_backend("cuda")
REASON = CUDA.unavailable_reason()
needs_gpu = pytest.mark.skipif(REASON is not None, reason=f"cuda: {REASON}")
SOURCE = importlib.resources.files("colibri_plan.shaders").joinpath("cuda", "matmul.cu")
ATT_SOURCE = SOURCE.parent.joinpath("attention.cu")


def _instances() -> str:
    kernels = (("mm", 4, 1, "const u64 *"), ("mm_args", 4, 1, "const MMArgs"),
               ("gate_up", 2, 1, "const u64 *"))
    body = "".join(f"template __global__ void {k}<{f}, {r}, {u}, {tc}>({t}, int, int, int, int);\n"
                   for f in range(7) for k, r, u, t in kernels for tc in (1, 4))
    return f'#include "{SOURCE}"\n{body}'


def test_unavailable_reason_is_clean_when_there_is_no_gpu():
    if REASON is None:
        pytest.skip("a CUDA device is present")
    assert isinstance(REASON, str) and ("CuPy" in REASON or "CUDA" in REASON)
    assert CUDA.list_devices() == []
    with pytest.raises(BackendUnavailableError, match="cuda backend unavailable"):
        CUDA.open(0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_kernels_compile_to_ptx(tmp_path):
    src = tmp_path / "inst.cu"
    src.write_text(_instances())
    run = subprocess.run(["nvcc", "--ptx", "-std=c++14", "-arch=sm_90", "-o", str(tmp_path / "k.ptx"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    assert ptx.count(".entry") == 43  # 7 formats x (mm, mm_args, gate_up) x (1, 4 tokens per pass) + rmsnorm


HARNESS = r"""
#include <cstdio>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <algorithm>
using std::min;
#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__
#define __shared__
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct D3 { unsigned x, y, z; };
static D3 threadIdx, blockIdx, blockDim, gridDim;
static float __int_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
static float __uint_as_float(unsigned v) { return __int_as_float(v); }
static unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {  // CUDA semantics: bytes of {y, x}
  unsigned char in[8]; memcpy(in, &x, 4); memcpy(in + 4, &y, 4); unsigned r = 0;
  for (int n = 0; n < 4; n++) r |= (unsigned)in[(s >> (4 * n)) & 7] << (8 * n);
  return r; }
static float __shfl_xor_sync(unsigned, float, int) { return 0.0f; }  // lanes are summed by the caller
static void __syncthreads() {}
static float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
template <class T> T __ldg(const T *p) { return *p; }
static uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
#define asm(...) (f = 0.0f)
#include "SOURCE"
// reads: fmt rows in_pad G, then the weight bytes, scales, x; prints each row's dot product
int main() {
  int fmt, rows, in_pad, G; if (scanf("%d %d %d %d", &fmt, &rows, &in_pad, &G) != 4) return 2;
  int bits = fmt == 0 ? 32 : fmt <= 2 ? 16 : fmt == 3 ? 8 : fmt == 5 ? 2 : 4;
  int row_bytes = in_pad * bits / 8, ngroups = fmt == 6 ? in_pad / G : 1;
  int gshift = G == 64 ? 1 : G == 128 ? 2 : 0;
  static uint4 W[1 << 16]; static float S[1 << 16], x[1 << 15], xs[1 << 15];  // xs: staged (rotated)
  unsigned char *wb = (unsigned char *)W; unsigned v;
  for (int i = 0; i < rows * row_bytes; i++) { if (scanf("%u", &v) != 1) return 3; wb[i] = v; }
  int ns = fmt == 6 ? rows * ngroups : rows;
  for (int i = 0; i < ns; i++) if (scanf("%f", &S[i]) != 1) return 4;
  for (int i = 0; i < in_pad; i++) if (scanf("%f", &x[i]) != 1) return 5;
  const uint4 *Wp[1] = {W}; const float *Sp[1] = {S};
  // token 1 = -0.5 * token 0: two tokens per pass, staged one after the other
  for (int i = 0; i < in_pad; i++) x[in_pad + i] = -0.5f * x[i];
  static double sum[2][1 << 12];
  gridDim.x = 1; blockDim.x = 32; blockIdx.x = 0;
  const int ntiles = (rows + 1) / 2;
  for (int lane = 0; lane < 32; lane++) {  // one warp streams every 2-row tile, 2 words per lane per step
    auto emit = [&](int row0, float (&acc)[2][1][2]) {
      for (int j = 0; j < 2; j++)
        for (int i = 0; i < 2; i++) if (row0 + i < rows) sum[j][row0 + i] += acc[j][0][i]; };
    switch (fmt) {
#define CASE(F) case F: \
      threadIdx.x = 0; blockDim.x = 1; stage_tokens<F>(xs, x, in_pad, 2); \
      threadIdx.x = lane; blockDim.x = 32; \
      warp_rows<F, 2, 1, 2, 2>(Wp, Sp, rows, ntiles, in_pad / Cols<F>::n, gshift, xs, in_pad, 2, emit); break;
      CASE(0) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
    }
  }
  for (int j = 0; j < 2; j++) for (int r = 0; r < rows; r++) printf("%.9g\n", sum[j][r]);
  return 0;
}
"""


def _host_build(tmp_path_factory, text: str, *flags: str):
    """Compile a host harness (C++ source ``text``) with g++; skips where g++ is missing.
    Returns (executable, the finished g++ process)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    folder = tmp_path_factory.mktemp("cuda_host")
    exe, src = folder / "harness", folder / "h.cpp"
    src.write_text(text)
    return exe, subprocess.run(["g++", "-O1", "-w", *flags, "-o", str(exe), str(src)], capture_output=True,
                               text=True, timeout=300)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    exe, build = _host_build(tmp_path_factory, HARNESS.replace("SOURCE", str(SOURCE)), "-std=c++17")
    assert build.returncode == 0, build.stderr
    return exe


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "int4", "int2", "int4-g32", "int4-g64", "int4-g128"])
def test_kernel_decoding_matches_quant_on_the_host(harness, fmt):
    """warp_rows of matmul.cu (every lane's part, summed) equals x . dequantize(W) for odd shapes and two
    tokens per pass: the 16-byte word decoding, byte-permute conversions, column order, group scales,
    row clamping, and the step stream crossing tiles (2 words per lane per step, 4 tiles per warp)."""
    from colibri_plan.backends.staging import padded_layout

    rows, in_f = 7, 300
    rng = np.random.default_rng(5)
    qt = quant.quantize(rng.standard_normal((rows, in_f), dtype=np.float32), fmt)
    data, scales, in_pad = padded_layout(qt)
    x = np.zeros(in_pad, np.float32)
    x[:in_f] = rng.standard_normal(in_f, dtype=np.float32)
    fid = {"f32": 0, "bf16": 2, "int8": 3, "int4": 4, "int2": 5}.get(fmt, 6)
    g = quant.group_size(fmt) or 0
    sc = scales.reshape(-1) if qt.scales is not None else np.zeros(rows, np.float32)
    text = " ".join([f"{fid} {rows} {in_pad} {g}", " ".join(map(str, data.reshape(-1).tolist())),
                     " ".join(repr(float(s)) for s in sc), " ".join(repr(float(v)) for v in x)])
    run = subprocess.run([str(harness)], input=text, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = np.array(run.stdout.split(), np.float64).reshape(2, rows)
    ref = quant.matmul_ref(np.stack([x[:in_f], -0.5 * x[:in_f]]), qt).astype(np.float64)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_attention_kernel_compiles_to_ptx(tmp_path):
    run = subprocess.run(["nvcc", "--ptx", "-std=c++14", "-arch=sm_90", "-o", str(tmp_path / "a.ptx"),
                          str(ATT_SOURCE)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ptx = (tmp_path / "a.ptx").read_text()
    kernels = ("attention_gqa", "attention_gqa_at", "attention_combine")  # _at: a captured step's
    assert [ptx.count(f".entry {k}(") for k in kernels] == [1, 1, 1] and ptx.count(".entry ") == 3


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_attention_registers_allow_blocks_of_the_widest_head(tmp_path):
    """attention_gqa runs a thread per channel past head_dim 256 (MLA's 576): its registers per thread
    times the widest head's threads (cuda_device.ATT_MAX_HEAD_DIM) must fit an SM's 65536, or the launch
    fails on the GPU."""
    from colibri_plan.backends.cuda.device import ATT_MAX_HEAD_DIM

    cmd = ["nvcc", "--cubin", "-std=c++14", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "a.cubin"),
           str(ATT_SOURCE)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    info = run.stderr.split("entry function 'attention_gqa'")[1].split("entry function")[0]
    regs = int(info.split(" registers")[0].split()[-1])
    assert regs * -(-ATT_MAX_HEAD_DIM // 32) * 32 <= 65536, info


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_trunk_kernels_compile_to_ptx(tmp_path):
    from colibri_plan.backends.cuda.launch import _TRUNK_KERNELS

    run = subprocess.run(["nvcc", "--ptx", "-std=c++14", "-arch=sm_90", "-o", str(tmp_path / "t.ptx"),
                          str(SOURCE.parent.joinpath("trunk.cu"))], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    ptx = (tmp_path / "t.ptx").read_text()
    assert ptx.count(".entry ") == len(_TRUNK_KERNELS)
    assert all(f".entry {k}(" in ptx for k in _TRUNK_KERNELS)


@needs_gpu
def test_driver_oom_is_typed_and_holds_nothing(monkeypatch):
    import cupy

    with CUDA.open(0) as be:
        qt = quant.quantize(np.ones((64, 64), np.float32), "int4")

        def full(nbytes):
            raise cupy.cuda.runtime.CUDARuntimeError(2)  # cudaErrorMemoryAllocation

        monkeypatch.setattr(cupy.cuda.memory, "Memory", full)
        with pytest.raises(DeviceOutOfMemoryError) as info:
            be.upload(qt)
        assert info.value.requested_bytes >= qt.nbytes and info.value.held_bytes == 0
        assert be.memory_used() == 0


@needs_gpu
def test_capacity_is_the_free_memory_and_checked_before_allocating():
    with CUDA.open(0) as be:
        dev = CUDA.list_devices()[0]
        assert 0 < be.capacity_bytes() <= dev.total_memory_bytes
        be.capacity_bytes = lambda: 1000
        with pytest.raises(DeviceOutOfMemoryError):
            be.upload(quant.quantize(np.ones((64, 64), np.float32), "f32"))
        assert be.memory_used() == 0


@needs_gpu
def test_mixed_batch_and_device_timing():
    rng = np.random.default_rng(0)
    H, I = 300, 130
    fmts = [("int4", "int4", "int8"), ("int4-g32", "int4-g32", "int4-g32"), ("f16", "bf16", "f32")]
    with CUDA.open(0) as be:
        be.timing = True
        qts = [tuple(quant.quantize(rng.standard_normal(s, dtype=np.float32) / 10, f)
                     for f, s in zip(fs, ((I, H), (I, H), (H, I)))) for fs in fmts]
        xs = [rng.standard_normal((T, H), dtype=np.float32) for T in (1, 4, 2)]
        ys = be.expert_ffn(xs, [be.upload_expert(*q) for q in qts])
        for x, (g, u, d), y in zip(xs, qts, ys):
            ref = quant.matmul_ref(silu_mul_ref(quant.matmul_ref(x, g), quant.matmul_ref(x, u)), d)
            assert np.abs(y - ref).max() <= 5e-4 * np.abs(ref).max()
        assert be.last_device_seconds is not None and be.last_device_seconds > 0


@needs_gpu
def test_repeated_batches_replay_a_graph_with_identical_results():
    rng = np.random.default_rng(1)
    H, I = 6144, 2048  # GLM-5.2 expert shapes, 8 experts, 1 token each: the decode hot path
    with CUDA.open(0) as be:
        qts = [tuple(quant.quantize(rng.standard_normal(s, dtype=np.float32) / 50, "int4")
                     for s in ((I, H), (I, H), (H, I))) for _ in range(8)]
        experts = [be.upload_expert(*q) for q in qts]
        xs = [rng.standard_normal((1, H), dtype=np.float32) for _ in range(8)]
        first = be.expert_ffn(xs, experts)  # plain launches
        again = [be.expert_ffn(xs, experts) for _ in range(3)]  # captured, then replayed
        assert be.use_graphs and len(be._graphs) == 1
        for ys in again:
            for a, b in zip(first, ys):
                np.testing.assert_array_equal(a, b)
        xs2 = [x[:, ::-1].copy() for x in xs]  # new activations through the same graph
        second = be.expert_ffn(xs2, experts)
        for (g, u, d), x, x2, y, y2 in zip(qts[:3], xs, xs2, first, second):
            for xx, yy in ((x, y), (x2, y2)):
                ref = quant.matmul_ref(silu_mul_ref(quant.matmul_ref(xx, g), quant.matmul_ref(xx, u)), d)
                assert np.abs(yy - ref).max() <= 5e-4 * np.abs(ref).max()


@needs_gpu
def test_device_ops_queue_without_waiting_and_reuse_pool_memory_in_order():
    """More d_put calls than staging slots before any wait, a 200-op chain whose intermediates go back to
    CuPy's pool while later ops are queued, row scales put on the device per call, and a matmul whose x
    needs padding (131 columns) fed by the previous one: every result equals numpy."""
    rng = np.random.default_rng(3)
    with CUDA.open(0) as be:
        hosts = [rng.standard_normal((3, 50), dtype=np.float32) for _ in range(20)]
        puts = [be.d_put(h) for h in hosts]  # 20 > the 8 staging slots
        for h, d in zip(hosts, puts):
            np.testing.assert_array_equal(be.d_get(d), h)
        x, b = be.d_put(hosts[0]), be.d_put(hosts[1][0])
        ref = hosts[0].astype(np.float64)
        for i in range(100):
            s = np.float32([1.0, -1.0, 0.5]) if i % 2 else np.float32([1.0, 1.0, 2.0])
            x = be.d_scale_rows(be.d_add(x, b), s)  # the old x is dropped at once
            ref = (ref + hosts[1][0]) * s[:, None]
        np.testing.assert_allclose(be.d_get(x), ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())
        w1 = quant.quantize(rng.standard_normal((131, 50), dtype=np.float32) / 8, "int8")
        w2 = quant.quantize(rng.standard_normal((70, 131), dtype=np.float32) / 12, "int4-g32")
        y = be.d_get(be.d_matmul(be.d_matmul(be.d_put(hosts[2]), be.upload(w1)), be.upload(w2)))
        ref = quant.matmul_ref(quant.matmul_ref(hosts[2], w1), w2)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@needs_gpu
@pytest.mark.parametrize("t, pos0, shift", [(1, 50, 0), (13, 40, 0), (1, 20, 1)])
def test_fused_attention_prologue_gives_the_unfused_bits_on_the_gpu(t, pos0, shift):
    """d_attention_prologue at Qwen3-30B-A3B's attention shape (32 q heads, 4 kv heads of 128, q/k norms,
    full RoPE): decode and prefill rows, and q/k rows 4 bytes off alignment (``shift``: the norm's strided
    sums on both sides): roped q and both caches bit for bit the unfused ops (rmsnorm, tr_rope, copies);
    a decode row captured at one position and replayed at another, into other caches, too."""
    from test_backends_device_ops import prologue_inputs, replay_prologue, unfused_prologue

    from colibri_plan.backends.handles import DArray

    hq, hkv, d = 32, 4, 128
    with CUDA.open(0) as be:
        (q, k, v, _, _), norms, rope = prologue_inputs(be, t, hq, hkv, d, d, False, True)

        def put(a):  # a DArray of a's values, ``shift`` floats into its buffer
            buf = be.d_put(np.concatenate([np.zeros(shift, np.float32), a.reshape(-1)]))
            return DArray(a.shape, buf.buf, buf.owner, buf.offset + shift)

        dq, dk, dv = put(q), put(k), be.d_put(v)
        caches = [be.d_zeros((64, hkv, d)) for _ in range(4)]
        got = be.d_get(be.d_attention_prologue(dq, dk, dv, norms, 1e-6, rope, caches[0], caches[1], pos0))
        want = be.d_get(unfused_prologue(be, dq, dk, dv, norms, rope, caches[2], caches[3], pos0))
        np.testing.assert_array_equal(got, want)
        for a, b in ((0, 2), (1, 3)):
            np.testing.assert_array_equal(be.d_get(caches[a]), be.d_get(caches[b]))
        if t != 1:
            return
        kc0, vc0, kc, vc = (be.d_zeros((64, hkv, d)) for _ in range(4))
        rep = replay_prologue(be, q, k, v, norms, rope, (kc0, vc0), 3, (kc, vc), pos0)
        if shift == 0:  # the step's inputs are aligned: the eager unfused ops on aligned rows
            np.testing.assert_array_equal(rep.reshape(1, hq, d), want)
            np.testing.assert_array_equal(be.d_get(kc), be.d_get(caches[2]))
            np.testing.assert_array_equal(be.d_get(vc), be.d_get(caches[3]))
