"""Trunk probe (profiler/trunk_probe.py): dense GEMV, device ops and decode attention through the d_* ops,
on the host backends (and the OpenCL / Vulkan CPU devices where installed), at tiny shapes."""

from __future__ import annotations

import time

import numpy as np
import pytest

from colibri_plan.formats.profile import MachineProfile
from colibri_plan.profiler import trunk_probe as tp
from colibri_plan.profiler.machine import list_all_devices
from colibri_plan.profiler.trunk_shapes import host_device, model_dense_shapes, tiled_weight
from colibri_plan.quant import dequantize, quantize, tensor_bytes

TINY = tp.TrunkSettings(shapes=((64, 128), (128, 64)), formats=("int8", "int4", "bf16", "f32"),
                        contexts=(16, 64), n_heads=4, n_kv_heads=2, head_dim=16, hidden=256, repetitions=3,
                        budget_s=300.0, chain_s=0.002,  # tiny: the budget never binds (a JIT may)
                        layer=tp.LayerGeometry(256, 4, 2, 16, 8, 2, "tiny"))


def _device(backend: str) -> dict:
    devs, skipped = list_all_devices([backend])
    if not devs:
        pytest.skip(f"{backend} has no device here: {skipped[0]['reason'] if skipped else 'none listed'}")
    return devs[0]


@pytest.mark.parametrize("backend", ["numpy", "cpu", "opencl", "vulkan", "cuda"])
def test_probe_returns_well_formed_plausible_sections(backend):
    dev = _device(backend)
    got, skipped = tp.probe_trunk_device(dev, TINY)
    supported = [f for f in TINY.formats if f in dev["formats"]]
    # every tiny figure fits the budget and the memory; only formats without kernels are left out
    assert [s for s in skipped if "do not implement" not in s["reason"]] == []
    assert len(skipped) == (len(supported) < len(TINY.formats)) and "int8" in supported
    gemv = got["dense_gemv"]
    assert sorted((e["fmt"], e["out_features"], e["in_features"]) for e in gemv) == sorted(
        (f, o, i) for f in supported for o, i in TINY.shapes)
    for e in gemv:
        assert (e["backend"], e["device_index"], e["tokens"]) == (backend, dev["index"], 1)
        assert e["device_name"] == dev["name"]
        assert e["weight_bytes"] == tensor_bytes(e["fmt"], e["out_features"], e["in_features"])
        s, g = e["seconds"], e["weight_gbps"]
        assert 0 < s["min"] <= s["median"] <= s["max"] and s["median"] < 0.5  # [128, 64]: well under 1 s
        assert s["repetitions"] == g["repetitions"] == 3
        # rates are bytes / seconds of the same repetitions: the fastest repetition is the top rate
        assert g["max"] == pytest.approx(e["weight_bytes"] / s["min"] / 1e9)
        assert g["median"] == pytest.approx(e["weight_bytes"] / s["median"] / 1e9)
    (ops,) = got["device_ops"]
    assert ops["roundtrip_bytes"] == 2 * 4 * 256 and ops["hidden"] == 256
    assert 0 < ops["op_seconds"]["median"] < 0.1 and 0 < ops["roundtrip_seconds"]["median"] < 0.1
    att = got["attention"]
    assert [e["context_tokens"] for e in att] == [16, 64]
    for e in att:
        assert (e["n_heads"], e["n_kv_heads"], e["head_dim"]) == (4, 2, 16)
        assert e["kv_bytes"] == 2 * e["context_tokens"] * 2 * 16 * 4
        assert e["kv_gbps"]["median"] == pytest.approx(e["kv_bytes"] / e["seconds"]["median"] / 1e9)
        assert 0 < e["seconds"]["median"] < 0.5
    (lay,) = got["trunk_layer"]   # one whole layer, in the first supported format, on the device's path
    assert (lay["path"], lay["fmt"], lay["hidden"], lay["shape_source"]) == (
        "host" if backend in ("numpy", "cpu") else "device", "int8", 256, "tiny")
    assert lay["layers"] == 16 and lay["context_tokens"] == 64 < lay["long_context_tokens"]
    assert 0 < lay["attention_seconds"]["median"] < lay["block_seconds"]["median"] < 0.5
    # the entries are what a profile holds: validation accepts them
    from test_profiler_schema import toy_doc

    MachineProfile({**toy_doc(), **got})


