"""bench/cuda_promote.py on the simulated GPU of test_backend_cuda_device_sim.py: its heat, placement and
counterbalanced on/off decodes, so that the H200 run of it has only the GPU left to differ."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine.fixture import FixtureConfig, build_fixture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cuda_promote  # noqa: E402


@pytest.fixture
def sim_cuda(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from tests.test_backend_cuda_device_sim import device_cupy
    from tests.test_backend_cuda_sim import Sim

    monkeypatch.setitem(sys.modules, "cupy", device_cupy(Sim()))
    monkeypatch.setenv("COLIBRI_PROMOTE", "1")
    b = get_backend("cuda").open(0)
    yield b
    b.close()


def test_promotion_serves_more_from_vram_with_the_same_tokens(tmp_path, sim_cuda):
    """VRAM starting with the heat's coldest half: the promoter moves experts in, tokens unchanged."""
    d = tmp_path / "fx"
    build_fixture(d, FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    doc = cuda_promote.run(str(d), tokens=40, pairs=2, vram_share=0.5, be=sim_cuda, pick="cold")
    assert doc["same_tokens"] is True and doc["pick"] == "cold"
    assert doc["off"]["swaps"] == [0, 0] and min(doc["on"]["swaps"]) > 0
    assert doc["on"]["vram_share_of_selections"] > doc["off"]["vram_share_of_selections"]
    assert doc["off"]["graph_off"] is None and doc["on"]["graph_off"] is None  # replayed, not eager
    assert sum(doc["on"]["uses"].values()) == sum(doc["off"]["uses"].values()) == 40 * 2 * 4
