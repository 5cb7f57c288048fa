"""The trunk's cost model and placement (planner/trunk.py, planner/trunk_solve.py) on toy numbers."""

from __future__ import annotations

import json

import pytest
from _solver_fixtures import st, toy_profile, toy_spec

from colibri_plan.errors import BudgetError, FormatError, InputError
from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan import load_plan, save_plan, validate_plan
from colibri_plan.formats.plan_trunk import kv_bytes
from colibri_plan.planner import make
from colibri_plan.planner.budgets import resources_from_profile
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.trunk import (
    DEFAULT_GPU_OP_S,
    TrunkFigures,
    dense_read_bytes,
    device_figures,
    split_layers,
    trunk_options,
    trunk_seconds,
)
from colibri_plan.planner.trunk_layer import TrunkWork

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}


def test_trunk_seconds_by_hand():
    fig = TrunkFigures("cuda:0", dense_gbps=100.0, op_s=1e-6, roundtrip_s=20e-6, kv_gbps=((0, 50.0),))
    work = TrunkWork(10**9, n_layers=10, n_moe_layers=5, context_tokens=1000, kv_bytes_per_token=1000)
    dense, attn, rt = trunk_seconds(fig, work, ops_per_layer=10)
    assert rt == pytest.approx(5 * 20e-6)                         # 5 MoE layers x one round trip
    assert dense == pytest.approx(0.01 + 10 * 10 * 1e-6 + 1e-4)   # 1 GB at 100 GB/s + 100 ops + round trips
    assert attn == pytest.approx(1000 * 1000 / 50e9)
    d2, a2, _ = trunk_seconds(fig, TrunkWork(10**9, 10, 5, 1000, 1000), 10, c_dense=2.0, c_attention=3.0)
    assert d2 == pytest.approx(0.02 + 1e-4 + 1e-4) and a2 == pytest.approx(3 * attn)


def test_kv_figure_at_the_nearest_context_and_split_by_free_memory():
    fig = TrunkFigures("x", 1.0, 0.0, 0.0, ((256, 10.0), (4096, 40.0), (32768, 80.0)))
    assert [fig.kv_gbps_at(c) for c in (1, 300, 3000, 100_000)] == [10.0, 10.0, 40.0, 80.0]
    assert split_layers(10, {"a": 30, "b": 10}) == ((0, 7, "a"), (8, 9, "b"))    # 7.5 / 2.5: a takes the .5
    assert split_layers(4, {"a": 1, "b": 0, "c": 3}) == ((0, 0, "a"), (1, 3, "c"))
    assert split_layers(4, {"a": 0}) == ()


def _fig(profile, spec, fmt="int4"):
    res = resources_from_profile(profile, spec, {"cuda:0": 10**9})
    return device_figures(profile, res, spec, fmt, Coefficients())


def test_figures_fall_back_to_matmul_links_and_ram():
    spec = toy_spec(hidden=2048, inter=1024)
    f = _fig(toy_profile(gpus=[GPU]), spec)
    cpu, gpu = f["cpu"], f["cuda:0"]
    assert (cpu.dense_gbps, cpu.op_s, cpu.roundtrip_s, cpu.kv_gbps) == (20.0, 0.0, 0.0, ((0, 40.0),))
    assert (gpu.dense_gbps, gpu.op_s, gpu.kv_gbps) == (60.0, DEFAULT_GPU_OP_S, ((0, 60.0),))
    # 2 link latencies (10 µs) + the f32 hidden state [1, 2048] down and up at 25 GB/s
    assert gpu.roundtrip_s == pytest.approx(2 * 10e-6 + 2 * 2048 * 4 / 25e9)
    assert gpu.sources["dense_gbps"] == "profile matmul at int4"
    assert _fig(toy_profile(gpus=[GPU]), spec, "f16")["cuda:0"].dense_gbps == 60.0   # no f16 row: expert GB/s


def test_figures_from_the_profile_trunk_sections():
    spec = toy_spec(hidden=2048, inter=1024)
    prof = toy_profile(gpus=[GPU])
    row = {"backend": "cuda", "device_index": 0, "device_name": "toy gpu 0"}
    prof.doc["dense_gemv"] = [
        {**row, "fmt": "int4", "out_features": 2048, "in_features": 2048, "tokens": 1, "seconds": st(1e-5),
         "weight_gbps": st(300.0)},
        {**row, "fmt": "int4", "out_features": 151936, "in_features": 2048, "tokens": 1, "seconds": st(1e-4),
         "weight_gbps": st(900.0)},
        {"backend": "cpu", "device_index": 0, "device_name": "toy cpu", "fmt": "int4", "out_features": 2048,
         "in_features": 2048, "tokens": 1, "seconds": st(1e-4), "weight_gbps": st(33.0)}]
    prof.doc["device_ops"] = [{**row, "op_seconds": st(5e-6), "roundtrip_seconds": st(30e-6),
                               "roundtrip_bytes": 32768}]
    prof.doc["attention"] = [{**row, "n_heads": 16, "n_kv_heads": 4, "head_dim": 128, "context_tokens": c,
                              "seconds": st(1e-4), "kv_gbps": st(g)} for c, g in ((256, 20.0), (4096, 200.0))]
    f = _fig(prof, spec)
    gpu = f["cuda:0"]
    assert (gpu.dense_gbps, gpu.op_s, gpu.roundtrip_s) == (300.0, 5e-6, 30e-6)   # [H, H] is the nearest shape
    assert gpu.kv_gbps == ((256, 20.0), (4096, 200.0)) and gpu.kv_gbps_at(8192) == 200.0
    assert f["cpu"].dense_gbps == 33.0 and f["cpu"].kv_gbps == ((0, 40.0),)
    prof.doc["attention"] = {"unavailable": "no GPU"}                   # a section the probe could not take
    assert _fig(prof, spec)["cuda:0"].kv_gbps == ((0, 300.0),)


