"""MLA families (DeepSeek-V2/V2-Lite/V3/V3.2, Kimi-K2, GLM-4.7-Flash, GLM-5) in the engine against
transformers fp32 (the DSA ones, V3.2 and GLM-5, within index_topk context tokens, where DSA is MLA).

Tiny seeded checkpoints (``_tiny_models.MLA_FAMILIES``; random weights, router gaps >= 1e-3 checked on
every token of the sequences compared, re-seeded otherwise): 32 greedy tokens identical, logits within
1e-4 on the prefill and on every cached decode step (the weight-absorbed path), identical top-k per MoE
layer; int8 packs identical in routing to their dequantized reference; YaRN; FP8 block-scaled
checkpoints against their dequantized reference; the paged latent cache on the trunk's device; the
absorbed weights against the expanded attention; DSA contexts beyond index_topk refused before any work;
the DSA indexer tensors packed as dense.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from _backend_params import backend_params
from _tiny_models import MLA_FAMILIES, build_mla, greedy, logits, min_router_gap, record_router_ids

from colibri_plan.engine.forward import Model
from colibri_plan.engine.kv_device import DeviceLatentCache, latent_kv_bytes
from colibri_plan.engine.trunk_weights import absorbed_weights
from colibri_plan.engine.weights import InMemoryWeights, load_checkpoint
from colibri_plan.errors import UnsupportedError
from colibri_plan.families import plan_geometry
from colibri_plan.formats.plan_trunk import PAGE_TOKENS
from colibri_plan.quant import dequantize, quantize

pytest.importorskip("torch", reason="torch is needed to build the reference models")
pytest.importorskip("transformers", minversion="5.0", reason="transformers >= 5 builds the reference models")

PROMPT = [3, 17, 99, 42, 5, 120, 64, 7, 31, 88, 2, 77, 19, 101, 56, 9, 33, 12, 90, 45]  # 20 tokens
TOL = 1e-4  # max |logit difference|
GAP = 1e-3
YARN_MLA = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}


def _gapped(build_fn, folder_factory, seed: int, tries: int = 10):
    """(model, folder, greedy ids of PROMPT[:16], gap): the first seed from ``seed`` whose router gaps
    are >= GAP on PROMPT and on PROMPT[:16] + its 32 greedy tokens."""
    for s in range(seed, seed + tries):
        folder = folder_factory()
        hf = build_fn(folder, s)
        want = greedy(hf, PROMPT[:16], 32)
        gap = min_router_gap(hf, [PROMPT, PROMPT[:16] + want])
        if gap >= GAP:
            return hf, folder, want, gap
    raise AssertionError(f"no seed in {seed}..{seed + tries - 1} gives router gaps >= {GAP}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(name, **overrides):
        key = (name, json.dumps(overrides, sort_keys=True))
        if key not in cache:
            from _tiny_models import MLA_SEEDS
            cache[key] = _gapped(lambda f, s: build_mla(name, f, seed=s, **overrides),
                                 lambda: tmp_path_factory.mktemp(name), MLA_SEEDS[name][0])
        return cache[key]
    return get


def _check_parity(hf, folder, want, family, trunk_backend=None):
    """Prefill logits, cached decode logits (absorbed path) and top-k per MoE layer against transformers
    on PROMPT[:16] + the greedy tokens; then 32 greedy tokens; the trunk on ``trunk_backend`` (None: the
    host). Returns the max |logit diff|."""
    w = load_checkpoint(folder)
    assert w.arch.family == family and w.arch.attention == "mla"
    seq = PROMPT[:16] + want
    calls, remove = record_router_ids(hf)
    ref = logits(hf, seq[:-1])  # [47, V]: 16 prompt + 31 decode positions
    remove()
    with Model(w, trunk_backend=trunk_backend, context_tokens=64) as model:
        cache = model.new_cache()
        got = np.concatenate([model.forward(seq[:16], cache)]
                             + [model.forward([t], cache) for t in seq[16:-1]])  # decode: absorbed path
        assert isinstance(cache, DeviceLatentCache) and cache.length == len(seq) - 1
        diff = float(np.abs(got - ref).max())
        assert diff < TOL, f"{family}: logits differ by {diff:.2e}"
        assert len(calls) == w.arch.n_moe_layers
        for layer, hf_ids in zip(w.arch.moe_layers, calls):  # prefill and every decode step
            np.testing.assert_array_equal(np.sort(model.routing.topk_ids(layer), axis=1),
                                          np.sort(hf_ids, axis=1), err_msg=f"{family} layer {layer}")
        assert (model.routing.counts > 0).sum() > 2 * w.arch.n_moe_layers  # routing is not degenerate
        assert model.generate(PROMPT[:16], 32) == want, f"{family}: greedy tokens differ"
    assert len(set(want)) > 3
    return diff


@pytest.mark.parametrize("name", list(MLA_FAMILIES))
def test_mla_family_matches_transformers(tiny, name):
    hf, folder, want, gap = tiny(name)
    family = json.loads((folder / "config.json").read_text())["model_type"]
    arch = load_checkpoint(folder).arch
    assert arch.q_lora_rank == (0 if name == "deepseek_v2_lite" else 32)
    assert arch.index_topk == (64 if family in ("deepseek_v32", "glm_moe_dsa") else 0)
    diff = _check_parity(hf, folder, want, family)
    print(f"{family}: max |logit diff| {diff:.2e}")


DSA = ("deepseek_v32", "glm_moe_dsa")


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite", "glm_moe_dsa"])
def test_mla_on_a_device_trunk_matches_transformers(tiny, name, backend):
    """MLA attention and its latent cache on each backend's device (q LoRA or plain q_proj; DSA within
    index_topk): the same logits, routing and greedy tokens as transformers."""
    from colibri_plan.backends import get_backend

    hf, folder, want, _ = tiny(name)
    family = json.loads((folder / "config.json").read_text())["model_type"]
    be = get_backend(backend).open(0)
    try:
        diff = _check_parity(hf, folder, want, family, trunk_backend=be)
        assert be.memory_used() == 0   # closing the model freed the trunk's uploads
    finally:
        be.close()
    print(f"{family} on {backend}: max |logit diff| {diff:.2e}")


@pytest.mark.parametrize("name", DSA)
def test_dsa_context_beyond_index_topk_is_refused_before_any_work(tmp_path, name):
    from colibri_plan.engine.runner import generate
    from colibri_plan.run_options import RunOptions

    build_mla(name, tmp_path, index_topk=8)
    w = load_checkpoint(tmp_path)
    assert w.arch.index_topk == 8
    with Model(w) as model:
        cache = model.new_cache()
        with pytest.raises(UnsupportedError) as info:
            model.forward(PROMPT[:9], cache)  # the prompt alone passes index_topk
        msg = str(info.value)
        assert ("DSA sparse selection beyond index_topk=8 tokens is not implemented; use contexts up to 8"
                in msg)
        assert "\n" not in msg and cache.length == 0 and model.routing.counts.sum() == 0  # no work done
        seen = []
        with pytest.raises(UnsupportedError, match="index_topk=8"):  # at the step feeding token 9
            model.generate(PROMPT[:5], 10, on_token=lambda step, tok, s: seen.append(tok))
        assert len(seen) == 4  # contexts 5..8 ran: 5 prompt + 3 fed tokens, 4 new tokens
        assert model.generate(PROMPT[:5], 4) == seen  # within index_topk: runs
    with pytest.raises(UnsupportedError, match="use contexts up to 8"):  # run / verify: prompt + tokens
        generate(w, PROMPT[:5], RunOptions(tokens=4, backend="numpy"))


def test_dsa_indexer_is_packed_as_dense(tiny, tmp_path):
    from colibri_plan.engine.pack import open_pack, write_pack

    _, folder, _, _ = tiny("glm_moe_dsa")
    w = load_checkpoint(folder)
    index = {n for n in w.dense if ".attn.indexer." in n}
    assert {n.split(".")[1] for n in index} == {"0", "2"}  # layer 1 is "shared": no indexer of its own
    assert w.dense["layers.0.attn.indexer.wq_b"].shape == (2 * 16, 32)
    pack = open_pack(write_pack(w, tmp_path / "pack", "f32"))
    assert pack.arch == w.arch and index <= set(pack.dense)  # kept for contexts beyond index_topk
    assert pack.spec().dense_params == sum(int(v.size) for v in w.dense.values())
    pack.close()


def test_yarn_mla_matches_transformers(tiny):
    from colibri_plan.families.rope import attention_factor, mla_softmax_scale

    hf, folder, want, _ = tiny("deepseek_v3", rope_parameters=YARN_MLA)
    arch = load_checkpoint(folder).arch
    assert (arch.rope_type, arch.yarn_factor, arch.yarn_original_max_position) == ("yarn", 4.0, 16)
    assert attention_factor(arch) != 1.0 and mla_softmax_scale(arch) != 24 ** -0.5  # both mscales act
    _check_parity(hf, folder, want, "deepseek_v3")


def test_paged_latent_cache_crosses_pages_and_matches_the_planner(tiny):
    hf, folder, _, _ = tiny("deepseek_v3")
    seq = (PROMPT * 5)[:90]
    ref = logits(hf, seq)
    w = load_checkpoint(folder)
    a = w.arch
    with Model(w) as model:
        cache = model.new_cache(40)  # one 64-token page reserved, a second one added past it
        parts = [model.forward(seq[:40], cache)]
        assert cache.capacity == PAGE_TOKENS and cache.grown_pages == 0
        parts += [model.forward([t], cache) for t in seq[40:]]
    assert float(np.abs(np.concatenate(parts) - ref).max()) < TOL
    assert cache.length == 90 and cache.capacity == 2 * PAGE_TOKENS and cache.grown_pages == 1
    values = a.kv_lora_rank + a.qk_rope_head_dim
    assert cache.k[0].shape == (2 * PAGE_TOKENS, 1, values) and cache.v is cache.k  # one row array: K = V
    assert cache.nbytes() == a.n_layers * 90 * values * 4
    assert cache.reserved_bytes == a.n_layers * 2 * PAGE_TOKENS * values * 4 == latent_kv_bytes(
        a.n_layers, a.qk_rope_head_dim, a.kv_lora_rank, 90)
    geo = plan_geometry(json.loads((folder / "config.json").read_text()))
    assert geo.kv_values_per_layer == values == a.kv_values_per_token  # what the planner charges, per layer


def test_absorbed_weights_equal_the_expanded_attention():
    """[q_rope | W_ukᵀ q_nope] scored against rows [k_rope | latent] by d_attention (one kv head), then
    W_uv per head: the expanded per-head keys and values, on the numpy backend's device ops."""
    from types import SimpleNamespace

    from colibri_plan.backends import get_backend

    rng = np.random.default_rng(1)
    nh, dn, dv, r, dr, t = 3, 6, 5, 7, 4, 9
    arch = SimpleNamespace(n_heads=nh, qk_nope_head_dim=dn, qk_rope_head_dim=dr, v_head_dim=dv,
                           kv_lora_rank=r)
    kv_b = rng.standard_normal((nh * (dn + dv), r)).astype(np.float32)
    w_uk, w_uv = kv_b.reshape(nh, dn + dv, r)[:, :dn], kv_b.reshape(nh, dn + dv, r)[:, dn:]
    q = rng.standard_normal((1, nh, dn + dr)).astype(np.float32)  # one query token at position t - 1
    latent, k_rope = rng.standard_normal((t, r)), rng.standard_normal((t, dr))
    k_nope, v = np.einsum("hdr,tr->htd", w_uk, latent), np.einsum("hvr,tr->htv", w_uv, latent)
    s = 0.3 * (np.einsum("hd,htd->ht", q[0, :, :dn], k_nope) + q[0, :, dn:] @ k_rope.T)
    p = np.exp(s - s.max(1, keepdims=True))
    want = np.einsum("ht,htv->hv", p / p.sum(1, keepdims=True), v)  # expanded: per-head keys and values
    aq, ao = absorbed_weights(arch, kv_b)
    assert aq.shape == (nh, dr + r, dn + dr) and ao.shape == (nh, dv, dr + r)
    be = get_backend("numpy").open(0)
    try:
        query = be.d_head_matmul(be.d_put(q), be.d_put(aq))  # [1, nh, dr + R]
        np.testing.assert_array_equal(be.d_get(query)[0, :, :dr], q[0, :, dn:])  # the rope part, exactly
        rows = be.d_put(np.concatenate([k_rope, latent], axis=1)[:, None, :])  # [T, 1, dr + R]
        o = be.d_attention(query, rows, rows, t, t - 1, 0.3)  # [1, nh·(dr + R)]
        got = be.d_get(be.d_head_matmul(be.d_view(o, (1, nh, dr + r)), be.d_put(ao)))[0]  # [nh, dv]
    finally:
        be.close()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_int8_pack_routes_as_its_dequantized_reference(tiny, tmp_path):
    from colibri_plan.engine.pack import open_pack, write_pack

    _, folder, _, _ = tiny("deepseek_v3")
    out = write_pack(load_checkpoint(folder), tmp_path / "pack", "int8")
    pack = open_pack(out)
    assert pack.arch == load_checkpoint(folder).arch  # the MLA and YaRN fields survive the pack index
    deq = {k: tuple(quantize(dequantize(t), "f32") for t in pack.expert(*k)) for k in pack.expert_keys()}
    ref = InMemoryWeights(pack.arch, pack.dense, deq, "f32")
    with Model(pack) as mq, Model(ref) as mref:
        assert float(np.abs(mq.forward(PROMPT) - mref.forward(PROMPT)).max()) < TOL
        assert mq.generate(PROMPT[:16], 32) == mref.generate(PROMPT[:16], 32)
        for layer in pack.arch.moe_layers:
            np.testing.assert_array_equal(mq.routing.topk_ids(layer), mref.routing.topk_ids(layer))
    pack.close()


