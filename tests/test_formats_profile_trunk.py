"""The profile's optional trunk sections (dense_gemv, device_ops, attention): validation and readers."""

from __future__ import annotations

import copy
import json

import pytest
from test_profiler_schema import fig, toy_doc

from colibri_plan.errors import FormatError
from colibri_plan.formats import profile_trunk as pt
from colibri_plan.formats.profile import MachineProfile, load_profile, resolve_profile, save_profile


def gemv(backend, fmt, out_f, in_f, gbps, index=0):
    nbytes = out_f * in_f * (1 if fmt == "int8" else 4)
    return {"backend": backend, "device_index": index, "device_name": "dev", "fmt": fmt,
            "out_features": out_f, "in_features": in_f, "tokens": 1, "weight_bytes": nbytes,
            "seconds": fig(nbytes / gbps / 1e9), "weight_gbps": fig(gbps, gbps * 0.9, gbps * 1.1)}


def trunk_doc() -> dict:
    doc = toy_doc()
    doc["dense_gemv"] = [gemv("cuda", "int8", 4096, 4096, 3000.0), gemv("cuda", "int8", 1024, 4096, 1500.0),
                         gemv("cuda", "f32", 4096, 4096, 3800.0), gemv("cpu", "int8", 4096, 4096, 30.0),
                         gemv("cpu", "int8", 14336, 4096, 36.0)]
    doc["device_ops"] = [
        {"backend": "cuda", "device_index": 0, "device_name": "Toy GPU", "op_seconds": fig(6e-6, 5e-6, 9e-6),
         "roundtrip_seconds": fig(4e-5), "roundtrip_bytes": 32768},
        {"backend": "cpu", "device_index": 0, "device_name": "host", "op_seconds": fig(1.5e-6),
         "roundtrip_seconds": fig(1.4e-6), "roundtrip_bytes": 32768}]
    doc["attention"] = [
        {"backend": "cuda", "device_index": 0, "device_name": "Toy GPU", "n_heads": 32, "n_kv_heads": 8,
         "head_dim": 128, "context_tokens": c, "seconds": fig(c * 8192 / g / 1e9), "kv_gbps": fig(g)}
        for c, g in ((256, 50.0), (4096, 900.0), (32768, 2500.0))]
    return doc


def test_an_old_profile_without_the_sections_loads_and_reads_none(tmp_path):
    prof = load_profile(save_profile(MachineProfile(toy_doc()), tmp_path / "old.json"))
    assert not any(s in prof.doc for s in ("dense_gemv", "device_ops", "attention"))
    assert pt.dense_gemv_gbps(prof, "cuda", 0, "int8") is None
    assert pt.device_op_s(prof, "cuda", 0) is None and pt.roundtrip_s(prof, "cuda", 0) is None
    assert pt.attention_kv_gbps(prof, "cuda", 0, 4096) is None and pt.attention_s(prof, "cuda", 0, 1) is None
    assert not pt.has_trunk_figures(prof, "cuda", 0)


def test_shipped_profiles_lack_the_sections_and_still_load():
    from importlib import resources

    names = [p.name for p in resources.files("colibri_plan.profiles").iterdir() if p.name.endswith(".json")]
    assert names
    for name in names:
        prof, _ = resolve_profile(name)
        assert pt.dense_gemv_formats(prof, "cuda", 0) == []


def test_a_profile_with_the_sections_round_trips_and_reads_back(tmp_path):
    doc = trunk_doc()
    path = save_profile(MachineProfile(doc), tmp_path / "p.json")
    prof = load_profile(path)
    assert {k: prof.doc[k] for k in ("dense_gemv", "device_ops", "attention")} == \
        {k: doc[k] for k in ("dense_gemv", "device_ops", "attention")}
    assert json.loads(path.read_text())["dense_gemv"][1]["out_features"] == 1024
    # nearest shape in log(out) + log(in); without a shape, the median over shapes
    assert pt.dense_gemv_gbps(prof, "cuda", 0, "int8", 1024, 4096) == 1500.0
    assert pt.dense_gemv_gbps(prof, "cuda", 0, "int8", 6144, 6144) == 3000.0
    assert pt.dense_gemv_gbps(prof, "cuda", 0, "int8") == 2250.0
    assert pt.dense_gemv_gbps(prof, "cpu", 0, "int8", 16384, 4096) == 36.0
    assert pt.dense_gemv_gbps(prof, "cuda", 0, "bf16") is None
    assert pt.dense_gemv_formats(prof, "cuda", 0) == ["int8", "f32"]
    assert pt.device_op_s(prof, "cuda", 0) == 6e-6 and pt.roundtrip_s(prof, "cpu", 0) == 1.4e-6
    assert pt.attention_kv_gbps(prof, "cuda", 0, 3000) == 900.0
    assert pt.attention_kv_gbps(prof, "cuda", 0, 100_000) == 2500.0
    # seconds scale with the context from the nearest measured one
    assert pt.attention_s(prof, "cuda", 0, 8192) == pytest.approx(2 * 4096 * 8192 / 900e9)
    assert pt.has_trunk_figures(prof, "cuda", 0) and not pt.has_trunk_figures(prof, "cpu", 0)


