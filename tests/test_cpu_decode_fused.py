"""The CPU decode path's one-call shortcuts give the bits of the numpy formulas they replace: the cpu
backend's ``d_rmsnorm`` (the numpy backend's ``d_rmsnorm``: numpy's pairwise Σx²), ``expert_ffn_sum``
(the experts' weighted sum in scatter_sum's float32 order), ``RamExperts.run_sum`` and the one-token
routing of ``routed_experts``."""

from __future__ import annotations

import numpy as np
import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine.moe import RamExperts, route_tokens, routed_experts, scatter_sum
from colibri_plan.errors import InputError
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.quant import quantize

cpu_cls = get_backend("cpu")
pytestmark = pytest.mark.skipif(not cpu_cls.is_available(), reason="numba is not installed")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def cpu():
    be = cpu_cls.open(0)
    yield be
    be.close()


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """The numpy backend's d_rmsnorm of x [N, H] with weight [H]."""
    be = get_backend("numpy").open(0)
    try:
        return be.d_get(be.d_rmsnorm(be.d_put(x), be.d_put(w), eps))
    finally:
        be.close()


@pytest.mark.parametrize("hidden", [7, 8, 128, 129, 1000, 2048, 5120])
def test_cpu_d_rmsnorm_is_the_numpy_rmsnorm_bit_for_bit(cpu, hidden):
    rng = np.random.default_rng(hidden)
    x = (rng.standard_normal((5, hidden)) * 30).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    got = cpu.d_get(cpu.d_rmsnorm(cpu.d_put(x), cpu.d_put(w), 1e-6))
    assert np.array_equal(_bits(got), _bits(_rmsnorm(x, w, 1e-6)))
    with pytest.raises(InputError, match="d_rmsnorm"):
        cpu.d_rmsnorm(cpu.d_put(x), cpu.d_put(np.ones(hidden + 1, np.float32)), 1e-6)


def _experts(be, fmt: str, n: int, hidden: int = 256, inter: int = 128, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [be.upload_expert(*(quantize(rng.standard_normal(s).astype(np.float32) * 0.05, fmt)
                               for s in ((inter, hidden), (inter, hidden), (hidden, inter))))
            for _ in range(n)]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g32", "f32"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_expert_ffn_sum_is_expert_ffn_weighted_and_summed_in_order(cpu, fmt, tokens):
    experts = _experts(cpu, fmt, 8, seed=tokens)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((tokens, 256)).astype(np.float32)
    gates = rng.random(8).astype(np.float32)
    ys = cpu.expert_ffn([x] * 8, experts)
    want = np.zeros_like(x)
    for y, g in zip(ys, gates):
        want += y * g  # the engine's y · gates[:, None], then scatter_sum's in-order add
    got = cpu.expert_ffn_sum(x, experts, gates)
    assert got.shape == x.shape and np.array_equal(_bits(got), _bits(want))
    assert np.abs(want).max() > 0  # a real sum, not zeros
    with pytest.raises(InputError, match="7 gates for 8 experts"):
        cpu.expert_ffn_sum(x, experts, gates[:7])
    cpu.free(experts[3].down)
    with pytest.raises(InputError, match="freed"):
        cpu.expert_ffn_sum(x, experts, gates)


def test_expert_ffn_sum_of_mixed_formats_takes_the_per_expert_path(cpu):
    experts = _experts(cpu, "int8", 2) + _experts(cpu, "int4", 2, seed=1)
    x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
    gates = np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    want = np.zeros_like(x)
    for y, g in zip(cpu.expert_ffn([x] * 4, experts), gates):
        want += y * g
    assert np.array_equal(_bits(cpu.expert_ffn_sum(x, experts, gates)), _bits(want))


def _arch(**kw) -> ArchConfig:
    base = dict(family="qwen3_moe", n_layers=1, hidden_size=256, n_heads=4, n_kv_heads=2, head_dim=64,
                vocab_size=32, n_experts=8, top_k=3, moe_intermediate_size=128, moe_layers=(0,),
                norm_topk_prob=True, qk_norm="head")
    base.update(kw)
    return ArchConfig(**base)


class _Weights:
    """Expert source for RamExperts: int8 experts of one MoE layer."""

    def __init__(self, arch):
        rng = np.random.default_rng(11)
        shapes = ((128, 256), (128, 256), (256, 128))
        self._e = {(0, e): tuple(quantize(rng.standard_normal(s).astype(np.float32) * 0.05, "int8")
                                 for s in shapes) for e in range(arch.n_experts)}

    def expert_keys(self):
        return iter(self._e)

    def expert(self, layer, e):
        return self._e[(layer, e)]


@pytest.mark.parametrize("backend", ["cpu", "numpy"])
def test_one_token_routed_experts_match_the_grouped_path(backend):
    arch = _arch()
    rng = np.random.default_rng(5)
    dense = {"layers.0.router": rng.standard_normal((8, 256)).astype(np.float32)}
    x = rng.standard_normal((1, 256)).astype(np.float32)
    with_sum = RamExperts(_Weights(arch), backend)
    try:
        got = routed_experts(x, 0, arch, dense, with_sum)  # run_sum: one call
        uniq, tok_of, gates = route_tokens(x, 0, arch, dense)
        want = scatter_sum(x, tok_of, with_sum.run(0, uniq, [x] * len(uniq), gates))  # the general path
    finally:
        with_sum.close()
    assert np.array_equal(_bits(got), _bits(want)) and np.abs(want).max() > 0
    assert uniq == sorted(uniq) and len(uniq) == 3
