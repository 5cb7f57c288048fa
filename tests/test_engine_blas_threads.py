"""numpy's OpenBLAS held at one thread while the cpu backend's numba kernels run (engine/blas_threads.py),
and the decode-path shortcuts of the CPU trunk giving the same numbers as the plain formulas."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine import blas_threads
from colibri_plan.engine.blas_threads import BlasLimit, _openblas, openblas_threads
from colibri_plan.engine.moe import route_tokens, scatter_sum
from colibri_plan.formats.arch import ArchConfig


def _numpy_uses_openblas() -> bool:
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return "openblas" in str(blas.get("name", "")).lower()


@pytest.fixture
def two_threads(monkeypatch):
    """OpenBLAS at 2 threads for the test, its count restored after; no limit held by an earlier test's
    model that was never closed."""
    monkeypatch.setattr(blas_threads, "_holders", 0)
    monkeypatch.setattr(blas_threads, "_saved", [])
    api = _openblas()
    before = openblas_threads()
    for _, put in api:
        put(2)
    yield
    for (_, put), n in zip(api, before):
        put(n)


def test_this_numpy_has_an_openblas_to_limit():
    # the venv's numpy wheel bundles OpenBLAS: the limit must find it, or it silently does nothing
    assert _numpy_uses_openblas()
    assert len(openblas_threads()) >= 1


def test_limit_sets_one_thread_and_restores(two_threads):
    assert set(openblas_threads()) == {2}
    outer = BlasLimit()
    assert outer.applied and set(openblas_threads()) == {1}
    inner = BlasLimit()  # nested (two models): the count comes back only with the last
    inner.restore()
    assert set(openblas_threads()) == {1}
    inner.restore()  # idempotent: a second restore of the same limit does not release the outer one
    assert set(openblas_threads()) == {1}
    outer.restore()
    assert set(openblas_threads()) == {2}


def test_model_with_a_quantized_trunk_on_the_cpu_backend_limits_blas(two_threads, tmp_path):
    pytest.importorskip("transformers")
    from _tiny_models import build

    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack, write_pack
    from colibri_plan.engine.weights import load_checkpoint

    if not get_backend("cpu").is_available():
        pytest.skip("numba is not usable here")
    build("qwen2_moe", tmp_path / "ckpt", std=0.08)
    w = load_checkpoint(tmp_path / "ckpt", expert_format="int8")
    m_f32 = Model(w, backend_name="cpu")  # float trunk: its matmuls are BLAS's, threads kept
    assert set(openblas_threads()) == {2}
    path = write_pack(w, tmp_path / "pack", "int8", dense_format="int8")
    with open_pack(path) as p_np, open_pack(path) as p_cpu:  # a pack's dense binds to one backend
        m_np = Model(p_np, backend_name="numpy")  # the numpy backend runs everything in numpy: left alone
        assert set(openblas_threads()) == {2}
        m_cpu = Model(p_cpu, backend_name="cpu")
        assert set(openblas_threads()) == {1}
        ids_cpu = m_cpu.generate([3, 17, 42], 4)
        m_cpu.close()
        assert set(openblas_threads()) == {2}
        assert m_np.generate([3, 17, 42], 4) == ids_cpu
        m_np.close()
    m_f32.close()


@pytest.mark.parametrize("width", [64, 100, 2048, 2047])
def test_rmsnorm_is_bit_identical_to_the_mean_formula(width):
    rng = np.random.default_rng(width)
    x = rng.standard_normal((3, width)).astype(np.float32) * 7
    wt = rng.standard_normal(width).astype(np.float32)
    ref = (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(1e-6))) * wt
    be = get_backend("numpy").open(0)  # the host trunk's RMSNorm
    try:
        assert np.array_equal(be.d_get(be.d_rmsnorm(be.d_put(x), be.d_put(wt), 1e-6)), ref)
    finally:
        be.close()


@pytest.mark.parametrize("tokens", [1, 5])
def test_route_tokens_groups_by_expert_like_a_plain_loop(tokens):
    arch = ArchConfig(family="qwen2_moe", n_layers=1, hidden_size=16, n_heads=2, n_kv_heads=2, head_dim=8,
                      vocab_size=32, n_experts=8, top_k=3, moe_intermediate_size=4, moe_layers=(0,),
                      norm_topk_prob=False)
    rng = np.random.default_rng(tokens)
    x = rng.standard_normal((tokens, 16)).astype(np.float32)
    dense = {"layers.0.router": rng.standard_normal((8, 16)).astype(np.float32)}
    uniq, tok_of, gates = route_tokens(x, 0, arch, dense)
    logits = x @ dense["layers.0.router"].T
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = np.argsort(-p, axis=1, kind="stable")[:, :3]
    want = {}
    for t in range(tokens):
        for e in top[t]:
            want.setdefault(int(e), []).append(t)
    assert uniq == sorted(want)
    for e, toks, g in zip(uniq, tok_of, gates):
        assert toks.tolist() == want[e]
        assert toks.dtype == np.int64 and g.dtype == np.float32 and g.shape == (len(want[e]),)
    # each token's gates are its top-3 probabilities (norm_topk_prob off)
    per_tok = np.zeros(tokens)
    for toks, g in zip(tok_of, gates):
        np.add.at(per_tok, toks, g)
    assert np.allclose(per_tok, np.take_along_axis(p, top, axis=1).sum(axis=1), atol=1e-6)
    ys = [np.full((len(t), 16), float(i + 1), np.float32) for i, t in enumerate(tok_of)]
    out = scatter_sum(x, tok_of, ys)
    for t in range(tokens):
        assert np.all(out[t] == sum(i + 1 for i, toks in enumerate(tok_of) if t in toks.tolist()))
