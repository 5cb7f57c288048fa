"""The CPU path's measured per-call cost (Resources.cpu_call_s, from the trunk_layer host figure)."""

from __future__ import annotations

import numpy as np
import pytest
from test_profiler_schema import toy_doc

from colibri_plan.formats.coefficients import Coefficients
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM
from colibri_plan.formats.profile_trunk import expert_call_s
from colibri_plan.planner.costmodel import Resources, layer_terms

B = 10**8   # 100 MB experts at 10 GB/s: 10 ms each


def _terms(call_s, p, tier, hits=None):
    res = Resources(cpu_matmul_gbps=10.0, ram_read_gbps=10.0, disk_read_gbps=1.0, cpu_call_s=call_s)
    return layer_terms(np.array(p), np.array(tier), 4, B, res, Coefficients(), 4096,
                       hits=None if hits is None else np.array(hits))


def test_resident_experts_pay_one_call_when_any_is_selected():
    p, tier = [0.5, 0.5, 1.0], [TIER_RAM, TIER_RAM, 0]     # expert 2 on GPU 0 (the resources list none)
    base = _terms(0.0, p, tier)
    got = _terms(1e-3, p, tier)
    # P(any RAM expert selected) = 1 - (1 - 0.5)(1 - 0.5) = 0.75 -> 0.75 ms more, on the resident compute
    assert base["cpu_resident_s"] == pytest.approx(1.0 * 0.01)
    assert got["cpu_resident_s"] - base["cpu_resident_s"] == pytest.approx(0.75e-3)
    assert got["cpu_stream_s"] == base["cpu_stream_s"] == 0.0


def test_lru_hits_join_the_resident_call_and_each_miss_is_a_call():
    p, tier = [0.4, 0.5], [TIER_RAM, TIER_DISK]
    base, got = _terms(0.0, p, tier, hits=[0.0, 0.6]), _terms(2e-3, p, tier, hits=[0.0, 0.6])
    # resident call: 1 - (1 - 0.4)(1 - 0.5 * 0.6) = 0.58; misses 0.5 * 0.4 = 0.2 calls
    assert got["cpu_resident_s"] - base["cpu_resident_s"] == pytest.approx(2e-3 * 0.58)
    assert got["cpu_stream_s"] - base["cpu_stream_s"] == pytest.approx(2e-3 * 0.2)


def test_the_reader_takes_the_fixed_part_of_a_call():
    st = lambda v: {"min": v, "median": v, "max": v, "repetitions": 1}   # noqa: E731
    e = {"backend": "cpu", "device_index": 0, "path": "host", "expert_fmt": "int4", "expert_topk": 8,
         "expert_one_seconds": st(300e-6), "expert_topk_seconds": st(1700e-6)}
    doc = {**toy_doc(), "trunk_layer": [e]}
    assert expert_call_s(doc) == pytest.approx(300e-6 - 1400e-6 / 7)        # 100 µs fixed, 200 µs each
    assert expert_call_s(doc, "int4") == expert_call_s(doc) and expert_call_s(doc, "int8") is None
    assert expert_call_s(toy_doc()) is None
    e["expert_one_seconds"] = st(100e-6)                                      # slower alone than 1/k: 0
    assert expert_call_s(doc) == 0.0
