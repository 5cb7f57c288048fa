"""The mapped-memory ``expert_ffn`` row (the zero-copy pinned tier's figure): the probe writes it on a
backend that declares ``upload_expert_mapped``, the profile keeps it apart from the device rows, the
resources turn it into ``GpuResource.mapped_gbps``, and ``solve`` puts the pinned tier on the trunk's
GPU with it (tests/data/h200-mapped-profile.json: the shipped H200 profile plus synthetic 45 GB/s
mapped rows)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from _cli_fixtures import invoke
from test_profiler_probes import ToyBackend

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.profile import MachineProfile, load_profile
from colibri_plan.model import load_model_spec
from colibri_plan.planner.budgets import gpu_mapped_gbps, resources_from_profile
from colibri_plan.profiler import matmul_probe

DATA = Path(__file__).parent / "data"
MAPPED = DATA / "h200-mapped-profile.json"
SHIPPED = Path(__file__).parents[1] / "profiles" / "h200-16core-gen5.json"


class MappedToy(ToyBackend):
    """The toy host backend declaring the mapped upload (here the plain upload: the plumbing is tested)."""

    uploads: list = []

    @classmethod
    def supports(cls, op):
        return op == "upload_expert_mapped" or super().supports(op)

    def upload_expert_mapped(self, gate, up, down):
        MappedToy.uploads.append(gate.out_features)
        return self.upload_expert(gate, up, down)


def test_the_probe_adds_a_mapped_row_only_where_the_backend_maps(monkeypatch):
    import colibri_plan.backends as backends

    cfg = matmul_probe.MatmulSettings(["int4"], hidden=128, width=64, tokens=(1,), repetitions=3,
                                      ffn_experts=2)
    dev = ToyBackend.list_devices()[0].to_dict()
    monkeypatch.setattr(backends, "get_backend", lambda name: MappedToy)
    MappedToy.uploads = []
    _, ffn, skipped = matmul_probe.probe_matmul([dev], cfg)
    assert [r["memory"] for r in ffn] == ["device", "mapped"] and skipped == []
    assert MappedToy.uploads == [64, 64]        # the mapped row's 2 experts went through the mapped upload
    assert ffn[1]["weight_bytes"] == ffn[0]["weight_bytes"] and "upload_expert_mapped" in ffn[1]["method"]
    monkeypatch.setattr(backends, "get_backend", lambda name: ToyBackend)
    _, ffn, _ = matmul_probe.probe_matmul([dev], cfg)
    assert [r["memory"] for r in ffn] == ["device"]
    assert matmul_probe.maps_experts(ToyBackend) is False and matmul_probe.maps_experts(MappedToy) is True


def test_device_and_mapped_rows_are_kept_apart():
    p = load_profile(MAPPED)
    assert p.expert_ffn_s("cuda", 0, "int4", 8) == pytest.approx(0.000168391, rel=1e-5)   # the device row
    # 8 experts x 18,915,328 B at 45 GB/s
    assert p.mapped_expert_ffn_s("cuda", 0, "int4", 8) == pytest.approx(8 * 18_915_328 / 45e9)
    assert p.mapped_expert_ffn_gbps("cuda", 0, "int4", 8) == pytest.approx(45.0)
    old = load_profile(SHIPPED)                  # no memory key: device rows, and no mapped figure
    assert old.expert_ffn_s("cuda", 0, "int4", 8) == p.expert_ffn_s("cuda", 0, "int4", 8)
    with pytest.raises(InputError, match="mapped-memory expert_ffn"):
        old.mapped_expert_ffn_s("cuda", 0, "int4", 8)


def test_the_checker_refuses_an_unknown_memory():
    doc = json.loads(MAPPED.read_text())
    bad = copy.deepcopy(doc)
    bad["expert_ffn"][-1]["memory"] = "managed"
    with pytest.raises(FormatError, match="memory"):
        MachineProfile(bad)
    MachineProfile(doc)


def test_resources_carry_the_mapped_rate_of_discrete_gpus():
    spec = load_model_spec("qwen3-30b-a3b")
    res = resources_from_profile(load_profile(MAPPED), spec, {"cuda:0": 2_500_000_000})
    assert res.gpus[0].mapped_gbps == pytest.approx(45.0)
    assert resources_from_profile(load_profile(SHIPPED), spec, {}).gpus[0].mapped_gbps == 0.0
    assert gpu_mapped_gbps(load_profile(SHIPPED), "cuda", 0, "int4", spec) == 0.0


def _solve(profile: Path, *extra: str) -> dict:
    r = invoke("solve", "--model", "qwen3-30b-a3b", "--profile", str(profile), "--vram", "4.5", "--json",
               *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_solve_computes_the_pins_zero_copy_on_the_trunks_gpu():
    got, base = _solve(MAPPED), _solve(SHIPPED)
    assert got["compute"]["ram_pinned"] == "cuda:0" and got["compute"]["disk"] == "cpu"
    whole = got["compute_explain"]["ram_pinned_decode_s"]
    assert whole["cuda:0"] < whole["cpu"]
    assert got["predicted"]["tok_s"] == pytest.approx(1 / whole["cuda:0"], rel=1e-6)
    # without a mapped row the same solve keeps the pins on the CPU, at the CPU choice's speed
    assert (base["compute"] or {}).get("ram_pinned", "cpu") == "cpu"
    assert base["predicted"]["tok_s"] == pytest.approx(1 / whole["cpu"], rel=1e-6)
    colibri = _solve(MAPPED, "--target", "colibri")   # colibrì does not do it for a discrete GPU
    assert (colibri["compute"] or {}).get("ram_pinned", "cpu") == "cpu"
