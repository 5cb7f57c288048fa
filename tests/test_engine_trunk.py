"""The device trunk (engine/trunk.py, engine/kv_device.py) against the CPU path, per GQA family and backend.

Same greedy tokens as the CPU path, and logits within ``|Δ| ≤ 1e-4 · max(1, max |logit|)`` of it (the
trunk's matmuls, norms and attention on the device differ from the host's float32 numpy only by summation
order; attention's reference accumulates in float64). Backends: numpy and cpu always; OpenCL and Vulkan
where they run (CI: PoCL, lavapipe), CUDA on a GPU host; its host side on the simulated GPU. The MLA
path (attention kept on the host) and a pack with an int8 trunk (QuantLinear uploads) too; the KV cache
reserves whole 64-token pages and grows past them.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
from _backend_params import backend_params  # noqa: E402
from _tiny_models import MLA_SEEDS, build, build_mla  # noqa: E402

from colibri_plan.backends import get_backend  # noqa: E402
from colibri_plan.backends.device_ops import DArray  # noqa: E402
from colibri_plan.engine.forward import Model  # noqa: E402
from colibri_plan.engine.kv_device import DeviceKVCache, device_kv_bytes  # noqa: E402
from colibri_plan.engine.trunk import trunk_dense_bytes, trunk_kv_bytes  # noqa: E402
from colibri_plan.engine.weights import load_checkpoint  # noqa: E402
from colibri_plan.errors import InputError  # noqa: E402
from colibri_plan.formats.plan_trunk import kv_bytes  # noqa: E402

PROMPT = [3, 17, 5, 99, 42, 8]
N_TOKENS = 12
REL_TOL = 1e-4
#: variants: the five GQA families of _tiny_models, and Mixtral with a sliding window shorter than the run
VARIANTS = {"mixtral": ("mixtral", {}), "qwen2_moe": ("qwen2_moe", {}), "qwen3_moe": ("qwen3_moe", {}),
            "olmoe": ("olmoe", {}), "glm4_moe": ("glm4_moe", {}),
            "mixtral_sliding": ("mixtral", {"sliding_window": 5})}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant -> (weights, CPU-path greedy tokens, CPU-path prefill logits [T, V])."""
    out = {}
    for key, (family, over) in VARIANTS.items():
        folder = tmp_path_factory.mktemp(key)
        build(family, folder, seed=1, **over)
        w = load_checkpoint(folder)
        with Model(w) as ref:
            out[key] = (w, ref.generate(PROMPT, N_TOKENS), ref.forward(PROMPT))
    return out


def _close(got: np.ndarray, want: np.ndarray) -> None:
    bound = REL_TOL * max(1.0, float(np.abs(want).max()))
    assert got.shape == want.shape
    assert float(np.abs(got - want).max()) <= bound


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_device_trunk_matches_the_cpu_path(models, variant, backend):
    w, want_ids, want_logits = models[variant]
    be = get_backend(backend).open(0)
    try:
        with Model(w, trunk_backend=be, context_tokens=8) as model:
            assert model.trunk.dense_bytes == trunk_dense_bytes(w.arch, w.dense, 8)
            assert model.generate(PROMPT, N_TOKENS) == want_ids
            _close(model.forward(PROMPT), want_logits)
            cache = model.new_cache()
            assert isinstance(cache, DeviceKVCache) and isinstance(cache.k[0], DArray)
            model.forward(PROMPT[:4], cache)  # prefill, then decode one token at a time
            steps = [model.forward([t], cache) for t in PROMPT[4:]]
            _close(np.concatenate(steps), want_logits[4:])
            assert cache.length == len(PROMPT)
        assert be.memory_used() == 0   # closing the model freed the trunk's uploads
    finally:
        be.close()


def test_sliding_window_is_shorter_than_the_run(models):
    w = models["mixtral_sliding"][0]
    assert w.arch.sliding_window == 5 and set(w.arch.sliding_layers) == set(range(w.arch.n_layers))
    assert len(PROMPT) + N_TOKENS > 5


def test_kv_cache_grows_by_whole_pages_past_the_reserved_context(models):
    w, _, _ = models["qwen3_moe"]
    with Model(w) as ref:
        want = ref.generate(PROMPT, 70)
    be = get_backend("numpy").open(0)
    with Model(w, trunk_backend=be, context_tokens=8) as model:
        cache = model.new_cache(8)
        assert cache.capacity == 64 and cache.reserved_bytes == trunk_kv_bytes(w.arch, 8)
        assert model.generate(PROMPT, 70, cache=cache) == want   # 6 + 69 tokens cached: two pages
        assert cache.length == len(PROMPT) + 69 and cache.capacity == 128 and cache.grown_pages == 1
        assert model.trunk._rope_rows == 128   # the RoPE table followed the cache


def test_kv_reserve_copies_the_rows_and_matches_the_plan_bytes():
    be = get_backend("numpy").open(0)
    cache = DeviceKVCache(be, n_layers=2, n_kv_heads=2, head_dim=4, context_tokens=100)
    assert cache.capacity == 128
    bpt = 2 * 2 * 2 * 4 * 4   # K and V, 2 layers, 2 kv heads, head_dim 4, float32
    assert cache.reserved_bytes == kv_bytes(100, bpt) == device_kv_bytes(2, 2, 4, 100)
    rows = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    k, v = cache.append(1, be.d_put(rows), be.d_put(-rows))
    assert k.shape == (128, 2, 4)
    cache.advance(3)
    cache.reserve(129)
    assert cache.capacity == 192 and cache.grown_pages == 1
    assert np.array_equal(be.d_get(cache.k[1])[:3], rows) and np.array_equal(be.d_get(cache.v[1])[:3], -rows)
    assert not be.d_get(cache.k[1])[3:].any()
    with pytest.raises(InputError, match="reserve"):
        big = be.d_put(np.zeros((190, 2, 4), np.float32))
        cache.append(0, big, big)


