"""`colibri-plan profile` with the trunk probe: the sections in --json and the tables, --model shapes,
--probes without trunk, and the devices the probe gets from run_profile."""

from __future__ import annotations

import json

from _cli_fixtures import invoke

from colibri_plan.formats.profile import load_profile
from colibri_plan.profiler import run as run_mod
from colibri_plan.profiler.trunk_shapes import host_device

TINY = ["--quick", "--backends", "numpy", "--probes", "trunk", "--trunk-shapes", "64x128,128x64",
        "--contexts", "16,64", "--dense-formats", "int8,f32"]


def test_json_holds_the_sections_and_the_file_matches(tmp_path):
    out = tmp_path / "p.json"
    res = invoke("profile", *TINY, "--out", out, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc == load_profile(out).doc
    gemv = doc["dense_gemv"]
    assert sorted((e["fmt"], e["out_features"], e["in_features"]) for e in gemv) == [
        ("f32", 64, 128), ("f32", 128, 64), ("int8", 64, 128), ("int8", 128, 64)]
    assert {(e["backend"], e["device_index"], e["shape_source"]) for e in gemv} == {("numpy", 0, "generic")}
    assert all(e["weight_gbps"]["median"] > 0 for e in gemv)
    (ops,) = doc["device_ops"]
    assert ops["backend"] == "numpy" and ops["op_seconds"]["median"] > 0
    assert [e["context_tokens"] for e in doc["attention"]] == [16, 64]
    t = doc["settings"]["trunk"]
    assert t["shapes"] == [[64, 128], [128, 64]] and t["contexts"] == [16, 64] and t["model_shapes"] == []
    assert t["formats"] == ["int8", "f32"] and t["budget_s_per_device"] == 3.0
    assert "trunk" in doc["probe_seconds"] and "disk" not in doc["probe_seconds"]
    assert "not selected" in doc["disk"]["unavailable"]


def test_tables_show_the_trunk_figures(tmp_path):
    res = invoke("profile", *TINY, "--out", "-")
    assert res.exit_code == 0, res.output
    text = res.stdout
    for heading in ("dense_gemv (d_matmul, x on the device, 1 token", "device_ops (us, median (min-max))",
                    "attention (one decode d_attention of one layer)"):
        assert heading in text
    rows = [line.split() for line in text.splitlines()]
    assert ["numpy:0", "int8", "64x128", "generic"] in [r[:4] for r in rows]
    assert any(r[:3] == ["numpy:0", "32/8x128", "64"] for r in rows)
    assert "trunk: numpy:0 dense_gemv int8 [64x128]" in res.stderr


def test_model_adds_its_own_trunk_shapes(tmp_path, tiny_pack):
    res = invoke("profile", *TINY, "--model", tiny_pack, "--out", tmp_path / "p.json", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    name = doc["model"]["name"]
    # the fixture: hidden 256, 4 query heads and 2 KV heads of 32, vocab 512
    model = {(o, i): s for o, i, s in doc["settings"]["trunk"]["model_shapes"]}
    assert model == {(128, 256): f"{name} q_proj", (64, 256): f"{name} k_proj", (256, 128): f"{name} o_proj",
                     (512, 256): f"{name} lm_head"}
    measured = {(e["out_features"], e["in_features"]): e["shape_source"] for e in doc["dense_gemv"]
                if e["fmt"] == "int8"}
    assert measured == {(64, 128): "generic", (128, 64): "generic", **model}


def test_model_arch_from_catalogue_and_what_has_none(tmp_path):
    from colibri_plan.cli.profile import model_arch
    from colibri_plan.model import load_model_spec, save_model_spec

    arch, why = model_arch("mixtral-8x7b")
    assert (arch.hidden_size, arch.n_heads, arch.n_kv_heads, arch.head_dim, why) == (4096, 32, 8, 128, None)
    spec = save_model_spec(load_model_spec("mixtral-8x7b"), tmp_path / "spec.json")
    arch, why = model_arch(str(spec))
    assert arch is None and "generic shapes only" in why and "spec files" in why
    assert model_arch(None) == (None, None) and model_arch("no-such-model") == (None, None)


def test_probes_without_trunk_leave_the_sections_out(tmp_path):
    res = invoke("profile", "--quick", "--backends", "numpy", "--probes", "ram", "--ram-bytes", "16MiB",
                 "--out", tmp_path / "p.json", "--json")
    assert res.exit_code == 0, res.output
    doc = load_profile(tmp_path / "p.json").doc
    assert not {"dense_gemv", "device_ops", "attention"} & set(doc) and "trunk" not in doc["settings"]


def test_bad_trunk_options_are_refused(tmp_path):
    res = invoke("profile", *TINY[:-6], "--trunk-shapes", "64by128", "--out", "-")
    assert res.exit_code == 1 and "'64by128' is not a GEMV shape" in res.output
    res = invoke("profile", *TINY[:-2], "--dense-formats", "int9", "--out", "-")
    assert res.exit_code == 1 and "int9" in res.output
    res = invoke("profile", *TINY, "--trunk-seconds", "0", "--out", "-")
    assert res.exit_code == 2 and "--trunk-seconds" in res.output


def test_the_host_cpu_joins_gpu_devices_and_empty_results_say_why(monkeypatch):
    seen = {}

    def fake(devices, cfg, extra, ram, progress):
        seen["devices"] = devices
        return {"dense_gemv": [], "device_ops": [], "attention": []}, [
            {"backend": "cuda", "device_index": 0, "what": "trunk", "reason": "driver too old"}]

    monkeypatch.setattr(run_mod, "probe_trunk", fake)
    gpu = {"backend": "cuda", "index": 0, "name": "a GPU"}
    doc = {"settings": {}}
    skipped = run_mod._run_trunk(doc, run_mod.ProfileOptions(), run_mod.mode_settings(True), [gpu],
                                 {"name": "m"}, {"ram_available_bytes": 1 << 30}, lambda _m: None)
    assert seen["devices"] == [host_device(), gpu]
    assert seen["devices"][0]["backend"] in ("cpu", "numpy")
    assert skipped[0]["reason"] == "driver too old"
    assert doc["attention"] == {"unavailable": "cuda: driver too old"}
    host = host_device()
    run_mod._run_trunk(doc, run_mod.ProfileOptions(), run_mod.mode_settings(True), [host], {"name": "m"}, {},
                       lambda _m: None)
    assert seen["devices"] == [host]  # already there: not twice
