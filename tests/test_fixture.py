"""The synthetic fixture: deterministic, a valid pack, runs in the engine, routing skew like OLMoE's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.engine.fixture import (
    FixtureConfig,
    build_fixture,
    fit_router_bias,
    fixture_prompt,
    target_probabilities,
    top8_share,
)
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.formats.pack_verify import verify_pack
from colibri_plan.heatsynth import real_heat
from colibri_plan.quant import dequantize


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("fx") / "small"
    build_fixture(out, FixtureConfig.small())
    return out


def test_targets_are_the_real_olmoe_rows():
    cfg = FixtureConfig.small()
    t = target_probabilities(cfg)
    real = real_heat("olmoe", cfg.domain).probabilities()  # layers 0, 7, 15
    np.testing.assert_allclose(t, real)
    np.testing.assert_allclose(t.sum(axis=1), 8.0)
    t5 = target_probabilities(FixtureConfig.small(layers=5, experts=32, top_k=4))
    assert t5.shape == (5, 32) and np.all(t5 <= 1.0)
    np.testing.assert_allclose(t5.sum(axis=1), 4.0)


def test_router_bias_fit_reproduces_target_frequencies():
    rng = np.random.default_rng(0)
    target = real_heat("olmoe", "github").probabilities()[1]  # the most skewed row (51% on 8 experts)
    fit_logits = rng.standard_normal((4096, 64))
    b = fit_router_bias(fit_logits, target, 8)
    held_out = rng.standard_normal((20000, 64))  # fresh samples, not the ones fitted
    scores = 1 / (1 + np.exp(-held_out)) + b
    top = np.argpartition(-scores, 7, axis=1)[:, :8]
    freq = np.bincount(top.ravel(), minlength=64) / len(top)
    assert np.abs(freq - target).max() < 0.05
    assert abs(top8_share(freq[None])[0] - top8_share(target[None])[0]) < 0.03


def test_small_fixture_is_a_valid_deterministic_pack(small, tmp_path):
    assert verify_pack(small)["ok"]
    pk = open_pack(small)
    assert pk.arch.family == "glm4_moe" and pk.expert_format == "int4"
    assert pk.arch.hidden_size == 256 and pk.arch.moe_intermediate_size == 128 and pk.arch.n_experts == 64
    again = build_fixture(tmp_path / "again", FixtureConfig.small())
    doc_a = json.loads((small / "pack.json").read_text())
    doc_b = json.loads((tmp_path / "again" / "pack.json").read_text())
    assert doc_a["experts"] == doc_b["experts"]  # same offsets and crc32s
    assert doc_a["format"]["dense_crc32"] == doc_b["format"]["dense_crc32"]
    build_fixture(tmp_path / "other", FixtureConfig.small(seed=1))
    doc_c = json.loads((tmp_path / "other" / "pack.json").read_text())
    assert [r[4] for r in doc_c["experts"]] != [r[4] for r in doc_a["experts"]]
    assert again["expert_block_bytes"] % 4096 == 0


def test_expert_values_are_zero_mean_and_scaled(small):
    pk = open_pack(small)
    gate, up, down = pk.expert(1, 7)
    w = dequantize(gate)
    assert abs(float(w.mean())) < 0.02 * float(w.std())
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    y = x @ w.T
    assert 0.6 < float(y.std()) < 1.6  # gate outputs O(1) for unit-RMS inputs


def test_routing_on_256_tokens_follows_olmoe_skew(small):
    pk = open_pack(small)
    model = Model(pk)
    model.forward(fixture_prompt(pk.arch.vocab_size, 256))
    counts = np.asarray(model.routing.counts, dtype=np.float64)  # [3, 64]
    assert counts.sum() == 3 * 256 * 8
    share = top8_share(counts)
    target = pk.index["extra"]["fixture"]["target_top8_share"]
    assert np.all((share >= 0.20) & (share <= 0.51)), share
    np.testing.assert_allclose(share, target, atol=0.06)


def test_greedy_decoding_does_not_loop(small):
    pk = open_pack(small)
    ids = Model(pk).generate([1, 2, 3], 32)
    assert len(set(ids)) >= 24  # walks through the vocabulary instead of repeating a few tokens


def test_fixture_cli(tmp_path):
    out = tmp_path / "fx"
    args = ["model", "fixture", str(out), "--small", "--layers", "2", "--experts", "16", "--top-k", "2",
            "--quant", "int4-g64", "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["experts"] == 32
    pk = open_pack(out)
    assert pk.expert_format == "int4-g64" and pk.arch.top_k == 2 and pk.arch.moe_layers == (0, 1)
    assert pk.expert(1, 15)[0].scales.shape == (128, 4)
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1 and "already exists" in res.output
    res = CliRunner().invoke(cli, ["model", "fixture", str(tmp_path / "x"), "--small", "--domain", "poetry"])
    assert res.exit_code == 1 and "poetry" in res.output and not (tmp_path / "x").exists()
