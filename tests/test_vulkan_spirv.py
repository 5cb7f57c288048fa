"""Vulkan backend specifics: committed SPIR-V, the pipeline cache file, out-of-memory and buffer limits.

Numerical agreement of every op and format with numpy lives in the cross-backend oracle; here only what
is particular to Vulkan. Tests that need a device skip with the reason when none is usable (lavapipe
counts: ``apt-get install mesa-vulkan-drivers libvulkan1``).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from colibri_plan.backends import get_backend
from colibri_plan.backends.base import silu_mul_ref
from colibri_plan.backends.vulkan import util as vu
from colibri_plan.errors import DeviceOutOfMemoryError, UnsupportedError
from colibri_plan.quant import matmul_ref, quantize

SHADERS = importlib.resources.files("colibri_plan.shaders") / "vulkan"
COMPS = sorted(p.name for p in SHADERS.iterdir() if p.name.endswith(".comp"))


def test_every_shader_has_its_spirv():
    spvs = sorted(p.name for p in SHADERS.iterdir() if p.name.endswith(".spv"))
    assert COMPS, "no .comp shaders found"
    assert spvs == [c.replace(".comp", ".spv") for c in COMPS]


@pytest.mark.parametrize("comp", COMPS)
def test_committed_spirv_equals_fresh_compile(comp, tmp_path):
    glslang = shutil.which("glslangValidator")
    if glslang is None:
        pytest.skip("glslangValidator not found (apt-get install glslang-tools)")
    out = tmp_path / "fresh.spv"
    cmd = [glslang, "-V", "--target-env", "vulkan1.1", "--quiet", str(SHADERS / comp), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    committed = (SHADERS / comp.replace(".comp", ".spv")).read_bytes()
    assert out.read_bytes() == committed, f"{comp} changed: run scripts/compile_shaders.sh, commit the .spv"


def test_missing_loader_is_reported(monkeypatch):
    class NoLoader:  # what `import vulkan` does without libvulkan.so.1
        def find_spec(self, name, path=None, target=None):
            if name == "vulkan":
                raise OSError("cannot find libvulkan.so.1")
            return None

    monkeypatch.delitem(sys.modules, "vulkan", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NoLoader(), *sys.meta_path])
    monkeypatch.setattr(vu, "_PROBE", [])
    cls = get_backend("vulkan")
    assert "libvulkan.so.1" in cls.unavailable_reason()
    assert not cls.is_available() and cls.list_devices() == []


@pytest.fixture
def vk_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cls = get_backend("vulkan")
    reason = cls.unavailable_reason()
    if reason is not None:
        pytest.skip(f"vulkan unavailable: {reason}")
    be = cls.open(0)
    yield be
    be.close()


def test_pipeline_cache_is_written_and_read_back(vk_backend):
    be, rng = vk_backend, np.random.default_rng(1)
    assert be.pipeline_cache_state == "absent"
    w = be.upload(quantize(rng.standard_normal((8, 40)).astype(np.float32), "int4"))
    be.matmul(rng.standard_normal((1, 40)).astype(np.float32), w)  # creates a pipeline
    path = be.pipeline_cache_path
    be.close()
    raw = path.read_bytes()
    assert raw[:8] == vu.CACHE_MAGIC and len(raw) >= 40 + 32  # our header + the driver's 32-byte header
    again = type(be).open(0)
    try:
        assert again.pipeline_cache_state == "loaded"
        assert again._cache_blob == raw[40:]
    finally:
        again.close()


def test_corrupt_pipeline_cache_is_replaced(vk_backend):
    be = vk_backend
    path = be.pipeline_cache_path
    be.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    for junk, why in [(b"garbage", "checksum"), (None, "header")]:
        if junk is None:  # a well-formed file whose driver header names another device
            blob = (32).to_bytes(4, "little") + (1).to_bytes(4, "little") + b"\xff" * 24 + b"x" * 16
            junk = vu.CACHE_MAGIC + hashlib.sha256(blob).digest() + blob
        path.write_bytes(junk)
        be2 = type(be).open(0)
        try:
            assert be2.pipeline_cache_state.startswith("corrupt") and why in be2.pipeline_cache_state
            be2.rmsnorm(np.ones((1, 5), np.float32), np.ones(5, np.float32))
        finally:
            be2.close()
        assert vu.read_cache(path, be2.facts)[1] == "loaded"  # rewritten valid on close


def test_upload_over_capacity_is_typed_and_leaves_nothing(vk_backend, monkeypatch):
    be, rng = vk_backend, np.random.default_rng(2)
    keep = be.upload(quantize(rng.standard_normal((16, 64)).astype(np.float32), "int8"))
    big = quantize(rng.standard_normal((64, 64)).astype(np.float32), "f32")
    monkeypatch.setattr(be, "_capacity", keep.nbytes + big.nbytes - 1)
    with pytest.raises(DeviceOutOfMemoryError) as err:
        be.upload(big)
    assert err.value.requested_bytes == big.nbytes and err.value.held_bytes == keep.nbytes
    assert be.memory_used() == keep.nbytes and len(be._live) == 1


def test_driver_out_of_memory_frees_the_blocks_already_made(vk_backend, monkeypatch):
    be, rng = vk_backend, np.random.default_rng(3)
    qt = quantize(rng.standard_normal((40, 128)).astype(np.float32), "int4")
    monkeypatch.setattr(be, "max_buffer_bytes", 16 * 68 + 16)  # 16 rows of 64 B + 4 B scale per buffer
    made, released, real_buffer, real_release = [], [], be._buffer, be._release

    def failing_buffer(size, role):
        if role == "w" and len(made) == 2:  # the third block does not fit
            raise be.vk.VkErrorOutOfDeviceMemory("simulated")
        b = real_buffer(size, role)
        if role == "w":
            made.append(b)
        return b

    monkeypatch.setattr(be, "_buffer", failing_buffer)
    monkeypatch.setattr(be, "_release", lambda b: (released.append(b), real_release(b)))
    with pytest.raises(DeviceOutOfMemoryError) as err:
        be.upload(qt)
    assert err.value.requested_bytes == qt.nbytes and err.value.held_bytes == 0
    assert len(made) == 2 and all(b in released for b in made)
    assert be.memory_used() == 0 and not be._live


def test_weights_over_the_buffer_limit_are_split_into_row_blocks(vk_backend, monkeypatch):
    be, rng = vk_backend, np.random.default_rng(4)
    assert 0 < be.max_buffer_bytes <= be.facts.max_range  # lavapipe: 128 MiB
    monkeypatch.setattr(be, "max_buffer_bytes", 4096)
    qt = quantize(rng.standard_normal((75, 300)).astype(np.float32), "int4-g32")  # 192 + 48 B per row
    w = be.upload(qt)
    assert len(w.payload.parts) == 5 and all(p.b.size <= 4096 for p in w.payload.parts)
    x = rng.standard_normal((2, 300)).astype(np.float32)  # activations obey the limit too
    ref = matmul_ref(x, qt)
    np.testing.assert_allclose(be.matmul(x, w), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    with pytest.raises(UnsupportedError, match="largest buffer"):
        be.upload(quantize(rng.standard_normal((2, 2048)).astype(np.float32), "f32"))  # one row: 8 KiB


def test_expert_batches_over_one_dispatch_and_replays_stay_fresh(vk_backend):
    """More experts than one dispatch holds (8), uneven tokens, replayed command buffers, and a freed
    weight whose id is reused must all give fresh, correct results."""
    be, rng = vk_backend, np.random.default_rng(5)
    H, I = 40, 24
    shapes = ((I, H), (I, H), (H, I))  # gate, up, down
    qts = [[quantize(rng.standard_normal(s).astype(np.float32) * 0.2, "int4") for s in shapes]
           for _ in range(10)]
    experts = [be.upload_expert(*q) for q in qts]
    for _ in range(2):  # the second call replays the recorded command buffer with new activations
        xs = [rng.standard_normal((t, H)).astype(np.float32) for t in (1, 3, 1, 1, 2, 1, 1, 9, 1, 4)]
        for x, q, y in zip(xs, qts, be.expert_ffn(xs, experts)):
            h = silu_mul_ref(matmul_ref(x, q[0]), matmul_ref(x, q[1]))
            ref = matmul_ref(h, q[2])
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    x = rng.standard_normal((1, H)).astype(np.float32)
    be.matmul(x, experts[0].gate)
    be.free(experts[0].gate)
    other = quantize(rng.standard_normal((I, H)).astype(np.float32), "int4")
    w = be.upload(other)
    np.testing.assert_allclose(be.matmul(x, w), matmul_ref(x, other), rtol=1e-4, atol=1e-4)


def test_staged_uploads_match_direct_ones(vk_backend, monkeypatch):
    """Discrete GPUs without a host-visible VRAM type upload through a staging buffer and a copy."""
    be, rng = vk_backend, np.random.default_rng(6)
    qt = quantize(rng.standard_normal((50, 70)).astype(np.float32), "int2")
    x = rng.standard_normal((1, 70)).astype(np.float32)
    direct = be.upload(qt)
    monkeypatch.setattr(be, "weight_memory", "staged")
    staged = be.upload(qt)
    np.testing.assert_array_equal(be.matmul(x, staged), be.matmul(x, direct))
    ref = matmul_ref(x, qt)
    np.testing.assert_allclose(be.matmul(x, staged), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_device_time_of_the_last_call_is_within_its_wall_time(vk_backend):
    be, rng = vk_backend, np.random.default_rng(7)
    w = be.upload(quantize(rng.standard_normal((256, 512)).astype(np.float32), "int4"))
    x = rng.standard_normal((1, 512)).astype(np.float32)
    be.matmul(x, w)
    t0 = time.perf_counter()
    be.matmul(x, w)
    wall = time.perf_counter() - t0
    gpu = be.last_gpu_seconds()
    if gpu is None:
        pytest.skip(f"{be.device.name}: its compute queue has no timestamps")
    assert 0 < gpu <= wall
