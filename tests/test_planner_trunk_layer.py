"""The trunk priced from a measured decoder layer (planner/trunk_layer.py) and its use by planner/trunk.py."""

from __future__ import annotations

import pytest
from _solver_fixtures import st, toy_profile, toy_spec

from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.planner.budgets import resources_from_profile
from colibri_plan.planner.trunk import dense_read_bytes, device_figures, trunk_options
from colibri_plan.planner.trunk_layer import (
    LayerFigures,
    TrunkWork,
    kv_growth_s_per_byte,
    layer_trunk_seconds,
    lm_head_bytes,
)
from colibri_plan.quant import tensor_bytes

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}


def test_layer_trunk_seconds_by_hand():
    # the docstring's example: block 300 µs (attention 50 µs of it), hand-off 100 µs, the probe's bytes equal
    # the model's per-layer bytes, 10 layers (5 MoE), a 1 GB LM head at 100 GB/s, ops of 5 µs, context = c0
    lay = LayerFigures(block_s=300e-6, handoff_s=100e-6, attn0_s=50e-6, context_tokens=64,
                       probe_bytes=10_000_000, kv_bytes_per_token=4096)
    dense_bytes = 10 * 10_000_000 + 10**9
    d, a, rt = layer_trunk_seconds(lay, TrunkWork(dense_bytes, 10, 5, 64, 10 * 4096), 10**9, 500.0, 100.0,
                                   5e-6, ((0, 1.0),))
    assert d == pytest.approx(10 * 250e-6 + 0.01 + 10e-6 + 5 * 100e-6)
    assert a == pytest.approx(10 * 50e-6) and rt == pytest.approx(5 * 100e-6)
    # the model's layer holds 5 MB more than the probe's: read at 500 GB/s, 10 µs more a layer
    d2, _, _ = layer_trunk_seconds(lay, TrunkWork(dense_bytes + 10 * 5_000_000, 10, 5, 64, 10 * 4096), 10**9,
                                   500.0, 100.0, 5e-6, ((0, 1.0),))
    assert d2 - d == pytest.approx(10 * 10e-6)
    # c_dense scales the layers, the LM head and the ops, not the hand-off
    d3, _, _ = layer_trunk_seconds(lay, TrunkWork(dense_bytes, 10, 5, 64, 10 * 4096), 10**9, 500.0, 100.0,
                                   5e-6, ((0, 1.0),), c_dense=2.0)
    assert d3 == pytest.approx(2 * (10 * 250e-6 + 0.01 + 10e-6) + 5 * 100e-6)


def test_attention_grows_with_context_from_the_layer_probe_or_the_attention_section():
    # measured growth: 1 µs per 1000 extra tokens at the probe's 4096 B per token; the model has 8192 B
    lay = LayerFigures(300e-6, 0.0, 50e-6, 64, 0, 4096, growth_s=1e-9, path="host")
    _, a, rt = layer_trunk_seconds(lay, TrunkWork(0, 2, 2, 1064, 2 * 8192), 0, 1.0, 1.0, 0.0, ((0, 1.0),))
    assert a == pytest.approx(2 * (50e-6 + 1000 * 2e-9)) and rt == 0.0      # the host path has no round trip
    # no second context in the layer probe: the attention section's slope per byte
    slope = kv_growth_s_per_byte(((256, 10.0), (4096, 40.0)), 512)
    assert slope == pytest.approx((102.4 - 25.6) / 3840 / 1e9)
    assert kv_growth_s_per_byte(((0, 50.0),), 512) == pytest.approx(1 / 50e9)
    lay2 = LayerFigures(300e-6, 0.0, 50e-6, 64, 0, 4096)
    _, a2, _ = layer_trunk_seconds(lay2, TrunkWork(0, 2, 0, 1064, 2 * 8192), 0, 1.0, 1.0, 0.0,
                                   ((256, 10.0), (4096, 40.0)))
    assert a2 == pytest.approx(2 * (50e-6 + 1000 * 8192 * 2e-11))
    # from the reader's dict: growth = (long - short) / (long context - short context)
    row = {"path": "device", "fmt": "int8", "hidden": 2048, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128,
           "context_tokens": 64, "weight_bytes": 18_000_000, "block_s": 3e-4, "handoff_s": 1e-4,
           "attention_s": 5e-5, "long_context_tokens": 1024, "attention_long_s": 5e-5 + 960e-9}
    f = LayerFigures.from_reader(row)
    assert f.growth_s == pytest.approx(1e-9) and f.kv_bytes_per_token == 8 * 4 * 128
    assert LayerFigures.from_reader(None) is None


