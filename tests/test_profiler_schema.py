"""Profile schema: round trip, rejection of corrupt files, accessors on hand-made documents."""

from __future__ import annotations

import copy
import json
import re

import pytest
from _cli_fixtures import assert_one_line, cli_run, edited

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.profile import (
    MachineProfile,
    load_profile,
    machine_fingerprint,
    save_profile,
    stat,
)


def fig(median, lo=None, hi=None, reps=3):
    return {"min": lo if lo is not None else median, "median": median,
            "max": hi if hi is not None else median, "repetitions": reps}


def toy_doc() -> dict:
    machine = {"cpu_model": "Toy CPU", "cores": 4, "ram_total_bytes": 16 << 30,
               "ram_available_bytes": 12 << 30, "os": "Linux"}
    devices = [
        {"backend": "numpy", "index": 0, "name": "host", "kind": "cpu", "total_memory_bytes": 16 << 30,
         "free_memory_bytes": None, "unified_memory": True, "formats": ["int4"], "driver": ""},
        {"backend": "cuda", "index": 0, "name": "Toy GPU", "kind": "gpu", "total_memory_bytes": 80 << 30,
         "free_memory_bytes": 79 << 30, "unified_memory": False, "formats": ["int4"], "driver": "12"},
        {"backend": "opencl", "index": 1, "name": "Toy iGPU", "kind": "igpu", "total_memory_bytes": 8 << 30,
         "free_memory_bytes": None, "unified_memory": True, "formats": ["int4"], "driver": "3"},
    ]
    machine["fingerprint"] = machine_fingerprint(machine, devices)

    def mm(backend, fmt, out_f, in_f, tokens, gbps):
        nbytes = out_f * in_f // 2
        return {"backend": backend, "device_index": 0, "device_name": "x", "device_kind": "gpu", "fmt": fmt,
                "out_features": out_f, "in_features": in_f, "tokens": tokens,
                "weight_gbps": fig(gbps), "seconds": fig(nbytes / gbps / 1e9)}

    return {
        "machine": machine,
        "disk": {"path": "/data", "filesystem": {"fstype": "ext4"}, "o_direct": True,
                 "page_cache_method": "o_direct", "block_bytes": 1 << 20,
                 "random": [
                     {"queue_depth": 1, "read_gbps": fig(0.5, 0.4, 0.6),
                      "latency_ms": {"p50": 2.0, "p99": 3.0}},
                     {"queue_depth": 4, "read_gbps": fig(1.5), "latency_ms": {"p50": 40.0, "p99": 50.0}},
                     {"queue_depth": 16, "read_gbps": fig(2.0), "latency_ms": {"p50": 80.0, "p99": 90.0}},
                 ],
                 "sequential": {"read_gbps": fig(0.9)}},
        "ram": {"read_gbps": fig(20.0, 18.0, 21.0, 7), "threads": 4},
        "devices": devices,
        "links": [{"backend": "cuda", "device_index": 0, "device_name": "Toy GPU", "unified_memory": False,
                   "block_bytes": 1 << 20, "h2d_pinned_gbps": fig(50.0), "h2d_pageable_gbps": fig(8.0),
                   "d2h_pinned_gbps": fig(49.0), "d2h_pageable_gbps": {"unavailable": "not measured"}}],
        "matmul": [mm("cuda", "int4", 2048, 6144, 1, 800.0), mm("cuda", "int4", 6144, 2048, 1, 600.0),
                   mm("cuda", "int4", 2048, 6144, 16, 2000.0), mm("cuda", "int4", 6144, 2048, 16, 1000.0),
                   mm("cuda", "int4", 2048, 6144, 4, 1200.0)],
        "expert_ffn": [{"backend": "cuda", "device_index": 0, "fmt": "int4", "experts": 8, "tokens": 1,
                        "seconds": fig(0.016)}],
    }


def test_round_trip(tmp_path):
    p = MachineProfile(toy_doc())
    path = save_profile(p, tmp_path / "p.json")
    q = load_profile(path)
    assert q.doc == p.doc
    assert q.doc["kind"] == "profile" and q.doc["schema_version"] == 1
    assert q.fingerprint == p.fingerprint


