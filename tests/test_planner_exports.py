"""planner/exports (issue 16): the colibrì line says DIRECT=1 for an O_DIRECT plan, CUDA_RELEASE_HOST=0
for kept host copies (their bytes inside PIN_GB), which pins the VRAM overhead displaces, and sizes
MTP-layer experts at colibrì's int8 width."""

from __future__ import annotations

import json

from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.formats.plan import Plan
from colibri_plan.planner.exports import export_colibri
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}
SPEC = toy_spec(n_experts=16, hidden=2048, inter=1024)


def _plan(spec=SPEC, **kw):
    opts = SolveOptions(ram="0.58", context_tokens=100, trunk="cpu", **kw)
    return make_plan(toy_profile(gpus=[GPU], ram_available_bytes=3 * 10**9), spec, None, opts)[0]


def test_direct_and_the_displaced_pins(tmp_path):
    plan = _plan()
    out = export_colibri(plan, tmp_path / "u")
    v = out["vars"]
    assert v["DIRECT"] == "1" and v["CUDA_RELEASE_HOST"] == "1"
    note = out["notes"][-1]                       # the plan's VRAM set is full: the overhead pushes some out
    assert "do not fit its VRAM budget (L" in note and "displace the plan's" in note
    assert "coldest pins (L" in note
    doc = json.loads(json.dumps(plan.doc))
    doc["knobs"]["o_direct"] = False   # our buffered reads (page cache inside --ram): colibrì keeps DIRECT=1
    assert export_colibri(Plan(doc), tmp_path / "u2")["vars"]["DIRECT"] == "1"
    doc["knobs"]["target"] = "colibri"   # a colibrì plan that counts on buffered reads: colibrì's default
    assert "DIRECT" not in export_colibri(Plan(doc), tmp_path / "u3")["vars"]


def test_a_colibri_target_plan_needs_no_correction(tmp_path):
    out = export_colibri(_plan(target="colibri"), tmp_path / "u")
    assert not any("do not fit" in n for n in out["notes"])


def test_kept_host_copies(tmp_path):
    plan = _plan(keep_host_copies=True)
    out = export_colibri(plan, tmp_path / "u")
    c, b = plan.counts(), plan.expert_bytes
    assert out["vars"]["CUDA_RELEASE_HOST"] == "0"
    assert any("CUDA_RELEASE_HOST=0" in n for n in out["notes"])
    fit = int(float(out["vars"]["CUDA_EXPERT_GB"]) * 1e9 // (b + 776994))
    # PIN_GB covers the VRAM prefix's host copies too (colibrì does not release them)
    assert float(out["vars"]["PIN_GB"]) * 1e9 >= (c["ram_pinned"] + min(fit, c["cuda:0"])) * b


def test_mtp_experts_at_int8_width(tmp_path):
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, n_layers=4, moe_layers=(1, 2, 3, 4))
    plan = _plan(spec)
    assert plan.doc["model"]["mtp_expert_bytes"] == spec.expert_bytes("int8") > plan.expert_bytes
    out = export_colibri(plan, tmp_path / "u")
    assert any("int8 width" in n for n in out["notes"])
    tiers, b = plan.tiers(), plan.expert_bytes
    mtp = plan.layer_ids.index(4)
    pinned_mtp = int((tiers[mtp] == -1).sum())
    if pinned_mtp:
        low = (plan.counts()["ram_pinned"] - pinned_mtp) * b + pinned_mtp * spec.expert_bytes("int8")
        assert float(out["vars"]["PIN_GB"]) * 1e9 >= low
