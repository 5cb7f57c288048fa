"""The integer tensor-core decode kernels of ``shaders/cuda/decode_imma.cu`` (mm_imma, mm_args_imma,
gate_up_imma: T = 1, per-row int4 and int8), without a GPU: g++ runs them on the host as a block runs them
(one OS thread per lane; ``mma.sync`` m16n8k32 s8 x s8 emulated from the 32 lanes' fragments between
two barriers of the warp; warp shuffles through a per-warp exchange array; ``cp.async`` copies landing as
late as the lane's waits allow; ``__shared__`` arrays are static locals, one per instance, which is one per
block because blocks run one after another; the dynamic shared memory is a buffer of exactly the bytes the
launcher gives, then a guard that must come back untouched, all of it garbage at the start, so a read
past the end or before a write spoils the sums), against float64 sums of the quantized weights with the
error bound of the fixed-point activations. nvcc compiles every instance and ptxas reports registers.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
from _cuda_host import HOST_PRELUDE
from test_backend_cuda import SOURCE, _host_build
from test_backend_cuda_prefill import PREFILL, _numbers, _weight_text
from test_backend_cuda_sim import be  # noqa: F401 - the simulated GPU's backend fixture

from colibri_plan import quant
from colibri_plan.backends.cuda import launch as cuda_mod
from colibri_plan.backends.programs import kernel_format

IMMA = SOURCE.parent.joinpath("decode_imma.cu")
STAGES = cuda_mod._IMMA_STAGES  # steps in each warp's ring of weights
DYN = re.compile(r"extern __shared__ uint4 (\w+)\[\];")  # the dynamic shared memory: the host's buffer

HARNESS = HOST_PRELUDE + r"""
// prefill.cu's device helpers (never called here)
static void mma_bf16(float (&)[4], unsigned, unsigned, unsigned, unsigned, unsigned, unsigned) { abort(); }
static unsigned pack_bf16(float, float) { abort(); }
static unsigned bf16x2_minus136(unsigned) { abort(); }
static unsigned xch[8][32][6];  // per-warp exchange of fragments / shuffle values
static void warp_wait() { warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
static unsigned im_max_u32(unsigned v) {
  const int l = threadIdx.x & 31, wi = threadIdx.x >> 5;
  xch[wi][l][0] = v; warp_wait();
  unsigned m = 0; for (int i = 0; i < 32; i++) m = max(m, xch[wi][i][0]);
  warp_wait(); return m; }
static int im_sum_i32(int v) {  // wraps like the shuffles' int adds
  const int l = threadIdx.x & 31, wi = threadIdx.x >> 5;
  xch[wi][l][0] = (unsigned)v; warp_wait();
  unsigned s = 0; for (int i = 0; i < 32; i++) s += xch[wi][i][0];
  warp_wait(); return (int)s; }
static void mma_i8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                   unsigned b1) {
  const int l = threadIdx.x & 31, g = l >> 2, t = l & 3, wi = threadIdx.x >> 5;
  const unsigned mine[6] = {a0, a1, a2, a3, b0, b1};
  for (int i = 0; i < 6; i++) xch[wi][l][i] = mine[i];
  warp_wait();
  for (int c_ = 0; c_ < 4; c_++) {  // C[row][col]: row g + 8 (c / 2), column 2t + c % 2
    const int row = g + 8 * (c_ >> 1), col = 2 * t + (c_ & 1);
    long long s = 0;
    for (int k = 0; k < 32; k++) {  // k = 16 hi + 4 t' + i: lane t', byte i of a0 / a2 (a1 / a3: rows + 8)
      const int hi = k >> 4, tl = (k & 15) >> 2, i = k & 3;
      const unsigned a = xch[wi][(row & 7) * 4 + tl][2 * hi + (row >= 8)], b = xch[wi][col * 4 + tl][4 + hi];
      const unsigned ab = (a >> (8 * i)) & 0xFFu, bb = (b >> (8 * i)) & 0xFFu;  // A and B s8
      s += (long long)(signed char)ab * (signed char)bb;
    }
    c[c_] = (int)(c[c_] + s);
  }
  warp_wait();
}
static double __longlong_as_double(long long v) { double d; memcpy(&d, &v, 8); return d; }
// cp.async: each lane's copies land as late as its waits allow (a read too early sees the slot's old words)
static thread_local std::vector<std::pair<uint4 *, const uint4 *>> cp_open;
static thread_local std::deque<std::vector<std::pair<uint4 *, const uint4 *>>> cp_groups;
static void im_cp16(uint4 *dst, const uint4 *src) { cp_open.push_back({dst, src}); }
static void im_commit() { cp_groups.push_back(cp_open); cp_open.clear(); }
static void cp_land(size_t pending) {
  for (; cp_groups.size() > pending; cp_groups.pop_front()) for (auto [d, s] : cp_groups.front()) *d = *s; }
