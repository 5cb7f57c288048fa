"""What a KV cache in RAM costs as the engine holds it (a CPU trunk's: the trunk's DeviceKVCache /
DeviceLatentCache on a host backend, float32), priced with formats/plan_trunk.py ``HOST_KV_BYTES_PER_VALUE``
(planner/budgets.py, planner/trunk.py). Every figure below is worked out by hand in its comment."""

from __future__ import annotations

import dataclasses

import numpy as np
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.backends import get_backend
from colibri_plan.engine.kv_device import DeviceKVCache, DeviceLatentCache
from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan_trunk import HOST_KV_BYTES_PER_VALUE, host_kv_bytes_per_token
from colibri_plan.planner.budgets import ram_budget, ram_kv_bytes_per_token, resources_from_profile
from colibri_plan.planner.make import build_setup
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.trunk import device_figures, trunk_options


def _cache_bytes(arrays) -> int:
    return sum(a.buf.nbytes for a in {id(a): a for a in arrays}.values())  # each array once


def _host():
    return get_backend("numpy").open(0)


def test_gqa_host_cache_bytes_per_token_match_the_planners_price():
    # 3 layers, 2 kv heads of dim 8: a bf16 spec counts 2 (K, V) · 3 · 2 · 8 · 2 B = 192 B per token;
    # the engine's float32 cache holds 2 · 3 · 2 · 8 · 4 B = 384 B
    cache = DeviceKVCache(_host(), n_layers=3, n_kv_heads=2, head_dim=8, context_tokens=10)
    assert HOST_KV_BYTES_PER_VALUE == 4 and cache.k[0].buf.dtype.itemsize == HOST_KV_BYTES_PER_VALUE
    assert host_kv_bytes_per_token(192) == 384
    assert host_kv_bytes_per_token(192, "gguf: /m.gguf") == 384
    assert host_kv_bytes_per_token(192, "catalogue: m") == 384
    assert host_kv_bytes_per_token(384, "pack: /tmp/fixture") == 384      # an arch-built spec is float32
    assert _cache_bytes(cache.k + cache.v) == 64 * 384                    # one 64-token page of capacity


def test_mla_latent_cache_bytes_per_token_match_the_planners_price():
    # 2 layers, kv_lora_rank 16 + rope dim 4: a bf16 spec counts 2 · (16 + 4) · 2 B = 80 B per token;
    # the engine's float32 latent pages hold 2 · (16 + 4) · 4 B = 160 B
    be = _host()
    cache = DeviceLatentCache(be, n_layers=2, rope_dim=4, rank=16, context_tokens=1, page_tokens=64)
    for layer in range(2):
        cache.append(layer, be.d_put(np.ones((1, 4), np.float32)), be.d_put(np.ones((1, 16), np.float32)))
    held = _cache_bytes(cache.k + cache.v)                                 # K and V are one array
    assert held == 64 * 160                                                # one 64-token page per layer
    assert host_kv_bytes_per_token(80) == 160


def test_ram_budget_charges_the_host_cache_for_our_engine_and_the_spec_for_colibri():
    spec = toy_spec()                                  # kv_bytes_per_token 1024 (bf16): 2048 B float32
    assert ram_kv_bytes_per_token(spec) == 2048 and ram_kv_bytes_per_token(spec, "colibri") == 1024
    _, ex, parts = ram_budget(spec, 8 * 10**9, "4", context_tokens=1000, dense_fmt="int4")
    assert parts["kv_bytes"] == 2_048_000                                  # 1000 · 2048
    assert {"what": "KV cache (1000 tokens x 2048 B)", "bytes": -2_048_000} in ex
    _, _, theirs = ram_budget(spec, 8 * 10**9, "4", context_tokens=1000, dense_fmt="int4",
                              kv_bytes_per_token=ram_kv_bytes_per_token(spec, "colibri"))
    assert theirs["kv_bytes"] == 1_024_000                                 # colibrì's 16-bit cache
    ours = build_setup(toy_profile(), spec, None, SolveOptions(ram="4", context_tokens=1000))
    col = build_setup(toy_profile(), spec, None, SolveOptions(ram="4", context_tokens=1000, target="colibri"))
    assert ours.budgets.kv_bytes == 2_048_000 and col.budgets.kv_bytes == 1_024_000


def test_cpu_trunk_and_its_attention_priced_at_the_host_cache():
    spec = toy_spec(hidden=2048, inter=1024)           # 1024 B per token at bf16
    gpu = {"gbps": 60.0, "free_bytes": 2_060_000_000}
    res = resources_from_profile(toy_profile(gpus=[gpu]), spec, {"cuda:0": 10**9})
    figs = device_figures(toy_profile(gpus=[gpu]), res, spec, "int4", Coefficients())
    ours = trunk_options(figs, spec, "int4", 100, {"cuda:0": 10**9}, Coefficients())[0]
    spec_bpt = trunk_options(figs, spec, "int4", 100, {"cuda:0": 10**9}, Coefficients(),
                             host_kv_bytes_per_token=1024)[0]
    assert (ours.name, ours.kv_bytes_per_token, ours.kv_bytes) == ("cpu", 2048, 100 * 2048)
    assert (spec_bpt.kv_bytes_per_token, spec_bpt.kv_bytes) == (1024, 100 * 1024)
    # attention reads the cache: twice the bytes, twice the seconds at the same KV GB/s
    assert ours.attention_s == 2 * spec_bpt.attention_s > 0
    mla = dataclasses.replace(spec, family="deepseek_v3")   # MLA's latent cache: on the GPU, as GQA's K/V
    dev = trunk_options(figs, mla, "int4", 100, {"cuda:0": 10**9}, Coefficients())[1]
    assert (dev.kv_bytes_per_token, dev.kv_bytes) == (2048, 2 * 64 * 2048)   # float32, 2 pages of 64
