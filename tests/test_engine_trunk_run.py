"""A device trunk through the run path: run_placement, `run --trunk`, `run --plan` and `verify` with a plan's
trunk section, and the refusals before any upload (a device the machine lacks, trunk + KV + VRAM experts
past the device's capacity, a split trunk), each with the bytes asked and available."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _cli_fixtures import invoke, pack_and_profile

from colibri_plan.backends.numpy_ref import NumpyBackend
from colibri_plan.engine import session
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.session import expert_bytes_on, run_placement
from colibri_plan.engine.trunk import trunk_dense_bytes, trunk_kv_bytes
from colibri_plan.errors import BackendUnavailableError, DeviceOutOfMemoryError, UnsupportedError
from colibri_plan.formats.plan import load_plan
from colibri_plan.formats.plan_trunk import TrunkPlacement, kv_bytes

ROOT = Path(__file__).resolve().parents[1]

PROMPT = [5, 80, 200, 7]
N_TOKENS = 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "trunkrun", plan=True)


def _trunk(key: str, context: int = 64, **kw) -> TrunkPlacement:
    return TrunkPlacement(device=key, kv_device=kw.pop("kv_device", key), context_tokens=context, **kw)


def _cpu_tokens(pack) -> list[int]:
    a = pack.arch
    return run_placement(pack, Placement.all_ram(a.moe_layers, a.n_experts), PROMPT, N_TOKENS,
                         cpu_backend="numpy").tokens


def test_run_placement_on_a_device_trunk_is_token_exact_and_measured(files):
    with open_pack(files / "fx") as pack:
        a = pack.arch
        want = _cpu_tokens(pack)
        vram = Placement({l: LayerPlacement(vram={"numpy:0": [0, 1, 2]}, ram_pinned=list(range(3, 16)))
                          for l in a.moe_layers})
        rep = run_placement(pack, vram, PROMPT, N_TOKENS, cpu_backend="numpy", trunk=_trunk("numpy:0", 8))
    assert rep.tokens == want and rep.trunk_device == "numpy:0"
    assert rep.attention_s_per_token > 0 and rep.dense_s_per_token >= 0
    # 4 + 5 tokens fit the 64 rows reserved for a context of 8
    assert rep.trunk_bytes == {"dense": trunk_dense_bytes(a, pack.dense, 8), "kv": trunk_kv_bytes(a, 8)}
    assert rep.to_dict()["terms"]["attention_s"] == rep.attention_s_per_token
    assert rep.hit_rate["vram"] > 0


def test_a_trunk_device_the_machine_lacks_is_refused_before_any_upload(files, monkeypatch):
    monkeypatch.setattr(session, "ResidencyManager", None)   # building it (uploading) would fail loudly
    with open_pack(files / "fx") as pack:
        a = pack.arch
        asked = trunk_dense_bytes(a, pack.dense, 64) + trunk_kv_bytes(a, 64)
        with pytest.raises(BackendUnavailableError) as exc:
            run_placement(pack, Placement.all_ram(a.moe_layers, a.n_experts), PROMPT, N_TOKENS,
                          cpu_backend="numpy", trunk=_trunk("numpy:3"))
    msg = str(exc.value)
    assert f"{asked:,} B asked" in msg and "no numpy:3" in msg and "numpy has 1 device(s)" in msg
    assert "numpy:0 (" in msg and "--trunk cpu" in msg


def test_trunk_kv_and_vram_experts_past_the_capacity_are_refused_with_the_bytes(files, monkeypatch):
    with open_pack(files / "fx") as pack:
        a = pack.arch
        vram = Placement({l: LayerPlacement(vram={"numpy:0": [0, 1]}, ram_pinned=list(range(2, 16)))
                          for l in a.moe_layers})
        dense, kv = trunk_dense_bytes(a, pack.dense, 64), trunk_kv_bytes(a, 64)
        experts = expert_bytes_on(pack, vram, "numpy:0")
        assert experts == 2 * len(a.moe_layers) * sum(t.nbytes for t in pack.expert(a.moe_layers[0], 0))
        uploads = []
        monkeypatch.setattr(NumpyBackend, "_upload", lambda self, qt: uploads.append(qt))
        cap = dense + kv + experts - 1   # one byte short: the experts on the device count
        monkeypatch.setattr(NumpyBackend, "capacity_bytes", lambda self: cap)
        with pytest.raises(DeviceOutOfMemoryError) as exc:
            run_placement(pack, vram, PROMPT, N_TOKENS, cpu_backend="numpy", trunk=_trunk("numpy:0"))
    e = exc.value
    assert uploads == [] and e.requested_bytes == cap + 1 and e.capacity_bytes == cap
    for n in (dense, kv, experts, cap + 1, cap):
        assert f"{n:,} B" in str(e)
    assert "64 tokens" in str(e)


def test_a_run_longer_than_the_plans_context_is_checked_with_its_own_context(files, monkeypatch):
    with open_pack(files / "fx") as pack:
        a = pack.arch
        need = trunk_dense_bytes(a, pack.dense, 300) + trunk_kv_bytes(a, 300)
        monkeypatch.setattr(NumpyBackend, "capacity_bytes", lambda self: need - 1)
        with pytest.raises(DeviceOutOfMemoryError, match="300 tokens"):
            run_placement(pack, Placement.all_ram(a.moe_layers, a.n_experts), list(range(1, 296)), 5,
                          cpu_backend="numpy", trunk=_trunk("numpy:0", 64))


def test_a_split_trunk_or_a_kv_cache_away_from_it_is_refused_in_one_line(files):
    with open_pack(files / "fx") as pack:
        a = pack.arch
        place = Placement.all_ram(a.moe_layers, a.n_experts)
        split = _trunk("numpy:0", split=((0, 0, "numpy:0"), (1, 1, "cpu:0")))
        with pytest.raises(UnsupportedError, match="one trunk device") as exc:
            run_placement(pack, place, PROMPT, N_TOKENS, cpu_backend="numpy", trunk=split)
        assert "\n" not in str(exc.value) and "cpu:0, numpy:0" in str(exc.value)
        with pytest.raises(UnsupportedError, match="keeps them together"):
            run_placement(pack, place, PROMPT, N_TOKENS, cpu_backend="numpy",
                          trunk=_trunk("numpy:0", kv_device="cpu"))


# ---- through the CLI -------------------------------------------------------------------------------

def _run_json(*args):
    r = invoke("run", *args, "--prompt-ids", ",".join(map(str, PROMPT)), "--tokens", N_TOKENS, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_run_trunk_option_without_a_plan(files):
    cpu = _run_json("--model", files / "fx", "--backend", "numpy")
    dev = _run_json("--model", files / "fx", "--backend", "numpy", "--trunk", "device")
    assert cpu["trunk_device"] == "cpu" and "attention_s" not in cpu["terms"]
    assert dev["trunk_device"] == "numpy:0" and dev["terms"]["attention_s"] > 0
    assert dev["tokens"] == cpu["tokens"]
    assert dev["trunk_bytes"]["kv"] == trunk_kv_bytes(_arch(files), len(PROMPT) + N_TOKENS)


def _arch(files):
    with open_pack(files / "fx") as pack:
        return pack.arch


def _trunk_plan(files, tmp_path, device: str = "numpy:0", predicted: bool = True):
    """The solved CPU plan with one more device and a trunk section (and predicted.trunk) on it."""
    doc = json.loads((files / "plan.json").read_text())
    a = _arch(files)
    bpt = a.n_layers * a.kv_values_per_token * 4
    doc["devices"].append({"key": device})
    doc["budgets"]["vram_budget_bytes"][device] = 10**9
    doc["budgets"]["trunk_vram_bytes"] = {device: 123 + kv_bytes(64, bpt)}   # as solve takes it from VRAM
    doc["trunk"] = {"device": device, "dense_format": "f32", "dense_bytes": 123,
                    "kv": {"device": device, "context_tokens": 64, "page_tokens": 64, "bytes_per_token": bpt,
                           "bytes": kv_bytes(64, bpt)}}
    if predicted:
        doc["predicted"]["trunk"] = {"device": device, "dense_s_per_token": 0.002,
                                     "attention_s_per_token": 0.0005, "host_roundtrip_s_per_token": 0.0001,
                                     "kv_bytes": kv_bytes(64, bpt)}
    out = tmp_path / f"plan-{device.replace(':', '')}.json"
    out.write_text(json.dumps(doc))
    return out


def test_run_and_verify_a_plan_with_a_trunk_section(files, tmp_path):
    want = _run_json("--model", files / "fx", "--backend", "numpy")["tokens"]
    plan = _trunk_plan(files, tmp_path)
    got = _run_json("--model", files / "fx", "--backend", "numpy", "--plan", plan)
    assert got["tokens"] == want and got["trunk_device"] == "numpy:0" and got["terms"]["attention_s"] > 0
    host = _run_json("--model", files / "fx", "--backend", "numpy", "--plan", plan, "--trunk", "cpu")
    assert host["tokens"] == want and host["trunk_device"] == "cpu"
    r = invoke("run", "--model", files / "fx", "--plan", plan, "--prompt-ids", "1", "--trunk", "device")
    assert r.exit_code == 1 and "trunk section" in r.output
    report = tmp_path / "v.json"
    r = invoke("verify", "--plan", plan, "--model", files / "fx", "--tokens", 3, "--backend", "numpy",
               "--report", report, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verdict"]["token_exact"] is True and doc["settings"]["trunk_device"] == "numpy:0"
    rows = {row["term"]: row for row in doc["comparison"]}
    assert rows["attention"]["predicted"] == 0.0005 and rows["attention"]["measured"] > 0
    assert rows["dense (trunk)"]["predicted"] == 0.002
    assert rows["dense + attention"]["measured"] == pytest.approx(
        doc["measured"]["terms"]["dense_s"] + doc["measured"]["terms"]["attention_s"])
    assert rows["host round trip (in dense)"]["measured"] is None
    human = invoke("verify", "--plan", plan, "--model", files / "fx", "--tokens", 2, "--backend", "numpy",
                   "--no-reference", "--report", tmp_path / "v2.json")
    assert human.exit_code == 0 and "trunk (dense, attention, KV cache) on numpy:0" in human.output
    assert Placement.from_plan(load_plan(plan)).trunk.device == "numpy:0"
    # the H200 bench's summary of a CPU-trunk and a device-trunk report
    r = invoke("verify", "--plan", files / "plan.json", "--model", files / "fx", "--tokens", 3, "--backend",
               "numpy", "--report", tmp_path / "v-cpu.json")
    assert r.exit_code == 0, r.output
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "h200_trunk.py"), "summary",
                          str(tmp_path / "v-cpu.json"), str(report)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "token-exact (both): yes" in out.stdout and "ratio gpu/cpu" in out.stdout
    assert "trunk gpu: device numpy:0 (plan: numpy:0)" in out.stdout


def test_a_plan_trunk_on_a_missing_gpu_is_refused_naming_the_devices_here(files, tmp_path):
    plan = _trunk_plan(files, tmp_path, device="cuda:7", predicted=False)
    r = invoke("run", "--model", files / "fx", "--plan", plan, "--prompt-ids", "1,2", "--tokens", 2)
    assert r.exit_code == 1 and "Traceback" not in r.output
    line = [ln for ln in r.output.splitlines() if ln.startswith("Error: ")]
    assert len(line) == 1 and "Error: " in line[0]
    assert "no cuda:7" in line[0] and "B asked" in line[0] and "numpy:0 (" in line[0]


def test_the_benchs_int8_trunk_fixture_runs_token_exact_on_a_device_trunk(tmp_path):
    from colibri_plan.engine.dense_quant import QuantLinear
    from colibri_plan.engine.fixture import FixtureConfig, build_fixture

    cfg = FixtureConfig.small(layers=2, experts=8, top_k=2, heads=4, kv_heads=2, quant="int8",
                              dense_format="int8")
    build_fixture(tmp_path / "fx", cfg)
    with open_pack(tmp_path / "fx") as pack:
        assert isinstance(pack.dense["layers.1.attn.o"], QuantLinear)
        assert pack.index["format"]["dense_format"] == "int8"
        want = _cpu_tokens(pack)
        a = pack.arch
        rep = run_placement(pack, Placement.all_ram(a.moe_layers, a.n_experts), PROMPT, N_TOKENS,
                            cpu_backend="numpy", trunk=_trunk("numpy:0"))
    assert rep.tokens == want and rep.trunk_bytes["dense"] == trunk_dense_bytes(a, pack.dense, 64)
