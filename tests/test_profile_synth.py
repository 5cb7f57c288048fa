"""profile synth / list / show (issue 29): a machine described in one line, every figure labelled stated,
default (published, with its source) or assumed; the shipped profiles listed; unknown names list them."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke, refused

from colibri_plan.errors import InputError
from colibri_plan.formats.profile import load_profile, resolve_profile, shipped_profile_names
from colibri_plan.profiler.describe import describe_profile
from colibri_plan.profiler.synth import StatedMachine, parse_machine, parse_size, synth_profile


def _figure(doc: dict, what: str) -> dict:
    return next(r for r in doc["figures"] if r["what"] == what)


def test_synth_of_the_issue_machine_labels_every_figure(tmp_path):
    r = invoke("profile", "synth", "--gpu", "24G", "--ram", "64G", "--nvme", "gen4", "--cpu", "16",
               "--out", tmp_path / "m.json", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    prof = load_profile(tmp_path / "m.json")         # a valid profile, as `solve --profile` reads it
    assert prof.doc["figures"] == doc["figures"] and doc["profile_file"] == str(tmp_path / "m.json")
    assert prof.ram_available_bytes() == int(64e9 * 0.96) and prof.doc["machine"]["ram_total_bytes"] == 64e9
    gpu = prof.gpus()
    assert [(g["backend"], g["total_memory_bytes"], g["unified_memory"]) for g in gpu] == \
        [("cuda", 24e9, False)]
    # a Gen4 drive's published 7.0 GB/s, 35% of it at queue depth 1 (assumed), 85% at depth 8
    assert prof.disk_read_gbps(1) == pytest.approx(2.45) and prof.disk_read_gbps(8) == pytest.approx(5.95)
    assert prof.h2d_gbps("cuda", 0) == pytest.approx(31.5 * 0.85)        # PCIe 4.0 x16, not stated
    assert prof.matmul_weight_gbps("cuda", 0, "int4") == pytest.approx(504.0)
    assert prof.ram_read_gbps() == pytest.approx(62.7)
    assert prof.matmul_weight_gbps("cpu", 0, "int4") == pytest.approx(0.4 * 62.7)
    assert _figure(doc, "CPU cores") == {"what": "CPU cores", "value": 16, "unit": "", "origin": "stated",
                                         "source": ""}
    assert _figure(doc, "drive")["origin"] == "stated"
    seq = _figure(doc, "drive sequential read (rated)")
    assert seq["origin"] == "default" and "Samsung 990 PRO: 7,450 MB/s" in seq["source"]
    assert _figure(doc, "RAM read (all cores)")["origin"] == "default"
    assert "JEDEC" in _figure(doc, "RAM read (all cores)")["source"]
    assert _figure(doc, "GPU link")["origin"] == "default" and "PCI-SIG" in _figure(doc, "GPU link")["source"]
    assert _figure(doc, "cuda:0 memory")["origin"] == "stated"
    assert {r["origin"] for r in doc["figures"]} == {"stated", "default", "assumed"}
    assert all(r["source"] for r in doc["figures"] if r["origin"] != "stated")   # every default is sourced


def test_stated_rates_replace_the_defaults():
    m = StatedMachine.from_flags(ram="128G", gpu="2x24G:936", nvme="5.5", cpu="32:80", pcie="gen5")
    doc = synth_profile(m).doc
    assert m.summary() == "2x 24 GB GPU, 128 GB RAM, NVMe 5.5 GB/s, 32 cores"
    assert _figure(doc, "RAM read (all cores)") == {"what": "RAM read (all cores)", "value": 80.0,
                                                    "unit": "GB/s", "origin": "stated", "source": ""}
    assert _figure(doc, "drive sequential read (rated)")["origin"] == "stated"
    assert _figure(doc, "cuda:1 memory bandwidth")["value"] == 936.0
    assert _figure(doc, "GPU link")["origin"] == "stated"
    assert doc["disk"]["random"][0]["read_gbps"]["median"] == pytest.approx(5.5 * 0.35)
    assert [d["index"] for d in doc["devices"] if d["backend"] == "cuda"] == [0, 1]


def test_a_machine_in_one_line_is_the_same_statement():
    line = parse_machine("gpu=24G ram=64G nvme=gen4 cpu=16")
    assert line == StatedMachine.from_flags(gpu="24G", ram="64G", nvme="gen4", cpu="16")
    assert parse_machine("ram=64GiB; nvme=sata").ram_bytes == 64 * 2**30
    assert parse_size("1.5T", "--ram") == 1_500_000_000_000


@pytest.mark.parametrize("line, words", [
    ("gpu=24G", "RAM"), ("ram=64G disk=gen4", "'disk=gen4'"), ("ram=64Q", "--ram '64Q'"),
    ("ram=64G nvme=gen9", "--nvme 'gen9'"), ("ram=64G cpu=x", "--cpu 'x'"), ("ram=64G gpu=0", "--gpu '0'"),
    ("ram=64G pcie=gen7", "--pcie"), ("ram=64G nvme=0", "--nvme"),
    ("gpu=lots", "--gpu 'lots'"), ("ram=64G gpu=0x24G", "states no GPU"),
    ("gpu=24G gpu=16G ram=64G", "gpu= is given twice"), ("ram=64G ram=8G", "ram= is given twice")])
# a bad figure is named before the missing RAM
def test_bad_statements_say_what_and_how(line, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(")):
        parse_machine(line)


def test_synth_human_output_and_refusals(tmp_path):
    r = invoke("profile", "synth", "--gpu", "24G", "--ram", "64G", "--nvme", "gen4", "--cpu", "16")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.startswith("stated machine: 1x 24 GB GPU, 64 GB RAM, NVMe gen4, 16 cores\n")
    assert "drive sequential read (rated)" in out and "default" in out and "[4] PCIe 4.0 x4" in out
    assert "Not written: pass --out FILE" in out and "--machine 'gpu=24G ram=64G nvme=gen4 cpu=16'" in out
    refused(invoke("profile", "synth", "--gpu", "24G"), "--ram 64G")
    refused(invoke("profile", "synth", "--ram", "64G", "--gpu", "lots"), "--gpu 'lots'")
    assert not list(tmp_path.iterdir())


def test_profile_list_names_the_shipped_profiles():
    r = invoke("profile", "list", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["profiles"]
    assert [p["name"] for p in rows] == shipped_profile_names() == [
        "cpu-2core-virtio", "h200-16core-gen5", "published-6x-rtx5090"]
    kinds = {p["name"]: p["kind"] for p in rows}
    assert kinds == {"cpu-2core-virtio": "measured", "h200-16core-gen5": "measured",
                     "published-6x-rtx5090": "published"}
    human = invoke("profile", "list").stdout
    assert "6x NVIDIA GeForce RTX 5090 (34 GB)" in human and "solve --profile NAME" in human


def test_unknown_profile_lists_what_exists():
    with pytest.raises(InputError, match="shipped: cpu-2core-virtio, h200-16core-gen5, published-6x-rtx5090"):
        resolve_profile("no-such-machine")
    line = refused(invoke("solve", "--profile", "rtx5090", "--model", "glm-5.2"), "published-6x-rtx5090",
                   "profile synth")
    assert "InputError" not in line


def test_profile_show_labels_measured_and_published_figures(tmp_path):
    published = describe_profile(resolve_profile("published-6x-rtx5090")[0].doc)
    assert {r["origin"] for r in published} == {"published", "assumed"}
    measured = describe_profile(resolve_profile("h200-16core-gen5")[0].doc)
    assert {r["origin"] for r in measured} == {"measured"}
    qd1 = next(r for r in measured if r["what"] == "expert-block reads at queue depth 1")
    assert qd1["value"] == pytest.approx(1.34, abs=0.005)
    r = invoke("profile", "show", "h200-16core-gen5")
    assert r.exit_code == 0 and "measured" in r.stdout and "cuda:0 expert GEMV" in r.stdout
    assert "QD" not in r.stdout                                   # the full tables are behind -v
    assert "QD" in invoke("profile", "show", "h200-16core-gen5", "-v").stdout
    assert invoke("profile", "synth", "--ram", "32G", "--out", tmp_path / "s.json").exit_code == 0
    shown = json.loads(invoke("profile", "show", tmp_path / "s.json", "--json").stdout)
    assert shown["figures"] == json.loads((tmp_path / "s.json").read_text())["figures"]
    assert [r["value"] for r in shown["figures"] if r["what"] == "drive"] == ["gen4"]   # the default drive


def test_profile_without_subcommand_still_measures(tmp_path):
    """`profile` stays the measuring command: its flags work as before the sub-commands."""
    r = invoke("profile", "--quick", "--probes", "ram", "--ram-bytes", "16MiB", "--backends", "numpy",
               "--out", tmp_path / "p.json", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["ram"]["read_gbps"]["median"] > 0 and (tmp_path / "p.json").is_file()
