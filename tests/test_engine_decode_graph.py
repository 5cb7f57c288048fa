"""Captured decode steps (engine/decode_graph.py, backends/cuda/graph.py) on the simulated GPU of
``test_backend_cuda_device_sim.py``: its stream capture records the launches and copies and replays them,
and its kernels read the step's position from device memory when they run, as the GPU's do. What runs for
real is the host side: the capture, the pinned inputs and outputs, the device expert tables, the graph
keys (cache, capacity, attention slices), the eager timed steps and the accounting after a replay. The
replayed run must equal the eager one (``COLIBRI_CUDA_GRAPH=0``) in tokens, logits, recorded routing and
tier uses; the H200 run of tests/test_backend_cuda.py-style checks the kernels themselves."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine.decode_graph import EAGER_ENV, EAGER_EVERY, ENV, DecodeGraph, eager_every
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.moe import RoutingRecorder
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.residency import ResidencyManager
from colibri_plan.errors import InputError, UnsupportedError

PROMPT = [5, 80, 200, 7, 31]
EVERY = 64  # eager timed steps in the runs below (COLIBRI_EAGER_EVERY): a few in a short run


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    d = tmp_path_factory.mktemp("graph") / "fx"
    build_fixture(d, FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    return d


@pytest.fixture(params=["cuda-sim", "cuda"])
def be(request, monkeypatch):
    """The simulated GPU here; the real one too where CuPy sees one (else skipped with the reason)."""
    sim = None
    if request.param == "cuda-sim":
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        from tests.test_backend_cuda_device_sim import device_cupy
        from tests.test_backend_cuda_sim import Sim

        sim = Sim()
        monkeypatch.setitem(sys.modules, "cupy", device_cupy(sim))
    else:
        why = get_backend("cuda").unavailable_reason()
        if why:
            pytest.skip(why)
    b = get_backend("cuda").open(0)
    b.sim = sim
    yield b
    b.close()


def _decode(pack, be, monkeypatch, graph: bool, n_tokens: int, local=None, patch=None, requests=1,
            mapped=False, after=None):
    """(tokens, logits of every decode step [n, V] of the last of ``requests`` generations, manager uses,
    routing counts, (graph_off, captures, capacity), (hybrid layers, replayed steps, host waits, hand-offs)
    or None) with experts ``local`` (default: all; a dict: per layer) of each layer on ``be`` and the rest
    pinned in RAM (``mapped``: in RAM mapped by ``be``, which computes them: compute.ram_pinned)."""
    monkeypatch.setenv(ENV, "1" if graph else "0")
    monkeypatch.setenv(EAGER_ENV, str(EVERY))
    a = pack.arch
    local = range(a.n_experts) if local is None else local
    by_layer = local if isinstance(local, dict) else dict.fromkeys(a.moe_layers, local)
    placement = Placement({l: LayerPlacement(vram={"cuda:0": list(v)} if len(v) else {},
                                             ram_pinned=[e for e in range(a.n_experts) if e not in v])
                           for l, v in by_layer.items()}, compute={"ram_pinned": "cuda:0"} if mapped else {})
    cpu, rec = get_backend("numpy").open(0), RoutingRecorder(a)
    rm = ResidencyManager(pack, placement, cpu, devices={"cuda:0": be})
    try:
        with Model(pack, experts=rm, recorder=rec, trunk_backend=be, context_tokens=8) as model:
            if patch is not None:
                patch(model)
            for _ in range(requests):  # each a fresh cache, as a server's requests
                cache, toks, logits = model.new_cache(), [], []
                lg = model.trunk.last_logits(np.array(PROMPT), cache)
                for _ in range(n_tokens):
                    toks.append(int(np.argmax(lg)))
                    lg = model.trunk.last_logits(np.array(toks[-1:]), cache)
                    logits.append(lg[0])
            trunk = model.trunk
            info = (trunk.graph_off, getattr(trunk._step_graph, "captures", 0), cache.capacity)
            g = trunk._step_graph
            segs = (g.hybrid, g._steps - 1 - g._sampled, g.waits, g.handoffs) if g is not None else None
            held = rm.resident_bytes()
            if after is not None:  # the model and manager as the decode left them
                after(model, rm)
    finally:
        rm.close()
        cpu.close()
    return toks, np.array(logits), dict(rm.stats.uses), rec.counts.copy(), info, segs, held


def test_replayed_steps_equal_eager_ones_across_a_cache_growth(fx, be, monkeypatch):
    """70 steps from a 5-token prompt: the cache grows past its first 64-token page (a new capture), one
    step in EVERY and the first timed one run eagerly; tokens, logits bit for bit, the recorded
    routing and the "vram" uses equal the eager run's."""
    n = EVERY + 6
    with open_pack(fx) as pack:
        eager = _decode(pack, be, monkeypatch, False, n)
        eager_launches = be.sim.launches if be.sim else 0
        replay = _decode(pack, be, monkeypatch, True, n)
        replay_launches = be.sim.launches - eager_launches if be.sim else 0
    assert eager[4][0] == f"{ENV}=0" and replay[4][0] is None
    assert replay[0] == eager[0]
    np.testing.assert_array_equal(replay[1], eager[1])
    assert replay[2] == eager[2] and replay[2]["vram"] > 0
    np.testing.assert_array_equal(replay[3], eager[3])
    captures, capacity = replay[4][1], replay[4][2]
    # a capture per RoPE table / attention slice count (decode slices per doubling of the context: 75
    # keys are 8, 16, 32, 64, 128 at 8 keys a slice at least, fewer where the SMs cap the slices)
    assert capacity > 64 and 1 <= captures <= 6
    if be.sim is not None:  # host launches: the prefill, captures and eager steps (a replay is one call)
        assert 0 < replay_launches < eager_launches / 5