static void im_wait() { cp_land(IM_STAGES - 1); }
static void im_wait_all() { im_commit(); cp_land(0); }
static bool cp_in_flight() {  // a copy still pending when the lane is done
  if (!cp_open.empty()) return true;
  for (auto &gr : cp_groups) if (!gr.empty()) return true;
  return false; }
static std::atomic<bool> late_copy{false};
static uint4 *host_dyn;  // this block's dynamic shared memory
#include "MATMUL"
#include "PREFILL"
#undef __shared__
#define __shared__ static
IMMA_SOURCE
// reads: kind (0 mm_imma, 1 gate_up_imma, 2 mm_args_imma) fmt r16 rows in_pad hs nx blocks warps, the
// dynamic shared memory's bytes, the T of each of 2 entries (entry 0 takes the launch's rows, entry 1
// e[5] = erows), erows, idx (-1: none), then the weight bytes and scales of 1 (mm) or 2 (gate_up)
// matrices and nx rows of x; prints both entries' outputs
int main() {
  int kind, fmt, r16, rows, in_pad, hs, nx, blocks, warps, dyn_bytes, T0, T1, erows, id;
  if (scanf("%d %d %d %d %d %d %d %d %d %d %d %d %d %d", &kind, &fmt, &r16, &rows, &in_pad, &hs, &nx, &blocks,
            &warps, &dyn_bytes, &T0, &T1, &erows, &id) != 14) return 2;
  const int row_bytes = in_pad * (fmt == 3 ? 8 : 4) / 8, mats = kind == 1 ? 2 : 1;
  std::vector<std::vector<uint4>> W(mats, std::vector<uint4>(rows * row_bytes / 16));
  std::vector<std::vector<float>> S(mats, std::vector<float>(rows));
  unsigned v;
  for (int m = 0; m < mats; m++) {
    unsigned char *wb = (unsigned char *)W[m].data();
    for (int i = 0; i < rows * row_bytes; i++) { if (scanf("%u", &v) != 1) return 3; wb[i] = v; }
    for (auto &s : S[m]) if (scanf("%f", &s) != 1) return 4;
  }
  std::vector<float> x((size_t)nx * in_pad);
  for (auto &a : x) if (scanf("%f", &a) != 1) return 5;
  const int out_n = kind == 1 ? hs : rows;
  std::vector<float> y(2 * out_n, NAN);
  MMArgs args{};
  for (int j = 0; j < 2; j++) {
    u64 *e = args.e + 8 * j, T = j ? T1 : T0, yp = (u64)(y.data() + j * out_n);
    u64 mm[8] = {(u64)W[0].data(), (u64)S[0].data(), (u64)x.data(), yp, T, j ? (u64)erows : 0, 0, 0};
    u64 gu[8] = {(u64)W[0].data(), (u64)S[0].data(), (u64)W.back().data(), (u64)S.back().data(),
                 (u64)x.data(), yp, T, id < 0 ? 0 : (u64)&id};
    memcpy(e, kind == 1 ? gu : mm, sizeof mm);
  }
  const int dyn = dyn_bytes / 16, guard = 64;  // the dynamic shared memory, as uint4
  std::vector<uint4> smem(dyn + guard);
  blockDim.x = 32 * warps; gridDim = {(unsigned)blocks, 2, 1};
  for (unsigned ey = 0; ey < 2; ey++)
    for (unsigned b = 0; b < (unsigned)blocks; b++) {
      blockIdx = {b, ey, 0};
      unsigned seed = 0x9E3779B9u * (b + 7 * ey + 1);
      for (auto &q : smem) {  // garbage: a stale or out-of-range read spoils the sums
        unsigned *p = &q.x; for (int i = 0; i < 4; i++) p[i] = seed = seed * 1664525u + 1013904223u; }
      const std::vector<uint4> tail(smem.end() - guard, smem.end());
      host_dyn = smem.data();
      std::barrier<> bb(32 * warps); block_bar = &bb;
      warp_bar.clear();
      for (int w = 0; w < warps; w++) warp_bar.push_back(new std::barrier<>(32));
      std::vector<std::thread> ts;
      for (int l = 0; l < 32 * warps; l++) ts.emplace_back([&, l] {
        threadIdx.x = l;
#define RUN(F, R) if (fmt == F && r16 == R) { \
          if (kind == 0) mm_imma<F, R>(args.e, rows, in_pad, rows, 0); \
          if (kind == 1) gate_up_imma<F, R>(args.e, rows, in_pad, hs, 0); \
          if (kind == 2) mm_args_imma<F, R>(args, rows, in_pad, rows, 0); }
        RUN(3, 1) RUN(3, 2) RUN(4, 1) RUN(4, 2)
        if (cp_in_flight()) late_copy = true;
      });
      for (auto &t : ts) t.join();
      for (auto *p : warp_bar) delete p;
      if (memcmp(tail.data(), smem.data() + dyn, guard * sizeof(uint4))) return 7;  // wrote past its end
      if (late_copy) return 8;  // the block ended with copies into its shared memory in flight
    }
  for (float a : y) printf("%.9g\n", a);
  return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    src = IMMA.read_text()
    assert len(DYN.findall(src)) == 1, f"{IMMA.name}: the harness expects one `{DYN.pattern}`"
    text = HARNESS.replace("MATMUL", str(SOURCE)).replace("PREFILL", str(PREFILL))
    text = text.replace("IMMA_SOURCE", DYN.sub(r"uint4 *const \1 = host_dyn;", src))
    exe, build = _host_build(tmp_path_factory, text, "-std=c++20", "-pthread", f"-DIM_STAGES={STAGES}")
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"this g++ has no C++20 <barrier>: {build.stderr[:200]}")
    assert build.returncode == 0, build.stderr
    return exe


