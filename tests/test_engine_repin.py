"""Live re-pinning (engine.repin, issue #16 B): token-exact against the static plan and the all-RAM
reference, re-pins happen and raise the pinned hit rate on the shifted half, the decision rule, the plan's
``repin`` section and the run report's fields."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from colibri_plan.engine.fixture import FixtureConfig, build_fixture, fixture_prompt
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import Placement
from colibri_plan.engine.repin import RepinPolicy
from colibri_plan.engine.session import run_placement
from colibri_plan.errors import FormatError
from colibri_plan.formats.plan import Plan, check_structure
from colibri_plan.formats.report import RunReport
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions
from tests._solver_fixtures import toy_profile, toy_spec

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    path = ROOT / "bench" / "repin_domain_shift.py"
    spec = importlib.util.spec_from_file_location("repin_domain_shift", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("repin") / "fx"
    build_fixture(out, FixtureConfig.small(**_bench().CONFIG))
    return out


def test_domain_shift_repins_token_exact_and_raise_the_pinned_hit_rate(fixture_dir):
    bench = _bench()
    cfg = FixtureConfig.small(**bench.CONFIG)
    prompt = fixture_prompt(cfg.vocab, 16, seed=3)
    policy = RepinPolicy(enabled=True, every_tokens=8, window_tokens=32)
    with open_pack(fixture_dir) as pack:
        ref = run_placement(pack, Placement.all_ram(pack.arch.moe_layers, pack.arch.n_experts), prompt, 33,
                            cpu_backend="numpy")
        static = bench.run_once(pack, bench.shifted_placement(cfg, 8, 2, None), prompt, 32)
        live = bench.run_once(pack, bench.shifted_placement(cfg, 8, 2, policy), prompt, 32)
    assert static["tokens"] == ref.tokens and live["tokens"] == ref.tokens
    assert static["repins"] == 0 and live["repins"] > 0 and live["repin_bytes"] > 0
    assert live["second"]["hit_rate"]["ram_pinned"] > static["second"]["hit_rate"]["ram_pinned"] + 0.05
    assert live["second"]["hit_rate"]["disk"] < static["second"]["hit_rate"]["disk"]


def test_run_report_carries_repins_and_the_placement_is_untouched(fixture_dir):
    bench = _bench()
    cfg = FixtureConfig.small(**bench.CONFIG)
    prompt = fixture_prompt(cfg.vocab, 16, seed=3)
    pl = bench.shifted_placement(cfg, 8, 2, RepinPolicy(enabled=True, every_tokens=4, window_tokens=16))
    pins = {l: list(lp.ram_pinned) for l, lp in pl.layers.items()}
    with open_pack(fixture_dir) as pack:
        rep = run_placement(pack, pl, prompt, 17, cpu_backend="numpy")
        off = run_placement(pack, bench.shifted_placement(cfg, 8, 2, None), prompt, 17, cpu_backend="numpy")
    assert rep.repins > 0 and rep.repin_bytes > 0 and rep.repin_s > 0
    assert {l: lp.ram_pinned for l, lp in pl.layers.items()} == pins   # the manager worked on a copy
    d = rep.to_dict()
    assert d["repins"] == rep.repins and RunReport.from_dict(d).repin_bytes == rep.repin_bytes
    assert off.repins is None and "repins" not in off.to_dict()
    assert rep.tokens == off.tokens


def test_rule_swaps_only_when_the_window_saving_beats_the_migration():
    p = RepinPolicy(enabled=True, every_tokens=8, window_tokens=10, disk_gbps=2.0, h2d_gbps={"cuda:0": 2.0})
    # pinned tier: saving dq x miss_s x W vs one read: swap iff dq x W > 1
    assert p.swap_pays(0.11, 10**6, "ram_pinned") and not p.swap_pays(0.09, 10**6, "ram_pinned")
    # VRAM tier also pays the upload (here as slow as the read): swap iff dq x W > 2
    assert not p.swap_pays(0.15, 10**6, "cuda:0") and p.swap_pays(0.21, 10**6, "cuda:0")


def test_plan_repin_section_is_checked_and_defaults_off():
    assert RepinPolicy.from_doc(None) is None
    pol = RepinPolicy.from_doc({"enabled": True, "every_tokens": 4, "window_tokens": 8},
                               {"disk_read_gbps": 3.5, "gpus": [{"key": "cuda:0", "h2d_gbps": 25.0}]})
    assert pol.disk_gbps == 3.5 and pol.h2d_gbps == {"cuda:0": 25.0} and pol.max_swaps == 4
    for bad in ({"enabled": True, "every_tokens": 0, "window_tokens": 8},
                {"enabled": "yes", "every_tokens": 4, "window_tokens": 8},
                {"enabled": True, "every_tokens": 4, "window_tokens": 8, "bogus": 1}):
        with pytest.raises(FormatError):
            RepinPolicy.from_doc(bad)
    doc = json.loads(json.dumps(make_plan(toy_profile(), toy_spec(), None, SolveOptions(trunk="cpu"))[0].doc))
    doc["repin"] = {"enabled": True, "every_tokens": 16, "window_tokens": 64}
    check_structure(doc, predictions=True)
    assert Placement.from_plan(Plan(doc)).repin.enabled
    assert Placement.from_plan(Plan({**doc, "repin": None})).repin is None
    doc["repin"] = {"enabled": True, "every_tokens": 0, "window_tokens": 8}
    with pytest.raises(FormatError, match="repin.every_tokens"):
        check_structure(doc)
    doc["repin"] = {"enabled": True, "every_tokens": 4, "window_tokens": 8, "often": True}
    with pytest.raises(FormatError, match="unknown keys"):
        check_structure(doc)