def _fp8_copy(folder, out, block):
    """``folder`` re-saved as an FP8 block-scaled checkpoint (every *_proj weight e4m3 with
    ``weight_scale_inv`` per ``block``) in ``out``, and its dequantized f32 twin in ``out``-deq."""
    import torch
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and "proj" in name and name.endswith(".weight"):
            n, k = w.shape
            bn, bk = block
            pad = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
            pad[:n, :k] = w
            amax = pad.reshape(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).abs().amax(dim=(1, 3))
            scale = (amax / 448.0).clamp(min=1e-12)  # [ceil(n/bn), ceil(k/bk)]
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
            q = (w / full).to(torch.float8_e4m3fn)
            fp8[name], fp8[name + "_scale_inv"] = q, scale.float()
            deq[name] = q.float() * full
        else:
            fp8[name] = deq[name] = w
    for path, ts, extra in ((out, fp8, {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                 "weight_block_size": list(block)}}),
                            (out.with_name(out.name + "-deq"), deq, {})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**cfg, **extra}))
        save_file(ts, str(path / "model.safetensors"), metadata={"format": "pt"})
    return out, out.with_name(out.name + "-deq")


def test_fp8_block_scaled_checkpoint_matches_its_dequantized_reference(tiny, tmp_path):
    import transformers

    _, folder, _, _ = tiny("deepseek_v3")
    fp8, deq = _fp8_copy(folder, tmp_path / "fp8", (32, 32))  # partial blocks: 16×64, 96×64, ...
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(deq)).eval()
    want = greedy(hf, PROMPT[:16], 32)
    assert min_router_gap(hf, [PROMPT[:16] + want]) >= 1e-4
    w8, wd = load_checkpoint(fp8), load_checkpoint(deq)
    for name, t in wd.dense.items():
        np.testing.assert_array_equal(w8.dense[name], t, err_msg=name)  # per-block dequantization is exact
    _check_parity(hf, fp8, want, "deepseek_v3")