def test_a_host_cache_is_refused_by_the_device_trunk(models):
    w, _, _ = models["mixtral"]
    be = get_backend("numpy").open(0)
    with Model(w, trunk_backend=be) as model, Model(w) as host:
        with pytest.raises(InputError, match="DeviceKVCache"):
            model.forward(PROMPT, host.new_cache())


def test_mla_runs_with_attention_and_its_latent_cache_on_the_device(tmp_path):
    seed, router_std = MLA_SEEDS["deepseek_v3"]
    build_mla("deepseek_v3", tmp_path, seed=seed, router_std=router_std)
    w = load_checkpoint(tmp_path)
    a = w.arch
    with Model(w) as ref:
        want_ids, want_logits = ref.generate(PROMPT, N_TOKENS), ref.forward(PROMPT)
    be = get_backend("numpy").open(0)
    with Model(w, trunk_backend=be, context_tokens=8) as model:
        # the latent cache [k_rope | latent] lives on the trunk's device: 64 rows per layer at 4 B a value
        assert trunk_kv_bytes(a, 8) == a.n_layers * 64 * (a.qk_rope_head_dim + a.kv_lora_rank) * 4
        assert all(f"layers.{i}.attn.{n}" in model.trunk.w for i in range(a.n_layers)
                   for n in ("kv_a.latent", "kv_a.rope", "absorb_q", "absorb_o", "o"))
        assert model.trunk.dense_bytes == trunk_dense_bytes(a, w.dense, 8)
        assert model.generate(PROMPT, N_TOKENS) == want_ids
        _close(model.forward(PROMPT), want_logits)


def test_int8_trunk_of_a_pack_runs_its_quantized_matrices(models, tmp_path):
    from colibri_plan.engine.dense_quant import QuantLinear
    from colibri_plan.engine.pack import open_pack, write_pack

    w, _, _ = models["qwen2_moe"]
    write_pack(w, tmp_path / "p", "int8", dense_format="int8")
    with open_pack(tmp_path / "p") as pack:
        assert isinstance(pack.dense["layers.0.attn.q"], QuantLinear)
        with Model(pack) as ref:
            want_ids, want_logits = ref.generate(PROMPT, N_TOKENS), ref.forward(PROMPT)
        be = get_backend("numpy").open(0)
        with Model(pack, trunk_backend=be) as model:
            uploaded = model.trunk.w["layers.0.attn.q"]
            assert uploaded.fmt == "int8" and uploaded.nbytes == pack.dense["layers.0.attn.q"].nbytes
            assert model.generate(PROMPT, N_TOKENS) == want_ids
            _close(model.forward(PROMPT), want_logits)


@pytest.mark.parametrize("variant", ["qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "mixtral_sliding"])
def test_device_trunk_on_the_simulated_cuda_backend(models, variant, monkeypatch):
    """backends/cuda_device.py's host side (buffers, offsets of views, staging, launch arguments) under the
    trunk, on the stand-in cupy of test_backend_cuda_device_sim.py: the CUDA path without a GPU."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from tests.test_backend_cuda_device_sim import device_cupy
    from tests.test_backend_cuda_sim import Sim

    monkeypatch.setitem(sys.modules, "cupy", device_cupy(Sim()))
    w, want_ids, want_logits = models[variant]
    be = get_backend("cuda").open(0)
    try:
        with Model(w, trunk_backend=be, context_tokens=8) as model:
            assert model.generate(PROMPT, N_TOKENS) == want_ids
            _close(model.forward(PROMPT), want_logits)
            if variant == "glm4_moe":   # past the reserved page: the cache grows with device copies
                with Model(w) as ref:
                    want = ref.generate(PROMPT, 70)
                cache = model.new_cache(8)
                assert model.generate(PROMPT, 70, cache=cache) == want and cache.grown_pages == 1
    finally:
        be.close()


@pytest.mark.parametrize("variant", ["qwen3_moe", "glm4_moe"])
def test_the_fused_attention_prologue_keeps_the_bits_in_fewer_launches(models, variant, monkeypatch):
    """On the simulated CUDA backend the trunk runs each GQA layer's per-head q/k norms, RoPE and cache
    append as one d_attention_prologue launch (Qwen3: qk_norm "head"; GLM-4 with qk norms, q/k/v biases
    and a partial rotary_dim): a prefill and a decode step give the logits of the unfused ops bit for bit,
    with 3 launches fewer per layer and call (2 rmsnorm + 2 tr_rope -> 1; the eager append is copies)."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from tests.test_backend_cuda_device_sim import device_cupy
    from tests.test_backend_cuda_sim import Sim

    sim = Sim()
    monkeypatch.setitem(sys.modules, "cupy", device_cupy(sim))
    w = models[variant][0]
    be = get_backend("cuda").open(0)
    try:
        with Model(w, trunk_backend=be, context_tokens=8) as model:
            t = model.trunk
            assert t._prologue is not None and t.arch.qk_norm == "head"
            runs = []
            for fused in (True, False):
                t._prologue = be.d_attention_prologue if fused else None
                cache, launches = model.new_cache(), []
                logits = []
                for ids in (PROMPT, [7]):
                    before = sim.launches
                    logits.append(model.forward(ids, cache))
                    launches.append(sim.launches - before)
                runs.append((logits, launches))
        (fused_logits, fused_n), (plain_logits, plain_n) = runs
        for a, b in zip(fused_logits, plain_logits):
            np.testing.assert_array_equal(a, b)
        assert [p - f for f, p in zip(fused_n, plain_n)] == [3 * t.arch.n_layers] * 2
    finally:
        be.close()
