"""The tensor-core prefill kernels of ``shaders/cuda/prefill.cu`` (mm_tc, mm_args_tc, gate_up_tc), without a
GPU: nvcc compiles every instance the launcher can ask for, and g++ runs mm_tc and gate_up_tc on the host
as a warp runs them (one OS thread per lane; ``mma.sync`` emulated from the 32 lanes' fragments between
two barriers of the warp; bf16 conversions rounded to nearest even), against the quant-format semantics:
the column order of each lane's k-steps, group scales per 32-column part, the hi/lo split of the
activations, ragged row tiles and token passes, routed token rows (idx) and the zeroed h padding.
On a GPU the oracle (``test_backends_oracle.py``, T > 1 rows) runs them for real.
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from _cuda_host import HOST_PRELUDE
from test_backend_cuda import SOURCE, _host_build
from test_backend_cuda_sim import be  # noqa: F401 - the simulated GPU's backend fixture

from colibri_plan import quant
from colibri_plan.backends.base import silu_mul_ref
from colibri_plan.backends.cuda import launch as cuda_mod
from colibri_plan.backends.programs import kernel_format
from colibri_plan.backends.staging import padded_layout

PREFILL = SOURCE.parent.joinpath("prefill.cu")

HARNESS = HOST_PRELUDE + r"""
static unsigned frag[8][32][6];
static float bf(unsigned h) { return __uint_as_float(h << 16); }  // a bf16 (low 16 bits) as float
static unsigned to_bf(float f) {  // float -> bf16 bits, round to nearest even (finite values)
  const unsigned u = __float_as_uint(f); return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; }
static unsigned pack_bf16(float lo, float hi) { return to_bf(lo) | (to_bf(hi) << 16); }
static unsigned bf16x2_minus136(unsigned p) {
  return to_bf(bf(p & 0xFFFFu) - 136.0f) | (to_bf(bf(p >> 16) - 136.0f) << 16); }