def test_options_move_trunk_and_kv_bytes_and_split_only_when_no_gpu_holds_them():
    spec = toy_spec(hidden=2048, inter=1024)
    figs = _fig(toy_profile(gpus=[GPU]), spec)
    opts = trunk_options(figs, spec, "int4", 100, {"cuda:0": 10**9}, Coefficients())
    assert [o.name for o in opts] == ["cpu", "cuda:0"]
    dense = dense_read_bytes(spec, "int4")
    cpu, gpu = opts
    assert cpu.vram_bytes == {} and cpu.ram_freed_bytes == 0
    assert gpu.vram_bytes == {"cuda:0": dense + 2 * 64 * 2048}          # 100 tokens = 2 pages, float32 KV
    assert gpu.ram_freed_bytes == dense + 100 * 2048                     # what the RAM budget charged (f32)
    # two GPUs, neither holds trunk + KV alone, together they do: a layer split in proportion to free bytes
    two = dict(figs, **{"cuda:1": TrunkFigures("cuda:1", 60.0, 8e-6, 1e-5, ((0, 60.0),), True)})
    need = dense + 2 * 64 * 1024
    budget = {"cuda:0": need * 3 // 4, "cuda:1": need // 4}
    opts = trunk_options(two, spec, "int4", 100, budget, Coefficients())
    split = opts[-1]
    assert split.name == "split" and split.split == ((0, 2, "cuda:0"), (3, 3, "cuda:1"))
    assert sum(split.vram_bytes.values()) >= need and split.device == "cuda:0"
    one_holds = trunk_options(two, spec, "int4", 100, {"cuda:0": need, "cuda:1": 0}, Coefficients())
    assert "split" not in [o.name for o in one_holds]


def _fast_cpu_profile():
    """A fast CPU (400 GB/s both ways) and a small, slow GPU on a slow link."""
    return toy_profile(gpus=[{"gbps": 50.0, "free_bytes": 2_300_000_000, "h2d": 2.0, "d2h": 2.0}],
                       cpu_gbps=400.0, ram_gbps=400.0, ram_available_bytes=3 * 10**9)


def test_a_fast_cpu_keeps_the_trunk_and_a_fast_gpu_takes_it():
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    plan, _, setup = make_plan(_fast_cpu_profile(), spec, None, SolveOptions(ram="2", context_tokens=100,
                                                                             trunk="auto"))
    rep = plan.doc["solver"]["trunk"]
    assert plan.doc["trunk"]["device"] == "cpu" and rep["chosen"] == "cpu"
    cpu, gpu = rep["options"]
    assert gpu["solved"] and gpu["tok_s"] < cpu["tok_s"] == pytest.approx(plan.doc["predicted"]["tok_s"])
    slow_cpu = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": 2_300_000_000}], ram_available_bytes=3 * 10**9)
    plan2, _, _ = make_plan(slow_cpu, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="auto"))
    assert plan2.doc["trunk"]["device"] == "cuda:0"
    t = plan2.doc["predicted"]["terms"]
    pt = plan2.doc["predicted"]["trunk"]
    assert (t["dense_s"], t["attention_s"]) == (pt["dense_s_per_token"], pt["attention_s_per_token"])
    assert plan2.doc["predicted"]["decode_s_per_token"] == pytest.approx(
        t["dense_s"] + t["attention_s"] + t["expert_layers_s"])


