"""The placement document and its exports: round trip, refusal of inconsistent files, and the shapes and
field names SGLang's and vLLM(-Ascend)'s loaders read (SGLang's own code where it is installed)."""

import copy
import json

import numpy as np
import pytest

from colibri_plan.errors import FormatError, UnsupportedError
from colibri_plan.formats.ep_export import (
    eplb_tensors,
    export_body,
    sglang_logical_count,
    sglang_mapping,
    vllm_expert_map,
    write_export,
)
from colibri_plan.formats.ep_placement import EpPlacement, load_ep_placement, save_ep_placement
from colibri_plan.formats.heat_align import align_heat
from colibri_plan.heatsynth import synth_heat
from colibri_plan.model import load_model_spec
from colibri_plan.planner.ep_make import EpSettings, build_placement, slot_memory


def _placement(gpus=8, nodes=1, redundant=8, name="olmoe-1b-7b"):
    spec = load_model_spec(name)
    heat = align_heat(synth_heat(spec, seed=1), spec)
    mem = slot_memory(spec, len(spec.decode_moe_layers), None, "not checked")
    return build_placement(spec, heat, EpSettings(gpus, nodes, redundant, trace_tokens=128), mem), spec


@pytest.fixture(scope="module")
def placement():
    return _placement()


def test_round_trip_keeps_every_table(tmp_path, placement):
    pl, spec = placement
    path = save_ep_placement(pl, tmp_path / "ep.json")
    back = load_ep_placement(path)
    assert np.array_equal(back.phy2log(), pl.phy2log()) and back.moe_layers == list(spec.decode_moe_layers)
    s = back.doc["summary"]
    assert s["balancedness"] >= s["eplb"]["balancedness"] and 0 < s["balancedness"] <= 1
    assert back.replicas().sum(axis=1).tolist() == [72] * 16


@pytest.mark.parametrize("edit,words", [
    (lambda d: d["layers"][2]["physical_to_logical"].__setitem__(0, 64), "outside 0..63"),
    (lambda d: d["layers"][0].__setitem__("physical_to_logical", [0] * 72), "replicas disagree"),
    (lambda d: d["topology"].__setitem__("gpu_slots", [9] * 7 + [8]), "does not add up"),
    (lambda d: d.pop("summary"), "no 'summary' section"),
])
def test_inconsistent_documents_are_refused(placement, edit, words):
    doc = copy.deepcopy(placement[0].doc)
    edit(doc)
    with pytest.raises(FormatError, match=words):
        EpPlacement(doc)


def test_sglang_mapping_has_one_row_per_transformer_layer(placement):
    pl, spec = placement
    body = sglang_mapping(pl)
    assert list(body) == ["physical_to_logical_map"]     # SGLang passes the keys on as arguments
    table = np.array(body["physical_to_logical_map"])
    assert table.shape == (spec.n_layers, 72) and table.shape[1] % 8 == 0
    for row in table:                                     # every logical expert has a slot
        assert sorted(set(row.tolist())) == list(range(64))
    assert np.array_equal(table[list(spec.decode_moe_layers)], pl.phy2log())


def test_sglang_logical_count_and_eplb_tensors(placement):
    pl, spec = placement
    counts = np.array(sglang_logical_count(pl)["logical_count"])
    assert counts.shape == (spec.n_layers, 64) and counts.dtype.kind == "i" and counts.min() >= 0
    assert counts[spec.decode_moe_layers[0]].sum() == pytest.approx(1_000_000 * 8, rel=1e-4)
    t = eplb_tensors(pl)
    p2l, l2p, cnt = (np.array(t[k]) for k in ("physical_to_logical_map", "logical_to_physical_map",
                                                "expert_count"))
    assert p2l.shape == (16, 72) and l2p.shape[:2] == (16, 64) and cnt.tolist() == pl.replicas().tolist()
    assert all(p2l[i, s] == e for i in range(16) for e in range(64) for s in l2p[i, e] if s >= 0)


def test_vllm_expert_map_lists_each_devices_experts(placement):
    pl, _ = placement
    body = vllm_expert_map(pl)
    assert body["moe_layer_count"] == 16 and len(body["layer_list"]) == 16
    layer = body["layer_list"][3]
    assert layer["device_count"] == 8 and [d["device_id"] for d in layer["device_list"]] == list(range(8))
    assert sum((d["device_expert"] for d in layer["device_list"]), []) == pl.phy2log()[3].tolist()


def test_uneven_slots_are_refused_for_engines_and_nothing_is_written(tmp_path):
    pl, _ = _placement(gpus=16, nodes=2, redundant=4)    # 68 slots on 16 GPUs: 4-5 each
    assert not pl.even
    with pytest.raises(UnsupportedError, match="--redundant 16"):
        write_export(pl, "sglang", tmp_path / "s.json")
    with pytest.raises(UnsupportedError, match="same slot count"):
        export_body(pl, "vllm")
    assert list(tmp_path.iterdir()) == []
    assert np.array(export_body(pl, "eplb")["physical_to_logical_map"]).shape == (16, 68)


def test_sglang_loader_reads_the_mapping(placement):
    el = pytest.importorskip("sglang.srt.eplb.expert_location",
                             reason="SGLang is not installed: sglang 0.5.23 pins torch 2.14.1 and CUDA-13 "
                                    "packages (flashinfer, sgl-deep-ep, cutlass-dsl) that a CPU machine does "
                                    "not install, and its module alone fails on its other dependencies")
    import torch

    pl, spec = placement
    table = torch.tensor(json.loads(json.dumps(sglang_mapping(pl)))["physical_to_logical_map"])
    l2all = el._compute_logical_to_all_physical_map(table, num_logical_experts=64)
    assert l2all.shape[:2] == (spec.n_layers, 64)
    dispatch = el.compute_logical_to_rank_dispatch_physical_map(l2all, num_gpus=8, num_physical_experts=72,
                                                                ep_rank=0)
    assert torch.all(dispatch >= 0)