static void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                     unsigned b1) {
  const int l = threadIdx.x & 31, g = l >> 2, t = l & 3, wi = threadIdx.x >> 5;
  const unsigned mine[6] = {a0, a1, a2, a3, b0, b1};
  unsigned (&fr)[32][6] = frag[wi];
  for (int i = 0; i < 6; i++) fr[l][i] = mine[i];
  warp_bar[wi]->arrive_and_wait();
  for (int c_ = 0; c_ < 4; c_++) {  // C[row][col]: row g + 8 (c / 2), column 2t + c % 2
    const int row = g + 8 * (c_ >> 1), col = 2 * t + (c_ & 1);
    double s = 0.0;
    for (int k = 0; k < 16; k++) {  // k = 2 t' + h (+ 8): lane t', register a0/a2 (a1/a3 rows + 8), half h
      const int tl = (k & 7) >> 1, half = k & 1, hi8 = k >= 8;
      const unsigned a = fr[(row & 7) * 4 + tl][2 * hi8 + (row >= 8)], b = fr[col * 4 + tl][4 + hi8];
      s += (double)bf(half ? a >> 16 : a & 0xFFFFu) * bf(half ? b >> 16 : b & 0xFFFFu);
    }
    c[c_] = (float)(c[c_] + s);
  }
  warp_bar[wi]->arrive_and_wait();
}
#include "MATMUL"
#include "PREFILL"
// reads: kind (0 mm, 1 gate_up) fmt rows in_pad h_stride G T NT n_x blocks warps, then the weight bytes and
// scales of 1 (mm) or 2 (gate_up) matrices, n_x rows of x, T token rows (gate_up: idx); prints y / h
int main() {
  int kind, fmt, rows, in_pad, hs, G, T, NT, nx, blocks, warps;
  if (scanf("%d %d %d %d %d %d %d %d %d %d %d", &kind, &fmt, &rows, &in_pad, &hs, &G, &T, &NT, &nx,
            &blocks, &warps) != 11) return 2;
  const int bits = fmt <= 2 ? 16 : fmt == 3 ? 8 : 4, row_bytes = in_pad * bits / 8;
  const int ns = fmt == 6 ? rows * (in_pad / G) : fmt <= 2 ? 0 : rows;
  const int gshift = G == 64 ? 1 : G == 128 ? 2 : 0;
  const int mats = kind ? 2 : 1;
  std::vector<std::vector<uint4>> W(mats, std::vector<uint4>(rows * row_bytes / 16 + 1));
  std::vector<std::vector<float>> S(mats, std::vector<float>(ns + 1));
  unsigned v;
  for (int m = 0; m < mats; m++) {
    unsigned char *wb = (unsigned char *)W[m].data();
    for (int i = 0; i < rows * row_bytes; i++) { if (scanf("%u", &v) != 1) return 3; wb[i] = v; }
    for (int i = 0; i < ns; i++) if (scanf("%f", &S[m][i]) != 1) return 4;
  }
  std::vector<float> x((size_t)nx * in_pad);
  for (auto &a : x) if (scanf("%f", &a) != 1) return 5;
  std::vector<int> idx(T);
  if (kind) for (auto &a : idx) if (scanf("%d", &a) != 1) return 6;
  const int out_n = kind ? hs : rows;
  std::vector<float> y((size_t)T * out_n, NAN);
  u64 e[8] = {(u64)W[0].data(), (u64)S[0].data(), (u64)x.data(), (u64)y.data(), (u64)T, 0, 0, 0};
  if (kind) {
    u64 g[8] = {(u64)W[0].data(), (u64)S[0].data(), (u64)W[1].data(), (u64)S[1].data(), (u64)x.data(),
                (u64)y.data(), (u64)T, (u64)idx.data()};
    memcpy(e, g, sizeof e);
  }
  blockDim.x = 32 * warps; gridDim.x = blocks;
  for (unsigned b = 0; b < (unsigned)blocks; b++) {
    blockIdx = {b, 0, 0};
    std::barrier<> bb(32 * warps); block_bar = &bb;
    warp_bar.clear();
    for (int w = 0; w < warps; w++) warp_bar.push_back(new std::barrier<>(32));
    std::vector<std::thread> ts;
    for (int l = 0; l < 32 * warps; l++) ts.emplace_back([&, l] {
      threadIdx.x = l;
#define RUN(F) if (fmt == F) { \
        if (kind == 0 && NT == 1) mm_tc<F, 2, 1>(e, rows, in_pad, rows, gshift); \
        if (kind == 0 && NT == 2) mm_tc<F, 2, 2>(e, rows, in_pad, rows, gshift); \
        if (kind == 1 && NT == 1) gate_up_tc<F, 1, 1>(e, rows, in_pad, hs, gshift); \
        if (kind == 1 && NT == 2) gate_up_tc<F, 1, 2>(e, rows, in_pad, hs, gshift); }
      RUN(3) RUN(4) RUN(6)
    });
    for (auto &t : ts) t.join();
    for (auto *p : warp_bar) delete p;
  }
  for (float a : y) printf("%.9g\n", a);
  return 0;
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    text = HARNESS.replace("MATMUL", str(SOURCE)).replace("PREFILL", str(PREFILL))
    exe, build = _host_build(tmp_path_factory, text, "-std=c++20", "-pthread")
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"this g++ has no C++20 <barrier>: {build.stderr[:200]}")
    assert build.returncode == 0, build.stderr
    return exe


def _numbers(a) -> str:
    return " ".join(repr(float(v)) for v in np.asarray(a, np.float64).reshape(-1))


def _weight_text(qt) -> tuple[str, int]:
    data, scales, in_pad = padded_layout(qt)
    sc = scales.reshape(-1) if qt.scales is not None else np.zeros(0, np.float32)
    return " ".join(map(str, data.reshape(-1).view(np.uint8).tolist())) + " " + _numbers(sc), in_pad