def test_forced_cpu_against_auto_the_vram_trade():
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": 2_150_000_000}], ram_available_bytes=3 * 10**9)
    auto, _, _ = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="auto"))
    cpu, _, _ = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="cpu"))
    moved = dense_read_bytes(spec, "int4") + kv_bytes(100, 2 * spec.kv_bytes_per_token)   # float32 on the GPU
    a, c = auto.doc["budgets"], cpu.doc["budgets"]
    assert c["vram_budget_bytes"]["cuda:0"] - a["vram_budget_bytes"]["cuda:0"] == moved
    assert a["trunk_vram_bytes"] == {"cuda:0": moved} and c["trunk_vram_bytes"] == {}
    assert a["ram_budget_bytes"] - c["ram_budget_bytes"] == dense_read_bytes(spec, "int4") + 100 * 2048
    forced = cpu.doc["solver"]["trunk"]
    assert cpu.doc["trunk"]["device"] == "cpu" and forced["mode"] == "cpu" and forced["chosen"] == "cpu"
    assert [(r["option"], r["solved"]) for r in forced["options"]] == [("cpu", True), ("cuda:0", False)]
    assert auto.doc["predicted"]["tok_s"] > cpu.doc["predicted"]["tok_s"]
    assert auto.counts()["cuda:0"] < cpu.counts()["cuda:0"]             # fewer experts fit beside the trunk
    # the CPU trunk's terms are the cost model's (dense / min(CPU, RAM GB/s), KV / RAM GB/s), the KV at
    # the engine's float32 host cache: 100 tokens · 2048 B
    terms = cpu.doc["predicted"]["terms"]
    assert terms["dense_s"] == pytest.approx(make.dense_read_bytes(spec, "int4") / 20e9)
    assert terms["attention_s"] == pytest.approx(100 * 2048 / 40e9)


def test_refusals_before_solving(monkeypatch):
    def no_solve(*a, **k):
        raise AssertionError("solved before refusing")

    monkeypatch.setattr(make, "_solve", no_solve)
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[GPU], ram_available_bytes=3 * 10**9)
    with pytest.raises(InputError, match=r"--trunk cuda:3: the profile has no device cuda:3; choose "
                                         r"auto, cpu, cuda:0"):
        make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="cuda:3"))
    for ram in ("6", "2"):    # checked before the RAM budget, which would refuse the context otherwise
        with pytest.raises(BudgetError, match=r"KV cache of --context 3000000 tokens needs 6144000000 B "
                                              r"\(6\.14 GB\) there and cuda:0 has 60000000 B"):
            make_plan(toy_profile(gpus=[GPU], ram_available_bytes=8 * 10**9), spec, None,
                      SolveOptions(ram=ram, context_tokens=3_000_000, trunk="cuda:0"))
    big = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=2_000_000_000)   # ~1 GB of int4 trunk
    with pytest.raises(BudgetError, match=r"trunk on cuda:0: the dense trunk and KV cache need \d+ B .* has "
                                          r"60000000 B .*leave -\d\.\d+ GB for experts"):
        make_plan(toy_profile(gpus=[GPU], ram_available_bytes=8 * 10**9), big, None,
                  SolveOptions(ram="6", context_tokens=100, trunk="cuda:0"))
    with pytest.raises(InputError, match="no layer split"):
        make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="split"))


def test_plan_file_round_trip_and_old_plans(tmp_path):
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": 2_300_000_000}], ram_available_bytes=3 * 10**9)
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="cuda:0"))
    back = load_plan(save_plan(plan, tmp_path / "p.json"))
    validate_plan(back)
    assert back.doc["trunk"] == {"device": "cuda:0", "dense_format": "int4",
                                 "dense_bytes": dense_read_bytes(spec, "int4"),
                                 "kv": {"device": "cuda:0", "context_tokens": 100, "page_tokens": 64,
                                        "bytes_per_token": 2048, "bytes": 262144}}   # float32 on the GPU
    assert back.doc["predicted"]["trunk"]["kv_bytes"] == 262144
    bad = json.loads((tmp_path / "p.json").read_text())
    bad["trunk"]["device"] = "cuda:7"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError, match="trunk.device is 'cuda:7'; the plan knows cpu, cuda:0"):
        load_plan(tmp_path / "bad.json")
    old = json.loads((tmp_path / "p.json").read_text())
    del old["trunk"], old["predicted"]["trunk"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert "trunk" not in load_plan(tmp_path / "old.json").doc


def test_a_trunk_no_single_gpu_holds_is_split_over_two(tmp_path):
    from colibri_plan.planner.exports import export_llama_cpp

    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    need = dense_read_bytes(spec, "int4") + kv_bytes(100, spec.kv_bytes_per_token)   # ~0.11 GB
    free = 2 * 10**9 + need * 3 // 4                           # each GPU: 3/4 of it after the 2 GB reserve
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": free}] * 2, ram_available_bytes=3 * 10**9)
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="auto"))
    rows = {r["option"]: r for r in plan.doc["solver"]["trunk"]["options"]}
    assert not rows["cuda:0"]["feasible"] and "need" in rows["cuda:0"]["why"]
    assert plan.doc["trunk"]["split"] == [{"first_layer": 0, "last_layer": 1, "device": "cuda:0"},
                                          {"first_layer": 2, "last_layer": 3, "device": "cuda:1"}]
    took = plan.doc["budgets"]["trunk_vram_bytes"]
    assert set(took) == {"cuda:0", "cuda:1"} and sum(took.values()) >= need
    assert rows["split"]["tok_s"] > rows["cpu"]["tok_s"]
    back = load_plan(save_plan(plan, tmp_path / "split.json"))
    ll = export_llama_cpp(back)
    assert ll["ngl"] == 5 and ll["tensor_split"] == "2,2"
