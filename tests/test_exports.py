"""llama.cpp export: whole layers to the GPUs by the plan's VRAM-served selections, within VRAM budgets."""

import json
import re

import pytest
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.formats.plan import Plan, check_structure, validate_plan
from colibri_plan.planner.exports import export_llama_cpp

B = 100                                    # expert bytes: a whole layer of 4 experts is 400 B


def toy_plan(vram_budget=None, keys=("cuda:0", "cuda:1"), check_budgets=True):
    """2 GPUs, 4 MoE layers of 4 experts (top-2) and an MTP row (layer 4) that has no blk.N tensors.

    VRAM-served selection mass per layer (sum of p over its VRAM experts): L0 1.4, L1 1.0, L2 1.9, L3 0.7,
    MTP 2.0 (hottest, but not exportable).
    """
    k0, k1 = keys
    rows = [  # (p, {device: ids})
        ([0.8, 0.6, 0.4, 0.2], {k0: [0], k1: [1]}),
        ([0.5, 0.5, 0.5, 0.5], {k0: [0, 1]}),
        ([0.9, 0.9, 0.1, 0.1], {k0: [0, 1], k1: [2]}),
        ([0.7, 0.7, 0.3, 0.3], {k1: [0]}),
        ([1.0, 1.0, 0.0, 0.0], {k1: [0, 1]}),
    ]
    layers = []
    for lid, (p, vram) in enumerate(rows):
        held = {e for ids in vram.values() for e in ids}
        layers.append({"layer": lid, "vram": vram, "ram_pinned": [e for e in range(4) if e not in held],
                       "lru_slots": 0, "disk": [], "p": p})
    doc = {"kind": "plan", "schema_version": 1,
           "model": {"name": "toy", "fingerprint": "0" * 16, "n_experts": 4, "top_k": 2, "n_layers": 4,
                     "expert_bytes": B, "moe_layers": [0, 1, 2, 3, 4]},
           "profile": {}, "heat": {}, "expert_format": "int4", "solver": {}, "predicted": {},
           "budgets": {"ram_budget_bytes": 20 * B,
                       "vram_budget_bytes": vram_budget or {k0: 8 * B + 99, k1: 5 * B}},
           "devices": [{"key": k, "unified": False} for k in keys], "layers": layers}
    check_structure(doc)
    plan = Plan(doc)
    if check_budgets:
        validate_plan(plan)
    return plan


def test_two_gpus_hand_checked():
    out = export_llama_cpp(toy_plan())
    # ranked by VRAM-served mass L2 > L0 > L1 > L3 (MTP row skipped); cuda:0 fits 2 layers, cuda:1 one
    assert out["layers"] == {"CUDA0": [0, 2], "CUDA1": [1], "CPU": [3]}
    # promoted RAM experts: L2 1 + L0 2 + L1 2; demoted VRAM experts: L3 1
    assert out["moved_experts"] == 6
    # VRAM experts landing on the other GPU: L2 expert 2, L0 expert 1, L1 experts 0 and 1
    assert out["moved_device_experts"] == 4
    assert out["gpu_share"]["plan"] == pytest.approx(5.0 / 8)
    assert out["gpu_share"]["export"] == pytest.approx(6.0 / 8)
    assert "export 75.0%, plan 62.5%" in " ".join(out["notes"])
    assert out["patterns"][0] == r"blk\.(0|2)\.ffn_(gate|up|down)_exps=CUDA0"
    pats = [(re.compile(p.split("=")[0]), p.split("=")[1]) for p in out["patterns"]]
    for lid, dev in [(0, "CUDA0"), (1, "CUDA1"), (2, "CUDA0"), (3, "CPU")]:
        for kind in ("gate", "up", "down"):
            assert [d for rx, d in pats if rx.search(f"blk.{lid}.ffn_{kind}_exps.weight")] == [dev]
    assert not any(rx.search("blk.4.ffn_up_exps.weight") for rx, _ in pats)


def test_budget_limits_and_single_gpu_naming():
    # budgets smaller than one layer (e.g. the plan's budgets were cut down for a smaller card; the plan
    # itself no longer fits them, the export must still respect them): one usable GPU (vulkan:0, two
    # layers' worth) takes the two hottest layers
    out = export_llama_cpp(toy_plan({"vulkan:0": 8 * B, "cuda:1": 3 * B}, ("vulkan:0", "cuda:1"), False))
    assert out["layers"] == {"Vulkan0": [0, 2], "CPU": [1, 3]}
    # no VRAM budget at all: everything on the CPU, every planned VRAM expert demoted (MTP row excluded)
    out = export_llama_cpp(toy_plan({"cuda:0": 3 * B, "cuda:1": 3 * B}, check_budgets=False))
    assert out["layers"] == {"CPU": [0, 1, 2, 3]} and out["moved_experts"] == 2 + 2 + 3 + 1
    assert out["gpu_share"]["export"] == 0.0


def test_glm_6gpu_plan_uses_every_gpu(tmp_path):
    path = tmp_path / "p.json"
    r = CliRunner().invoke(cli, ["solve", "--profile", "published-6x-rtx5090", "--model", "glm-5.2",
                                 "--out", str(path)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["export", str(path), "--to", "llama.cpp", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    doc = json.loads(path.read_text())
    layer_bytes = doc["model"]["n_experts"] * doc["model"]["expert_bytes"]
    for i in range(6):
        ids = out["layers"].get(f"CUDA{i}", [])
        assert ids, f"CUDA{i} got no layer"
        assert len(ids) * layer_bytes <= doc["budgets"]["vram_budget_bytes"][f"cuda:{i}"]
    placed = sorted(x for ids in out["layers"].values() for x in ids)
    assert placed == [x for x in doc["model"]["moe_layers"] if x < doc["model"]["n_layers"]]
    # the plan-side share matches the solver's own prediction of VRAM-served selections
    assert out["gpu_share"]["plan"] == pytest.approx(doc["predicted"]["hit_rate"]["vram"], abs=1e-3)
    assert 0.3 < out["gpu_share"]["export"] <= out["gpu_share"]["plan"]
    human = CliRunner().invoke(cli, ["export", str(path), "--to", "llama.cpp"]).stdout
    assert "=CUDA5" in human and "# " in human and "selections served from GPU" in human
