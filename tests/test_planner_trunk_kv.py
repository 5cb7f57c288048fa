"""What a GPU trunk's KV cache costs as the engine holds it (float32 on the device, MLA's latent rows too) and
the host's launches of the experts on the trunk's GPU, on toy numbers (planner/trunk.py, trunk_solve.py,
formats/plan_trunk.py)."""

from __future__ import annotations

import dataclasses

import pytest
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import FormatError
from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan_trunk import (
    DEVICE_KV_BYTES_PER_VALUE,
    SPEC_KV_BYTES_PER_VALUE,
    TrunkPlacement,
    check_trunk_budgets,
    device_kv_bytes_per_token,
    parse_trunk,
)
from colibri_plan.planner.budgets import resources_from_profile
from colibri_plan.planner.trunk import TrunkFigures, dense_read_bytes, device_figures, trunk_options

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}


def _options(spec, context=100):
    res = resources_from_profile(toy_profile(gpus=[GPU]), spec, {"cuda:0": 10**9})
    figs = device_figures(toy_profile(gpus=[GPU]), res, spec, "int4", Coefficients())
    return figs, trunk_options(figs, spec, "int4", context, {"cuda:0": 10**9}, Coefficients())


def test_the_shared_constant_is_the_engines_float32_cache():
    # the engine's device cache (engine/kv_device.py) reserves pages · 64 · 2 · layers · kv heads · dim · 4
    from colibri_plan.engine.kv_device import device_kv_bytes

    assert (SPEC_KV_BYTES_PER_VALUE, DEVICE_KV_BYTES_PER_VALUE) == (2, 4)
    layers, heads, dim = 4, 2, 64
    spec_bpt = 2 * layers * heads * dim * SPEC_KV_BYTES_PER_VALUE          # 2048 B: a bf16 cache
    assert device_kv_bytes_per_token(spec_bpt) == 4096
    assert device_kv_bytes(layers, heads, dim, 100) == 2 * 64 * device_kv_bytes_per_token(spec_bpt)


def test_gpu_and_cpu_trunk_kv_priced_at_the_engines_float32_caches():
    spec = toy_spec(hidden=2048, inter=1024)                 # kv_bytes_per_token 1024 (bf16)
    _, (cpu, gpu) = _options(spec)
    dense = dense_read_bytes(spec, "int4")
    assert cpu.kv_bytes == 100 * 2048 and cpu.kv_bytes_per_token == 2048   # the host cache, float32
    assert gpu.kv_bytes_per_token == 2048
    assert gpu.kv_bytes == 2 * 64 * 2048                      # 100 tokens = 2 pages of 64, float32
    assert gpu.vram_bytes == {"cuda:0": dense + 2 * 64 * 2048}
    assert gpu.ram_freed_bytes == dense + 100 * 2048          # what the RAM budget charged (host float32)


def test_a_packs_arch_spec_already_counts_float32():
    # fixture packs (and packs whose checkpoint spec could not be built) store a spec built from the arch
    # (formats.pack_index.spec_from_arch) at 4 bytes a value: the engine's device cache holds just that
    from colibri_plan.formats.plan_trunk import spec_kv_bytes_per_value

    assert spec_kv_bytes_per_value("pack: /p") == 4 and spec_kv_bytes_per_value("catalogue: x") == 2
    assert spec_kv_bytes_per_value(None) == 2
    assert device_kv_bytes_per_token(65536, "pack: /tmp/fixture") == 65536    # the H200 fixture's figure
    assert device_kv_bytes_per_token(65536, "gguf: /m.gguf") == 131072
    spec = dataclasses.replace(toy_spec(hidden=2048, inter=1024), source="pack: /tmp/toy")
    _, (cpu, gpu) = _options(spec)
    assert gpu.kv_bytes_per_token == cpu.kv_bytes_per_token == 1024 and gpu.kv_bytes == 2 * 64 * 1024


def test_mla_trunk_on_a_gpu_holds_attention_and_its_latent_cache_there():
    spec = dataclasses.replace(toy_spec(hidden=2048, inter=1024), family="deepseek_v3")
    _, (_, gpu) = _options(spec)
    gqa = dataclasses.replace(spec, family="qwen3_moe")
    _, (_, g_gqa) = _options(gqa)
    dense = dense_read_bytes(spec, "int4")
    assert gpu.kv_bytes == 2 * 64 * 2048                      # the device's float32 rows, whole pages
    assert gpu.vram_bytes == {"cuda:0": dense + 2 * 64 * 2048}
    assert gpu.ram_freed_bytes == dense + 100 * 2048          # the RAM budget gets trunk and KV back
    assert gpu.seconds == pytest.approx(g_gqa.seconds)        # priced as GQA: no host round trips
    assert gpu.roundtrip_s == pytest.approx(g_gqa.roundtrip_s)


def test_a_plan_whose_mla_cache_was_kept_in_ram_is_refused():
    t = TrunkPlacement("cuda:0", "int8", 1000, "cuda:0", 64, 64, 100, 6400, ())
    doc = {"trunk": t.to_dict(), "devices": [{"key": "cuda:0"}],
           "budgets": {"trunk_vram_bytes": {"cuda:0": 7400}, "vram_budget_bytes": {"cuda:0": 5}}}
    assert "host" not in doc["trunk"]["kv"]
    back = parse_trunk(doc, ["cuda:0"])
    assert back == t
    check_trunk_budgets(doc, back)                            # 7400 B taken = dense + KV
    with pytest.raises(FormatError, match="1000 B dense \\+ 6400 B KV"):
        check_trunk_budgets(dict(doc, budgets={"trunk_vram_bytes": {"cuda:0": 1000},
                                               "vram_budget_bytes": {"cuda:0": 5}}), back)
    old = {"trunk": dict(t.to_dict(), kv=dict(t.to_dict()["kv"], host=True)), "devices": [{"key": "cuda:0"}]}
    with pytest.raises(FormatError, match="an earlier version kept an MLA model's latent cache in RAM"):
        parse_trunk(old, ["cuda:0"])
    assert parse_trunk(dict(old, trunk=dict(old["trunk"], kv=dict(old["trunk"]["kv"], host=False))),
                       ["cuda:0"]) == t
    bad = {"trunk": dict(t.to_dict(), kv=dict(t.to_dict()["kv"], host="yes"))}
    with pytest.raises(FormatError, match="trunk.kv.host"):
        parse_trunk(bad, ["cuda:0"])


def test_trunk_gpu_option_carries_the_devices_op_seconds_as_expert_call():
    spec = toy_spec(hidden=2048, inter=1024)
    figs, (cpu, gpu) = _options(spec)
    assert cpu.expert_call_s == 0.0
    assert gpu.expert_call_s == figs["cuda:0"].op_s > 0
    fig = TrunkFigures("cuda:0", 100.0, 17e-6, 0.0, ((0, 50.0),), True)
    assert fig.op_s == 17e-6
