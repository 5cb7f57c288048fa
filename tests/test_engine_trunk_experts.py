"""Routed experts in VRAM on the device trunk's own device run on its device x (engine/trunk.py
``_routed``, ``d_expert_ffn``); the others (another device, pinned RAM, LRU, disk) go through the residency
manager. Same greedy tokens as the CPU path, and the manager's uses, hit rates and routing counts equal
those of the host path with the same placement. Host backends (numpy, cpu, and OpenCL/Vulkan where they run)
stand in for the GPU; the CUDA path runs on the simulated GPU of test_backend_cuda_device_sim.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from _backend_params import backend_params, count_calls

from colibri_plan.backends import get_backend
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.moe import RoutingRecorder
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.residency import ResidencyManager
from colibri_plan.engine.session import run_placement
from colibri_plan.formats.plan_trunk import TrunkPlacement

PROMPT = [5, 80, 200, 7, 31]
N_TOKENS = 10
LOCAL = [0, 1, 2, 3, 4, 5]  # experts in VRAM on the trunk's device (of 16, top-4)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    d = tmp_path_factory.mktemp("trunkexperts") / "fx"
    build_fixture(d, FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    with open_pack(d) as pack, Model(pack) as ref:
        want = ref.generate(PROMPT, N_TOKENS)
    return d, want


def _placement(arch, key: str, other: str | None = "numpy:1") -> Placement:
    """Every tier in every layer: LOCAL on ``key``, two experts on ``other``, four pinned, an LRU of two,
    the rest streamed from disk."""
    return Placement({l: LayerPlacement(vram={key: list(LOCAL), **({other: [6, 7]} if other else {})},
                                        ram_pinned=[8, 9, 10, 11], lru_slots=2) for l in arch.moe_layers})


def _run(pack, placement, devices, trunk_be=None):
    """(tokens, the manager's stats, routing counts, expert ids the manager's run() computed per layer)."""
    rec = RoutingRecorder(pack.arch)
    cpu = get_backend("numpy").open(0)
    rm = ResidencyManager(pack, placement, cpu, devices=devices)
    seen: dict[int, set] = {}
    run = rm.run

    def spy(layer, ids, xs, gates, observed=False):
        seen.setdefault(layer, set()).update(int(e) for e in ids)
        return run(layer, ids, xs, gates, observed=observed)

    rm.run = spy
    try:
        with Model(pack, experts=rm, recorder=rec, trunk_backend=trunk_be, context_tokens=16) as model:
            tokens = model.generate(PROMPT, N_TOKENS)
        return tokens, rm.stats, rec.counts.copy(), seen
    finally:
        rm.close()
        cpu.close()


@pytest.mark.parametrize("backend", backend_params())
def test_local_experts_run_on_the_device_x_with_the_host_paths_tokens_and_counts(fx, backend):
    folder, want = fx
    key = f"{backend}:0"
    be, other = get_backend(backend).open(0), get_backend("numpy").open(0)  # other: "another GPU"
    host_be = get_backend("numpy").open(0)
    calls = count_calls(be, "d_expert_ffn")
    try:
        with open_pack(folder) as pack:
            placement = _placement(pack.arch, key)
            ref_tokens, ref_stats, ref_counts, _ = _run(pack, _placement(pack.arch, "numpy:0"),
                                                        {"numpy:0": host_be, "numpy:1": other})
            tokens, stats, counts, seen = _run(pack, placement, {key: be, "numpy:1": other}, trunk_be=be)
    finally:
        for b in (be, other, host_be):
            b.close()
    assert ref_tokens == want and tokens == want
    assert stats.uses == ref_stats.uses and np.array_equal(counts, ref_counts)
    assert all(stats.uses[t] > 0 for t in ("vram", "ram_pinned", "lru", "disk")), stats.uses
    assert stats.hit_rates() == ref_stats.hit_rates() and stats.disk_bytes == ref_stats.disk_bytes
    # decode steps chose local experts; the manager never computed one (the prefill's T > 1 aside)
    assert calls and sum(calls) <= stats.uses["vram"]
    assert stats.device_compute_s[key] > 0 and stats.device_compute_s["numpy:1"] > 0
    assert stats.layer_wall_s >= stats.device_compute_s[key]


def test_prefill_runs_every_expert_through_the_manager_and_decode_splits(fx):
    folder, _ = fx
    be, cpu = get_backend("numpy").open(0), get_backend("numpy").open(0)
    with open_pack(folder) as pack:
        rm = ResidencyManager(pack, _placement(pack.arch, "numpy:0", None), cpu, devices={"numpy:0": be})
        got: list[tuple[int, list[int], bool]] = []
        run = rm.run
        rm.run = lambda layer, ids, xs, gates, observed=False: (
            got.append((layer, list(ids), observed)) or run(layer, ids, xs, gates, observed=observed))
        with Model(pack, experts=rm, trunk_backend=be) as model:
            cache = model.new_cache()
            model.forward(PROMPT, cache)
            prefill = list(got)
            got.clear()
            model.forward([9], cache)
        rm.close()
    assert [g[0] for g in prefill] == list(pack.arch.moe_layers) and not any(g[2] for g in prefill)
    assert any(set(ids) & set(LOCAL) for _, ids, _ in prefill)  # the prefill keeps the host path
    assert all(observed and not set(ids) & set(LOCAL) for _, ids, observed in got)


def test_all_experts_local_only_x_crosses(fx):
    """Every expert in VRAM on the trunk's device: a decode step puts only its embedding row up and gets
    x (one per MoE layer) and the logits down; the manager's run() is never called."""
    folder, want = fx
    be, cpu = get_backend("numpy").open(0), get_backend("numpy").open(0)
    with open_pack(folder) as pack:
        a = pack.arch
        placement = Placement({l: LayerPlacement(vram={"numpy:0": list(range(a.n_experts))})
                               for l in a.moe_layers})
        rm = ResidencyManager(pack, placement, cpu, devices={"numpy:0": be})
        with Model(pack, experts=rm, trunk_backend=be) as model:
            cache = model.new_cache()
            model.forward(PROMPT, cache)
            before = dict(rm.stats.uses)
            counts = {"put": 0, "get": 0, "run": 0, "inside": 0}
            for name, attr in (("put", "d_put"), ("get", "d_get")):  # the trunk's own, not the op's insides
                fn = getattr(be, attr)
                setattr(be, attr, lambda *a, _fn=fn, _n=name: counts.__setitem__(
                    _n, counts[_n] + (counts["inside"] == 0)) or _fn(*a))
            ffn = be.d_expert_ffn

            def inside(*a):
                counts["inside"] += 1
                try:
                    return ffn(*a)
                finally:
                    counts["inside"] -= 1

            be.d_expert_ffn = inside
            rm.run = lambda *a, **k: counts.__setitem__("run", 1)
            tok = int(np.argmax(model.trunk.last_logits(np.array([want[0]]), cache)))
        uses = rm.stats.uses
        rm.close()
    assert tok == want[1]
    assert counts == {"put": 1, "get": len(a.moe_layers) + 1, "run": 0, "inside": 0}
    # a use per distinct expert of each layer and call: top-k per MoE layer for one token
    assert uses["vram"] - before["vram"] == a.top_k * len(a.moe_layers) and uses["vram"] == sum(uses.values())