def test_a_second_cache_replays_the_first_ones_graph(fx, be, monkeypatch):
    """Two requests of 10 steps, each on a fresh cache: the second replays the graph captured for the
    first (the cache's arrays are input slots), with the first's tokens and the eager run's logits."""
    with open_pack(fx) as pack:
        one = _decode(pack, be, monkeypatch, True, 10)
        two = _decode(pack, be, monkeypatch, True, 10, requests=2)
        eager = _decode(pack, be, monkeypatch, False, 10, requests=2)
    assert two[4][1] == one[4][1] >= 1 and two[0] == one[0] == eager[0]
    np.testing.assert_array_equal(two[1], eager[1])
    np.testing.assert_array_equal(two[3], eager[3])


@pytest.mark.parametrize("local", [range(8), "mixed"])
def test_a_hybrid_placement_replays_segments_equal_to_eager_steps(fx, be, monkeypatch, local):
    """Experts split VRAM / RAM (every layer hybrid, or layer 0 all in VRAM and layer 1 with none): the
    step replays as segments cut after each hybrid layer's router; over EVERY + 6 steps (a cache
    growth, eager timed steps between) tokens, logits bit for bit, the recorded routing and every tier's
    uses equal the eager run's; the host waits once per hybrid layer per replayed step, never at a layer
    whose experts all live in VRAM, and hands experts over only when the token chose some."""
    n = EVERY + 6
    local = {0: range(16), 1: ()} if local == "mixed" else local
    with open_pack(fx) as pack:
        eager = _decode(pack, be, monkeypatch, False, n, local=local)
        replay = _decode(pack, be, monkeypatch, True, n, local=local)
    assert eager[4][0] == f"{ENV}=0" and replay[4][0] is None
    assert replay[0] == eager[0]
    np.testing.assert_array_equal(replay[1], eager[1])
    np.testing.assert_array_equal(replay[3], eager[3])
    assert replay[2] == eager[2] and replay[2]["vram"] > 0 and replay[2]["ram_pinned"] > 0
    hybrid, replayed, waits, handoffs = replay[5]
    assert hybrid == ([1] if isinstance(local, dict) else [0, 1])
    assert replayed > n // 2 and waits == replayed * len(hybrid)
    assert 0 < handoffs <= waits


