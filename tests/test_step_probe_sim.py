"""The step probe (profiler/step_probe.py with engine/step_timing.py) on the simulated GPU of
``test_backend_cuda_device_sim.py``: two tiny packs built, their decode steps replayed (not eager) and
timed, one well-formed ``step_graph`` entry whose figures follow split_step (times are the simulator's,
meaningless; the H200 gives the real ones)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from colibri_plan.backends import get_backend
from colibri_plan.engine import step_timing
from colibri_plan.formats.profile import MachineProfile
from colibri_plan.profiler.step_probe import StepSettings, probe_step, split_step
from colibri_plan.profiler.trunk_layer_probe import LayerGeometry


def test_the_probe_replays_both_packs_and_writes_a_valid_entry(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from test_profiler_schema import toy_doc

    from tests.test_backend_cuda_device_sim import device_cupy
    from tests.test_backend_cuda_sim import Sim

    monkeypatch.setitem(sys.modules, "cupy", device_cupy(Sim()))
    be = get_backend("cuda").open(0)
    geom = LayerGeometry(hidden=256, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=16, top_k=4,
                         source="tiny", expert_width=128, expert_fmt="int4", vocab=300)
    st = StepSettings(warm_tokens=3, rounds=2, round_tokens=2, context_tokens=64, runner=step_timing)
    try:
        e = probe_step(be, {"backend": "cuda", "device_index": 0, "device_name": "sim"}, geom, "f32", st,
                       workdir=str(tmp_path))
    finally:
        be.close()
    assert (e["layers_short"], e["layers_long"], e["top_k"], e["fixture_experts"]) == (2, 4, 4, 8)
    short, long = e["step_short_seconds"], e["step_long_seconds"]
    assert short["repetitions"] == long["repetitions"] == 2
    layer, _ = split_step([short["median"]], [long["median"]], 2, 4)
    assert e["layer_seconds"]["median"] == pytest.approx(layer[0], rel=0.5)
    MachineProfile({**toy_doc(), "step_graph": [e]})   # validates
    assert list(tmp_path.iterdir()) == []              # the packs are removed


def test_no_runner_no_probe():
    from colibri_plan.errors import UnsupportedError

    with pytest.raises(UnsupportedError):
        probe_step(None, {"backend": "cuda", "device_index": 0}, LayerGeometry(), "int8", StepSettings())