def test_chain_timing_amortises_the_sync_per_call():
    calls = {"step": 0, "finish": 0}

    def step():
        calls["step"] += 1
        time.sleep(0.002)
        return calls["step"]

    def finish(_x):
        calls["finish"] += 1
        time.sleep(0.01)  # a slow sync, paid once per chain

    secs, n = tp.time_chain(step, finish, repetitions=3, budget_s=5.0, chain_s=0.1)
    assert len(secs) == 3 and 2 <= n <= 8
    # 2 ms per call plus the 10 ms sync spread over n calls (sleep overshoots on a busy host)
    assert all(0.002 + 0.01 / n <= s < 0.002 + 0.01 / n + 0.02 for s in secs)
    assert calls["finish"] == 2 + 3 and calls["step"] == 2 + 3 * n  # warm-up, sizing call, 3 chains


def test_budget_spent_leaves_figures_out_and_says_how_to_get_them():
    cfg = tp.TrunkSettings(**{**TINY.__dict__, "budget_s": 0.0})
    got, skipped = tp.probe_trunk_device(host_device(), cfg)
    assert got["dense_gemv"] == [] and got["attention"] == []
    assert len(got["device_ops"]) == 1  # one repetition at least, whatever the budget
    reasons = {s["what"]: s["reason"] for s in skipped}
    assert "--trunk-seconds" in reasons["dense_gemv"] and "int8 [64x128]" in reasons["dense_gemv"]
    assert "and 2 more" in reasons["dense_gemv"]  # 8 figures: 6 named, the rest counted
    assert "context 16, context 64" in reasons["attention"]


def test_memory_limit_scales_the_probe_down():
    cfg = tp.TrunkSettings(**{**TINY.__dict__, "formats": ("int8", "f32")})
    # room for the int8 weights (8,448 B) but not the f32 ones (32,768 B), nor a K+V of 64 tokens
    got, skipped = tp.probe_trunk_device(host_device(), cfg, ram_available_bytes=4 * 12_000)
    assert {e["fmt"] for e in got["dense_gemv"]} == {"int8"}
    assert [e["context_tokens"] for e in got["attention"]] == [16]
    reasons = {s["what"]: s["reason"] for s in skipped}
    assert "over the 0.0114 MiB" in reasons["dense_gemv"]
    assert "f32 [64x128], f32 [128x64]" in reasons["dense_gemv"]
    assert "context 64" in reasons["attention"]
    assert tp.device_limit_bytes({"backend": "cuda", "free_memory_bytes": 1000, "total_memory_bytes": 4000},
                                 10**9, 0.25) == 250
    assert tp.device_limit_bytes({"backend": "cuda", "free_memory_bytes": None, "total_memory_bytes": 4000},
                                 10**9, 0.25) == 1000
    assert tp.device_limit_bytes({"backend": "cpu"}, 8000, 0.5) == 4000


def test_unsupported_format_is_skipped_with_the_reason(monkeypatch):
    dev = dict(host_device())
    from colibri_plan.backends import get_backend

    cls = get_backend(dev["backend"])
    monkeypatch.setattr(cls, "formats", tuple(f for f in cls.formats if f != "bf16"))
    got, skipped = tp.probe_trunk_device(dev, TINY)
    assert "bf16" not in {e["fmt"] for e in got["dense_gemv"]} and got["dense_gemv"]
    assert any(s["what"] == "dense_gemv" and "do not implement bf16" in s["reason"] for s in skipped)


