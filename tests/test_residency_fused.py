"""The residency manager's one-call decode step (ResidencyManager.run_sum on the cpu backend's
expert_ffn_sum): taken when every chosen expert is computed on the CPU from RAM, bit-identical logits to the
per-expert path (run + scatter_sum), and the same tier counts, LRU order and timers."""

import numpy as np
import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.residency import ResidencyManager

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
STEPS = 10


@pytest.fixture(scope="module", params=["int4", "int8"])
def fixture_dir(tmp_path_factory, request):
    out = tmp_path_factory.mktemp("fused") / request.param
    build_fixture(out, FixtureConfig.small(layers=2, experts=16, top_k=4, quant=request.param))
    return out


def _placement(arch, shape):
    if shape == "all_ram":
        return Placement.all_ram(arch.moe_layers, arch.n_experts)
    # pinned + an LRU that covers most experts: decode steps of hits only (fused) and steps with misses
    return Placement({l: LayerPlacement(ram_pinned=[0, 5, 7, 11], lru_slots=10) for l in arch.moe_layers})


def _decode(fixture_dir, shape, fused: bool):
    """Logits of the prompt then of STEPS greedy tokens, the stats, the LRU keys per layer and the number
    of one-call steps (the fused path disabled: the manager without run_sum, as before it existed)."""
    pack = open_pack(fixture_dir)
    cpu = get_backend("cpu").open(0)
    rm = ResidencyManager(pack, _placement(pack.arch, shape), cpu)
    calls = [0]
    one_call = rm._fused

    def counted(*a):
        calls[0] += 1
        return one_call(*a)

    rm._fused = counted
    if not fused:
        rm.run_sum = None  # routed_experts then takes route_tokens -> run -> scatter_sum
    try:
        model = Model(pack, experts=rm)
        cache = model.new_cache(len(PROMPT) + STEPS)
        logits = [model.forward(PROMPT, cache)[-1:]]
        for _ in range(STEPS):
            logits.append(model.forward([int(np.argmax(logits[-1]))], cache))  # [1, V]
        lru = {l: list(d) for l, d in rm._lru.items()}
        return np.concatenate(logits), rm.stats, lru, calls[0]
    finally:
        rm.close()
        cpu.close()
        pack.close()


@pytest.mark.parametrize("shape", ["all_ram", "pinned_lru"])
def test_one_call_decode_gives_the_per_expert_paths_bits_and_counts(fixture_dir, shape):
    got, st, lru, calls = _decode(fixture_dir, shape, fused=True)
    want, st0, lru0, calls0 = _decode(fixture_dir, shape, fused=False)
    assert calls0 == 0
    n_moe = len(open_pack(fixture_dir).arch.moe_layers)
    if shape == "all_ram":
        assert calls == STEPS * n_moe  # every decode step of every MoE layer in one call
    else:
        assert 0 < calls < STEPS * n_moe and st.misses > 0  # hit-only steps fused, steps with misses not
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert np.abs(got).max() > 0
    assert st.uses == st0.uses and st.disk_bytes == st0.disk_bytes
    assert lru == lru0  # the same LRU contents in the same recency order
    assert st.cpu_compute_s > 0 and st.layer_wall_s >= st.cpu_compute_s


def test_a_device_expert_keeps_the_per_expert_path(fixture_dir):
    pack = open_pack(fixture_dir)
    arch = pack.arch
    every = list(range(arch.n_experts))
    pl = Placement({l: LayerPlacement(vram={"numpy:1": every}) for l in arch.moe_layers})
    cpu, dev = get_backend("cpu").open(0), get_backend("numpy").open(0)
    rm = ResidencyManager(pack, pl, cpu, devices={"numpy:1": dev})
    calls = [0]
    one_call = rm._fused
    rm._fused = lambda *a: (calls.__setitem__(0, calls[0] + 1), one_call(*a))[1]
    try:
        Model(pack, experts=rm).generate(PROMPT, 4)
        assert calls[0] == 0 and rm.stats.uses["vram"] > 0 and rm.stats.device_compute_s["numpy:1"] > 0
    finally:
        rm.close()
        cpu.close()
        dev.close()
        pack.close()


def test_live_repinning_sees_the_same_routing_through_the_one_call_path(tmp_path, monkeypatch):
    """Re-pinning counts the routing before the tier lookup (a round may swap tiers): with and without
    run_sum the same swaps, tokens and tier counts."""
    import importlib.util
    from pathlib import Path

    from colibri_plan.engine.fixture import fixture_prompt
    from colibri_plan.engine.repin import RepinPolicy
    from colibri_plan.engine.session import run_placement

    path = Path(__file__).resolve().parents[1] / "bench" / "repin_domain_shift.py"
    spec = importlib.util.spec_from_file_location("repin_domain_shift", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = FixtureConfig.small(**bench.CONFIG)
    build_fixture(tmp_path / "fx", cfg)
    prompt = fixture_prompt(cfg.vocab, 16, seed=3)
    policy = RepinPolicy(enabled=True, every_tokens=4, window_tokens=16)
    from colibri_plan.backends.cpu.experts import CpuExperts

    calls = [0]
    one_call = CpuExperts.expert_ffn_sum

    def counted(self, *a):
        calls[0] += 1
        return one_call(self, *a)

    monkeypatch.setattr(CpuExperts, "expert_ffn_sum", counted)
    reports, n_calls = [], []
    for fused in (True, False):
        if not fused:
            monkeypatch.delattr(ResidencyManager, "run_sum")
        with open_pack(tmp_path / "fx") as pack:
            reports.append(run_placement(pack, bench.shifted_placement(cfg, 8, 2, policy), prompt, 17,
                                         cpu_backend="cpu"))
        n_calls.append(calls[0])
    got, want = reports
    assert n_calls[0] > 0 and n_calls[1] == n_calls[0]  # one-call steps taken, then none without run_sum
    assert got.repins > 0 and got.repins == want.repins and got.repin_bytes == want.repin_bytes
    assert got.tokens == want.tokens and got.hit_rate == want.hit_rate
