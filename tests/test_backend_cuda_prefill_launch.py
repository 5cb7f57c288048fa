"""The launcher's choice of shaders/cuda/prefill.cu's tensor-core kernels (T > 1) and the shared memory it
gives them (each warp's cp.async ring of weights), on the simulated GPU of test_backend_cuda_sim.py (4 SMs,
227 KiB of shared memory a block). The kernels' arithmetic and rings are tests/test_backend_cuda_prefill.py
(host-compiled) and, on a GPU, the oracle."""

from __future__ import annotations

import pytest
from test_backend_cuda_prefill import STAGES, _dyn_bytes
from test_backend_cuda_sim import be  # noqa: F401 - the simulated GPU's backend fixture

from colibri_plan.backends import cuda as cuda_mod
from colibri_plan.backends._shared import kernel_format


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
        assert smem > 0  # GEMV: x; decode_imma.cu: x's limbs, rings; prefill.cu: rings
    assert cuda_mod._IMMA_FORMATS == {"int4"}
    for T, nt in ((8, 1), (9, 2)):
        fn = be._launcher("mm", "int8", 1, 64, 64, 256, 64, T)[0]
        assert fn.__name__.endswith(f",{cuda_mod._TC_R16['mm_tc']},{nt}>"), (T, fn.__name__)


@pytest.mark.parametrize("name, nm", [("mm", 1), ("mm_args", 1), ("gate_up", 2)])
def test_launcher_gives_the_tensor_core_kernels_their_rings(be, name, nm):  # noqa: F811 - the fixture
    """T > 1 (simulated GPU: 4 SMs, 227 KiB a block): the launcher gives each block _dyn_bytes at its warps
    and the kernel's 16-row subtiles, the bytes the host runs above fill without passing them, and compiles
    the kernel with its ring depth (-DTC_STAGES); the block fits with prefill.cu's static red."""
    tc = cuda_mod._TC[name]
    r16 = cuda_mod._TC_R16[tc]
    for fmt in ("int4", "int8", "int4-g64"):
        for T, nt in ((5, 1), (16, 2)):
            fn, grid, block, smem, _ = be._launcher(name, fmt, 3, 256, 250, 1024, 256, T)
            assert fn.__name__ == f"{tc}<{kernel_format(fmt)},{r16},{nt}>", fn.__name__
            items = 256 // (16 * r16) * -(-T // (8 * nt))
            # 16 warps per SM over the grid, 2..8 a block
            assert grid == (items, 3) and block == (32 * min(8, max(2, round(16 * 4 / (3 * items)))),)
            assert smem == _dyn_bytes(fmt, block[0] // 32, nm, r16, nt)
            assert smem + fn.shared_size_bytes <= 227 * 1024 and fn.shared_size_bytes == 4096 * nm * r16 * nt
    assert any(f"-DTC_STAGES={STAGES}" in k for k in be._fns if k.startswith(tc + "<"))


def test_launcher_fits_deep_rings_with_fewer_warps(be, monkeypatch):  # noqa: F811 - the fixture
    """A ring too deep for 8 warps (gate/up at 4 stages, 16 tokens: weights and two token tiles of
    activations, 64 KiB a warp in the group formats, 48 KiB per-row; 32 KiB of red) gets the warps that fit
    in 227 KiB, not a launch the GPU refuses; the kernel opts in to the bytes."""
    monkeypatch.setattr(cuda_mod, "_TC_WARPS", 8)
    monkeypatch.setattr(cuda_mod, "_TC_STAGES", 4)
    fn, _, block, smem, _ = be._launcher("gate_up", "int4-g64", 1, 256, 250, 1024, 256, 16)
    r16 = cuda_mod._TC_R16["gate_up_tc"]
    per_warp = _dyn_bytes("int4-g64", 1, 2, r16, 2, stages=4)
    assert block == (32 * ((227 * 1024 - 16384 * r16) // per_warp),)
    assert smem == _dyn_bytes("int4-g64", block[0] // 32, 2, r16, 2, stages=4) and smem > 48 * 1024
    assert fn.max_dynamic_shared_size_bytes == smem
    fn, _, block, _, _ = be._launcher("gate_up", "int4", 1, 256, 250, 1024, 256, 16)
    assert block == (32 * ((227 * 1024 - 16384 * r16) // _dyn_bytes("int4", 1, 2, r16, 2, stages=4)),)