def test_stat():
    assert stat([3.0, 1.0, 2.0, 10.0]) == {"min": 1.0, "median": 2.5, "max": 10.0, "repetitions": 4}
    with pytest.raises(InputError):
        stat([])


def test_disk_accessors():
    p = MachineProfile(toy_doc())
    assert p.disk_read_gbps() == 0.5
    assert p.disk_read_gbps(4) == 1.5
    assert p.disk_read_gbps(8) == 1.5  # nearest measured queue depth <= 8 is 4
    assert p.disk_read_gbps(64) == 2.0
    assert p.disk_latency_s(4) == pytest.approx(0.040)
    assert p.disk_block_bytes() == 1 << 20
    assert p.disk_o_direct() is True


def test_ram_gpu_link_accessors():
    p = MachineProfile(toy_doc())
    assert p.ram_read_gbps() == 20.0
    assert p.ram_available_bytes() == 12 << 30
    assert [g["name"] for g in p.gpus()] == ["Toy GPU", "Toy iGPU"]
    assert p.h2d_gbps("cuda", 0) == 50.0
    assert p.h2d_gbps("cuda", 0, pinned=False) == 8.0
    assert p.d2h_gbps("cuda", 0) == 49.0
    with pytest.raises(InputError, match="not measured"):
        p.d2h_gbps("cuda", 0, pinned=False)
    with pytest.raises(InputError, match="colibri-plan profile"):
        p.h2d_gbps("cuda", 3)
    assert p.summary()["gpus"] == ["Toy GPU", "Toy iGPU"]


def test_matmul_accessors():
    p = MachineProfile(toy_doc())
    assert p.matmul_weight_gbps("cuda", 0, "int4", 1) == 700.0  # median of the two shapes
    assert p.matmul_weight_gbps("cuda", 0, "int4", 1, 2048, 6144) == 800.0
    assert p.matmul_weight_gbps("cuda", 0, "int4", 1, 6000, 2000) == 600.0  # nearest shape
    assert p.matmul_weight_gbps("cuda", 0, "int4", 16) == 1500.0
    assert p.matmul_weight_gbps("cuda", 0, "int4", 5) == 1200.0  # nearest token count is 4
    assert p.matmul_weight_gbps("cuda", 0, "int4", 12) == 1500.0  # log-nearest to 16
    with pytest.raises(InputError, match="int4-g64"):
        p.matmul_weight_gbps("cuda", 0, "int4-g64")
    assert p.expert_ffn_s("cuda", 0, "int4", 4) == pytest.approx(0.008)


def test_fingerprint_ignores_free_memory():
    d = toy_doc()
    m2 = dict(d["machine"], ram_available_bytes=1)
    assert machine_fingerprint(m2, d["devices"]) == d["machine"]["fingerprint"]
    m3 = dict(d["machine"], cores=8)
    assert machine_fingerprint(m3, d["devices"]) != d["machine"]["fingerprint"]
    devs = copy.deepcopy(d["devices"])
    devs[1]["total_memory_bytes"] = 40 << 30
    assert machine_fingerprint(d["machine"], devs) != d["machine"]["fingerprint"]


def test_unavailable_sections_raise_with_hint():
    d = toy_doc()
    d["disk"] = {"unavailable": "no disk"}
    d["links"] = {"unavailable": "no GPU"}
    p = MachineProfile(d)
    with pytest.raises(InputError, match=r"no disk.*colibri-plan profile"):
        p.disk_read_gbps()
    with pytest.raises(InputError, match="no GPU"):
        p.h2d_gbps("cuda", 0)


def _write(tmp_path, doc) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _full(doc):
    return {"kind": "profile", "schema_version": 1, **doc}


