"""The engine against transformers on tiny random MoE models of every supported family.

Acceptance of the engine (checkpoint import + forward pass): logits within 1e-4 relative (norm-based)
over >= 16 tokens, identical greedy tokens for >= 32 steps, identical top-k expert ids per layer; with
int8/int4 experts the engine matches the dequantized reference in routing and to 1e-4 in logits.
"""

from __future__ import annotations

import numpy as np
import pytest
from _tiny_models import FAMILIES, build, greedy, load_hf, logits, record_router_ids, with_dequantized_experts

from colibri_plan.engine.forward import Model
from colibri_plan.engine.weights import InMemoryWeights, load_checkpoint
from colibri_plan.quant import dequantize, quantize

pytest.importorskip("torch", reason="torch is needed to build the reference models")
pytest.importorskip("transformers", minversion="5.0", reason="transformers >= 5 builds the reference models")

PROMPT = [3, 17, 99, 42, 5, 120, 64, 7, 31, 88, 2, 77, 19, 101, 56, 9, 33, 12, 90, 45]  # 20 tokens
TOL = 1e-4


def rel(a, b):
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            cache[family] = (build(family, folder), folder)
        return cache[family]
    return get


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_routing_and_greedy_match_transformers(tiny, family):
    hf, folder = tiny(family)
    w = load_checkpoint(folder)
    assert w.arch.family == family
    with Model(w) as model:
        calls, remove = record_router_ids(hf)
        ref = logits(hf, PROMPT)
        remove()
        cache = model.new_cache()
        got = model.forward(PROMPT, cache)
        assert got.shape == ref.shape == (len(PROMPT), 128)
        assert rel(got, ref) < TOL, f"{family}: logits differ by {rel(got, ref):.2e}"
        # routing: the same set of experts per token and MoE layer, in the transformers call order
        assert len(calls) == w.arch.n_moe_layers
        for layer, hf_ids in zip(w.arch.moe_layers, calls):
            ours = model.routing.topk_ids(layer)
            np.testing.assert_array_equal(np.sort(ours, axis=1), np.sort(hf_ids, axis=1),
                                          err_msg=f"{family} layer {layer}")
        counts = model.routing.counts
        assert counts.sum(axis=1).tolist() == [len(PROMPT) * w.arch.top_k] * w.arch.n_moe_layers
        assert (counts > 0).sum() > w.arch.n_moe_layers * 2  # routing is not degenerate

        # greedy: engine (prefill + cached decode) vs transformers (full recompute each step)
        want = greedy(hf, PROMPT[:16], 32)
        got_ids = model.generate(PROMPT[:16], 32)
        assert got_ids == want, f"{family}: greedy tokens differ"
        assert len(set(want)) > 3  # the tokens really vary


@pytest.mark.parametrize("family", ["glm4_moe", "mixtral"])
def test_kv_cache_decode_logits_match_full_sequence(tiny, family):
    hf, folder = tiny(family)
    seq = PROMPT[:8] + greedy(hf, PROMPT[:8], 12)
    ref = logits(hf, seq)
    with Model(load_checkpoint(folder)) as model:
        cache = model.new_cache(capacity=4)  # forces the cache to grow
        parts = [model.forward(seq[:8], cache)] + [model.forward([t], cache) for t in seq[8:]]
        assert cache.length == len(seq)
    assert rel(np.concatenate(parts), ref) < TOL


@pytest.mark.parametrize("family,fmt", [("glm4_moe", "int4"), ("qwen2_moe", "int8"),
                                        ("mixtral", "int4-g32")])