def test_mapped_pinned_experts_replay_as_one_graph_without_hand_offs(fx, be, monkeypatch):
    """Half of each layer's experts in VRAM, the rest pinned in RAM that the GPU maps and computes
    (compute.ram_pinned = cuda:0): no layer is hybrid, a replayed step never waits for the host, and the
    tokens, routing and tier uses equal the run whose host computes those pinned experts (logits within
    float32 rounding: the GPU sums all chosen experts itself). The pinned bytes are host memory, not VRAM.
    The plan's tiers hold still (COLIBRI_PROMOTE=0: the next test moves them)."""
    monkeypatch.setenv("COLIBRI_PROMOTE", "0")
    n = EVERY + 6
    with open_pack(fx) as pack:
        host = _decode(pack, be, monkeypatch, True, n, local=range(8))
        eager = _decode(pack, be, monkeypatch, False, n, local=range(8), mapped=True)
        mapped = _decode(pack, be, monkeypatch, True, n, local=range(8), mapped=True)
        expert_bytes = sum(q.nbytes for q in pack.expert(pack.arch.moe_layers[0], 0))
    assert mapped[4][0] is None and mapped[5][0] == [] and mapped[5][2:] == (0, 0)
    assert host[5][2] > 0  # the CPU-pinned run waits at every hybrid layer
    assert mapped[0] == eager[0] == host[0]
    np.testing.assert_array_equal(mapped[1], eager[1])
    np.testing.assert_allclose(mapped[1], host[1], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(mapped[3], host[3])
    assert mapped[2] == eager[2] == host[2] and mapped[2]["ram_pinned"] > 0 and mapped[2]["vram"] > 0
    n_pinned = 8 * len(pack.arch.moe_layers)
    assert mapped[6]["ram_pinned"] == n_pinned * expert_bytes
    assert mapped[6]["cuda:0"] == host[6]["cuda:0"] < host[6]["cuda:0"] + n_pinned * expert_bytes


def test_hot_mapped_experts_move_into_vram_between_replays_with_the_same_bits(fx, be, monkeypatch):
    """VRAM holding each layer's least chosen half (the other half mapped pinned, computed by the GPU): the
    promoter exchanges hot mapped experts with cold VRAM ones between replayed steps. Tokens, logits,
    routing and resident bytes equal the run that keeps the plan's tiers (COLIBRI_PROMOTE=0); more of the
    selections are served from VRAM; every expert is held once, and each table row holds its own
    weights' addresses."""
    n = EVERY + 24
    with open_pack(fx) as pack:
        a = pack.arch
        monkeypatch.setenv("COLIBRI_PROMOTE", "0")
        counts = _decode(pack, be, monkeypatch, True, n, mapped=True)[3]  # [layers, E] selections
        cold = {l: np.argsort(counts[r], kind="stable")[: a.n_experts // 2].tolist()
                for r, l in enumerate(a.moe_layers)}
        kept = _decode(pack, be, monkeypatch, True, n, local=cold, mapped=True)
        monkeypatch.setenv("COLIBRI_PROMOTE", "1")
        seen = {}

        def after(model, rm):
            g = model.trunk._step_graph
            seen["swaps"], seen["bytes"] = g.promoter.swaps, g.promoter.swap_bytes
            for layer in a.moe_layers:
                vram, mapped = rm.tiers_on(be, layer)
                assert sorted(vram + mapped) == list(range(a.n_experts)) and len(vram) == a.n_experts // 2
                rows = g.tables[layer].rows
                for e in range(a.n_experts):
                    ew = rm.held_weights(layer, e)
                    assert int(rows[e, 0]) == ew.gate.payload.data and int(rows[e, 4]) == ew.down.payload.data
                    assert ew.gate.host_mapped == (e in mapped)
                seen[layer] = vram
        moved = _decode(pack, be, monkeypatch, True, n, local=cold, mapped=True, after=after)
        expert_bytes = sum(q.nbytes for q in pack.expert(a.moe_layers[0], 0))
    assert moved[0] == kept[0]
    np.testing.assert_array_equal(moved[1], kept[1])
    np.testing.assert_array_equal(moved[3], kept[3])
    assert moved[6] == kept[6]
    assert seen["swaps"] > 0 and seen["bytes"] == 2 * expert_bytes * seen["swaps"]
    assert moved[2]["vram"] > kept[2]["vram"] and sum(moved[2].values()) == sum(kept[2].values())
    assert any(sorted(seen[l]) != sorted(cold[l]) for l in a.moe_layers)


def test_a_discrete_gpu_computes_no_streamed_tier(fx, be):
    """compute.lru / compute.disk on a discrete GPU would need a host copy per slot fill: refused at
    start-up with what to do instead."""
    with open_pack(fx) as pack:
        a = pack.arch
        pl = Placement({l: LayerPlacement(ram_pinned=list(range(a.n_experts))) for l in a.moe_layers},
                       compute={"lru": "cuda:0"})
        cpu = get_backend("numpy").open(0)
        try:
            with pytest.raises(InputError, match="no unified memory.*pinned tier alone"):
                ResidencyManager(pack, pl, cpu, devices={"cuda:0": be})
        finally:
            cpu.close()


def test_the_switch_decodes_a_hybrid_placement_eagerly_and_says_why(fx, be, monkeypatch):
    with open_pack(fx) as pack:
        off = _decode(pack, be, monkeypatch, False, 3, local=range(8))
    assert off[4][0] == f"{ENV}=0" and off[4][1] == 0


def test_a_capture_the_backend_refuses_falls_back_to_eager_steps(fx, be, monkeypatch):
    def refuse(model):
        def no(*a, **k):
            raise UnsupportedError("cuda: the decode step could not be captured: test")
        model.trunk.be.d_capture_step = no

    with open_pack(fx) as pack:
        eager = _decode(pack, be, monkeypatch, False, 4)
        refused = _decode(pack, be, monkeypatch, True, 4, patch=refuse)
    assert refused[4][0] == "cuda: the decode step could not be captured: test"
    assert refused[0] == eager[0] and refused[2] == eager[2]


def test_indexed_experts_equal_the_listed_ones_and_refuse_bad_shapes(fx, be):
    """d_expert_ffn_indexed on ids in device memory (in choice order, unsorted) equals d_expert_ffn on
    the same experts listed by ascending id with their gates: the same kernels and summation order."""
    with open_pack(fx) as pack:
        a = pack.arch
        layer = a.moe_layers[0]
        ws = [be.upload_expert(*pack.expert(layer, e)) for e in range(a.n_experts)]
        table = be.d_expert_table(ws)
        x = be.d_put(np.random.default_rng(0).standard_normal((1, a.hidden_size), dtype=np.float32))
        ids = np.array([11, 2, 7, 5], np.int32)
        gates = np.array([0.4, 0.3, 0.2, 0.1], np.float32)
        route = be.d_put(np.concatenate([ids.view(np.float32), gates]))
        from colibri_plan.backends.handles import DArray

        d_ids = DArray((1, 4), route.buf, route.owner, 0)
        d_w = DArray((1, 4), route.buf, route.owner, 4)
        got = be.d_get(be.d_expert_ffn_indexed(x, d_ids, d_w, table))
        order = np.argsort(ids)
        want = be.d_get(be.d_expert_ffn(x, [ws[int(ids[i])] for i in order], gates[order]))
        np.testing.assert_array_equal(got, want)
        with pytest.raises(InputError, match="one token"):
            be.d_expert_ffn_indexed(be.d_put(np.ones((2, a.hidden_size), np.float32)), d_ids, d_w, table)
        with pytest.raises(InputError, match="no experts"):
            be.d_expert_table([])


def test_eager_every_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    """COLIBRI_EAGER_EVERY: unset -> the default; a multiple of 8 -> takes()'s period; else InputError."""
    monkeypatch.delenv(EAGER_ENV, raising=False)
    assert eager_every() == EAGER_EVERY == 256
    monkeypatch.setenv(EAGER_ENV, "16")
    assert eager_every() == 16
    g = DecodeGraph.__new__(DecodeGraph)  # takes() reads only these
    g._steps, g._sampled, g.eager_every = 0, 0, eager_every()
    g.trunk = type("T", (), {"attention_every": 8})()
    eager = [c for c in range(1, 65) if not g.takes(c)]
    assert eager == [1, 8, 16, 32, 48, 64]  # the first step, the first timed one, then one in 16
    for bad in ("12", "0", "-8", "x", "\u00b2"):  # "²" is a digit to str.isdigit, not to int()
        monkeypatch.setenv(EAGER_ENV, bad)
        with pytest.raises(InputError, match="multiple of 8"):
            eager_every()