def test_local_expert_time_is_measured_on_sampled_steps_only(fx):
    """As on a GPU (attention_every 4, attention untimed): synchronizations bracket the local experts of
    one decode step in four, the other steps are charged the measured seconds per local expert."""
    folder, want = fx
    be, cpu = get_backend("numpy").open(0), get_backend("numpy").open(0)
    with open_pack(folder) as pack:
        rm = ResidencyManager(pack, _placement(pack.arch, "numpy:0", None), cpu, devices={"numpy:0": be})
        syncs = []
        sync = be.synchronize
        be.synchronize = lambda: syncs.append(model.trunk._calls) or sync()
        with Model(pack, experts=rm, trunk_backend=be) as model:
            model.trunk.attention_every, model.trunk.time_attention = 4, False
            assert model.generate(PROMPT, N_TOKENS) == want
            per_expert = model.trunk._local_s / model.trunk._local_n
        st = rm.stats
        rm.close()
    assert syncs and all(c % 4 == 0 for c in syncs)
    assert per_expert > 0 and st.device_compute_s["numpy:0"] > 0


def test_run_placement_reports_the_host_paths_hit_rates(fx):
    folder, want = fx
    with open_pack(folder) as pack:
        placement = _placement(pack.arch, "numpy:0", None)
        host = run_placement(pack, placement, PROMPT, N_TOKENS, cpu_backend="numpy")
        dev = run_placement(pack, placement, PROMPT, N_TOKENS, cpu_backend="numpy",
                            trunk=TrunkPlacement(device="numpy:0", kv_device="numpy:0", context_tokens=16))
    assert host.tokens == dev.tokens == want
    assert dev.hit_rate == host.hit_rate and dev.expert_uses_per_token == host.expert_uses_per_token
    assert dev.expert_compute_s_per_token["numpy:0"] > 0 and dev.expert_layers_s_per_token > 0


