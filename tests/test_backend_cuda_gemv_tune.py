"""The GEMV work shapes of backends/cuda.py ``_GEMV_TUNE`` (what ``bench/cuda_expert_ffn.py --gemv-sweep``
times on a GPU) compute the same sums as ``colibri_plan.quant``.

shaders/cuda/matmul.cu's ``warp_rows`` is compiled for the host with g++ (the stand-ins of
``tests/test_backend_cuda.py``: shuffles as no-ops, every lane's part summed here) with and without
``COLIBRI_X_BY_PART``, for each (rows per tile R, matrices NW, words per lane per step U, tokens per pass
TC) of the sweep, over a grid of several blocks and warps per block that leaves some warps a tile more
than others; each row must come out exactly once. The launcher side (shape per format family, NVRTC
options, occupancy per warps) runs on the simulated GPU of ``tests/test_backend_cuda_sim.py``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess

import numpy as np
import pytest
from test_backend_cuda import HARNESS, SOURCE, _host_build
from test_backend_cuda_sim import be, record_compiles  # noqa: F401 - the simulated GPU's backend fixture
from test_bench_bad_args import bench as load_bench

from colibri_plan import quant
from colibri_plan.backends.base import silu_mul_ref
from colibri_plan.backends.cuda import launch as cuda_mod
from colibri_plan.backends.staging import padded_layout

# (R, NW, U, TC): the sweep's gate_up (NW 2) and down (NW 1) shapes, and several tokens per pass
CONFIGS = ((2, 2, 1, 1), (4, 1, 1, 1), (2, 2, 2, 1), (4, 1, 2, 1), (4, 2, 1, 1), (8, 1, 1, 1), (6, 1, 1, 1),
           (2, 2, 1, 2), (4, 1, 1, 4))
GRIDS = ((2, 3), (1, 8), (3, 16))  # (blocks, warps per block)
TOKEN_SCALE = (1.0, -0.5, 0.25, 2.0)  # token j = TOKEN_SCALE[j] * x

_PRELUDE = HARNESS.split('#include "SOURCE"')[0]
MAIN = r"""
#include "SOURCE"
// reads: fmt rows in_pad G, then per matrix (2) the weight bytes and scales, then x; for every config and
// grid prints "config grid" then each matrix's, token's, row's sum and how many lanes-0 emitted the row
static uint4 W[2][1 << 17]; static float S[2][1 << 16], x[4 << 13], xs[4 << 13];
static double sum[2][4][1 << 10]; static int cnt[2][4][1 << 10];
template <int F, int R, int NW, int U, int TC>
void run(int rows, int in_pad, int gshift, int blocks, int warps) {
  memset(sum, 0, sizeof sum); memset(cnt, 0, sizeof cnt);
  const uint4 *Wp[2] = {W[0], W[1]}; const float *Sp[2] = {S[0], S[1]};
  threadIdx.x = 0; blockDim.x = 1; stage_tokens<F>(xs, x, in_pad, TC);
  gridDim.x = blocks; blockDim.x = 32 * warps;
  const int ntiles = (rows + R - 1) / R;
  for (int b = 0; b < blocks; b++) for (int w = 0; w < warps; w++) for (int lane = 0; lane < 32; lane++) {
    blockIdx.x = b; threadIdx.x = 32 * w + lane;
    warp_rows<F, R, NW, U, TC>(Wp, Sp, rows, ntiles, in_pad / Cols<F>::n, gshift, xs, in_pad, TC,
                               [&](int row0, auto &acc) {
      for (int m = 0; m < NW; m++) for (int j = 0; j < TC; j++) for (int i = 0; i < R; i++)
        if (row0 + i < rows) { sum[m][j][row0 + i] += acc[j][m][i]; cnt[m][j][row0 + i] += lane == 0; } });
  }
  for (int m = 0; m < NW; m++) for (int j = 0; j < TC; j++) for (int r = 0; r < rows; r++)
    printf("%d %d %d %.9g %d\n", m, j, r, sum[m][j][r], cnt[m][j][r]);
}
int main() {
  int fmt, rows, in_pad, G; if (scanf("%d %d %d %d", &fmt, &rows, &in_pad, &G) != 4) return 2;
  int bits = fmt == 0 ? 32 : fmt <= 2 ? 16 : fmt == 3 ? 8 : fmt == 5 ? 2 : 4;
  int row_bytes = in_pad * bits / 8, ns = fmt == 6 ? rows * (in_pad / G) : rows;
  int gshift = G == 64 ? 1 : G == 128 ? 2 : 0; unsigned v;
  for (int m = 0; m < 2; m++) {
    unsigned char *wb = (unsigned char *)W[m];
    for (int i = 0; i < rows * row_bytes; i++) { if (scanf("%u", &v) != 1) return 3; wb[i] = v; }
    for (int i = 0; i < ns; i++) if (scanf("%f", &S[m][i]) != 1) return 4;
  }
  for (int i = 0; i < in_pad; i++) if (scanf("%f", &x[i]) != 1) return 5;
  const float scale[4] = {1.0f, -0.5f, 0.25f, 2.0f};
  for (int j = 1; j < 4; j++) for (int i = 0; i < in_pad; i++) x[j * in_pad + i] = scale[j] * x[i];
  const int grids[][2] = {GRIDS};
  for (auto &g : grids) {
#define X(R, NW, U, TC) printf("config %d %d %d %d %d %d\n", R, NW, U, TC, g[0], g[1]); switch (fmt) { \
      case 0: run<0, R, NW, U, TC>(rows, in_pad, gshift, g[0], g[1]); break; \
      case 3: run<3, R, NW, U, TC>(rows, in_pad, gshift, g[0], g[1]); break; \
      case 4: run<4, R, NW, U, TC>(rows, in_pad, gshift, g[0], g[1]); break; \
      case 5: run<5, R, NW, U, TC>(rows, in_pad, gshift, g[0], g[1]); break; \
      case 6: run<6, R, NW, U, TC>(rows, in_pad, gshift, g[0], g[1]); break; }
    CONFIGS
  }
  return 0;
}
"""


def _source() -> str:
    configs = " ".join(f"X({r}, {nw}, {u}, {tc})" for r, nw, u, tc in CONFIGS)
    grids = ", ".join(f"{{{b}, {w}}}" for b, w in GRIDS)
    main = MAIN.replace("SOURCE", str(SOURCE)).replace("CONFIGS", configs).replace("GRIDS", grids)
    return _PRELUDE + main


@pytest.fixture(scope="module", params=[False, True], ids=["x_whole", "x_by_part"])
def harness(request, tmp_path_factory):
    flags = ("-DCOLIBRI_X_BY_PART",) if request.param else ()
    exe, build = _host_build(tmp_path_factory, _source(), "-std=c++17", *flags)
    assert build.returncode == 0, build.stderr
    return exe


@pytest.mark.parametrize("fmt", ["f32", "int8", "int4", "int2", "int4-g32", "int4-g64"])
def test_every_work_shape_matches_quant_on_the_host(harness, fmt):
    """Rows 37 (tiles of 2..8 rows leave a partial last tile), 2100 columns (int4: 68 words a row, 3 steps
    of 1 word per lane with the last partial), two matrices (gate and up), up to 4 tokens: every config and
    grid gives x_j . dequantize(W_m) for every row, each row emitted by exactly one warp."""
    rows, in_f = 37, 2100
    rng = np.random.default_rng(11)
    qts = [quant.quantize(rng.standard_normal((rows, in_f), dtype=np.float32), fmt) for _ in range(2)]
    fid = {"f32": 0, "int8": 3, "int4": 4, "int2": 5}.get(fmt, 6)
    parts, in_pad = [], 0
    for qt in qts:
        data, scales, in_pad = padded_layout(qt)
        sc = scales.reshape(-1) if qt.scales is not None else np.zeros(rows, np.float32)
        parts += [" ".join(map(str, data.reshape(-1).tolist())), " ".join(repr(float(s)) for s in sc)]
    x = np.zeros(in_pad, np.float32)
    x[:in_f] = rng.standard_normal(in_f, dtype=np.float32)
    text = " ".join([f"{fid} {rows} {in_pad} {quant.group_size(fmt) or 0}", *parts,
                     " ".join(repr(float(v)) for v in x)])
    run = subprocess.run([str(harness)], input=text, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    ref = {(m, j): quant.matmul_ref(np.float32(TOKEN_SCALE[j]) * x[None, :in_f], qts[m])[0].astype(np.float64)
           for m in range(2) for j in range(4)}
    blocks = run.stdout.split("config ")[1:]
    assert len(blocks) == len(CONFIGS) * len(GRIDS)
    for block in blocks:
        head, *lines = block.strip().splitlines()
        r, nw, u, tc, nb, warps = map(int, head.split())
        got = np.array([ln.split() for ln in lines], np.float64).reshape(nw, tc, rows, 5)
        shape = f"R {r} NW {nw} U {u} grid {nb}x{warps}"
        assert (got[..., 4] == 1).all(), f"rows emitted not exactly once: {shape}"
        for m in range(nw):
            for j in range(tc):
                want = ref[m, j]
                np.testing.assert_allclose(got[m, j, :, 3], want, rtol=1e-5, atol=1e-5 * np.abs(want).max(),
                                           err_msg=f"{fmt} R {r} NW {nw} U {u} TC {tc} matrix {m} token {j}")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_sweep_variants_compile_to_ptx(tmp_path):
    """Every _SWEEP shape of gate_up and mm, for every format, compiles with COLIBRI_X_BY_PART and a
    register cap, as NVRTC is asked to on a GPU."""
    src = tmp_path / "inst.cu"
    body = "".join(f"template __global__ void {k}<{f}, {r}, {u}, 1>(const u64 *, int, int, int, int);\n"
                   for f in range(7) for k, r, u in (("gate_up", 2, 2), ("gate_up", 4, 1), ("mm", 8, 1),
                                                     ("mm", 6, 1), ("mm", 4, 2)))
    src.write_text(f'#include "{SOURCE}"\n{body}')
    run = subprocess.run(["nvcc", "--ptx", "-std=c++14", "-arch=sm_90", "-DCOLIBRI_X_BY_PART",
                          "-maxrregcount=64", "-o", str(tmp_path / "k.ptx"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "k.ptx").read_text().count(".entry") == 7 * 5 + 1  # + rmsnorm


def test_launcher_takes_each_format_familys_settings(be, monkeypatch):  # noqa: F811 - the fixture
    """A _GEMV_TUNE entry for "int4" sets the kernel instances (R, U), NVRTC options, block size and grid of
    int4 and int4-gG launches; int8, without an entry, keeps _SHAPE and _WARPS; results stay those of
    numpy on the simulated GPU."""
    seen = record_compiles(be, monkeypatch)
    monkeypatch.setattr(cuda_mod, "_IMMA_FORMATS", frozenset())  # 1 token: GEMV kernels, not decode_imma
    monkeypatch.setattr(cuda_mod, "_GEMV_TUNE", {"int4": {"gate_up": (4, 2), "mm": (6, 1), "warps": 4,
                                                          "max_regs": 64, "x_by_part": True}})
    H, I, rng = 256, 128, np.random.default_rng(3)
    for fmt in ("int4-g64", "int8"):
        qs = [quant.quantize(rng.standard_normal(s, dtype=np.float32), fmt) for s in ((I, H), (I, H), (H, I))]
        experts = [be.upload_expert(*qs), be.upload_expert(*qs)]
        xs = [rng.standard_normal((1, H), dtype=np.float32) for _ in experts]
        got = np.stack(be.expert_ffn(xs, experts))  # [expert, T, H]
        g, u, d = (quant.dequantize(q).astype(np.float64) for q in qs)
        ref = np.stack([silu_mul_ref(x @ g.T, x @ u.T) @ d.T for x in xs])
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    tuned = ("--std=c++14", "--maxrregcount=64", "-DCOLIBRI_X_BY_PART")
    assert (("gate_up<6,4,2,1>",), tuned) in seen and (("mm<6,6,1,1>",), tuned) in seen
    assert (("gate_up<3,2,1,1>",), ("--std=c++14",)) in seen and (("mm<3,4,1,1>",), ("--std=c++14",)) in seen
    # sim: 4 SMs, 2 resident blocks; gate_up int4: 128 rows / R 4 = 32 tiles over 4 warps a block
    _, grid, block, _, _ = be._launcher("gate_up", "int4", 2, I, I, H, I, 1)
    assert block == (128,) and grid == (min(8, 4), 2)
    _, grid, block, _, _ = be._launcher("mm", "int8", 2, H, H, I, H, 1)
    assert block == (256,) and grid == (min(-(-H // 4 // 8), 4), 2)
    assert cuda_mod._gemv_shape("mm_args", "int4-g32") == (6, 1, 4, 64, True, False)


def test_fit_wave_keeps_the_grid_within_one_wave(be, monkeypatch):  # noqa: F811 - the fixture
    """3 resident blocks on 4 SMs over 8 matrices: 12 slots; rounding up gives 2 blocks a matrix (16 > 12),
    fit_wave 1 (8 <= 12); rows enough for more blocks either way."""
    monkeypatch.setattr(be.cp.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", lambda f, b, s: 3)
    monkeypatch.setattr(cuda_mod, "_IMMA_FORMATS", frozenset())
    for fit, want in ((False, 2), (True, 1)):
        monkeypatch.setattr(cuda_mod, "_GEMV_TUNE", {"int8": {"fit_wave": fit}})
        be._launchers.clear()
        be._occupancy.clear()
        _, grid, block, _, _ = be._launcher("mm", "int8", 8, 4096, 4096, 256, 4096, 1)
        assert grid == (want, 8) and block == (256,)


def _bench(monkeypatch):
    """bench/cuda_expert_ffn.py at small shapes (hidden 256, expert width 128) for the simulated GPU."""
    bench = load_bench("cuda_expert_ffn")
    monkeypatch.setattr(bench, "H", 256)
    monkeypatch.setattr(bench, "I", 128)
    return bench


def test_bench_sweep_runs_every_setting_and_restores_the_defaults(be, monkeypatch, capsys):  # noqa: F811
    """bench/cuda_expert_ffn.py --gemv-sweep on the simulated GPU (small shapes): a row per format and
    _SWEEP setting, each with the launch shape that setting asked for; _GEMV_TUNE is left as it was."""
    bench = _bench(monkeypatch)
    # device time grows with the kernel passes, so the kernels' own time (2 passes less 1) is 10 ms
    monkeypatch.setattr(be.cp.cuda, "get_elapsed_time", lambda a, b: 10.0 * (1 + be.kernel_passes))
    be.timing = True
    args = argparse.Namespace(formats="int4-g64,int8", experts=2, pool=3, calls=2, copy_gbps=100.0)
    before = {k: dict(v) for k, v in cuda_mod._GEMV_TUNE.items()}
    rows = bench.sweep(be, cuda_mod, args, np.random.default_rng(0))
    assert cuda_mod._GEMV_TUNE == before and cuda_mod._IMMA_FORMATS == {"int4"}
    assert [(r["fmt"], r["variant"]) for r in rows] == [(f, v) for f in ("int4-g64", "int8")
                                                        for v, _ in bench._SWEEP]
    for r, (_, tune) in zip(rows, bench._SWEEP * 2):
        assert r["kernel_s"] == pytest.approx(0.01)
        assert r["launch"]["gate_up"]["warps"] == tune.get("warps", 8)
        assert r["launch"]["mm"]["warps"] == tune.get("warps", 8)
    # sim: 4 SMs x 2 resident blocks over 2 experts: 4 blocks each; down 256 rows
    got = {(r["fmt"], r["variant"]): r["launch"]["mm"] for r in rows}
    assert got["int8", "default"] == {"resident_blocks": 2, "blocks": 4, "warps": 8, "registers": 0,
                                      "tiles_per_warp_max": 2, "tiles_per_warp_mean": 2.0}  # 64 tiles of 4
    assert got["int4-g64", "R4/8+fit"]["tiles_per_warp_max"] == 1  # 32 tiles of 8 over 32 warps
    assert got["int4-g64", "warps4+x_by_part+fit"]["blocks"] == 4  # 16 warps: 4 tiles each
    assert got["int4-g64", "warps4+x_by_part+fit"]["tiles_per_warp_max"] == 4
    assert "x_by_part+regs64+fit" in capsys.readouterr().out


def test_bench_tune_times_the_gemv_shapes_and_restores_the_settings(be, monkeypatch):  # noqa: F811
    """bench/cuda_expert_ffn.py --tune on the simulated GPU: each work shape it compares compiles the int4
    GEMV kernels of that shape (per-row int4 at 1 token would otherwise take decode_imma.cu's, the same
    kernels every time), and _SHAPE, _WARPS and _IMMA_FORMATS are left as they were."""
    bench = _bench(monkeypatch)
    seen = record_compiles(be, monkeypatch)
    ticks = iter(range(1, 1 << 20))  # event times that grow, so the kernels' time (2 passes less 1) is > 0
    monkeypatch.setattr(be.cp.cuda, "get_elapsed_time", lambda a, b: float(next(ticks)))
    before = (dict(cuda_mod._SHAPE), cuda_mod._WARPS, cuda_mod._IMMA_FORMATS)
    args = argparse.Namespace(experts=2, pool=3, calls=2)
    rows = bench.tune(type(be), args, np.random.default_rng(0))
    assert (cuda_mod._SHAPE, cuda_mod._WARPS, cuda_mod._IMMA_FORMATS) == before
    assert len(rows) == 7 and all(r["kernel_s"] > 0 for r in rows)
    names = {n for (n,), _ in seen}
    want = set()
    for r in rows:
        gu, dn = r["gate_up_rows_words"], r["down_rows_words"]
        want |= {f"gate_up<4,{gu[0]},{gu[1]},1>", f"mm<4,{dn[0]},{dn[1]},1>"}
    assert names == want
