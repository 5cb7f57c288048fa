"""Routing on the trunk's device (engine/device_route.py): on a GPU backend declaring ``d_router_topk`` with
the manager's experts on it, a decode step brings down each MoE layer's ids and weights ([1, K]) instead of
x ([1, H]), and x only in a layer where some chosen expert lives off the device; the greedy tokens, the
manager's uses and the recorded routing equal the host-routing run's (``COLIBRI_DEVICE_ROUTING=0``).
OpenCL (PoCL) and Vulkan (lavapipe) run here where installed; CUDA on the simulated GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from _backend_params import backend_params

from colibri_plan.backends import get_backend
from colibri_plan.engine.decode_graph import ENV as GRAPH_ENV
from colibri_plan.engine.device_route import ENV
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.moe import RoutingRecorder
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.residency import ResidencyManager

PROMPT = [5, 80, 200, 7, 31]
N_TOKENS = 6


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    d = tmp_path_factory.mktemp("devroute") / "fx"
    build_fixture(d, FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    with open_pack(d) as pack, Model(pack) as ref:
        want = ref.generate(PROMPT, N_TOKENS)
    return d, want


@pytest.fixture(params=backend_params(("opencl", "vulkan")) + ["cuda-sim"])
def gpu(request, monkeypatch):
    """(backend name, an open GPU backend): OpenCL / Vulkan where they run, CUDA on the stand-in cupy."""
    if request.param == "cuda-sim":
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        from tests.test_backend_cuda_device_sim import device_cupy
        from tests.test_backend_cuda_sim import Sim

        monkeypatch.setitem(sys.modules, "cupy", device_cupy(Sim()))
        name = "cuda"
    else:
        name = request.param
    be = get_backend(name).open(0)
    yield name, be
    be.close()


def _generate(pack, be, key, local, monkeypatch, on: bool):
    """(tokens, manager uses, routing counts, shapes of every d_get of the last decode step, the trunk's
    routing_off) with experts ``local`` of each layer on ``be`` and the rest pinned in RAM."""
    monkeypatch.setenv(ENV, "1" if on else "0")
    monkeypatch.setenv(GRAPH_ENV, "0")  # eager steps: a captured one reads nothing through d_get
    a = pack.arch
    rest = [e for e in range(a.n_experts) if e not in local]
    placement = Placement({l: LayerPlacement(vram={key: list(local)}, ram_pinned=rest) for l in a.moe_layers})
    cpu, rec = get_backend("numpy").open(0), RoutingRecorder(a)
    rm = ResidencyManager(pack, placement, cpu, devices={key: be})
    gets: list[tuple] = []
    d_get = be.d_get
    try:
        with Model(pack, experts=rm, recorder=rec, trunk_backend=be, context_tokens=32) as model:
            tokens = model.generate(PROMPT, N_TOKENS)
            cache = model.new_cache()
            model.trunk.last_logits(np.array(PROMPT), cache)
            be.d_get = lambda x: gets.append(tuple(x.shape)) or d_get(x)
            model.trunk.last_logits(np.array([tokens[0]]), cache)
            off = model.trunk.routing_off
    finally:
        be.d_get = d_get
        rm.close()
        cpu.close()
    return tokens, dict(rm.stats.uses), rec.counts.copy(), gets, off


def test_all_local_decode_brings_ids_and_weights_down_not_x(fx, gpu, monkeypatch):
    folder, want = fx
    name, be = gpu
    with open_pack(folder) as pack:
        a, every = pack.arch, range(pack.arch.n_experts)
        host = _generate(pack, be, f"{name}:0", every, monkeypatch, on=False)
        dev = _generate(pack, be, f"{name}:0", every, monkeypatch, on=True)
    assert host[4] == f"{ENV}=0" and dev[4] is None
    assert dev[0] == host[0] == want
    assert dev[1] == host[1] and np.array_equal(dev[2], host[2])  # uses and recorded routing
    n = len(a.moe_layers)
    assert host[3] == [(1, a.hidden_size)] * n + [(1, a.vocab_size)]  # x per MoE layer, then the logits
    # ids and weights per layer (one packed copy on CUDA and OpenCL, two on Vulkan), then the logits
    per_layer = [(1, a.top_k)] * 2 if name == "vulkan" else [(2, 1, a.top_k)]
    assert dev[3] == per_layer * n + [(1, a.vocab_size)]


def test_experts_off_the_device_bring_x_down_only_where_chosen(fx, gpu, monkeypatch):
    """Half the experts pinned in RAM: x comes down in a layer only when one of them was chosen; tokens,
    uses and routing as the host-routing run's."""
    folder, want = fx
    name, be = gpu
    with open_pack(folder) as pack:
        a = pack.arch
        host = _generate(pack, be, f"{name}:0", range(8), monkeypatch, on=False)
        dev = _generate(pack, be, f"{name}:0", range(8), monkeypatch, on=True)
    assert dev[0] == host[0] == want and dev[1] == host[1] and np.array_equal(dev[2], host[2])
    assert dev[1]["ram_pinned"] > 0 and dev[1]["vram"] > 0
    xs = [s for s in dev[3] if s == (1, a.hidden_size)]
    routing = [s for s in dev[3] if s in ((1, a.top_k), (2, 1, a.top_k))]
    assert len(routing) == (2 if name == "vulkan" else 1) * len(a.moe_layers)
    assert len(xs) <= len(a.moe_layers)


def test_host_backends_and_the_switch_keep_the_host_rule(fx, monkeypatch):
    folder, want = fx
    be = get_backend("numpy").open(0)
    try:
        with open_pack(folder) as pack:
            tokens, _, _, _, off = _generate(pack, be, "numpy:0", range(16), monkeypatch, on=True)
    finally:
        be.close()
    assert tokens == want and "host backend" in off