def test_fp8_dequantization_of_128_blocks_matches_torch():
    import torch

    from colibri_plan.engine.fp8 import dequant_blocks, e4m3_to_f32

    bits = torch.arange(256, dtype=torch.uint8)
    ok = ~torch.isnan(bits.view(torch.float8_e4m3fn).float())
    np.testing.assert_array_equal(e4m3_to_f32(bits.numpy())[ok.numpy()],
                                  bits.view(torch.float8_e4m3fn).float()[ok].numpy())
    assert np.isnan(e4m3_to_f32(np.array([0x7F, 0xFF], np.uint8))).all()
    g = torch.Generator().manual_seed(0)
    w8 = (torch.randn(300, 200, generator=g) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=g) + 0.1
    want = w8.float() * scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    np.testing.assert_array_equal(dequant_blocks(w8.view(torch.uint8).numpy(), scale.numpy()), want.numpy())


def test_mla_runs_on_the_cpu_backend_trunk(tiny):
    """With experts on the compiled "cpu" backend, the trunk (MLA attention and its latent cache) runs on
    that same backend's device ops (its numba attention kernel), matching transformers."""
    from colibri_plan.backends import get_backend

    reason = get_backend("cpu").unavailable_reason()
    if reason is not None:
        pytest.skip(f"cpu backend unavailable: {reason}")
    hf, folder, want, _ = tiny("deepseek_v3")
    seq = PROMPT[:16] + want
    ref = logits(hf, seq[:-1])
    with Model(load_checkpoint(folder), backend_name="cpu") as model:
        assert model.trunk.be is model.experts.backend and model.trunk.be.name == "cpu"
        cache = model.new_cache()
        assert cache.backend is model.experts.backend
        got = np.concatenate([model.forward(seq[:16], cache)]
                             + [model.forward([t], cache) for t in seq[16:-1]])
        assert float(np.abs(got - ref).max()) < TOL
        assert model.generate(PROMPT[:16], 32) == want


@pytest.mark.parametrize("name", ("deepseek_v3",) + DSA)
def test_tiny_mla_attention_is_not_uniform(tiny, name):
    """The tiny models' init scale makes attention peaked: the last token's largest weight is several
    times uniform on every layer and head (else a wrong score would go unnoticed)."""
    import torch

    hf, _, _, _ = tiny(name)
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        att = hf(torch.as_tensor([PROMPT]), output_attentions=True).attentions
    assert len(att) == 3 and all(float(a[0, :, -1].max(-1).values.min()) > 2.5 / len(PROMPT) for a in att)
