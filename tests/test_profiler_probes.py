"""Profiler probes at tiny sizes: disk (O_DIRECT, tmpfs, refused), RAM, links, matmul, and the CLI."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from colibri_plan.backends.base import Backend, DeviceInfo
from colibri_plan.cli import cli
from colibri_plan.errors import InputError
from colibri_plan.formats.profile import load_profile
from colibri_plan.profiler import disk, matmul_probe
from colibri_plan.profiler.links import probe_links
from colibri_plan.profiler.machine import filesystem_of, machine_info, meminfo
from colibri_plan.profiler.ram import probe_ram
from colibri_plan.profiler.run import PROBES, TRUNK_SECTIONS
from colibri_plan.quant import matmul_ref, tensor_bytes

SMALL = {"block_bytes": 64 << 10, "file_bytes": 2 << 20, "queue_depths": (1, 2), "repetitions": 2,
         "seconds": 0.03}


def test_machine_info_from_proc():
    m = machine_info()
    mem = meminfo()
    assert m["cores"] >= 1
    if mem:
        assert m["ram_total_bytes"] == mem["MemTotal"] > m["ram_available_bytes"] > 0


def test_filesystem_of_longest_mount():
    if not Path("/proc/mounts").exists():
        pytest.skip("no /proc/mounts on this OS")
    fs = filesystem_of("/proc/self")
    assert fs["fstype"] == "proc" and fs["mountpoint"] == "/proc"


def test_read_full_returns_file_bytes(tmp_path):
    path = tmp_path / "f.bin"
    disk.write_test_file(path, 1 << 20)
    raw = path.read_bytes()
    assert len(raw) == 1 << 20 and len(set(raw[:4096])) > 200  # incompressible, not zeros
    fd, direct, _method, _w = disk.open_for_read(path)
    try:
        buf = disk.aligned_buffer(64 << 10)
        assert disk.read_full(fd, buf, 12 * 4096, 64 << 10) == 64 << 10
        assert bytes(buf[: 64 << 10]) == raw[12 * 4096: 12 * 4096 + (64 << 10)]
    finally:
        os.close(fd)


def test_disk_probe_on_folder(tmp_path):
    d = disk.probe_disk(tmp_path, **SMALL)
    assert [e["queue_depth"] for e in d["random"]] == [1, 2]
    assert d["block_bytes"] == 64 << 10 and d["file_bytes"] == 2 << 20
    for e in d["random"] + [d["sequential"]]:
        assert e["read_gbps"]["repetitions"] == 2 and e["read_gbps"]["min"] > 0
        assert 0 < e["latency_ms"]["p50"] <= e["latency_ms"]["p99"]
    assert list(tmp_path.iterdir()) == []  # the test file is removed
    if d["filesystem"]["fstype"] not in disk.RAM_FILESYSTEMS:
        assert d["page_cache_method"] in ("o_direct", "buffered+fadvise_dontneed")
        assert d["o_direct"] == (d["page_cache_method"] == "o_direct")


def test_block_rounded_to_4k(tmp_path):
    d = disk.probe_disk(tmp_path, **{**SMALL, "block_bytes": 18_915_328 // 64 + 1, "queue_depths": (1,)})
    assert d["block_bytes"] % 4096 == 0 and 0 <= d["block_bytes"] - (18_915_328 // 64 + 1) < 4096


def test_existing_file_is_read_not_written(tmp_path):
    path = tmp_path / "data.bin"
    disk.write_test_file(path, 1 << 20)
    before = path.read_bytes()
    d = disk.probe_disk(path, **{**SMALL, "queue_depths": (1,)})
    assert d["file"] == str(path) and path.read_bytes() == before


def test_measure_arithmetic_and_concurrency(monkeypatch):
    """A fake read of 1 MB that takes 20 ms: QD readers overlap, so QD4 gives 4 x 1 MB / 20 ms."""
    import time

    def fake_read(fd, buf, offset, nbytes):
        assert offset % 4096 == 0 and 0 <= offset <= (64 << 20) - nbytes
        time.sleep(0.02)
        return nbytes

    monkeypatch.setattr(disk, "read_full", fake_read)
    got = {}
    for qd in (1, 4):
        m = disk.measure(-1, 64 << 20, 1_000_000, qd, repetitions=2, seconds=0.2, o_direct=True)
        got[qd] = m["read_gbps"]["median"]
        # sleeps only overshoot on a busy machine: allow slower, never faster
        assert 0.5 * qd * 1e6 / 0.02 / 1e9 <= got[qd] <= 1.05 * qd * 1e6 / 0.02 / 1e9
        assert 19.5 <= m["latency_ms"]["p50"] <= 40
        assert m["reads"] >= 2 * qd * 5
    assert got[4] / got[1] == pytest.approx(4, rel=0.25)


def test_disk_bad_paths(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        disk.probe_disk(tmp_path / "nope", **SMALL)
    small = tmp_path / "small.bin"
    small.write_bytes(b"x" * 8192)
    with pytest.raises(InputError, match="less than one"):
        disk.probe_disk(small, **SMALL)


def test_tmpfs_reported_buffered():
    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_of(shm)["fstype"] != "tmpfs":
        pytest.skip("/dev/shm is not a tmpfs on this machine")
    d = disk.probe_disk(shm, **{**SMALL, "queue_depths": (1,)})
    assert d["o_direct"] is False and d["page_cache_method"] == "buffered"
    assert d["warnings"] and "tmpfs" in d["warnings"][0]


def test_o_direct_refused_falls_back(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    d = disk.probe_disk(tmp_path, **{**SMALL, "queue_depths": (1,)})
    assert d["o_direct"] is False and d["page_cache_method"] == "buffered+fadvise_dontneed"
    assert "O_DIRECT refused" in d["warnings"][0] and "Invalid argument" in d["warnings"][0]


def test_disk_shrinks_file_to_free_space(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 3 << 20))
    d = disk.probe_disk(tmp_path, **{**SMALL, "file_bytes": 1 << 30, "queue_depths": (1,)})
    assert d["file_bytes"] == (3 << 20) // 2
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 64 << 10))
    with pytest.raises(InputError, match="too little"):
        disk.probe_disk(tmp_path, **SMALL)
    assert list(tmp_path.iterdir()) == []


def test_cuda_link_probe():
    cp = pytest.importorskip("cupy", reason="CuPy is not installed (CUDA link probe needs it)")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no CUDA device: {exc}")
    if n == 0:
        pytest.skip("no CUDA device")
    from colibri_plan.profiler.links import LINK_KEYS, probe_cuda_link

    figs = probe_cuda_link(0, 1 << 20, repetitions=2, copies=2)
    for k in LINK_KEYS:
        assert figs[k]["repetitions"] == 2 and 0.1 < figs[k]["median"] < 2000  # GB/s, PCIe/NVLink range


def test_opencl_link_probe():
    cl = pytest.importorskip("pyopencl", reason="pyopencl is not installed")
    try:
        names = [d.name for p in cl.get_platforms() for d in p.get_devices()]
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"no OpenCL platform: {exc}")
    if not names:
        pytest.skip("no OpenCL device")
    from colibri_plan.profiler.links import LINK_KEYS, probe_opencl_link

    figs = probe_opencl_link(names[0], 1 << 20, repetitions=2, copies=2)
    for k in LINK_KEYS:
        assert figs[k]["repetitions"] == 2 and figs[k]["median"] > 0.01
    with pytest.raises(LookupError):
        probe_opencl_link("no such device", 1 << 20)


def test_shipped_profiles_load():
    from importlib import resources

    from colibri_plan.formats.profile import load_profile as load

    files = [f for f in resources.files("colibri_plan.profiles").iterdir() if f.name.endswith(".json")]
    if not files:
        pytest.skip("no shipped profiles")
    for f in files:
        with resources.as_file(f) as path:
            prof = load(path)
        assert prof.fingerprint and prof.doc["machine"]["cores"] >= 1


def test_ram_probe():
    r = probe_ram(array_bytes=8 << 20, repetitions=3, threads=2)
    assert r["threads"] == 2 and r["read_gbps"]["repetitions"] == 3
    assert r["array_bytes"] == 8 << 20
    assert 0 < r["read_gbps"]["min"] <= r["read_gbps"]["median"] <= r["read_gbps"]["max"] < 10_000
    c = r["checksum_gbps"]
    assert c["repetitions"] == 3 and 0 < c["min"] <= c["median"] <= c["max"] < 10_000


def _dev(backend, kind, unified, index=0):
    return {"backend": backend, "index": index, "name": f"{backend}-{kind}", "kind": kind,
            "total_memory_bytes": 1 << 30, "free_memory_bytes": None, "unified_memory": unified,
            "formats": ["int4"], "driver": ""}


def test_links_unified_and_skipped():
    ram = {"read_gbps": {"min": 9.0, "median": 10.0, "max": 11.0, "repetitions": 3}}
    devices = [_dev("numpy", "cpu", True), _dev("opencl", "cpu", False), _dev("vulkan", "igpu", True),
               _dev("vulkan", "gpu", False, 1)]
    links, skipped = probe_links(devices, ram, 1 << 20)
    assert [(e["backend"], e["device_index"]) for e in links] == [("opencl", 0), ("vulkan", 0)]
    for e in links:
        assert e["unified_memory"] is True and e["h2d_pinned_gbps"]["median"] == 10.0
        assert e["d2h_pageable_gbps"] == ram["read_gbps"]
    assert skipped[0]["backend"] == "vulkan" and skipped[0]["device_index"] == 1 and skipped[0]["reason"]


def test_links_borrowed_from_same_gpu(monkeypatch):
    from colibri_plan.profiler import links as links_mod

    def fake_cuda(index, block_bytes, repetitions, copies):
        return {k: {"min": 10.0 + index, "median": 10.0 + index, "max": 10.0 + index, "repetitions": 1}
                for k in links_mod.LINK_KEYS}

    monkeypatch.setattr(links_mod, "probe_cuda_link", fake_cuda)
    devices = [{**_dev("vulkan", "gpu", False, 1), "name": "Big GPU"},
               {**_dev("cuda", "gpu", False, 0), "name": "Big GPU"},
               {**_dev("cuda", "gpu", False, 1), "name": "Big GPU"},
               {**_dev("vulkan", "gpu", False, 2), "name": "Other GPU"}]
    out, skipped = probe_links(devices, {"unavailable": "x"}, 1 << 20)
    by = {(e["backend"], e["device_index"]): e for e in out}
    assert by[("cuda", 1)]["h2d_pinned_gbps"]["median"] == 11.0
    assert by[("vulkan", 1)]["h2d_pinned_gbps"]["median"] == 11.0  # cuda:1, the same index
    assert "cuda:1" in by[("vulkan", 1)]["method"]
    assert [(s["backend"], s["device_index"]) for s in skipped] == [("vulkan", 2)]


class ToyBackend(Backend):
    """A host backend on the reference matmul, so the probe plumbing is tested without any driver."""

    name = "toy"
    formats = ("int4", "int8")
    calls = 0

    @classmethod
    def unavailable_reason(cls):
        return None

    @classmethod
    def list_devices(cls):
        return [DeviceInfo("toy", 0, "toy cpu", "cpu", 1 << 30, None, True, cls.formats, "")]

    def _upload(self, qt):
        return qt

    def _matmul(self, x, w):
        ToyBackend.calls += 1
        return matmul_ref(x, w.payload)


def test_matmul_probe_plumbing(monkeypatch):
    import colibri_plan.backends as backends

    monkeypatch.setattr(backends, "get_backend", lambda name: ToyBackend)
    ToyBackend.calls = 0
    dev = ToyBackend.list_devices()[0].to_dict()
    cfg = matmul_probe.MatmulSettings(["int4", "int4-g64"], hidden=128, width=64, tokens=(1, 4),
                                      repetitions=3, ffn_experts=2)
    rows, ffn, skipped = matmul_probe.probe_matmul([dev], cfg)
    assert [(r["out_features"], r["in_features"], r["tokens"]) for r in rows] == [
        (64, 128, 1), (64, 128, 4), (128, 64, 1), (128, 64, 4)]
    # each figure: (warm-up + 1 timed) then (warm-up + 2 timed) -> 5 calls; 4 matmul figures and one
    # expert_ffn figure of 2 experts x 3 matrices
    assert ToyBackend.calls == 4 * 5 + 2 * 3 * 5
    assert all(r["seconds"]["repetitions"] == 3 for r in rows + ffn)
    for r in rows:
        assert r["weight_bytes"] == tensor_bytes("int4", r["out_features"], r["in_features"])
        # median of bytes/seconds == bytes / median seconds for an odd count of repetitions
        assert r["weight_gbps"]["median"] == pytest.approx(r["weight_bytes"] / r["seconds"]["median"] / 1e9)
    assert ffn[0]["experts"] == 2 and ffn[0]["weight_bytes"] == 2 * (
        2 * tensor_bytes("int4", 64, 128) + tensor_bytes("int4", 128, 64))
    assert skipped == [{"backend": "toy", "device_index": 0, "fmt": "int4-g64", "what": "matmul",
                        "reason": "toy kernels do not implement int4-g64"}]


def test_budgeted_repetitions():
    calls = []

    def timer(n):
        calls.append(n)
        return [0.1] * n

    assert matmul_probe.budgeted(timer, 7, 10.0) == [0.1] * 7 and calls == [1, 6]
    calls.clear()
    assert len(matmul_probe.budgeted(timer, 7, 0.45)) == 3 and calls == [1, 2]  # 0.45 / 0.1 - 2 more
    calls.clear()
    assert matmul_probe.budgeted(timer, 7, 0.05) == [0.1] and calls == [1]


def test_ffn_skipped_over_budget(monkeypatch):
    import colibri_plan.backends as backends

    monkeypatch.setattr(backends, "get_backend", lambda name: ToyBackend)
    dev = ToyBackend.list_devices()[0].to_dict()
    cfg = matmul_probe.MatmulSettings(["int4"], hidden=128, width=64, tokens=(1,), repetitions=3,
                                      ffn_experts=4, ffn_budget_s=1e-9)
    rows, ffn, skipped = matmul_probe.probe_matmul([dev], cfg)
    assert len(rows) == 2 and ffn == []
    assert skipped[0]["what"] == "expert_ffn" and "budget" in skipped[0]["reason"]


def _available_backends():
    from colibri_plan.backends import BACKEND_NAMES, get_backend

    out = []
    for name in BACKEND_NAMES:
        try:
            if get_backend(name).is_available() and get_backend(name).list_devices():
                out.append(name)
        except Exception:  # noqa: BLE001 - a missing module is just unavailable
            pass
    return out


@pytest.mark.timeout(300)
def test_cli_quick_every_section(tmp_path):
    out = tmp_path / "p.json"
    args = ["profile", "--quick", "--path", str(tmp_path), "--out", str(out), "--block-bytes", "256KiB",
            "--file-bytes", "4MiB", "--ram-bytes", "16MiB", "--disk-seconds", "0.05", "--hidden", "256",
            "--width", "128", "--trunk-shapes", "256x256", "--contexts", "64", "--json"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    prof = load_profile(out)
    doc = prof.doc
    assert json.loads(res.stdout) == doc
    sections = [p for p in PROBES if p != "trunk"] + [*TRUNK_SECTIONS, "machine", "devices", "expert_ffn"]
    for section in sections:
        assert section in doc
        if isinstance(doc[section], dict) and "unavailable" in doc[section]:
            assert doc[section]["unavailable"]
    assert prof.disk_block_bytes() == 256 << 10
    assert [e["queue_depth"] for e in doc["disk"]["random"]] == [1, 4]
    assert prof.ram_read_gbps() > 0
    available = _available_backends()
    measured = {r["backend"] for r in doc["matmul"]} if isinstance(doc["matmul"], list) else set()
    expected = set(available) - ({"numpy"} if "cpu" in available else set())
    assert measured == expected
    if "numpy" in available and "cpu" in available:  # the reference is left out, with the reason
        assert any(s["backend"] == "numpy" and "reference" in s["reason"] for s in doc["skipped"])
    for name in set(("numpy", "opencl", "vulkan", "cuda", "metal")) - set(available):
        assert any(s["backend"] == name and s["reason"] for s in doc["skipped"])
    from colibri_plan.profiler.links import HOST_BACKENDS

    if sum(d["backend"] == "cuda" for d in doc["devices"]) < 2:
        assert "CUDA device(s)" in doc["peer_links"]["unavailable"]
    if all(b in HOST_BACKENDS for b in available):
        assert "unavailable" in doc["links"]
    else:  # every non-host device has a link entry or a skip reason
        keys = {(e["backend"], e["device_index"]) for e in doc["links"]}
        keys |= {(s["backend"], s.get("device_index")) for s in doc["skipped"] if s.get("what") == "links"}
        linkable = {(d["backend"], d["index"]) for d in doc["devices"] if d["backend"] not in HOST_BACKENDS}
        assert linkable <= keys
    for b in measured:
        assert prof.matmul_weight_gbps(b, 0, "int4", 1) > 0
    for section in TRUNK_SECTIONS:  # the trunk probe measures the matmul probe's devices
        if section == "step_graph":  # the replayed step: with --model, on a backend that captures steps
            assert "unavailable" in doc[section] or {e["backend"] for e in doc[section]} <= measured
            continue
        assert {e["backend"] for e in doc[section]} == measured
    assert list(tmp_path.iterdir()) == [out]  # only the profile; the test file is gone


def test_cli_rejects_bad_sizes(tmp_path):
    res = CliRunner().invoke(cli, ["profile", "--file-bytes", "lots", "--out", "-"])
    assert res.exit_code == 1 and "not a size" in res.output
    res = CliRunner().invoke(cli, ["profile", "--backends", "nope", "--out", "-"])
    assert res.exit_code == 1 and "unknown backend" in res.output


def test_random_weight_valid():
    for fmt in ("int4", "int4-g64", "int8", "int2", "f16"):
        q = matmul_probe.random_weight(fmt, 8, 70)
        assert q.nbytes == tensor_bytes(fmt, 8, 70)
        assert np.all(np.isfinite(matmul_ref(np.ones((1, 70), np.float32), q)))