def test_bad_json_rejected(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"kind": "profile", "schema_version": 1, "machine": ')
    with pytest.raises(FormatError, match="not valid JSON"):
        load_profile(path)


def test_wrong_version_rejected(tmp_path):
    doc = _full(toy_doc())
    doc["schema_version"] = 2
    with pytest.raises(FormatError, match="schema_version"):
        load_profile(_write(tmp_path, doc))


def test_wrong_kind_rejected(tmp_path):
    doc = _full(toy_doc())
    doc["kind"] = "plan"
    with pytest.raises(FormatError, match="'plan'"):
        load_profile(_write(tmp_path, doc))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("ram"), "missing section"),
    (lambda d: d["machine"].pop("cores"), "machine: missing cores"),
    (lambda d: d["disk"]["random"][1]["read_gbps"].update(min=-1.0), "negative"),
    (lambda d: d["ram"]["read_gbps"].update(median=float("nan")), "finite"),
    (lambda d: d["ram"]["read_gbps"].update(median=30.0), "min <= median <= max"),
    (lambda d: d["matmul"][0]["seconds"].update(repetitions=0), "repetitions"),
    (lambda d: d["disk"].update(random=[]), "non-empty"),
    (lambda d: d["disk"]["random"][0]["latency_ms"].update(p99=-3), "p99"),
    (lambda d: d["links"][0].pop("device_name"), "device_name"),
    (lambda d: d.update(disk={"unavailable": ""}), "reason"),
    (lambda d: d.update(matmul="fast"), "matmul"),
])
def test_corrupt_sections_rejected(tmp_path, mutate, message):
    doc = _full(toy_doc())
    mutate(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(FormatError, match=message) as info:
        load_profile(path)
    assert "p.json" in str(info.value) and "colibri-plan profile" in str(info.value)


def test_invalid_profile_not_saved(tmp_path):
    doc = toy_doc()
    doc["ram"]["read_gbps"]["max"] = -5.0
    with pytest.raises(FormatError):
        save_profile(doc, tmp_path / "bad.json")
    assert list(tmp_path.iterdir()) == []


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_profile(tmp_path / "nope.json")


def test_gpus_counts_each_card_once_across_backends():
    """An H200 listed by cuda, opencl and vulkan is one GPU; two cards of one model stay two."""
    from colibri_plan.formats.profile import MachineProfile

    def dev(backend, index, name="NVIDIA H200"):
        return {"backend": backend, "index": index, "name": name, "kind": "gpu",
                "total_memory_bytes": 150_000_000_000, "free_memory_bytes": None, "unified_memory": False,
                "formats": ["int4"], "driver": "x"}

    doc = {"devices": [dev("cuda", 0), dev("cuda", 1), dev("opencl", 0), dev("opencl", 1), dev("vulkan", 0),
                       dev("vulkan", 0, "AMD Radeon 780M")]}
    got = MachineProfile.gpus(type("P", (), {"doc": doc})())
    assert [(d["backend"], d["index"], d["name"]) for d in got] == [
        ("cuda", 0, "NVIDIA H200"), ("cuda", 1, "NVIDIA H200"), ("vulkan", 0, "AMD Radeon 780M")]


@pytest.mark.parametrize("field, value", [("total_memory_bytes", "lots"), ("index", -1),
                                          ("unified_memory", "no"), ("name", 5)])
def test_bad_device_entry_is_a_format_error(tmp_path, good, field, value):
    d, _, _ = good
    doc = json.loads((d / "profile.json").read_text())
    f = edited(tmp_path, doc, f"devices.1.{field}", value, "profile.json")
    with pytest.raises(FormatError, match=rf"devices\[1\]: {field} must be"):
        load_profile(f)
    r = cli_run("solve", "--profile", f, "--model", d / "model.json")
    assert_one_line(r, str(f), f"devices[1]: {field} must be")


def _peer(src, dst, gbps=None, **extra):
    return {"src": src, "dst": dst, "src_name": "NVIDIA H200", "dst_name": "NVIDIA H200",
            "block_bytes": 18915328, "can_access_peer": gbps is not None,
            "peer_access_enabled": gbps is not None,
            "copy_gbps": fig(gbps) if gbps else {"unavailable": "RuntimeError: cudaErrorIllegalAddress"},
            "copies_per_repetition": 8, "method": "memcpyPeer", **extra}


def test_peer_links_optional_and_read(tmp_path):
    """Old profiles without the section stay valid; a two-GPU section round-trips and is read back."""
    old = MachineProfile(toy_doc())
    assert "peer_links" not in old.doc and old.peer_gbps("cuda:0", "cuda:1") is None
    doc = toy_doc()
    doc["peer_links"] = [_peer("cuda:0", "cuda:1", 150.0), _peer("cuda:1", "cuda:0")]
    save_profile(doc, tmp_path / "p.json")
    p = load_profile(tmp_path / "p.json")
    assert p.peer_gbps("cuda:0", "cuda:1") == 150.0
    assert p.peer_gbps("cuda:1", "cuda:0") is None and p.peer_gbps("cuda:0", "cuda:2") is None
    one_gpu = MachineProfile({**toy_doc(), "peer_links": {"unavailable": "1 CUDA device(s) in this profile"}})
    assert one_gpu.peer_gbps("cuda:0", "cuda:1") is None


@pytest.mark.parametrize("peers, message", [
    ([], "empty list"),
    ({"unavailable": ""}, "reason"),
    ("fast", "expected a list"),
    ([{"src": "cuda:0"}], r"peer_links\[0\]: missing dst"),
    ([_peer("cuda:0", "cuda:0", 100.0)], "same device"),
    ([_peer("gpu0", "cuda:1", 100.0)], "device key"),
    ([_peer("cuda:0", "cuda:1", 100.0), _peer("cuda:0", "cuda:1", 90.0)], "listed twice"),
    ([_peer("cuda:0", "cuda:1", 100.0, can_access_peer="yes")], "can_access_peer must be true or false"),
    ([_peer("cuda:0", "cuda:1", 100.0, block_bytes=0)], "block_bytes"),
    ([{**_peer("cuda:0", "cuda:1", 100.0), "copy_gbps": fig(0.0)}], "must be > 0"),
    ([{**_peer("cuda:0", "cuda:1", 100.0), "copy_gbps": fig(5.0, 6.0)}], "min <= median"),
])
def test_bad_peer_links_rejected(tmp_path, peers, message):
    doc = _full(toy_doc())
    doc["peer_links"] = peers
    with pytest.raises(FormatError, match=message):
        load_profile(_write(tmp_path, doc))


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["disk"]["random"][0].update(read_gbps=fig(1e30)), "disk.random[0].read_gbps"),
    (lambda d: d["disk"]["random"][0].update(read_gbps=fig(1e-12)), "disk.random[0].read_gbps"),
    (lambda d: d["disk"]["random"][0].update(read_gbps=fig(5e-5)), "disk.random[0].read_gbps"),
    (lambda d: d["disk"]["random"][0].update(latency_ms={"p50": 1e12, "p99": 1e12}), "latency_ms"),
    (lambda d: d["ram"].update(read_gbps=fig(2e5)), "ram.read_gbps"),
    (lambda d: d["links"][0].update(h2d_pinned_gbps=fig(1e-9)), "links[0].h2d_pinned_gbps"),
    (lambda d: d["matmul"][0].update(seconds=fig(1e7)), "matmul[0].seconds"),
    (lambda d: d["matmul"][0].update(weight_gbps=fig(0.0)), "matmul[0].weight_gbps"),
])
def test_implausible_rates_and_times_are_refused_naming_the_field(edit, field):
    doc = toy_doc()
    edit(doc)
    with pytest.raises(FormatError, match=re.escape(field) + ".*plausible|" + re.escape(field) + ".*too slow"
                       "|" + re.escape(field) + ".*must be"):
        MachineProfile(doc)


def test_plan_show_never_prints_an_absurd_disk_rate(tmp_path):
    doc = toy_doc()
    for e in doc["disk"]["random"]:
        e["read_gbps"] = fig(1e30)
    (tmp_path / "p.json").write_text(json.dumps({"kind": "profile", "schema_version": 1, **doc}))
    with pytest.raises(FormatError, match="disk.random"):
        load_profile(tmp_path / "p.json")
