"""Tiered residency: token-exact for every plan shape, honest tier counters, and clean faults."""

import os

import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.residency import ResidencyManager
from colibri_plan.errors import DeviceOutOfMemoryError, FormatError, InputError, IntegrityError

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N_TOKENS = 12


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("res") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=32, top_k=4))
    return out


@pytest.fixture(scope="module")
def reference_tokens(fixture_dir):
    with open_pack(fixture_dir) as pack:
        return Model(pack, backend_name="numpy").generate(PROMPT, N_TOKENS)


def _generate(fixture_dir, placement, devices=None, **kw):
    pack = open_pack(fixture_dir)
    cpu = get_backend("numpy").open(0)
    rm = ResidencyManager(pack, placement, cpu, devices=devices, **kw)
    try:
        return Model(pack, experts=rm).generate(PROMPT, N_TOKENS), rm.stats, rm
    finally:
        rm.close()
        pack.close()


def _mixed(arch):
    return Placement({l: LayerPlacement(ram_pinned=[0, 5, 7, 11], lru_slots=3) for l in arch.moe_layers})


@pytest.mark.parametrize("shape", ["all_ram", "all_disk_1_slot", "all_disk_no_slot", "mixed", "device"])
def test_token_exact_for_every_plan_shape(fixture_dir, reference_tokens, shape):
    with open_pack(fixture_dir) as pack:
        arch = pack.arch
    devices = None
    if shape == "all_ram":
        pl = Placement.all_ram(arch.moe_layers, arch.n_experts)
    elif shape == "all_disk_1_slot":
        pl = Placement.all_disk(arch.moe_layers, 1)
    elif shape == "all_disk_no_slot":
        pl = Placement.all_disk(arch.moe_layers, 0)
    elif shape == "mixed":
        pl = _mixed(arch)
    else:  # a second backend instance standing in for a GPU: its own "VRAM" tier and thread
        pl = Placement({l: LayerPlacement(vram={"numpy:1": list(range(0, 32, 2))}, ram_pinned=[1, 3],
                                          lru_slots=2) for l in arch.moe_layers})
        devices = {"numpy:1": get_backend("numpy").open(0)}
    tokens, stats, _ = _generate(fixture_dir, pl, devices)
    assert tokens == reference_tokens
    uses = stats.expert_uses
    assert uses > 0
    if shape == "all_ram":
        assert stats.uses["ram_pinned"] == uses and stats.misses == 0 and stats.disk_bytes == 0
    if shape.startswith("all_disk"):
        assert stats.uses["ram_pinned"] == 0 and stats.misses > 0
        assert stats.disk_bytes == stats.misses * open_pack(fixture_dir).expert_location(0, 0)[1]
    if shape == "all_disk_no_slot":
        assert stats.uses["lru"] == 0 and stats.misses == uses
    if shape == "device":
        assert stats.uses["vram"] > 0 and stats.device_compute_s["numpy:1"] > 0


def test_lru_counts_match_a_simulation(fixture_dir):
    """The manager's hit/miss counts equal a plain LRU simulation over the routed expert ids."""
    with open_pack(fixture_dir) as pack:
        arch = pack.arch
        ref = Model(pack, backend_name="numpy")
        ref.generate(PROMPT, N_TOKENS)
        slots = 3
        hits = misses = 0
        for layer in arch.moe_layers:
            lru: list[int] = []
            ids = ref.routing.topk_ids(layer)  # [T, K] in forward order
            calls = [ids[: len(PROMPT)]] + [ids[t: t + 1] for t in range(len(PROMPT), len(ids))]
            for call in calls:
                chosen = sorted(set(int(e) for e in call.ravel()))
                hit = [e for e in chosen if e in lru]
                hits += len(hit)
                misses += len(chosen) - len(hit)
                for e in hit:
                    lru.remove(e)
                    lru.append(e)
                for e in chosen:
                    if e not in hit:
                        lru.append(e)
                lru = lru[-slots:] if len(lru) > slots else lru
        ref.close()
    _, stats, _ = _generate(fixture_dir, Placement.all_disk(arch.moe_layers, slots))
    assert (stats.uses["lru"], stats.misses) == (hits, misses)


def test_resident_bytes_counts_each_byte_once(fixture_dir):
    with open_pack(fixture_dir) as pack:
        arch, block = pack.arch, pack.expert_location(0, 0)[1]
        cpu = get_backend("numpy").open(0)
        dev = get_backend("numpy").open(0)
        pl = Placement({l: LayerPlacement(vram={"numpy:1": [0, 1, 2]}, ram_pinned=[3, 4], lru_slots=2)
                        for l in arch.moe_layers})
        with_dev = ResidencyManager(pack, pl, cpu, devices={"numpy:1": dev}, working_buffers=4)
        got = with_dev.resident_bytes()
        with_dev.close()
    n = len(arch.moe_layers)
    assert got["ram_pinned"] == n * 2 * block
    assert got["ram_buffers"] == (n * 2 + 4) * block
    assert got["numpy:1"] == n * 3 * block - n * 3 * (block - _expert_payload(fixture_dir))