def test_quantized_experts_match_dequantized_reference(tiny, family, fmt, tmp_path):
    """Engine with fmt experts == engine with f32 experts dequantized from them == transformers
    holding the dequantized expert weights (tolerance 1e-4 relative; routing identical)."""
    hf, folder = tiny(family)
    wq = load_checkpoint(folder, expert_format=fmt)
    deq = {k: tuple(quantize(dequantize(t), "f32") for t in wq.expert(*k)) for k in wq.expert_keys()}
    wref = InMemoryWeights(wq.arch, wq.dense, deq, "f32")
    with Model(wq) as mq, Model(wref) as mref:
        lq, lref = mq.forward(PROMPT), mref.forward(PROMPT)
        for layer in wq.arch.moe_layers:
            np.testing.assert_array_equal(mq.routing.topk_ids(layer), mref.routing.topk_ids(layer))
        assert rel(lq, lref) < TOL
        assert mq.generate(PROMPT[:16], 32) == mref.generate(PROMPT[:16], 32)

    # the same dequantized experts inside transformers: a copy of the checkpoint holding them
    hf_deq = load_hf(with_dequantized_experts(folder, wq, tmp_path), family)
    assert rel(lq, logits(hf_deq, PROMPT)) < TOL
    assert rel(logits(hf_deq, PROMPT), logits(hf, PROMPT)) > 1e-6  # the copy really differs


def test_int4_is_close_but_not_equal_to_f32(tiny):
    """Quantization error is visible (the quantized path really runs) and bounded."""
    _, folder = tiny("mixtral")
    with Model(load_checkpoint(folder)) as m32, Model(load_checkpoint(folder, "int8")) as m8:
        a, b = m32.forward(PROMPT), m8.forward(PROMPT)
    assert 1e-6 < rel(b, a) < 0.05


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_cpu_backend_matches_numpy_backend(tiny, fmt):
    """The default provider on the compiled "cpu" backend: same routing, logits within 1e-4."""
    from colibri_plan.backends import get_backend

    reason = get_backend("cpu").unavailable_reason()
    if reason is not None:
        pytest.skip(f"cpu backend unavailable: {reason}")
    _, folder = tiny("glm4_moe")
    w = load_checkpoint(folder, fmt)
    with Model(w, backend_name="numpy") as a, Model(w, backend_name="cpu") as b:
        la, lb = a.forward(PROMPT), b.forward(PROMPT)
        for layer in w.arch.moe_layers:
            np.testing.assert_array_equal(a.routing.topk_ids(layer), b.routing.topk_ids(layer))
    assert rel(lb, la) < TOL


def test_sliding_window_attention_matches_transformers(tmp_path):
    hf = build("mixtral", tmp_path, seed=4, sliding_window=5)
    w = load_checkpoint(tmp_path)
    assert w.arch.sliding_window == 5
    seq = PROMPT + PROMPT[:12]
    with Model(w) as model:
        cache = model.new_cache()
        got = np.concatenate([model.forward(seq[:20], cache)] + [model.forward([t], cache) for t in seq[20:]])
    assert rel(got, logits(hf, seq)) < TOL


YARN_GQA = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}


def test_yarn_gqa_matches_transformers(tmp_path):
    """Qwen3-MoE with YaRN RoPE (attention factor on cos/sin, blended frequencies): cached decode logits
    within 1e-4, identical top-k per MoE layer and 32 identical greedy tokens (router gaps >= 1e-3)."""
    from _tiny_models import min_router_gap

    from colibri_plan.families.rope import attention_factor

    for seed in range(1, 11):  # the first seed whose router gaps are >= 1e-3 on the compared tokens
        folder = tmp_path / f"seed{seed}"
        hf = build("qwen3_moe", folder, seed=seed, rope_parameters=YARN_GQA)
        want = greedy(hf, PROMPT[:16], 32)
        if min_router_gap(hf, [PROMPT[:16] + want]) >= 1e-3:
            break
    else:
        raise AssertionError("no seed gives router gaps >= 1e-3")
    w = load_checkpoint(folder)
    assert (w.arch.rope_type, w.arch.yarn_factor) == ("yarn", 4.0) and attention_factor(w.arch) > 1.1
    seq = PROMPT[:16] + want
    calls, remove = record_router_ids(hf)
    ref = logits(hf, seq[:-1])
    remove()
    with Model(w) as model:
        cache = model.new_cache()
        got = np.concatenate([model.forward(seq[:16], cache)]
                             + [model.forward([t], cache) for t in seq[16:-1]])
        assert float(np.abs(got - ref).max()) < TOL
        for layer, hf_ids in zip(w.arch.moe_layers, calls):
            np.testing.assert_array_equal(np.sort(model.routing.topk_ids(layer), axis=1),
                                          np.sort(hf_ids, axis=1))
        assert model.generate(PROMPT[:16], 32) == want
