"""A unified-memory device computing the host tiers (issue #16 A): the plan's ``compute`` choice from the
profile's figures, the engine computing pinned, cached and streamed experts on Vulkan (lavapipe here: a CPU
Vulkan device, whose memory is host memory) token-exact against the CPU reference, hot-first using
unified GPUs, and the plan checks."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.session import run_placement
from colibri_plan.engine.unified import TierCompute, check_compute
from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan import Plan, check_structure, load_plan, save_plan
from colibri_plan.planner.baselines import hot_first
from colibri_plan.planner.compute import choose_compute, host_seconds
from colibri_plan.planner.costmodel import GpuResource, Resources
from colibri_plan.planner.make import build_setup, make_plan
from colibri_plan.planner.options import SolveOptions
from tests._solver_fixtures import toy_profile

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
VK = pytest.mark.skipif(not get_backend("vulkan").is_available(), reason="no Vulkan device here")


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("unified") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=16, top_k=4))
    return out


def _vulkan_profile(gbps: float = 60.0):
    """A toy profile whose one GPU is a unified-memory "vulkan:0" (the CPU: 10 GB/s, RAM 40 GB/s)."""
    prof = toy_profile([{"gbps": gbps, "free_bytes": 8 * 10**9, "unified": True}], cpu_gbps=10.0)
    for sec in ("devices", "links", "matmul"):
        for row in prof.doc[sec]:
            if row.get("backend") == "cuda":
                row["backend"] = "vulkan"
    return prof


def _ram(spec, n_experts: int) -> str:
    """A --ram (GB) that leaves ``n_experts`` experts' bytes for pins and slots at --context 16."""
    b = build_setup(_vulkan_profile(), spec, None, SolveOptions(context_tokens=16)).budgets
    return f"{(b.dense_bytes + b.kv_bytes + b.working_bytes + n_experts * spec.expert_bytes()) / 1e9:.9f}"


def test_choose_compute_picks_the_faster_processor_and_charges_the_upload():
    cpu_only = Resources(cpu_matmul_gbps=20.0, ram_read_gbps=40.0, disk_read_gbps=2.0)
    fast = GpuResource("vulkan:0", matmul_gbps=60.0, unified=True)
    res, explain = choose_compute(Resources(cpu_matmul_gbps=15.0, ram_read_gbps=40.0, disk_read_gbps=2.0,
                                            gpus=(fast,)), 10**8, Coefficients())
    assert dict(res.compute) == {"ram_pinned": "vulkan:0", "lru": "vulkan:0", "disk": "vulkan:0"}
    # pinned: b / min(60, 40) on the GPU vs b / 20 on the CPU; a miss adds the upload copy b / 40
    assert explain["ram_pinned"]["vulkan:0"] == pytest.approx(1e8 / 40e9)
    assert explain["disk"]["vulkan:0"] == pytest.approx(2e8 / 40e9)
    assert explain["disk"]["cpu"] == pytest.approx(1e8 / 15e9)
    assert host_seconds(cpu_only, 10**8, Coefficients()) == pytest.approx((5e-3, 5e-3, 5e-3))
    # a GPU just faster than the CPU takes the pins but not the misses (the upload copy tips it)
    near = GpuResource("vulkan:0", matmul_gbps=25.0, unified=True)
    res, _ = choose_compute(Resources(cpu_matmul_gbps=20.0, ram_read_gbps=40.0, disk_read_gbps=2.0,
                                      gpus=(near,)), 10**8, Coefficients())
    assert dict(res.compute) == {"ram_pinned": "vulkan:0", "lru": "cpu", "disk": "cpu"}


def test_plan_from_a_unified_profile_computes_streamed_experts_on_the_gpu(fixture_dir, tmp_path):
    with open_pack(fixture_dir) as pack:
        spec = pack.spec()
    plan = make_plan(_vulkan_profile(), spec, None, SolveOptions(ram=_ram(spec, 12), context_tokens=16,
                                                                 vram="0", headroom=0, lru_slots="1",
                                                                 trunk="cpu"))[0]
    assert plan.doc["compute"]["disk"] == "vulkan:0" and plan.doc["compute"]["lru"] == "vulkan:0"
    assert plan.doc["compute_explain"]["disk"]["vulkan:0"] < plan.doc["compute_explain"]["disk"]["cpu"]
    assert plan.counts()["disk"] > 0
    save_plan(plan, tmp_path / "p.json")
    assert load_plan(tmp_path / "p.json").doc["compute"] == plan.doc["compute"]