def test_unavailable_sections_are_accepted_and_read_none():
    doc = trunk_doc()
    doc["attention"] = {"unavailable": "no compute backend is usable"}
    prof = MachineProfile(doc)
    assert pt.attention_kv_gbps(prof, "cuda", 0, 4096) is None and pt.device_op_s(prof, "cuda", 0) == 6e-6


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["dense_gemv"][0].update(device_index="0"),
     r"dense_gemv\[0\]: device_index must be an integer"),
    (lambda d: d["dense_gemv"][1].update(fmt=8), r"dense_gemv\[1\]: fmt must be a non-empty string, got 8"),
    (lambda d: d["dense_gemv"][1].update(fmt="int9"), r"fmt 'int9' is not a quant format"),
    (lambda d: d["dense_gemv"][0].update(out_features=0), r"out_features must be an integer >= 1"),
    (lambda d: d["dense_gemv"][0]["seconds"].update(min=-1e-3), r"dense_gemv\[0\]\.seconds: min is negative"),
    (lambda d: d["dense_gemv"][0]["seconds"].update(min=1.0),
     r"dense_gemv\[0\]\.seconds: expected min <= median"),
    (lambda d: d["dense_gemv"][0].update(weight_gbps=fig(2e5)),
     r"weight_gbps: max 200000 GB/s is not a plaus"),
    (lambda d: d["dense_gemv"][0].pop("weight_gbps"), r"dense_gemv\[0\]: missing weight_gbps"),
    (lambda d: d["dense_gemv"].append(copy.deepcopy(d["dense_gemv"][0])), r"dense_gemv\[5\]: .*listed twice"),
    (lambda d: d.update(dense_gemv=[]), r"dense_gemv: empty list"),
    (lambda d: d.update(dense_gemv={"unavailable": ""}), r"reason"),
    (lambda d: d.update(device_ops="fast"), r"device_ops: expected a list"),
    (lambda d: d["device_ops"][0].update(op_seconds=fig(0.0)),
     r"device_ops\[0\]\.op_seconds: figures must be > 0"),
    (lambda d: d["device_ops"][0].update(roundtrip_seconds=fig(2e6)),
     r"roundtrip_seconds: max 2e\+06 s is not"),
    (lambda d: d["device_ops"][1].update(roundtrip_bytes=-4), r"device_ops\[1\]: roundtrip_bytes must be"),
    (lambda d: d["device_ops"][0].update(device_name=None), r"device_name must be a non-empty string"),
    (lambda d: d["attention"][2].update(n_kv_heads=5), r"attention\[2\]: n_heads 32 is not a multiple"),
    (lambda d: d["attention"][0].update(context_tokens=2.5),
     r"attention\[0\]: context_tokens must be an int"),
    (lambda d: d["attention"][0]["kv_gbps"].update(repetitions=0), r"attention\[0\]\.kv_gbps: repetitions"),
    (lambda d: d["attention"][1].pop("seconds"), r"attention\[1\]: missing seconds"),
])
def test_malformed_trunk_sections_are_refused_with_the_field_named(tmp_path, edit, message):
    doc = trunk_doc()
    edit(doc)
    with pytest.raises(FormatError, match=message) as info:
        MachineProfile(doc)
    assert "colibri-plan profile" in str(info.value)
    path = tmp_path / "bad.json"  # nothing is written either
    with pytest.raises(FormatError, match=message):
        save_profile(doc, path)
    assert not path.exists()
