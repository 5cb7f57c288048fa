"""Experts spread over two devices plus the CPU: token-exact, per-device times reported; the multi-GPU
bench (bench/multi_gpu_verify.sh, bench/multi_gpu_table.py) checked without GPUs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.session import run_placement

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N_TOKENS = 10


def _table_module():
    spec = importlib.util.spec_from_file_location("multi_gpu_table", ROOT / "bench" / "multi_gpu_table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("multi") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=32, top_k=4))
    return out


def test_two_devices_and_cpu_token_exact_with_per_device_times(fixture_dir):
    """Two host backends stand in for two GPUs ("numpy:0", "cpu:0": each opened as its own device with
    its own thread); the rest is pinned, cached or streamed on the CPU path. Same tokens as all-RAM."""
    with open_pack(fixture_dir) as pack:
        arch = pack.arch
        ref = run_placement(pack, Placement.all_ram(arch.moe_layers, arch.n_experts), PROMPT, N_TOKENS,
                            cpu_backend="numpy")
        vram = {"numpy:0": list(range(0, 12)), "cpu:0": list(range(12, 22))}
        spread = Placement({l: LayerPlacement(vram=vram, ram_pinned=[22, 23, 24], lru_slots=2)
                            for l in arch.moe_layers})
        rep = run_placement(pack, spread, PROMPT, N_TOKENS, cpu_backend="numpy")
    assert rep.tokens == ref.tokens
    t = rep.expert_compute_s_per_token
    assert set(t) == {"cpu", "numpy:0", "cpu:0"}
    assert t["numpy:0"] > 0 and t["cpu:0"] > 0 and t["cpu"] > 0
    h = rep.hit_rate
    assert h["vram"] > 0 and h["ram_pinned"] + h["lru"] + h["disk"] > 0
    assert rep.placement["vram"] == {"numpy:0": 12 * len(arch.moe_layers), "cpu:0": 10 * len(arch.moe_layers)}
    assert set(rep.to_dict()["terms"]["expert_compute_s"]) == {"cpu", "numpy:0", "cpu:0"}


# ---- GPU<->GPU peer-link probe without CUDA ----------------------------------------------------
def _dev(backend, kind, unified, index=0, name=None):
    return {"backend": backend, "index": index, "name": name or f"{backend}-{kind}", "kind": kind,
            "total_memory_bytes": 1 << 30, "free_memory_bytes": None, "unified_memory": unified,
            "formats": ["int4"], "driver": ""}


def _cuda(index, name="NVIDIA H200"):
    return _dev("cuda", "gpu", False, index, name)


def test_peer_links_unavailable_without_two_cuda_devices(monkeypatch):
    from colibri_plan.profiler.links import probe_peer_links

    for devices in ([], [_dev("numpy", "cpu", True)], [_cuda(0), _dev("opencl", "gpu", False, 1)]):
        got = probe_peer_links(devices, 1 << 20)
        n = sum(d["backend"] == "cuda" for d in devices)
        assert got == {"unavailable": got["unavailable"]} and f"{n} CUDA device(s)" in got["unavailable"]
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    got = probe_peer_links([_cuda(0), _cuda(1)], 1 << 20)
    assert "CuPy cannot be imported" in got["unavailable"]


class _FakeCupy:
    """Just what probe_cuda_peer calls: peer queries, enabling, device buffers and memcpyPeer."""

    def __init__(self, n, no_peer=(), broken=()):
        fake = self
        self.copies, self.enabled, self.current = [], set(), 0
        self.no_peer, self.broken = set(no_peer), set(broken)
        self.uint8 = np.uint8

        class Device:
            def __init__(self, i):
                self.i = i

            def __enter__(self):
                self.prev, fake.current = fake.current, self.i
                return self

            def __exit__(self, *a):
                fake.current = self.prev

            def synchronize(self):
                pass

        class runtime:
            @staticmethod
            def deviceCanAccessPeer(src, dst):
                return 0 if (src, dst) in fake.no_peer else 1

            @staticmethod
            def deviceEnablePeerAccess(peer):
                if (fake.current, peer) in fake.enabled:
                    raise RuntimeError("cudaErrorPeerAccessAlreadyEnabled: peer access is already enabled")
                fake.enabled.add((fake.current, peer))

            @staticmethod
            def memcpyPeer(dst_ptr, dst, src_ptr, src, n):
                if (src, dst) in fake.broken:
                    raise RuntimeError("cudaErrorIllegalAddress")
                fake.copies.append((src, dst, n))

        self.cuda = types.SimpleNamespace(Device=Device, runtime=runtime)

    def _buf(self, n, dtype=None):
        return types.SimpleNamespace(data=types.SimpleNamespace(ptr=1000 * (self.current + 1)), nbytes=n)

    ones = empty = _buf


def test_peer_links_every_ordered_pair_on_a_fake_cupy(monkeypatch):
    from colibri_plan.profiler.links import probe_peer_links

    fake = _FakeCupy(3, no_peer={(2, 0)}, broken={(1, 2)})
    fake.enabled.add((0, 1))  # already enabled before the probe: not an error
    monkeypatch.setitem(sys.modules, "cupy", fake)
    devices = [_cuda(2), _cuda(0), _dev("numpy", "cpu", True), _cuda(1)]
    got = probe_peer_links(devices, 4096, repetitions=2, copies=3)
    pairs = [(e["src"], e["dst"]) for e in got]
    assert pairs == [("cuda:0", "cuda:1"), ("cuda:0", "cuda:2"), ("cuda:1", "cuda:0"), ("cuda:1", "cuda:2"),
                     ("cuda:2", "cuda:0"), ("cuda:2", "cuda:1")]
    by = dict(zip(pairs, got))
    ok = by[("cuda:0", "cuda:1")]
    assert ok["can_access_peer"] is ok["peer_access_enabled"] is True and ok["block_bytes"] == 4096
    assert ok["copy_gbps"]["repetitions"] == 2 and ok["copy_gbps"]["median"] > 0
    assert by[("cuda:2", "cuda:0")]["can_access_peer"] is False  # staged by the driver, still measured
    assert by[("cuda:2", "cuda:0")]["copy_gbps"]["median"] > 0
    assert "cudaErrorIllegalAddress" in by[("cuda:1", "cuda:2")]["copy_gbps"]["unavailable"]
    assert (2, 0) not in fake.enabled and (1, 0) in fake.enabled
    # warm-up + repetitions x copies per working pair, each one block from src to dst
    assert len([c for c in fake.copies if c[:2] == (0, 1)]) == 1 + 2 * 3
    assert all(n == 4096 for *_, n in fake.copies)


# ---- bench/multi_gpu_table.py on synthetic reports ---------------------------------------------
def _plan(split: list[tuple[int, int, int]]) -> dict:
    keys = ["cuda:0", "cuda:1"]
    layers = []
    for lid, (a, b, ram) in enumerate(split):
        ids = iter(range(64))
        layers.append({"layer": lid, "vram": {"cuda:0": [next(ids) for _ in range(a)],
                                              "cuda:1": [next(ids) for _ in range(b)]},
                       "ram_pinned": [next(ids) for _ in range(ram)], "lru_slots": 0, "disk": list(ids)})
    return {"devices": [{"key": k} for k in keys], "layers": layers, "predicted": {"tok_s": 50.0}}


def _report(tok_s: float, dev0: float, dev1: float, exact=None, tokens=(1, 2, 3)) -> dict:
    terms = {"expert_compute_s": {"cpu": 0.0, "cuda:0": dev0, "cuda:1": dev1},
             "expert_layers_s": max(dev0, dev1)}
    predicted = {"expert_compute_s": {"cpu": 0.0, "cuda:0": 0.003, "cuda:1": 0.003}}
    return {"plan": {"n_decode_layers": 3}, "predicted": {"tok_s": 50.0, "terms": predicted},
            "measured": {"tok_s": tok_s, "terms": terms, "tokens": list(tokens)},
            "verdict": {"token_exact": exact}}


def test_table_on_synthetic_reports(tmp_path, capsys):
    mod = _table_module()
    (tmp_path / "plan-ours.json").write_text(json.dumps(_plan([(20, 20, 0), (22, 18, 0), (21, 21, 0)])))
    (tmp_path / "plan-hot-first.json").write_text(json.dumps(_plan([(30, 10, 0), (10, 30, 0), (22, 22, 0)])))
    runs = {"ours": [(60.0, 0.006, 0.003, True), (40.0, 0.006, 0.006, None), (50.0, 0.003, 0.003, None)],
            "hot-first": [(50.0, 0.009, 0.003, None), (50.0, 0.006, 0.006, None)]}  # r3 missing: failed run
    for name, rs in runs.items():
        for r, (tok, d0, d1, exact) in enumerate(rs, 1):
            (tmp_path / f"verify-{name}-r{r}.json").write_text(json.dumps(_report(tok, d0, d1, exact)))
    (tmp_path / "profile.json").write_text(json.dumps({"peer_links": [
        {"src": "cuda:0", "dst": "cuda:1", "can_access_peer": True, "copy_gbps": {"median": 140.0}},
        {"src": "cuda:1", "dst": "cuda:0", "can_access_peer": False, "copy_gbps": {"unavailable": "x"}}]}))
    out = tmp_path / "summary.json"
    assert mod.main(["table", str(tmp_path), "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    ours, hot = s["placements"]["ours"], s["placements"]["hot-first"]
    assert ours["experts"] == {"cuda:0": 63, "cuda:1": 59, "ram_pinned": 0, "disk": 192 - 122}
    assert ours["per_layer_split"][1] == {"layer": 1, "cuda:0": 22, "cuda:1": 18, "ram_pinned": 0, "disk": 24}
    assert ours["tok_s"] == {"median": 50.0, "min": 40.0, "max": 60.0, "n": 3}
    assert ours["token_exact"] is True and hot["token_exact"] is None and ours["tokens_same_every_repeat"]
    # per device and MoE layer, ms: 6 ms per token over 3 layers = 2 ms (median of 2, 2, 1)
    assert ours["expert_ms_per_layer"]["cuda:0"]["measured"]["median"] == pytest.approx(2.0)
    assert ours["expert_ms_per_layer"]["cuda:0"]["predicted"] == pytest.approx(1.0)
    assert ours["measured_over_predicted"] == pytest.approx(1.0)
    assert hot["tok_s"]["n"] == 2
    assert s["paired_ratio"]["runs"] == pytest.approx([1.2, 0.8]) and s["paired_ratio"]["n"] == 2
    assert s["same_tokens_across_placements"] is True
    text = capsys.readouterr().out
    assert "paired tok/s ratio ours / hot-first: median 1.000" in text
    assert "peer cuda:0 -> cuda:1: peer access True, 140.00 GB/s" in text
    assert "peer cuda:1 -> cuda:0: x" in text


def test_table_with_no_runs(tmp_path):
    mod = _table_module()
    s = mod.summarize(tmp_path, ["ours", "hot-first"])
    assert s["placements"]["ours"]["tok_s"]["n"] == 0 and s["paired_ratio"]["n"] == 0
    assert "tok/s median -" in mod.render(s)


def test_bench_script_parses_and_refuses_one_gpu(tmp_path):
    script = ROOT / "bench" / "multi_gpu_verify.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # no CUDA here (or a python without CuPy): a clear refusal before anything is built
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "PY": "false"}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "needs at least 2 CUDA GPUs" in r.stderr and "found 0" in r.stderr
    assert not (tmp_path / "work" / "fixture").exists()


@pytest.mark.slow
def test_bench_rehearsal_without_gpus(tmp_path):
    """REHEARSE=1: the whole bench (small fixture, two host backends as GPUs) ends with the table."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work"), "REHEARSE": "1",
           "REPEATS": "1", "TOKENS": "3", "PY": sys.executable, "CP": str(bindir / "colibri-plan")}
    r = subprocess.run(["bash", str(ROOT / "bench" / "multi_gpu_verify.sh")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = tmp_path / "out" / "results"
    assert sorted(p.name for p in res.iterdir()) == [
        "plan-hot-first.json", "plan-ours.json", "profile.json", "reports.tar.gz", "smoke.txt",
        "summary.json", "table.txt"]
    s = json.loads((res / "summary.json").read_text())
    assert s["placements"]["ours"]["token_exact"] is True and s["same_tokens_across_placements"] is True
    assert len(s["peer_links"]) == 2