def _dyn_bytes(in_pad: int, warps: int, nm: int, r16: int) -> int:
    """The dynamic shared memory the launcher gives a block: x as 4 limb bytes per column, then each warp's
    ring of STAGES steps of 16-byte words (2 rows per subtile and matrix) of 32 lanes."""
    return in_pad * 4 + warps * STAGES * nm * r16 * 2 * 16 * 32


def _run(harness, kind, fmt, qts, x, *, r16=1, blocks=1, warps=2, T=(1, 1), erows=0, idx=-1, hs=0):
    """Both table entries' outputs [2, rows (mm) or hs (gate_up)] of one launch on the host."""
    texts = [_weight_text(q) for q in qts]
    rows, in_pad = qts[0].out_features, texts[0][1]
    dyn = _dyn_bytes(in_pad, warps, len(qts), r16)
    head = f"{kind} {kernel_format(fmt)} {r16} {rows} {in_pad} {hs} {x.shape[0]} {blocks} {warps} {dyn}"
    head += f" {T[0]} {T[1]} {erows} {idx}"
    body = " ".join([t for t, _ in texts] + [_numbers(x)])
    run = subprocess.run([str(harness)], input=head + " " + body, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr)  # 7: wrote past shared memory; 8: copies left
    return np.array(run.stdout.split(), np.float64).reshape(2, -1)


def _exact_w(qt) -> np.ndarray:
    """The weights the kernels multiply, float64 [rows, in]: integer code times row scale, exactly
    (dequantize rounds each product to float32; the code comes back from it with rint)."""
    s = qt.scales.astype(np.float64)[:, None]
    return np.rint(quant.dequantize(qt).astype(np.float64) / s) * s