def test_a_device_that_fails_to_open_is_skipped():
    bad = {"backend": "numpy", "index": 7, "name": "nothing"}
    got, skipped = tp.probe_trunk([bad], TINY)
    assert got == {"dense_gemv": [], "device_ops": [], "attention": [], "trunk_layer": []}
    assert skipped[0]["what"] == "trunk" and "device index 7" in skipped[0]["reason"]


def test_tiled_weight_is_valid_and_repeats_its_block():
    for fmt in ("int8", "int4", "int4-g64", "bf16", "f32"):
        w = tiled_weight(fmt, 150, 96)
        assert w.nbytes == tensor_bytes(fmt, 150, 96)
        dense = dequantize(w)  # [150, 96]
        assert np.array_equal(dense[64:128], dense[:64]) and np.array_equal(dense[128:], dense[:22])
        assert np.std(dense[:64]) > 0.1
    block = np.random.default_rng(0).standard_normal((64, 96), np.float32)
    assert np.array_equal(tiled_weight("int8", 64, 96).data, quantize(block, "int8").data)


def test_model_dense_shapes_gqa_and_mla():
    from colibri_plan.engine.fixture import FixtureConfig as Fx
    from colibri_plan.families import arch_from_config
    from colibri_plan.model.catalogue import find_entry

    arch = Fx.small(heads=4, kv_heads=2).arch()  # GQA: H 256, 4 x 32 query, 2 x 32 kv, vocab 512
    assert model_dense_shapes(arch, "fx") == [(128, 256, "fx q_proj"), (64, 256, "fx k_proj"),
                                              (256, 128, "fx o_proj"), (512, 256, "fx lm_head")]
    mla = arch_from_config(find_entry("deepseek-v3")["config"], plan_only=True)
    shapes = {s: (o, i) for o, i, s in model_dense_shapes(mla, "ds")}
    assert shapes["ds q_a_proj"] == (1536, 7168) and shapes["ds q_b_proj"] == (128 * 192, 1536)
    assert shapes["ds kv_a_proj"] == (512 + 64, 7168) and shapes["ds kv_b_proj"] == (128 * 256, 512)
    assert shapes["ds o_proj"] == (7168, 128 * 128) and shapes["ds lm_head"] == (129280, 7168)
    assert shapes["ds shared_expert gate/up"] == (2048, 7168) and shapes["ds dense_mlp down"] == (7168, 18432)


def test_a_first_call_that_compiles_does_not_spend_the_budget(monkeypatch):
    """A kernel's first call compiling for a second (NVRTC on a fresh GPU host) must not leave a short
    budget one dense shape measured: that first call runs off the budget, the other shape is measured
    too. The attention's first context likewise."""
    from colibri_plan.backends import get_backend

    dev = host_device()
    cls = get_backend(dev["backend"])
    seen: set = set()

    def slow_first(name, fn):
        def wrapped(*a, **k):
            if name not in seen:
                seen.add(name)
                time.sleep(1.0)   # the compile
            return fn(*a, **k)
        return wrapped

    opened = cls.open.__func__

    def open_slow(c, index):
        be = opened(c, index)
        be.d_matmul = slow_first("mm", be.d_matmul)   # the instance's ops, as the probe calls them
        be.d_attention = slow_first("att", be.d_attention)
        return be

    monkeypatch.setattr(cls, "open", classmethod(open_slow))
    cfg = tp.TrunkSettings(**{**TINY.__dict__, "formats": ("int8",), "budget_s": 0.6, "repetitions": 1})
    got, skipped = tp.probe_trunk_device(dev, cfg)
    assert sorted((e["out_features"], e["in_features"]) for e in got["dense_gemv"]) == [(64, 128), (128, 64)]
    assert [e["context_tokens"] for e in got["attention"]] == [16, 64]
    assert seen == {"mm", "att"}
