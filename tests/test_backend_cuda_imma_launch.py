"""The launcher's choice and grid for shaders/cuda/decode_imma.cu (1-token per-row int4 (int8) on integer
tensor cores), on the simulated GPU of test_backend_cuda_sim.py (4 SMs, 2 resident blocks, 227 KiB of
shared memory a block). The kernels' arithmetic is tests/test_backend_cuda_imma.py (host-compiled) and, on
a GPU, the oracle."""

from __future__ import annotations

import numpy as np
import pytest
from test_backend_cuda_sim import be, record_compiles  # noqa: F401 - the simulated GPU's backend fixture

from colibri_plan import quant
from colibri_plan.backends.base import silu_mul_ref
from colibri_plan.backends.cuda import launch as cuda_mod
from colibri_plan.backends.programs import kernel_format


@pytest.mark.parametrize("n_mats, rows, want_blocks", [
    (1, 320, 5),  # 10 tiles of 32 rows, 8 slots: 2 tiles a block, so 5 blocks (not 8 with 2 doing 2)
    (2, 320, 4),  # 4 slots a matrix: 3 tiles a block, 4 blocks
    (8, 2048, 1),  # 1 slot a matrix: one block streams all 64 tiles
    (1, 40, 2),  # 2 tiles (the second ragged), one each
])
def test_grid_is_one_wave_with_equal_tile_counts(be, n_mats, rows, want_blocks):  # noqa: F811
    fn, grid, block, smem, _ = be._launcher("mm", "int4", n_mats, rows, rows, 2048, rows, 1)
    assert fn.__name__ == f"mm_imma<4,{cuda_mod._IMMA_SHAPE['mm'][0]}>"
    assert grid == (want_blocks, n_mats) and block == (32 * cuda_mod._IMMA_SHAPE["mm"][1],)
    r16, warps = cuda_mod._IMMA_SHAPE["mm"]
    # x as four 8-bit limbs a column, then each warp's ring: stages x (2 r16 words of 16 bytes) x 32 lanes
    assert smem == 2048 * 4 + warps * cuda_mod._IMMA_STAGES * 2 * r16 * 16 * 32


def test_choice_by_tokens_format_and_shared_memory(be, monkeypatch):  # noqa: F811
    """T = 1 per-row int4 only (int8 when _IMMA_FORMATS lists it: the kernels take it, the int8 GEMV is
    faster); an x whose limbs would not fit in shared memory (with the kernel's static arrays) keeps the
    GEMV kernel; mm_args (the device trunk's matmuls) takes the same path."""
    name = lambda *a: be._launcher(*a)[0].__name__.split("<")[0]  # noqa: E731
    assert name("gate_up", "int4", 8, 64, 64, 256, 64, 1) == "gate_up_imma"
    assert name("gate_up", "int8", 8, 64, 64, 256, 64, 1) == "gate_up"
    monkeypatch.setattr(cuda_mod, "_IMMA_FORMATS", frozenset({"int4", "int8"}))
    be._launchers.clear()  # launch shapes are cached per call shape
    assert name("gate_up", "int8", 8, 64, 64, 256, 64, 2) == "gate_up_tc"
    assert name("gate_up", "int8", 8, 64, 64, 256, 64, 1) == "gate_up_imma"
    assert name("mm_args", "int4", 3, 64, 64, 256, 64, 1) == "mm_args_imma"
    assert name("mm", "int4-g32", 1, 64, 64, 256, 64, 1) == "mm"
    assert name("mm", "bf16", 1, 64, 64, 256, 64, 1) == "mm"
    assert name("mm", "int4", 1, 64, 64, 256, 64, 2) == "mm_tc"
    r16, warps = cuda_mod._IMMA_SHAPE["mm"]
    ring = warps * cuda_mod._IMMA_STAGES * 2 * r16 * 512
    static = cuda_mod._IMMA_STATIC_SMEM * r16 + 256
    fits = (227 * 1024 - static - ring) // 4 // 128 * 128  # largest in_pad that fits
    assert name("mm", "int8", 1, 64, 64, fits, 64, 1) == "mm_imma"
    assert name("mm", "int8", 1, 64, 64, fits + 128, 64, 1) == "mm"


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_expert_ffn_tables_reach_the_imma_kernels(be, fmt, monkeypatch):  # noqa: F811
    """A 1-token batch of 3 experts runs gate_up_imma then mm_imma (the simulated kernels compute each
    entry from its table with numpy), with the NVRTC options that set the launch bounds and the ring."""
    monkeypatch.setattr(cuda_mod, "_IMMA_FORMATS", frozenset({"int4", "int8"}))  # int8: its kernel path too
    seen = record_compiles(be, monkeypatch)
    H, I, rng = 256, 96, np.random.default_rng(11)
    qs = [[quant.quantize(rng.standard_normal(s, dtype=np.float32), fmt) for s in ((I, H), (I, H), (H, I))]
          for _ in range(3)]
    experts = [be.upload_expert(*q) for q in qs]
    xs = [rng.standard_normal((1, H), dtype=np.float32) for _ in experts]
    got = be.expert_ffn(xs, experts)
    for y, x, q in zip(got, xs, qs):
        g, u, d = (quant.dequantize(w).astype(np.float64) for w in q)
        ref = silu_mul_ref(x @ g.T, x @ u.T) @ d.T
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    kid = kernel_format(fmt)
    names = [n for (n,), _ in seen]
    assert f"gate_up_imma<{kid},{cuda_mod._IMMA_SHAPE['gate_up'][0]}>" in names
    assert f"mm_imma<{kid},{cuda_mod._IMMA_SHAPE['mm'][0]}>" in names
    want = (f"-DIM_MIN_BLOCKS={cuda_mod._IMMA_MIN_BLOCKS}", f"-DIM_STAGES={cuda_mod._IMMA_STAGES}")
    assert all(set(want) <= set(o) for (n,), o in seen if "imma" in n)