def _ref_bound(qt, x):
    """(y, bound) float64 [rows]: y = W . x, and the most the kernel may differ from it. x is turned into
    X = rint(x 2^-e) with 2^(e + 29) <= max|x| < 2^(e + 30), so each x moves by at most 2^(e - 1) and a row
    by sum_k |w_k| 2^(e - 1); the double sums add ~2^-50 of sum |w x|; the float32 output rounds once
    more, by 2^-24 of its value."""
    w, xs = _exact_w(qt), x[: qt.in_features].astype(np.float64)
    y, m = w @ xs, np.abs(x).max()
    fix = np.abs(w).sum(1) * 2.0 ** (np.frexp(np.float32(m))[1] - 31) if m > 0 else 0.0
    return y, fix + 2.0**-24 * (np.abs(y) + fix) + 2.0**-45 * (np.abs(w) @ np.abs(xs))


def _x(rng, in_f, in_pad, wide=False):
    x = np.zeros(in_pad, np.float32)
    if wide:  # |x| from 1e-9 to 1e3 (and one 1e4), both signs, some exact zeros
        x[:in_f] = 10.0 ** rng.uniform(-9, 3, in_f) * rng.choice([-1.0, 1.0], in_f)
        x[rng.choice(in_f, in_f // 10, replace=False)] = 0.0
        x[in_f - 1] = -1e4  # the largest, in the last column: in wide rows, staging's second pass finds it
    else:
        x[:in_f] = rng.standard_normal(in_f, dtype=np.float32) * np.float32(100.0)
    return x


@pytest.mark.parametrize("fmt, rows, in_f, r16, blocks, warps, wide", [
    ("int4", 37, 700, 2, 1, 1, False), ("int4", 37, 700, 2, 1, 8, True), ("int8", 37, 700, 2, 1, 5, False),
    ("int8", 37, 700, 2, 2, 3, True), ("int4", 150, 700, 1, 2, 3, True), ("int8", 150, 700, 1, 3, 8, False),
    ("int4", 20, 2000, 1, 1, 1, True), ("int8", 20, 2000, 2, 2, 1, False)])
def test_mm_imma_on_the_host(harness, fmt, rows, in_f, r16, blocks, warps, wide):
    """mm_imma: rows x 700 columns (padded to 768: 6 (int4) or 12 (int8) 64-byte segments per row) in
    tiles of 16 r16 rows (37 rows at r16 2: two tiles, the second ragged; 150 at r16 1: ten tiles), fewer
    blocks than tiles (each block loops over its tiles: the next tile's prefetch, the alternating
    reduction buffers), 1..8 warps splitting the segments (int4 at 8: two warps without any). x either
    Gaussian x 100 or of wide range (1e-9 .. 1e4, zeros, both signs), held to _ref_bound. 2000 columns
    (2048: 256 limb entries) on one warp: more than the IM_KEEP entries a thread keeps from staging's first
    pass; int8 there on 2 blocks for its one tile (the second has none). Entry 1 of the launch takes its
    rows from the table (e[5] = rows - 5): the same values, its last 5 rows unwritten."""
    rng = np.random.default_rng([rows, in_f, r16, blocks, warps, wide])
    qt = quant.quantize(rng.standard_normal((rows, in_f), dtype=np.float32), fmt)
    x = _x(rng, in_f, -(-in_f // 128) * 128, wide)
    got = _run(harness, 0, fmt, [qt], x[None], r16=r16, blocks=blocks, warps=warps, erows=rows - 5)
    ref, bound = _ref_bound(qt, x)
    assert np.all(np.abs(got[0] - ref) <= bound), np.abs(got[0] - ref).max()
    assert np.array_equal(got[1, : rows - 5], got[0, : rows - 5]) and np.all(np.isnan(got[1, rows - 5:]))
    if wide:  # the bound is near the fixed point's step: x below it rounded to 0 would show
        assert bound.max() < 1e-3 * np.abs(ref).max()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_mm_imma_rounds_x_at_its_fixed_point_step(harness, fmt):
    """x[0] = 1 is the largest (2^e = 2^-29); the other columns are 0.7 steps 2^e (a few: 0.5, 1.5, 2.5),
    with the sign of row 0's weight there, so row 0's rounding errors point one way (over half of
    _ref_bound's fixed-point part). y is the exact sum of x rounded to whole steps (rint: 1, and halves to
    even 0, 2, 2), to float32 rounding; a coarser step (fewer bits of X) rounds 0.7 to 0, and rounding
    halves away from zero gives 1, 2, 3."""
    rows, in_f = 20, 300
    rng = np.random.default_rng(7)
    qt = quant.quantize(rng.standard_normal((rows, in_f), dtype=np.float32), fmt)
    w, step = _exact_w(qt), 2.0**-29
    x = np.zeros(384, np.float32)
    steps = np.where(np.arange(in_f) % 40 == 1, rng.choice([0.5, 1.5, 2.5], in_f), 0.7)
    x[:in_f] = steps * step * np.sign(w[0])
    x[0] = 1.0
    got = _run(harness, 0, fmt, [qt], x[None], warps=2)[0]
    model = w @ (np.rint(x[:in_f] / step) * step)
    ref, bound = _ref_bound(qt, x)
    assert np.abs(model[0] - ref[0]) >= 0.5 * np.abs(w[0]).sum() * step / 2  # as sharp as meant
    assert np.all(np.abs(got - ref) <= bound), np.abs(got - ref).max()
    assert np.all(np.abs(got - model) <= 2.0**-24 * np.abs(model) + 2.0**-45 * (np.abs(w) @ np.abs(x[:in_f])))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_mm_imma_zero_inf_nan_and_empty_entries(harness, fmt):
    """All-zero x gives exact zeros; an inf or a NaN anywhere in x gives NaN in every row (the kernel's
    choice: no finite fixed point exists); an entry with T = 0 writes nothing (y keeps its NaN)."""
    rows, in_f = 20, 300
    rng = np.random.default_rng(3)
    qt = quant.quantize(rng.standard_normal((rows, in_f), dtype=np.float32), fmt)
    x = np.zeros(384, np.float32)
    got = _run(harness, 0, fmt, [qt], x[None], warps=3, T=(1, 0))
    assert np.array_equal(got[0], np.zeros(rows)) and np.all(np.isnan(got[1]))
    x = _x(rng, in_f, 384)
    for bad in (np.inf, -np.inf, np.nan):
        x[123] = bad
        got = _run(harness, 0, fmt, [qt], x[None], blocks=2, warps=2, T=(0, 1), erows=rows)
        assert np.all(np.isnan(got))


@pytest.mark.parametrize("fmt, r16, blocks, warps", [("int4", 1, 2, 3), ("int8", 2, 1, 2)])
def test_gate_up_imma_routed_row_on_the_host(harness, fmt, r16, blocks, warps):
    """gate_up_imma: the token is row idx[0] = 3 of a 5-row x; h = SiLU(g) u for the 40 real rows and
    exactly 0 in the padding rows 40..79 (h_stride 80, the last tile ragged); entry 1 (T = 0) writes
    nothing. The bound follows h's derivative from the bounds of g and u, plus a few float32 roundings
    of the SiLU (expf, add, divide, multiply)."""
    rows, in_f, hs = 40, 300, 80
    rng = np.random.default_rng([r16, blocks, warps])
    gq, uq = (quant.quantize(rng.standard_normal((rows, in_f), dtype=np.float32), fmt) for _ in range(2))
    x = np.stack([_x(rng, in_f, 384, wide=i == 3) * np.float32(1e-3) for i in range(5)])  # g, u ~ 1
    got = _run(harness, 1, fmt, [gq, uq], x, r16=r16, blocks=blocks, warps=warps, T=(1, 0), idx=3, hs=hs)
    (g, bg), (u, bu) = _ref_bound(gq, x[3]), _ref_bound(uq, x[3])
    sg = 1.0 / (1.0 + np.exp(-g))
    ref = g * sg * u
    bound = 1.1 * bg * np.abs(u) + np.abs(g * sg) * bu + bg * bu + 2.0**-20 * np.abs(ref)
    assert np.all(np.abs(got[0, :rows] - ref) <= bound), np.abs(got[0, :rows] - ref).max()
    assert np.array_equal(got[0, rows:], np.zeros(hs - rows)) and np.all(np.isnan(got[1]))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_mm_args_imma_matches_mm_imma_bits(harness, fmt):
    """mm_args_imma (table as a kernel argument) gives mm_imma's bits for the same entries."""
    rng = np.random.default_rng(11)
    qt = quant.quantize(rng.standard_normal((37, 700), dtype=np.float32), fmt)
    x = _x(rng, 700, 768, wide=True)
    a = _run(harness, 0, fmt, [qt], x[None], r16=2, blocks=1, warps=4, erows=30)
    b = _run(harness, 2, fmt, [qt], x[None], r16=2, blocks=1, warps=4, erows=30)
    assert np.array_equal(a, b, equal_nan=True) and not np.isnan(a[0]).any()


def test_launcher_gives_the_kernels_their_shared_memory(be, monkeypatch):  # noqa: F811 - the fixture
    """At T = 1 the launcher (simulated GPU) picks the imma kernels for int4 (and int8, when listed) and
    gives a block the dynamic shared memory the host runs above check: _dyn_bytes at the launcher's shape."""
    monkeypatch.setattr(cuda_mod, "_IMMA_FORMATS", frozenset({"int4", "int8"}))
    for name, nm in (("mm", 1), ("mm_args", 1), ("gate_up", 2)):
        r16, warps = cuda_mod._imma_shape(cuda_mod._IMMA[name])
        for fmt in ("int4", "int8"):
            fn, _, block, smem, _ = be._launcher(name, fmt, 3, 256, 250, 1024, 256, 1)
            assert fn.__name__.startswith(cuda_mod._IMMA[name] + "<"), fn.__name__
            assert block == (32 * warps,) and smem == _dyn_bytes(1024, warps, nm, r16)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_imma_kernels_compile_without_spills(tmp_path):
    """Every instance (FMT 3, 4 x R16 1, 2) compiles to PTX with the s8 x s8 integer mma (the four signed
    limbs are B's columns), and ptxas fits each in 128 registers (IM_MIN_BLOCKS 2 blocks of 256 threads per
    SM) without spills."""
    kinds = (("mm_imma", "const u64 *"), ("mm_args_imma", "const MMArgs"), ("gate_up_imma", "const u64 *"))
    inst = [(k, t, f, r) for f in (3, 4) for r in (1, 2) for k, t in kinds]
    src = tmp_path / "inst.cu"
    body = "".join(f"template __global__ void {k}<{f}, {r}>({t}, int, int, int, int);\n"
                   for k, t, f, r in inst)
    src.write_text(f'#include "{SOURCE}"\n#include "{PREFILL}"\n#include "{IMMA}"\n{body}')
    ptx = tmp_path / "k.ptx"
    flags = [f"-DIM_STAGES={STAGES}", f"-DIM_MIN_BLOCKS={cuda_mod._IMMA_MIN_BLOCKS}"]  # the launcher's
    run = subprocess.run(["nvcc", "--ptx", "-std=c++14", "-arch=sm_90", *flags, "-o", str(ptx), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    text = ptx.read_text()
    assert text.count(".entry") == 13  # 12 instances + matmul.cu's rmsnorm
    assert text.count("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32") >= 12
    assert "s8.u8" not in text
    run = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                          str(ptx)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    stats = r"function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers"  # per entry
    found = re.findall(stats, run.stderr, re.S)
    got = {name: (int(spill), int(regs)) for name, spill, regs in found}
    assert len(got) == 13, run.stderr
    assert cuda_mod._imma_shape("gate_up_imma")[0] == 1 and cuda_mod._IMMA_MIN_BLOCKS == 2
    for k, _, f, r in inst:
        spill, regs = got[next(n for n in got if n.startswith(f"_Z{len(k)}{k}ILi{f}ELi{r}E"))]
        assert regs <= 128 and spill == 0, (k, f, r, spill, regs)
