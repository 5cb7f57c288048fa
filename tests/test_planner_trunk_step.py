"""The replayed decode step's pricing (colibri_plan/planner/trunk_step.py): hand-checked figures, the
in-replay expert rates, and a profile without ``step_graph`` pricing exactly as before."""

from __future__ import annotations

import copy

import pytest
from _solver_fixtures import st, toy_profile, toy_spec

from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.planner.budgets import resources_from_profile
from colibri_plan.planner.compute import mapped_expert_seconds
from colibri_plan.planner.costmodel import GpuResource
from colibri_plan.planner.path_rows import gpu_expert_seconds
from colibri_plan.planner.trunk import dense_read_bytes, device_figures, trunk_options
from colibri_plan.planner.trunk_layer import lm_head_bytes
from colibri_plan.planner.trunk_step import StepFigures, replays_step, step_trunk_seconds

GPU = {"gbps": 60.0, "free_bytes": 4 * 10**9}
EXPERT_B = 4_732_928        # one 2048 x 768 int8 expert (gate, up, down), bytes


def test_all_vram_24_layers_by_hand():
    # fixed 100 us, layer 105 us of which 8 experts at 2000 GB/s: 8 * 4.733 MB / 2e12 = 18.93 us
    step = StepFigures(105e-6, 100e-6, 82, 8, EXPERT_B, 10**9, 2000.0)
    dense, attn, rt = step_trunk_seconds(step, 24, 0, 82, 1024, 100.0, 0.0, Coefficients())
    assert dense == pytest.approx(100e-6 + 24 * (105e-6 - 8 * EXPERT_B / 2e12))
    assert (attn, rt) == (0.0, 0.0)
    # the placement adds the 24 x 8 VRAM selections back at the replay's rate: 100 + 24 x 105 us
    gpu = GpuResource("cuda:0", matmul_gbps=60.0, step_expert_gbps=2000.0)
    total = dense + 24 * 8 * gpu_expert_seconds(gpu, EXPERT_B, Coefficients())
    assert total == pytest.approx(2.62e-3)
    # eager rate without the step figure: 4.733 MB / 60 GB/s
    assert gpu_expert_seconds(GpuResource("cuda:0", 60.0), EXPERT_B, Coefficients()) == pytest.approx(
        EXPERT_B / 60e9)


def test_attention_growth_beyond_the_probe_and_extra_layer_bytes():
    step = StepFigures(105e-6, 100e-6, 82, 8, EXPERT_B, 1_000_000, 2000.0)
    c = Coefficients()
    # 1082 tokens: 1000 beyond the probe's 82, 1024 B each at 1 GB/s = 1.024 ms; 2 MB extra per layer
    # over the probe's 1 MB at 2000 GB/s = 0.5 us a layer; round trip 30 us passes through
    dense, attn, rt = step_trunk_seconds(step, 2, 3_000_000, 1082, 1024, 1.0, 30e-6, c)
    assert attn == pytest.approx(1.024e-3)
    assert dense == pytest.approx(100e-6 + 2 * (105e-6 - 8 * EXPERT_B / 2e12) + 2 * 1e-6 + 30e-6)
    assert rt == 30e-6
    assert step_trunk_seconds(step, 2, 0, 40, 1024, 1.0, 0.0, c)[1] == 0.0   # shorter than the probe


def test_mapped_host_experts_inside_the_replay():
    # 8 pinned experts at 51.7 GB/s: 8 x 91.5 us = 732 us, the H200's 908.4 - 176.0 us
    gpu = GpuResource("cuda:0", 60.0, mapped_gbps=20.0, step_mapped_gbps=51.7)
    assert 8 * mapped_expert_seconds(gpu, EXPERT_B, Coefficients()) == pytest.approx(732.4e-6, rel=2e-3)
    eager = GpuResource("cuda:0", 60.0, mapped_gbps=20.0)
    assert mapped_expert_seconds(eager, EXPERT_B, Coefficients()) == pytest.approx(EXPERT_B / 20e9)


def _profile(spec, with_step=True, hidden=None):
    prof = toy_profile(gpus=[GPU])
    row = {"backend": "cuda", "device_index": 0, "device_name": "toy gpu 0"}
    prof.doc["dense_gemv"] = [{**row, "fmt": "int4", "out_features": 2048, "in_features": 2048, "tokens": 1,
                               "seconds": st(1e-5), "weight_gbps": st(g)} for g in (300.0,)] + [
        {**row, "fmt": "int8", "out_features": 8192, "in_features": 2048, "tokens": 1, "seconds": st(1e-5),
         "weight_gbps": st(2000.0)}]
    if with_step:
        prof.doc["step_graph"] = [{
            **row, "fmt": "int4", "expert_fmt": spec.expert_format, "hidden": hidden or spec.hidden_size,
            "n_heads": 16, "n_kv_heads": 4, "head_dim": 128, "vocab": spec.vocab_size,
            "n_experts": spec.n_experts, "top_k": spec.top_k, "expert_width": spec.moe_intermediate_size,
            "expert_bytes": spec.expert_bytes(), "layer_trunk_bytes": 10**9, "context_tokens": 82,
            "layers_short": 2, "layers_long": 4, "step_short_seconds": st(310e-6),
            "step_long_seconds": st(520e-6), "layer_seconds": st(105e-6), "fixed_seconds": st(100e-6)}]
    return prof


def _options(prof, spec):
    res = resources_from_profile(prof, spec, {"cuda:0": 10**9})
    figs = device_figures(prof, res, spec, "int4", Coefficients())
    return figs, trunk_options(figs, spec, "int4", 82, {"cuda:0": 10**9}, Coefficients())


def test_a_matching_step_graph_prices_the_cuda_trunk_from_the_replay():
    spec = toy_spec(hidden=2048, inter=1024)
    figs, opts = _options(_profile(spec), spec)
    gpu = opts[1]
    assert figs["cuda:0"].step is not None and figs["cuda:0"].sources["step"] == "profile step_graph"
    n_moe = 3
    expert_s = spec.top_k * spec.expert_bytes() / 2000e9          # the fastest GEMV: 2000 GB/s
    assert gpu.dense_s == pytest.approx(100e-6 + 4 * (105e-6 - expert_s) + n_moe * figs["cuda:0"].roundtrip_s)
    assert gpu.attention_s == 0.0 and (gpu.step_expert_gbps, gpu.step_mapped_gbps) == (2000.0, 0.0)
    assert replays_step("cuda:0", (), spec) and not replays_step("metal:0", (), spec)
    assert dense_read_bytes(spec, "int4") - lm_head_bytes(spec, "int4") <= 0   # the toy: no extra bytes


@pytest.mark.parametrize("variant", ["no section", "other hidden"])
def test_without_a_matching_step_graph_the_trunk_prices_exactly_as_before(variant):
    spec = toy_spec(hidden=2048, inter=1024)
    _, before = _options(_profile(spec, with_step=False), spec)
    prof = _profile(spec, with_step=variant != "no section", hidden=4096)
    figs, after = _options(copy.deepcopy(prof), spec)
    assert figs["cuda:0"].step is None
    for a, b in zip(before, after):
        assert (a.dense_s, a.attention_s, a.roundtrip_s, a.step_expert_gbps) == (
            b.dense_s, b.attention_s, b.roundtrip_s, b.step_expert_gbps)
        assert a.seconds > 0