def _layer_row(backend, path, block, handoff, attn, weight_bytes):
    return {"backend": backend, "device_index": 0, "device_name": "toy", "path": path, "fmt": "int4",
            "hidden": 2048, "n_heads": 16, "n_kv_heads": 4, "head_dim": 128, "context_tokens": 64,
            "layers": 4, "weight_bytes": weight_bytes, "block_seconds": st(block), "moe_layer_seconds":
            st(block + handoff), "handoff_seconds": st(handoff), "attention_seconds": st(attn)}


def test_options_are_priced_from_the_measured_layer_when_the_profile_has_one():
    spec = toy_spec(hidden=2048, inter=1024, dense_params=50_000_000)
    prof = toy_profile(gpus=[GPU])
    res = resources_from_profile(prof, spec, {"cuda:0": 10**9})
    before = trunk_options(device_figures(prof, res, spec, "int4", Coefficients()), spec, "int4", 64,
                           {"cuda:0": 10**9}, Coefficients())
    dense = dense_read_bytes(spec, "int4")
    lm = lm_head_bytes(spec, "int4")
    per_layer = (dense - lm) // spec.n_layers
    prof.doc["trunk_layer"] = [_layer_row("numpy", "host", 800e-6, 100e-6, 30e-6, per_layer),
                               _layer_row("cuda", "device", 400e-6, 300e-6, 60e-6, per_layer)]
    figs = device_figures(prof, res, spec, "int4", Coefficients())
    assert figs["cpu"].sources["layer"] == "profile trunk_layer (host path, int4)"
    assert figs["cuda:0"].sources["layer"] == "profile trunk_layer (device path, int4)"
    cpu, gpu = trunk_options(figs, spec, "int4", 64, {"cuda:0": 10**9}, Coefficients())
    # 4 layers, 3 MoE; context = the probe's 64: no growth. CPU: LM head at the CPU's 20 GB/s, no op cost
    assert cpu.dense_s == pytest.approx(4 * 770e-6 + lm / 20e9 + 3 * 100e-6, rel=1e-3)
    assert (cpu.attention_s, cpu.roundtrip_s) == (pytest.approx(4 * 30e-6), 0.0)
    # the GPU: its LM head at its 60 GB/s, final norm + logits at the 8 µs default op, hand-offs in dense
    assert gpu.dense_s == pytest.approx(4 * 340e-6 + lm / 60e9 + 2 * 8e-6 + 3 * 300e-6, rel=1e-3)
    assert gpu.roundtrip_s == pytest.approx(3 * 300e-6) and gpu.attention_s == pytest.approx(4 * 60e-6)
    assert gpu.dense_s > before[1].dense_s           # the formula missed the host work between the ops
    assert tensor_bytes("int4", spec.vocab_size, spec.hidden_size) == lm


def test_experts_on_the_trunks_own_gpu_need_no_transfer():
    from colibri_plan.planner.costmodel import GpuResource, transfer_seconds
    from colibri_plan.planner.make import make_plan
    from colibri_plan.planner.options import SolveOptions

    g = GpuResource("cuda:0", 100.0, 25.0, 25.0, link_latency_s=10e-6)
    assert transfer_seconds(g, 8192) == pytest.approx(2 * 8192 / 25e9 + 2 * 10e-6)
    assert transfer_seconds(GpuResource("cuda:0", 100.0, 25.0, 25.0, holds_trunk=True), 8192) == 0.0
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": 2_300_000_000}], ram_available_bytes=3 * 10**9)
    on_cpu, _, _ = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="cpu"))
    on_gpu, _, setup = make_plan(prof, spec, None,
                                 SolveOptions(ram="2", context_tokens=100, trunk="cuda:0"))
    assert on_cpu.doc["predicted"]["terms"]["transfer_s"] > 0          # the GPU holds experts of layers
    assert on_gpu.doc["predicted"]["terms"]["transfer_s"] == 0.0
    assert [g.holds_trunk for g in setup.res.gpus] == [True]