def test_static_shared_memory_counts_toward_the_opt_in(be, monkeypatch):  # noqa: F811
    """A launch whose dynamic shared memory alone is under 48 KiB but, with decode_imma.cu's static arrays,
    over it gets the opt-in attribute (a GPU refuses the launch otherwise): mm at R16 2 with 8 warps and a
    2-step ring is 32 KiB of ring plus 8 KiB of limbs for 2048 columns, and 8 KiB of its own."""
    monkeypatch.setattr(cuda_mod, "_IMMA_STAGES", 2)
    rng = np.random.default_rng(5)
    qt = quant.quantize(rng.standard_normal((64, 2048), dtype=np.float32), "int4")
    fn, _, _, smem, _ = be._launcher("mm", "int4", 1, 64, 64, 2048, 64, 1)
    assert smem < 48 * 1024 < smem + fn.shared_size_bytes
    assert fn.max_dynamic_shared_size_bytes == smem  # opted in (the simulated kernel asserts it at launch)
    x = rng.standard_normal((1, 2048), dtype=np.float32)
    ref = x.astype(np.float64) @ quant.dequantize(qt).astype(np.float64).T
    np.testing.assert_allclose(be.matmul(x, be.upload(qt)), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_opt_in_only_grows(be):  # noqa: F811
    """Two launch shapes of one compiled kernel: the larger one's opt-in stays when the smaller one is set
    up after it (a cached launch of the larger shape still runs)."""
    big = be._launcher("mm", "int4", 1, 64, 64, 8192, 64, 1)
    small = be._launcher("mm", "int4", 1, 64, 64, 2048, 64, 1)
    assert big[0] is small[0] and small[3] < big[3]
    assert big[0].max_dynamic_shared_size_bytes == big[3]


def test_changed_nvrtc_options_compile_anew(be, monkeypatch):  # noqa: F811
    """A kernel compiled under other NVRTC options (a benchmark's read-only build) is a different function,
    not the cached one: the compiled-function cache is keyed by the options as well as the instance."""
    seen = record_compiles(be, monkeypatch)
    first = be._launcher("mm", "int4-g32", 1, 64, 64, 256, 64, 1)[0]
    monkeypatch.setattr(cuda_mod, "_NVRTC_OPTIONS", cuda_mod._NVRTC_OPTIONS + ("-DCOLIBRI_READ_ONLY",))
    be._launchers.clear()
    second = be._launcher("mm", "int4-g32", 1, 64, 64, 256, 64, 1)[0]
    assert second is not first and len(seen) == 2 and "-DCOLIBRI_READ_ONLY" in seen[1][1]
