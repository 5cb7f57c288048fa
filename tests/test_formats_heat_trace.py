"""formats/heat_trace: the optional token-level routing trace of a heat document (written by `run
--stats-out`), bounded and checked on read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibri_plan.errors import FormatError
from colibri_plan.formats.heat import Heat, load_heat, save_heat
from colibri_plan.formats.heat_trace import MAX_TRACE_IDS, RoutingTrace


def _heat(trace=None):
    return Heat(n_experts=4, layers=(1, 2), counts=np.array([[2.0, 1, 0, 1], [1, 1, 1, 1]]), top_k=2,
                tokens=2, trace=trace)


def test_trace_round_trips_and_heat_without_one_is_unchanged(tmp_path):
    calls = {1: [np.array([[0, 1]]), np.array([[0, 3]])], 2: [np.array([[1, 2]]), np.array([[0, 3]])]}
    tr = RoutingTrace.from_calls((1, 2), 2, calls)
    assert tr.steps == (1, 1) and tr.rows(2).tolist() == [[1, 2], [0, 3]] and tr.rows(9) is None
    save_heat(_heat(tr), tmp_path / "h.json")
    back = load_heat(tmp_path / "h.json")
    assert back.trace.layers == (1, 2) and back.trace.ids.tolist() == tr.ids.tolist()
    assert back.fingerprint() == _heat().fingerprint()         # the trace does not change the counts' id
    save_heat(_heat(), tmp_path / "plain.json")
    assert "trace" not in json.loads((tmp_path / "plain.json").read_text())
    assert load_heat(tmp_path / "plain.json").trace is None


def test_trace_is_size_bounded_keeping_the_first_calls():
    calls = {0: [np.zeros((3, 2), dtype=np.int64)] * 5}
    tr = RoutingTrace.from_calls((0,), 2, calls, max_ids=20)     # 6 ids per call: 3 calls fit
    assert tr.steps == (3, 3, 3) and tr.dropped_steps == 2 and tr.ids.shape == (1, 9, 2)


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.update(top_k=9), "top_k"),
    (lambda t: t.update(steps=[1, 0]), "steps"),
    (lambda t: t.update(layers=[1, 1]), "layers"),
    (lambda t: t["ids"][0].__setitem__(0, 7), "expert ids"),
    (lambda t: t["ids"][1].pop(), "whole numbers"),
    (lambda t: t.update(ids=[[0, 1, 0, 1]]), "one list per layer"),
    (lambda t: t.update(dropped_steps=-1), "dropped_steps"),
    (lambda t: t.update(steps=[MAX_TRACE_IDS]), "more than"),
])
def test_bad_trace_is_a_format_error(tmp_path, edit, match):
    tr = RoutingTrace((1, 2), 2, (1, 1), np.array([[[0, 1], [0, 3]], [[1, 2], [0, 3]]], dtype=np.int32))
    save_heat(_heat(tr), tmp_path / "h.json")
    doc = json.loads((tmp_path / "h.json").read_text())
    edit(doc["trace"])
    (tmp_path / "h.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=match):
        load_heat(tmp_path / "h.json")


def test_engine_stats_out_writes_the_trace(tmp_path):
    """`run --stats-out` (engine/runner.write_stats) records the top-k ids of every call per MoE layer."""
    from colibri_plan.engine.fixture import FixtureConfig, build_fixture
    from colibri_plan.engine.moe import RoutingRecorder
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.placement import Placement
    from colibri_plan.engine.runner import write_stats
    from colibri_plan.engine.session import run_placement

    build_fixture(tmp_path / "fx", FixtureConfig.small(experts=8, top_k=2, layers=2))
    pack = open_pack(tmp_path / "fx")
    try:
        rec = RoutingRecorder(pack.arch)
        run_placement(pack, Placement.all_resident(pack.arch.moe_layers, 8, None), [1, 2, 3, 4], 3,
                      recorder=rec)
        write_stats(rec, pack, str(tmp_path / "s.json"), None)
    finally:
        pack.close()
    h = load_heat(tmp_path / "s.json")
    assert h.trace.steps == (4, 1, 1)                           # the prefill call, then two decode steps
    assert h.trace.layers == tuple(pack.arch.moe_layers)
    for i, layer in enumerate(h.layers):                         # the trace and the counts agree
        ids = h.trace.rows(layer)
        assert np.bincount(ids.ravel(), minlength=8).tolist() == h.counts[i].tolist()