@VK
def test_engine_computes_host_tiers_on_vulkan_token_exact(fixture_dir):
    """Pinned, LRU-cached and streamed experts all on lavapipe: the same tokens as the all-RAM CPU run,
    every host tier used, the CPU computing no expert."""
    with open_pack(fixture_dir) as pack:
        arch = pack.arch
        ref = run_placement(pack, Placement.all_ram(arch.moe_layers, arch.n_experts), PROMPT, 12,
                            cpu_backend="numpy")
        compute = dict.fromkeys(("ram_pinned", "lru", "disk"), "vulkan:0")
        pl = Placement({l: LayerPlacement(ram_pinned=[0, 1, 2, 3, 4], lru_slots=2) for l in arch.moe_layers},
                       compute=compute)
        rep = run_placement(pack, pl, PROMPT, 12, cpu_backend="numpy")
        mixed = Placement({l: LayerPlacement(ram_pinned=[0, 1, 2], lru_slots=3) for l in arch.moe_layers},
                          compute={"ram_pinned": "vulkan:0"})
        rep2 = run_placement(pack, mixed, PROMPT, 12, cpu_backend="numpy")
    assert rep.tokens == ref.tokens and rep2.tokens == ref.tokens
    h = rep.hit_rate
    assert h["ram_pinned"] > 0 and h["lru"] > 0 and h["disk"] > 0
    assert rep.expert_compute_s_per_token["vulkan:0"] > 0 and rep.expert_compute_s_per_token["cpu"] == 0
    assert rep.resident_bytes["ram_pinned"] == 0 and rep.resident_bytes["vulkan:0"] > 0
    assert rep2.expert_compute_s_per_token["cpu"] > 0 and rep2.expert_compute_s_per_token["vulkan:0"] > 0


@VK
def test_plan_compute_runs_through_the_engine(fixture_dir):
    """The solved plan (unified vulkan:0 computing the host tiers) run by the engine: token-exact."""
    with open_pack(fixture_dir) as pack:
        spec, arch = pack.spec(), pack.arch
        plan = make_plan(_vulkan_profile(), spec, None, SolveOptions(ram=_ram(spec, 12), context_tokens=16,
                                                                     vram="0", headroom=0, lru_slots="1",
                                                                     trunk="cpu"))[0]
        pl = Placement.from_plan(plan)
        assert pl.compute["disk"] == "vulkan:0" and pl.device_keys() == ["vulkan:0"]
        ref = run_placement(pack, Placement.all_ram(arch.moe_layers, arch.n_experts), PROMPT, 8,
                            cpu_backend="numpy")
        rep = run_placement(pack, pl, PROMPT, 8, cpu_backend="numpy")
    assert rep.tokens == ref.tokens and rep.hit_rate["disk"] > 0
    assert rep.expert_compute_s_per_token["vulkan:0"] > 0


def test_hot_first_uses_unified_gpus(fixture_dir):
    """Before issue #16 hot-first skipped unified GPUs: with a CPU-computed pinned tier it now deals
    pins to a unified GPU too (least-loaded in seconds), so --compare's baseline is not handicapped."""
    with open_pack(fixture_dir) as pack:
        spec = pack.spec()
    setup = build_setup(_vulkan_profile(gbps=25.0), spec, None, SolveOptions(ram=_ram(spec, 20),
                                                                             context_tokens=16, vram="0",
                                                                             headroom=0, lru_slots="1"))
    assert dict(setup.res.compute)["ram_pinned"] == "vulkan:0"   # 25 > 20 GB/s: the GPU takes the pins
    tiers, _ = hot_first(setup.problem)
    assert np.sum(tiers == -1) > 0   # pins (computed on vulkan:0 through compute)
    cpu_pins = dataclasses.replace(setup.problem, res=dataclasses.replace(setup.res, compute=()))
    tiers2, _ = hot_first(cpu_pins)
    assert np.sum(tiers2 == 0) > 0 and np.sum(tiers2 == -1) > 0   # split between the GPU and the CPU


def test_plan_checks_compute_and_tier_compute_refuses_discrete(fixture_dir):
    with open_pack(fixture_dir) as pack:
        spec = pack.spec()
    plan = make_plan(_vulkan_profile(), spec, None, SolveOptions(ram=_ram(spec, 12), context_tokens=16,
                                                                 vram="0", headroom=0, lru_slots="1",
                                                                 trunk="cpu"))[0]
    doc = json.loads(json.dumps(plan.doc))
    doc["compute"]["disk"] = "cuda:3"
    with pytest.raises(FormatError, match="compute.disk"):
        check_structure(doc, predictions=True)
    doc["compute"] = {"vram": "cpu"}
    with pytest.raises(FormatError, match="unknown tier"):
        check_structure(Plan(doc).doc)
    with pytest.raises(InputError, match="unknown tier"):
        check_compute({"gpu": "cpu"})

    class _Discrete:
        class device:   # noqa: N801 - a DeviceInfo stand-in
            unified_memory, name = False, "toy dGPU"

    with pytest.raises(InputError, match="no unified memory"):
        TierCompute({"disk": "cuda:0"}, {"cuda:0": _Discrete()})
    with pytest.raises(InputError, match="no such device is open"):
        TierCompute({"disk": "vulkan:0"}, {})