def _expert_payload(fixture_dir):
    with open_pack(fixture_dir) as pack:
        return sum(qt.nbytes for qt in pack.expert(0, 0))


def test_vram_out_of_memory_before_inference(fixture_dir):
    class SmallDevice(get_backend("numpy")):
        def capacity_bytes(self):
            return 3 * _expert_payload(fixture_dir)

    with open_pack(fixture_dir) as pack:
        arch = pack.arch
        dev = SmallDevice(get_backend("numpy").list_devices()[0])
        pl = Placement({l: LayerPlacement(vram={"gpu:0": [0, 1]}) for l in arch.moe_layers})
        with pytest.raises(DeviceOutOfMemoryError) as err:
            ResidencyManager(pack, pl, get_backend("numpy").open(0), devices={"gpu:0": dev})
        assert err.value.requested_bytes > 0 and err.value.held_bytes == 3 * _expert_payload(fixture_dir)
        assert dev.memory_used() == 0  # nothing left uploaded


def _copy_pack(src, dst):
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_checksum_mismatch_on_a_streamed_expert(fixture_dir, tmp_path):
    bad = _copy_pack(fixture_dir, tmp_path / "bad")
    with open_pack(bad) as pack:
        off, nbytes, _ = pack.expert_location(1, 0)
    with open(bad / "experts.bin", "r+b") as f:  # flip one byte inside every expert of layer 1
        for e in range(32):
            f.seek(off + e * nbytes + 100)
            b = f.read(1)
            f.seek(off + e * nbytes + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="crc32"):
        _generate(bad, Placement.all_disk(range(2), 1))


def test_pack_truncated_mid_run(fixture_dir, tmp_path):
    bad = _copy_pack(fixture_dir, tmp_path / "trunc")
    pack = open_pack(bad)
    rm = ResidencyManager(pack, Placement.all_disk(pack.arch.moe_layers, 0), get_backend("numpy").open(0))
    model = Model(pack, experts=rm)
    model.generate(PROMPT, 2)
    os.truncate(bad / "experts.bin", pack.expert_location(1, 0)[0])  # layer 1 gone
    with pytest.raises(IntegrityError, match="short read|truncated"):
        model.generate(PROMPT, 2)
    rm.close()
    pack.close()


def test_pack_deleted_mid_run_keeps_serving_from_the_open_file(fixture_dir, tmp_path, reference_tokens):
    """Documented behaviour: the open descriptor keeps the unlinked file readable; tokens stay exact."""
    victim = _copy_pack(fixture_dir, tmp_path / "del")
    pack = open_pack(victim)
    rm = ResidencyManager(pack, Placement.all_disk(pack.arch.moe_layers, 1), get_backend("numpy").open(0))
    os.unlink(victim / "experts.bin")
    assert Model(pack, experts=rm).generate(PROMPT, N_TOKENS) == reference_tokens
    rm.close()
    pack.close()


def test_bad_placements(fixture_dir):
    with open_pack(fixture_dir) as pack:
        cpu = get_backend("numpy").open(0)
        with pytest.raises(FormatError, match="two tiers"):
            ResidencyManager(pack, Placement({0: LayerPlacement(vram={"x:0": [1]}, ram_pinned=[1])}), cpu,
                             devices={"x:0": cpu})
        with pytest.raises(FormatError, match="out of range"):
            ResidencyManager(pack, Placement({0: LayerPlacement(ram_pinned=[99])}), cpu)
        with pytest.raises(FormatError, match="not a MoE layer"):
            ResidencyManager(pack, Placement({7: LayerPlacement()}), cpu)
        with pytest.raises(InputError, match="no such device"):
            ResidencyManager(pack, Placement({0: LayerPlacement(vram={"cuda:0": [1]})}), cpu)


def test_weights_held_in_memory_run_all_resident_and_refuse_streaming(fixture_dir, reference_tokens):
    """A checkpoint folder's weights (in memory, no experts.bin) take the same run path with every
    expert resident; a placement that streams needs a pack."""
    from colibri_plan.engine import runner
    from colibri_plan.engine.weights import InMemoryWeights
    from colibri_plan.run_options import RunOptions

    with open_pack(fixture_dir) as pack:
        arch = pack.arch
        mem = InMemoryWeights(arch, dict(pack.dense), {k: pack.expert(*k) for k in pack.expert_keys()},
                              pack.expert_format)
        rep = runner.generate(mem, PROMPT, RunOptions(tokens=len(reference_tokens), backend="numpy"))
        assert rep.hit_rate["ram_pinned"] == 1 and rep.disk_bytes_per_token == 0
        with pytest.raises(InputError, match="needs an expert pack"):
            ResidencyManager(mem, Placement.all_disk(arch.moe_layers, 1), get_backend("numpy").open(0))
    assert rep.tokens == reference_tokens
