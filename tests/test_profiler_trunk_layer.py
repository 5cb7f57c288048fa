"""Trunk layer probe (profiler/trunk_layer_probe.py): one decoder layer's op sequence, host and device
paths, at a tiny geometry."""

from __future__ import annotations

import numpy as np
import pytest
from test_profiler_schema import toy_doc

from colibri_plan.errors import FormatError
from colibri_plan.formats.profile import MachineProfile
from colibri_plan.formats.profile_trunk import trunk_layer
from colibri_plan.profiler import trunk_layer_probe as tl
from colibri_plan.quant import tensor_bytes

TINY = tl.LayerGeometry(hidden=256, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=8, top_k=2, source="tiny")


def test_host_routing_weights_sum_to_one_so_the_stand_in_sum_is_x():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 64), np.float32)
    out = tl.host_route(x, rng.standard_normal((16, 64), np.float32), 4)
    # each chosen expert's stand-in output is x, weighted; the top-4 weights are renormalised to sum 1
    np.testing.assert_allclose(out, x, rtol=1e-5)


def test_geometry_bytes_and_chain_length_by_hand():
    # q [64, 256], k and v [32, 256], o [256, 64] at int8: 4 matrices
    want = (tensor_bytes("int8", 64, 256) + 2 * tensor_bytes("int8", 32, 256) + tensor_bytes("int8", 256, 64))
    assert TINY.weight_bytes("int8") == want
    assert tl.chain_layers(TINY, "int8", None) == 16                  # tiny weights: the most layers
    big = tl.LayerGeometry(hidden=8192, n_heads=64, n_kv_heads=8, head_dim=128)
    per = big.weight_bytes("int8")                                     # about 151 MB a layer
    assert tl.chain_layers(big, "int8", None) == -(-tl.CHAIN_BYTES // per) == 2
    kv = 8 * 8 * 128                                                   # K and V bytes per token, f32
    fixed = tl.LONG_LAYERS * kv * tl.LONG_CONTEXT                      # the long caches
    assert tl.chain_layers(big, "int8", fixed + 2 * (per + kv * tl.LAYER_CONTEXT)) == 2
    assert tl.chain_layers(big, "int8", fixed + 2 * (per + kv * tl.LAYER_CONTEXT) - 1) == 1   # the limit wins


def test_paired_chains_time_each_step_in_turn():
    calls = []
    a, b = tl.paired_chains([lambda: calls.append("a"), lambda: calls.append("b")], lambda _r: None, 3, 10.0)
    assert calls == ["a", "b"] * 4 and len(a) == len(b) == 3          # a warm-up each, then 3 turns
    assert tl.paired_chains([lambda: None], lambda _r: None, 5, 0.0) == [[pytest.approx(0, abs=0.01)]]


def test_geometry_from_an_arch():
    from types import SimpleNamespace

    arch = SimpleNamespace(attention="gqa", hidden_size=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                           n_experts=128, top_k=8)
    assert tl.LayerGeometry.from_arch(arch, "qwen3") == tl.LayerGeometry(2048, 32, 4, 128, 128, 8, "qwen3")
    assert tl.LayerGeometry.from_arch(SimpleNamespace(attention="mla")) is None


@pytest.mark.parametrize("backend,path", [("cpu", "host"), ("numpy", "host"), ("numpy", "device")])
def test_probe_layer_entry_is_valid_and_readable(backend, path):
    from colibri_plan.backends import get_backend

    cls = get_backend(backend)
    if cls.unavailable_reason():
        pytest.skip(cls.unavailable_reason())
    be = cls.open(0)
    try:
        e = tl.probe_layer(be, {"backend": backend, "device_index": 0, "device_name": "host"}, TINY, "int8",
                           path, None, 3, 5.0)
    finally:
        be.close()
    assert (e["path"], e["fmt"], e["layers"], e["weight_bytes"]) == (path, "int8", 16,
                                                                     TINY.weight_bytes("int8"))
    assert (e["context_tokens"], e["long_context_tokens"]) == (tl.LAYER_CONTEXT, tl.LONG_CONTEXT)
    block, moe = e["block_seconds"]["median"], e["moe_layer_seconds"]["median"]
    assert 0 < block < 0.1 and 0 < moe < 0.1
    assert e["handoff_seconds"]["repetitions"] == e["block_seconds"]["repetitions"] == 3
    assert 0 < e["handoff_seconds"]["median"] < moe
    doc = {**toy_doc(), "trunk_layer": [e]}
    MachineProfile(doc)                                               # validation accepts the entry
    r = trunk_layer(doc, backend, 0, path)
    assert (r["block_s"], r["attention_s"]) == (block, e["attention_seconds"]["median"])
    assert r["attention_long_s"] == e["attention_long_seconds"]["median"] and r["weight_bytes"] > 0
    assert trunk_layer(doc, backend, 0, "device" if path == "host" else "host") is None


def _entry(**kw):
    st = {"min": 1e-4, "median": 2e-4, "max": 3e-4, "repetitions": 3}
    e = {"backend": "cuda", "device_index": 0, "device_name": "g", "path": "device", "fmt": "int8",
         "hidden": 2048, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128, "context_tokens": 64, "layers": 8,
         "weight_bytes": 18_000_000, "block_seconds": st, "moe_layer_seconds": st, "handoff_seconds": st,
         "attention_seconds": st}
    e.update(kw)
    return e


@pytest.mark.parametrize("edit,message", [
    ({"path": "gpu"}, "path must be one of device, host"),
    ({"fmt": "int7"}, "not a quant format"),
    ({"layers": 0}, "layers"),
    ({"block_seconds": {"min": 1, "median": 0.5, "max": 2, "repetitions": 1}}, "block_seconds"),
    ({"attention_long_seconds": {"min": 1e-4, "median": 2e-4, "max": 3e-4, "repetitions": 3}},
     "long_context_tokens"),
])
def test_malformed_layer_entries_are_refused(edit, message):
    MachineProfile({**toy_doc(), "trunk_layer": [_entry()]})
    with pytest.raises(FormatError, match=message):
        MachineProfile({**toy_doc(), "trunk_layer": [_entry(**edit)]})
    with pytest.raises(FormatError, match="listed twice"):
        MachineProfile({**toy_doc(), "trunk_layer": [_entry(), _entry()]})
