"""The backends' shared parts (``staging``, ``pools``, ``batched``, ``programs``) and the timed calls of
``base``: staging, grow-only work buffers, replays, cache files, and the batched expert FFN's grouping."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends import batched, get_backend, pools, programs, staging
from colibri_plan.backends.base import silu_mul_ref


def test_stage_rows_pads_with_zeros_and_stacks():
    xs = [np.full((2, 3), 1.0, np.float32), np.full((1, 3), 2.0, np.float32)]
    out = staging.stage_rows(xs, 5, np.full((3, 5), np.nan, np.float32))
    np.testing.assert_array_equal(out, [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [2, 2, 2, 0, 0]])
    assert batched.token_offsets([2, 1, 4]) == [0, 2, 3, 7]


def test_pack_places_inputs_at_aligned_offsets():
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.full(5, 7.0, np.float32)
    out, offs = staging.pack((a, b))
    assert offs == [0, 8] and out.size == 13 and out.dtype == np.float32  # b at the 16-byte boundary after a
    np.testing.assert_array_equal(out[0:6], a.ravel())
    np.testing.assert_array_equal(out[8:13], b)
    got = []
    view, offs2 = staging.pack((b,), lambda n: got.append(n) or np.zeros(n, np.float32))
    assert got == [5] and offs2 == [0] and view.tolist() == [7.0] * 5


def test_copy_in_chunks_moves_every_byte():
    src, dst, stage = np.arange(1000, dtype=np.uint16), bytearray(2000), np.zeros(300, np.uint8)

    def put(off, n):
        dst[off:off + n] = stage[:n].tobytes()
    staging.copy_in_chunks(src, stage, put)
    assert bytes(dst) == src.tobytes()


def test_work_buffers_grow_only_and_release_the_old_one():
    made, released, checked = [], [], []
    wb = pools.WorkBuffers(lambda name, n: made.append((name, n)) or len(made), released.append,
                        grow=lambda n: 2 * n, before_grow=lambda name, n: checked.append(n))
    assert wb.get("x", 10) == 1 and wb.get("x", 20) == 1 and made == [("x", 20)]
    assert wb.get("x", 21) == 2 and released == [1] and checked == [10, 21]
    wb.clear()
    assert released == [1, 2]


def test_replays_are_lru_bounded_and_capture_on_second_sight():
    dropped = []
    r = pools.Replays(2, dropped.append)
    for k in "abc":
        r.put(k, k.upper())
    assert dropped == ["A"] and len(r) == 2 and r.get("b") == "B"
    r.put("d", "D")  # "c" is now the least recently used
    assert dropped == ["A", "C"]
    r.drop(lambda v: v == "D")
    assert dropped == ["A", "C", "D"] and len(r) == 1
    assert not r.seen_before("k") and r.seen_before("k")


def test_cache_files_are_checksummed(tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_PLAN_CACHE_DIR", str(tmp_path))
    path = programs.cache_file("opencl", "device", "driver 1", "source")
    assert path.parent == tmp_path / "opencl"
    assert path != programs.cache_file("opencl", "device", "driver 2", "source")  # a driver update: new file
    assert programs.read_cache_file(path, b"TESTMAG1") == (b"", "absent")
    assert programs.write_cache_file(path, b"TESTMAG1", b"blob")
    assert programs.read_cache_file(path, b"TESTMAG1") == (b"blob", "loaded")
    path.write_bytes(path.read_bytes()[:-1])  # torn
    assert programs.read_cache_file(path, b"TESTMAG1")[1].startswith("corrupt")
    monkeypatch.delenv("COLIBRI_PLAN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert programs.cache_dir("vulkan") == tmp_path / "xdg" / "colibri-plan" / "vulkan"


def _usable(name):
    cls = get_backend(name)
    return cls if cls.unavailable_reason() is None and cls.list_devices() else None


@pytest.mark.parametrize("name", ["opencl", "vulkan", "cuda", "metal"])
def test_mixed_batches_run_per_expert_and_timed_calls(name, tmp_path, monkeypatch):
    monkeypatch.setenv("COLIBRI_PLAN_CACHE_DIR", str(tmp_path))
    cls = _usable(name)
    if cls is None:
        pytest.skip(f"{name}: {get_backend(name).unavailable_reason() or 'no device'}")
    rng = np.random.default_rng(0)
    H, I = 70, 33
    fmts = [("int4", "int4", "int8"), ("int4-g32", "int4-g32", "int4-g32"), ("f16", "bf16", "f32")]
    qts = [tuple(quant.quantize(rng.standard_normal(s, dtype=np.float32) / 4, f)
                 for f, s in zip(fs, ((I, H), (I, H), (H, I)))) for fs in fmts]
    xs = [rng.standard_normal((T, H), dtype=np.float32) for T in (1, 3, 2)]
    with cls.open(0) as be:
        experts = [be.upload_expert(*q) for q in qts]
        ys = be.expert_ffn(xs, experts)
        for x, (g, u, d), y in zip(xs, qts, ys):
            ref = quant.matmul_ref(silu_mul_ref(quant.matmul_ref(x, g), quant.matmul_ref(x, u)), d)
            assert y.shape == (x.shape[0], H) and np.abs(y - ref).max() <= 5e-4 * np.abs(ref).max()
        secs = be.time_expert_ffn(xs, experts, repeats=2)
        assert len(secs) == 2 and all(s > 0 for s in secs)
        be.timing = True
        be.matmul(xs[0], experts[0].gate)
        assert be.last_device_seconds == be.last_gpu_seconds()  # None where not measured
