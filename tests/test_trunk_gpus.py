"""The trunk's GPU split as a solver decision (planner/trunk_gpus.py) and colibrì's unified-memory GPU
(planner/compute.py): toy numbers checked by hand, the plan round trip, the export's env vars, the CLI."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from _cli_fixtures import invoke
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import FormatError
from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.model_spec import save_model_spec
from colibri_plan.formats.plan import load_plan, save_plan
from colibri_plan.formats.profile import save_profile
from colibri_plan.planner.compute import colibri_unified_compute, host_seconds
from colibri_plan.planner.costmodel import GpuResource, Resources
from colibri_plan.planner.exports import colibri_env
from colibri_plan.planner.make import build_setup, make_plan
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.trunk import TrunkFigures, TrunkOption, dense_read_bytes, price_trunk
from colibri_plan.planner.trunk_gpus import gpu_split_line, handoffs, round_robin_layers, spread_option


def test_round_robin_layers_and_their_handoffs():
    assert round_robin_layers(5, ["a", "b"]) == ((0, 0, "a"), (1, 1, "b"), (2, 2, "a"), (3, 3, "b"),
                                                 (4, 4, "a"))
    assert handoffs(round_robin_layers(5, ["a", "b"])) == 4          # every boundary changes device
    assert round_robin_layers(3, ["a"]) == ((0, 2, "a"),) and handoffs(((0, 2, "a"),)) == 0
    assert handoffs(((0, 1, "a"), (2, 3, "b"), (4, 4, "b"))) == 1


def test_spread_seconds_and_vram_by_hand():
    # 4 layers, MoE layers 1..3, 4 GB of trunk (no embedding: vocab 0), no KV (context 0)
    spec = SimpleNamespace(n_layers=4, moe_layers=(1, 2, 3), vocab_size=0, hidden_size=64,
                           dense_bytes=lambda fmt: 4 * 10**9)
    figs = {"cuda:0": TrunkFigures("cuda:0", 100.0, 0.0, 1e-4, ((0, 100.0),), True),
            "cuda:1": TrunkFigures("cuda:1", 50.0, 0.0, 2e-4, ((0, 50.0),), True)}
    def price(key, work, share):
        return price_trunk(figs[key], spec, "int4", work, 14, Coefficients(), share)
    opt = spread_option(figs, spec, ["cuda:0", "cuda:1"], 0, 123, 1024, price, TrunkOption,
                        dense_bytes=dense_read_bytes(spec, "int4"))
    assert opt.split == ((0, 0, "cuda:0"), (1, 1, "cuda:1"), (2, 2, "cuda:0"), (3, 3, "cuda:1"))
    # cuda:0 layers 0, 2: 2 GB at 100 GB/s = 0.02 s, one MoE layer (2) x 1e-4; cuda:1 layers 1, 3: 2 GB at
    # 50 GB/s = 0.04 s, two MoE layers x 2e-4; 3 hand-offs x cuda:0's round trip 1e-4
    assert opt.handoff_s == pytest.approx(3e-4)
    assert opt.roundtrip_s == pytest.approx(1e-4 + 4e-4 + 3e-4)
    assert opt.dense_s == pytest.approx(0.02 + 0.04 + 8e-4)
    assert opt.vram_bytes == {"cuda:0": 2 * 10**9, "cuda:1": 2 * 10**9}    # half the layers each
    assert opt.ram_freed_bytes == 123 and opt.device == "cuda:0"


def test_unified_gpu_under_colibri_computes_streamed_experts_zero_copy():
    gpu = GpuResource("cuda:0", matmul_gbps=100.0, unified=True)
    res = Resources(cpu_matmul_gbps=10.0, ram_read_gbps=40.0, gpus=(gpu,))
    col = colibri_unified_compute(res)
    assert dict(col.compute) == {"disk": "cuda:0", "lru": "cuda:0", "ram_pinned": "cuda:0"}
    # 1 GB at min(100, 40) GB/s = 0.025 s each tier; zero copy: no upload on top of a streamed one
    assert host_seconds(col, 10**9, Coefficients()) == pytest.approx((0.025, 0.025, 0.025))
    copied = Resources(10.0, 40.0, gpus=(gpu,), compute=col.compute)
    assert host_seconds(copied, 10**9, Coefficients())[2] == pytest.approx(0.05)   # + 1 GB copy at 40 GB/s
    # the CPU path for comparison: 1 GB at min(10, 40) GB/s
    assert host_seconds(res, 10**9, Coefficients()) == pytest.approx((0.1, 0.1, 0.1))


def test_build_setup_puts_host_tiers_on_the_unified_gpu_only_for_colibri():
    prof = toy_profile(gpus=[{"gbps": 5.0, "free_bytes": 10**9, "unified": True}])  # slower than the CPU
    spec = toy_spec()
    col = build_setup(prof, spec, None, SolveOptions(ram="4", context_tokens=100, target="colibri"))
    assert dict(col.res.compute) == {"disk": "cuda:0", "lru": "cuda:0", "ram_pinned": "cuda:0"}
    ours = build_setup(prof, spec, None, SolveOptions(ram="4", context_tokens=100))
    assert set(dict(ours.res.compute).values()) == {"cpu"}     # ours chooses: the CPU is faster here


def _two_gpu_case(left_mb: int = 300):
    """Two 500 GB/s GPUs with ``left_mb`` MB each after the 2 GB reserve; a 0.1 GB int4 trunk; 48 experts of
    3.1 MB."""
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    per_gpu = 2 * 10**9 + left_mb * 10**6
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": per_gpu}] * 2, ram_available_bytes=3 * 10**9)
    return prof, spec


@pytest.mark.parametrize("left_mb, chosen", [(130, "spread"), (300, "one")])
def test_colibri_spread_or_one_gpu_chosen_by_time_written_to_plan_and_export(tmp_path, left_mb, chosen):
    # 130 MB a GPU: one GPU keeps ~30 MB for experts after the trunk, a spread ~80 MB on each (more VRAM
    # experts beat 3 hand-offs); 300 MB: one GPU's experts nearly all fit and the hand-offs decide
    prof, spec = _two_gpu_case(left_mb)
    plan, _, setup = make_plan(prof, spec, None, SolveOptions(ram="1", context_tokens=100, trunk="auto",
                                                              target="colibri"))
    rows = {r["option"]: r for r in plan.doc["solver"]["trunk"]["options"]}
    assert set(rows) == {"cpu", "cuda:0", "cuda:1", "split"}
    assert rows["cuda:0"]["vram_expert_budget_bytes"]["cuda:1"] == 0     # COLI_GPU=0: no experts on cuda:1
    solved = {k: r["tok_s"] for k, r in rows.items() if r["tok_s"] is not None}
    assert plan.doc["solver"]["trunk"]["chosen"] == max(solved, key=solved.get)
    sec = plan.doc["trunk_gpus"]
    assert sec["version"] == 1 and sec["target"] == "colibri" and sec["chosen"] == chosen
    if chosen == "spread":
        assert sec["devices"] == ["cuda:0", "cuda:1"] and sec["handoffs"] == 3
        assert sec["env"] == {"COLI_GPUS": "0,1", "CUDA_DENSE": "1"}
        assert plan.doc["trunk"]["split"][1] == {"first_layer": 1, "last_layer": 1, "device": "cuda:1"}
        assert plan.counts()["cuda:0"] > 0 and plan.counts()["cuda:1"] > 0
    else:
        assert sec["env"] == {"COLI_GPU": "0", "CUDA_DENSE": "1"} and plan.counts()["cuda:1"] == 0
    assert sec["spread"]["tok_s"] == rows["split"]["tok_s"]
    # --compare's "colibri hot-first (CUDA_DENSE=1 ...)" row: colibrì spreads CUDA_DENSE over COLI_GPUS
    from colibri_plan.planner.compare import trunk_setups

    assert trunk_setups(setup)[1].trunk.name == "split"
    back = load_plan(save_plan(plan, tmp_path / "p.json"))
    assert back.doc["trunk_gpus"] == sec
    env = colibri_env(back, tmp_path / "u")["vars"]
    assert {k: env.get(k) for k in sec["env"]} == sec["env"]
    assert ("COLI_GPUS" in env) == (chosen == "spread")
    assert "Trunk GPUs: " in gpu_split_line(sec) and sec["why"] in gpu_split_line(sec)


def test_colibri_one_gpu_trunk_exports_coli_gpu(tmp_path):
    prof, spec = _two_gpu_case()
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="1", context_tokens=100, trunk="cuda:0",
                                                          target="colibri"))
    sec = plan.doc["trunk_gpus"]
    assert sec["chosen"] == "one" and sec["devices"] == ["cuda:0"] and sec["handoffs"] == 0
    assert plan.counts().get("cuda:1", 0) == 0                  # colibrì's one device list: experts on cuda:0
    env = colibri_env(plan, tmp_path / "u")["vars"]
    assert env["COLI_GPU"] == "0" and "COLI_GPUS" not in env and env["CUDA_DENSE"] == "1"


def test_our_engine_keeps_one_gpu_and_says_so():
    prof, spec = _two_gpu_case()
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="1", context_tokens=100, trunk="auto"))
    sec = plan.doc["trunk_gpus"]
    assert "split" not in {r["option"] for r in plan.doc["solver"]["trunk"]["options"]}
    assert sec["target"] == "colibri-plan" and sec["env"] == {} and sec["spread"] is None
    assert sec["chosen"] == "one" and sec["why"] == "our engine runs one trunk device: one GPU"


def test_old_plans_load_and_a_future_section_version_is_refused(tmp_path):
    prof, spec = _two_gpu_case()
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="1", context_tokens=100, target="colibri"))
    doc = json.loads(save_plan(plan, tmp_path / "p.json").read_text())
    del doc["trunk_gpus"]
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert "trunk_gpus" not in load_plan(tmp_path / "old.json").doc
    doc["trunk_gpus"] = {**plan.doc["trunk_gpus"], "version": 2}
    (tmp_path / "new.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="trunk_gpus.version"):
        load_plan(tmp_path / "new.json")


def test_solve_json_and_text_show_the_gpu_split(tmp_path):
    prof, spec = _two_gpu_case()
    save_profile(prof, tmp_path / "profile.json")
    save_model_spec(spec, tmp_path / "model.json")
    args = ("solve", "--profile", tmp_path / "profile.json", "--model", tmp_path / "model.json", "--ram", "1",
            "--context", "100", "--target", "colibri")
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.output
    sec = json.loads(r.stdout)["trunk_gpus"]
    assert sec["chosen"] in ("cpu", "one", "spread") and sec["spread"] is not None
    r = invoke(*args, "-v")
    assert r.exit_code == 0, r.output
    assert gpu_split_line(sec) in r.output