@pytest.mark.parametrize("variant", ["qwen2_moe", "olmoe"])
def test_shared_experts_and_local_experts_match_the_cpu_path(tmp_path, variant):
    """A transformers model (Qwen2-MoE: a gated shared expert) in memory, half its experts in VRAM on the
    trunk's device and half pinned: the CPU path's tokens, logits within the trunk tests' bound."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tiny_models import build

    from colibri_plan.engine.weights import load_checkpoint

    build(variant, tmp_path, seed=1)
    w = load_checkpoint(tmp_path)
    a = w.arch
    prompt = [3, 17, 5, 99, 42, 8]
    with Model(w) as ref:
        want_ids = ref.generate(prompt, 12)
        c = ref.new_cache()
        ref.forward(prompt, c)
        want = ref.forward([want_ids[0]], c)
    half = a.n_experts // 2
    placement = Placement({l: LayerPlacement(vram={"numpy:0": list(range(half))},
                                             ram_pinned=list(range(half, a.n_experts)))
                           for l in a.moe_layers})
    be, cpu = get_backend("numpy").open(0), get_backend("numpy").open(0)
    rm = ResidencyManager(w, placement, cpu, devices={"numpy:0": be})
    try:
        with Model(w, experts=rm, trunk_backend=be) as model:
            assert model.generate(prompt, 12) == want_ids
            c = model.new_cache()
            model.forward(prompt, c)
            got = model.forward([want_ids[0]], c)
    finally:
        rm.close()
    assert float(np.abs(got - want).max()) <= 1e-4 * max(1.0, float(np.abs(want).max()))
    assert rm.stats.uses["vram"] > 0 and rm.stats.uses["ram_pinned"] > 0


def test_local_experts_on_the_simulated_cuda_backend(fx, monkeypatch):
    """backends/cuda_experts.py's host side under the engine (tables, work buffers, the sum's launch) on
    the stand-in cupy: the CUDA split without a GPU."""
    folder, want = fx
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from tests.test_backend_cuda_device_sim import device_cupy
    from tests.test_backend_cuda_sim import Sim

    monkeypatch.setitem(sys.modules, "cupy", device_cupy(Sim()))
    be = get_backend("cuda").open(0)
    calls = count_calls(be, "_d_expert_ffn")
    prefill, rows_op = [], be._d_expert_rows  # the prefill's local experts: on the device x too
    be._d_expert_rows = lambda x, ws, rows, gates: prefill.append(x.shape[0]) or rows_op(x, ws, rows, gates)
    try:
        with open_pack(folder) as pack:
            tokens, stats, _, seen = _run(pack, _placement(pack.arch, "cuda:0", None), {"cuda:0": be}, be)
            ref_tokens, ref_stats, _, _ = _run(pack, _placement(pack.arch, "numpy:0", None),
                                               {"numpy:0": get_backend("numpy").open(0)})
    finally:
        be.close()
    assert tokens == want and calls and stats.uses["vram"] > 0
    assert prefill == [len(PROMPT)] * len(pack.arch.moe_layers)  # one call per MoE layer of the prefill
    assert stats.uses == ref_stats.uses  # the host path's counts, prefill included
