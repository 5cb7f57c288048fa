"""The step probe's arithmetic (colibri_plan/profiler/step_probe.py) and the ``step_graph`` profile section:
schema round trip and reader (formats/profile_trunk.py)."""

from __future__ import annotations

import copy

import pytest
from test_profiler_schema import toy_doc

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.profile import stat
from colibri_plan.formats.profile_check import validate_profile
from colibri_plan.formats.profile_trunk import fastest_gemv_gbps, step_graph
from colibri_plan.profiler.step_probe import FLOOR_S, split_step


def test_split_step_per_layer_and_fixed_by_hand():
    # 2 layers 310 us, 4 layers 520 us: layer (520 - 310) / 2 = 105 us, fixed 310 - 2 * 105 = 100 us
    layer, fixed = split_step([310e-6, 300e-6], [520e-6, 500e-6], 2, 4)
    assert layer == pytest.approx([105e-6, 100e-6])
    assert fixed == pytest.approx([100e-6, 100e-6])
    # 24 layers of the H200 case: 100 us + 24 * 105 us = 2.62 ms per token
    assert fixed[0] + 24 * layer[0] == pytest.approx(2.62e-3)


def test_split_step_floors_noise_and_refuses_bad_input():
    layer, fixed = split_step([300e-6], [290e-6], 2, 4)   # long faster than short: noise
    assert layer == [FLOOR_S] and fixed == [pytest.approx(300e-6)]
    _, fixed = split_step([100e-6], [400e-6], 2, 4)       # per layer 150 us > short / 2
    assert fixed == [FLOOR_S]
    with pytest.raises(InputError):
        split_step([1.0], [1.0, 2.0], 2, 4)
    with pytest.raises(InputError):
        split_step([1.0], [2.0], 4, 4)


def _entry(**kw) -> dict:
    e = {"backend": "cuda", "device_index": 0, "device_name": "H200", "fmt": "int8", "expert_fmt": "int8",
         "hidden": 2048, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128, "vocab": 32000, "n_experts": 32,
         "top_k": 8, "expert_width": 768, "expert_bytes": 4732928, "layer_trunk_bytes": 19034112,
         "context_tokens": 82, "layers_short": 2, "layers_long": 4,
         "step_short_seconds": stat([310e-6]), "step_long_seconds": stat([520e-6]),
         "layer_seconds": stat([105e-6]), "fixed_seconds": stat([100e-6])}
    e.update(kw)
    return e


def _doc(tiny_profile_doc, entries):
    d = copy.deepcopy(tiny_profile_doc)
    d["step_graph"] = entries
    return d


@pytest.fixture
def tiny_profile_doc():
    return toy_doc()


def test_step_graph_round_trip_and_reader(tiny_profile_doc, tmp_path):
    from colibri_plan.formats.profile import MachineProfile, load_profile, save_profile

    doc = _doc(tiny_profile_doc, [_entry()])
    path = save_profile(MachineProfile(doc), tmp_path / "p.json")
    prof = load_profile(path)
    got = step_graph(prof, "cuda", 0, {"hidden": 2048, "top_k": 8, "expert_width": 768, "fmt": "int8"})
    assert got["layer_s"] == pytest.approx(105e-6) and got["fixed_s"] == pytest.approx(100e-6)
    assert got["expert_bytes"] == 4732928 and got["layers_long"] == 4
    assert step_graph(prof, "cuda", 0, {"hidden": 4096}) is None   # another model's shapes
    assert step_graph(prof, "cuda", 1) is None
    old = copy.deepcopy(tiny_profile_doc)   # a profile without the section still loads
    assert step_graph(MachineProfile(old), "cuda", 0) is None
    assert fastest_gemv_gbps(MachineProfile(old), "cuda", 0) is None


@pytest.mark.parametrize("bad", [{"layers_long": 2}, {"expert_fmt": "int7"}, {"fmt": "nope"},
                                 {"layer_seconds": stat([0.0])}])
def test_step_graph_bad_entries_fail(tiny_profile_doc, bad):
    with pytest.raises(FormatError):
        validate_profile(_doc(tiny_profile_doc, [_entry(**bad)]))