def _run(harness, head: str, body: str) -> np.ndarray:
    run = subprocess.run([str(harness)], input=head + " " + body, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return np.array(run.stdout.split(), np.float64)


@pytest.mark.parametrize("fmt, T, nt, blocks, warps", [
    ("int4", 11, 2, 1, 1), ("int4", 19, 2, 2, 2), ("int8", 3, 1, 1, 3), ("int4-g32", 19, 2, 1, 2),
    ("int4-g64", 5, 1, 3, 1), ("int4-g128", 9, 2, 1, 4), ("int8", 10, 2, 2, 8)])
def test_mm_tc_on_the_host(harness, fmt, T, nt, blocks, warps):
    """mm_tc: 37 rows (two 32-row tiles, the second ragged) x 700 columns (padded to 768: 6 (int4) or 12
    (int8) 64-byte segments per row), T tokens in passes of 8 nt (partial last pass), one warp per block, the
    work items split over ``blocks`` blocks, each block's ``warps`` warps splitting the segments (8 warps:
    some have none) and summing through shared memory; y = x . dequantize(W)^T."""
    rows, in_f = 37, 700
    rng = np.random.default_rng([T, nt, blocks, warps])
    qt = quant.quantize(rng.standard_normal((rows, in_f), dtype=np.float32), fmt)
    wtext, in_pad = _weight_text(qt)
    x = np.zeros((T, in_pad), np.float32)
    x[:, :in_f] = rng.standard_normal((T, in_f), dtype=np.float32) * np.float32(100.0)  # not bf16-exact
    g = quant.group_size(fmt) or 0
    head = f"0 {kernel_format(fmt)} {rows} {in_pad} 0 {g} {T} {nt} {T} {blocks} {warps}"
    got = _run(harness, head, wtext + " " + _numbers(x)).reshape(T, rows)
    ref = x[:, :in_f].astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T
    assert np.abs(got - ref).max() <= 2e-5 * np.abs(ref).max()  # x to 2^-17 (bf16 hi + lo)


@pytest.mark.parametrize("fmt, T, nt", [("int4", 6, 1), ("int8", 13, 2), ("int4-g32", 17, 2)])
def test_gate_up_tc_routed_rows_on_the_host(harness, fmt, T, nt):
    """gate_up_tc with routed rows: the expert's T tokens are rows idx of a 23-row x; h [T, 64] =
    SiLU(x.gate^T) * x.up^T for the 20 real rows, 0 in the padding rows 20..63 (down reads them)."""
    I, H, nx, hs = 20, 200, 23, 64
    rng = np.random.default_rng([T, nt])
    gq, uq = (quant.quantize(rng.standard_normal((I, H), dtype=np.float32), fmt) for _ in range(2))
    (gt, in_pad), (ut, _) = _weight_text(gq), _weight_text(uq)
    x = np.zeros((nx, in_pad), np.float32)
    x[:, :H] = rng.standard_normal((nx, H), dtype=np.float32)
    idx = np.sort(rng.choice(nx, T, replace=False))
    g = quant.group_size(fmt) or 0
    head = f"1 {kernel_format(fmt)} {I} {in_pad} {hs} {g} {T} {nt} {nx} 2 3"
    got = _run(harness, head, " ".join([gt, ut, _numbers(x), " ".join(map(str, idx))])).reshape(T, hs)
    xs = x[idx, :H].astype(np.float64)
    ref = silu_mul_ref(xs @ quant.dequantize(gq).astype(np.float64).T, xs @ quant.dequantize(uq).T)
    assert np.all(got[:, I:] == 0.0)
    assert np.abs(got[:, :I] - ref).max() <= 1e-5 * np.abs(ref).max()


def test_launcher_sends_prefill_to_tensor_cores_and_decode_to_gemv(be):  # noqa: F811 - the fixture
    """The formats the tensor-core kernels take: int8 and int4 codes (exact in bf16, 4 columns of one
    32-bit part per k-step); the float formats and int2 keep the GEMV kernels at every T. The launcher
    (simulated GPU) picks mm_tc from T = 2, with one 8-token column tile up to T = 8 and two above; at
    T = 1 per-row int4 takes decode_imma.cu (its x limbs in shared memory), int8 and the group formats
    the GEMV kernels."""
    assert cuda_mod._TC_FORMATS == {"int8", "int4", "int4-g32", "int4-g64", "int4-g128"}
    assert cuda_mod._TC_MIN_TOKENS == 2
    assert set(cuda_mod._TC) == {"mm", "mm_args", "gate_up"}
    for fmt, T, want in (("int8", 1, "mm<"), ("int4", 1, "mm_imma<"), ("int4-g64", 1, "mm<"),
                         ("int8", 2, "mm_tc<"), ("int4-g64", 16, "mm_tc<"), ("f32", 16, "mm<")):
        fn, _, _, smem, _ = be._launcher("mm", fmt, 1, 64, 64, 256, 64, T)
        assert fn.__name__.startswith(want), (fmt, T, fn.__name__)
        assert (smem == 0) == (want == "mm_tc<")  # the tensor-core kernels stage no activations
    assert cuda_mod._IMMA_FORMATS == {"int4"}
    for T, nt in ((8, 1), (9, 2)):
        fn = be._launcher("mm", "int8", 1, 64, 64, 256, 64, T)[0]
        assert fn.__name__.endswith(f",{cuda_mod._TC_R16['mm_tc']},{nt}>"), (T, fn.__name__)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_prefill_kernels_compile_to_ptx(tmp_path):
    src = tmp_path / "inst.cu"
    body = "".join(f"template __global__ void {k}<{f}, {r}, {nt}>({t}, int, int, int, int);\n"
                   for f in (3, 4, 6) for nt in (1, 2)
                   for k, r, t in (("mm_tc", 2, "const u64 *"), ("mm_args_tc", 2, "const MMArgs"),
                                   ("gate_up_tc", 1, "const u64 *")))
    src.write_text(f'#include "{SOURCE}"\n#include "{PREFILL}"\n{body}')
    run = subprocess.run(["nvcc", "--ptx", "-std=c++14", "-arch=sm_90", "-o", str(tmp_path / "k.ptx"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    assert ptx.count(".entry") == 19  # 3 formats x 3 kernels x (8, 16 tokens per pass) + rmsnorm
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") >= 18
    # the register arrays (acc, part, cur, ...) are indexed by constants only (for4's loops unrolled):
    # an array indexed at run time would live in local memory
    assert ".local" not in ptx


@pytest.fixture(params=["sim", "gpu"])
def dev(request, monkeypatch):
    """The CUDA backend on the simulated GPU of test_backend_cuda_device_sim.py, and on a real one."""
    import sys

    from colibri_plan.backends import get_backend

    if request.param == "sim":
        from test_backend_cuda_device_sim import device_cupy
        from test_backend_cuda_sim import Sim

        monkeypatch.setitem(sys.modules, "cupy", device_cupy(Sim()))
    else:
        reason = get_backend("cuda").unavailable_reason()
        if reason:
            pytest.skip(f"cuda: {reason}")
    b = get_backend("cuda").open(0)
    yield b
    b.close()


def _silu(v):
    return v / (1.0 + np.exp(-v))


@pytest.mark.parametrize("fmt, hidden, T", [("int4", 256, 7), ("int8", 200, 20), ("int4-g64", 384, 33),
                                            ("f32", 128, 5)])
def test_d_expert_ffn_rows_routes_each_token_to_its_experts(dev, fmt, hidden, T):
    """A prefill's routed experts on the device x: expert i on its own tokens' rows only (gate_up's idx),
    gated and scattered back in expert order; an expert with no rows is skipped; against float64 numpy
    and the engine's host combine. f32 experts (GEMV gate_up, its idx too) as well."""
    width, n = 48, 4
    rng = np.random.default_rng([hidden, T])
    qts = [tuple(quant.quantize(rng.standard_normal(s, dtype=np.float32) / np.float32(np.sqrt(s[1])), fmt)
                 for s in ((width, hidden), (width, hidden), (hidden, width))) for _ in range(n)]
    ws = [dev.upload_expert(*q) for q in qts]
    x = rng.standard_normal((T, hidden), dtype=np.float32)
    rows = [np.sort(rng.choice(T, k, replace=False)) for k in (T // 2 + 1, 1, 0, T)]
    gates = [np.abs(rng.standard_normal(len(r), dtype=np.float32)) + np.float32(0.05) for r in rows]
    y = dev.d_get(dev.d_expert_ffn_rows(dev.d_put(x), ws, rows, gates))
    ref = np.zeros((T, hidden))
    host = np.zeros((T, hidden), np.float32)
    for (g, u, d), w, r, gt in zip(qts, ws, rows, gates):
        xr = x[r].astype(np.float64)
        dg, du, dd = (quant.dequantize(q).astype(np.float64) for q in (g, u, d))
        ref[r] += gt[:, None] * ((_silu(xr @ dg.T) * (xr @ du.T)) @ dd.T)
        if len(r):
            host[r] += dev.expert_ffn([x[r]], [w])[0] * gt[:, None]
    assert y.shape == (T, hidden)
    assert np.abs(y - ref).max() <= 5e-5 * np.abs(ref).max()
    assert np.abs(y - host).max() <= 1e-5 * np.abs(host).max()


def test_d_expert_ffn_rows_refuses_bad_routing(dev):
    from colibri_plan.errors import InputError

    q = [quant.quantize(np.ones(s, np.float32), "int8") for s in ((16, 128), (16, 128), (128, 16))]
    w, dx = dev.upload_expert(*q), dev.d_put(np.ones((3, 128), np.float32))
    assert np.array_equal(dev.d_get(dev.d_expert_ffn_rows(dx, [w], [[]], [[]])), np.zeros((3, 128)))
    with pytest.raises(InputError, match="one of each per expert"):
        dev.d_expert_ffn_rows(dx, [w], [[0], [1]], [[1.0]])
    with pytest.raises(InputError, match=r"each row in \[0, 3\)"):
        dev.d_expert_ffn_rows(dx, [w], [[3]], [[1.0]])
    with pytest.raises(InputError, match="one finite gate per row"):
        dev.d_expert_ffn_rows(dx, [w], [[0, 1]], [[np.inf, 1.0]])
    with pytest.raises(InputError, match=r"d_expert_ffn_rows: x is \(3, 64\); an expert's gate/up must be"):
        dev.d_expert_ffn_rows(dev.d_put(np.ones((3, 64), np.float32)), [w], [[0]], [[1.0]])
