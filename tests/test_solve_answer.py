"""`solve`'s answer first (issue 29): one line per engine a user may deploy (ours, colibrì, llama.cpp) with
its predicted tok/s, time to first token and the whole command, absolute paths; the details behind -v;
always where the plan went or how to keep it; a stated machine in one --machine line."""

from __future__ import annotations

import json
import shlex

import pytest
from _cli_fixtures import invoke

MACHINE = "gpu=24G ram=64G nvme=gen4 cpu=16"
MODEL = "olmoe-1b-7b"   # a small catalogue model: the solve takes about a second


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    d = tmp_path_factory.mktemp("answer")
    human = invoke("solve", "--model", MODEL, "--machine", MACHINE, "--time-limit", "5")
    doc = invoke("solve", "--model", MODEL, "--machine", MACHINE, "--time-limit", "5", "--json")
    assert human.exit_code == 0 and doc.exit_code == 0, human.output + doc.output
    return d, human.stdout, json.loads(doc.stdout)


def _engine_line(stdout: str, name: str) -> str:
    return next(ln for ln in stdout.splitlines() if ln.startswith(f"  {name} "))


def test_one_line_per_engine_with_tok_s_ttft_and_command(answered):
    _, out, doc = answered
    lines = out.splitlines()
    assert lines[0] == f"{MODEL} on a stated machine: 1x 24 GB GPU, 64 GB RAM, NVMe gen4, 16 cores"
    rows = {r["engine"]: r for r in doc["engines"]}
    assert list(rows) == ["colibri-plan", "colibri", "llama.cpp"]
    assert rows["colibri-plan"]["tok_s"] == doc["predicted"]["tok_s"]   # ours is the plan's own figure
    for name, key in (("colibri-plan", "colibri-plan"), ("colibrì", "colibri"), ("llama.cpp", "llama.cpp")):
        r = rows[key]
        line = _engine_line(out, name)
        assert r["tok_s"] > 0 and r["ttft_s"] > 0
        assert f"{r['tok_s']:.3g} tok/s" in line and line.endswith(r["command"]), line
    # llama.cpp is priced as it runs: whole layers, the rest through mmap, not the plan's own placement
    # (on this machine every layer fits the GPU, so its price may equal ours: the segmented step prices a
    # layer all in VRAM at the device's work alone, as for llama.cpp's)
    assert rows["llama.cpp"]["what"].startswith("whole layers: 16 of 16 on the GPUs")
    assert "Details (budgets, trunk, placement, knobs): add -v" in out and "Budgets:" not in out


def test_commands_are_pasteable_with_absolute_paths(answered, tmp_path):
    _, _, doc = answered
    rows = {r["engine"]: r for r in doc["engines"]}
    llama = shlex.split(rows["llama.cpp"]["command"])
    assert llama[:3] == ["llama-server", "-m", f"/path/to/{MODEL}.gguf"] and llama[3] == "-ngl"
    assert "--tensor-split" not in llama                     # one GPU: a split means nothing
    coli = shlex.split(rows["colibri"]["command"])
    assert coli[-2:] == ["./coli", "chat"] and coli[0].startswith("COLI_MODEL=/")
    pin = next(w for w in coli if w.startswith("PIN="))
    assert pin == f"PIN={doc['usage_path']}" and pin.startswith("PIN=/")
    ours = shlex.split(rows["colibri-plan"]["command"])
    assert ours[:4] == ["colibri-plan", "run", "--plan", doc["plan_file"]]
    assert doc["plan_file"].startswith("/")


def test_plan_written_or_how_to_keep_it(answered, tmp_path):
    _, out, doc = answered
    assert not doc["plan_written"] and "Plan not kept: pass --out plan.json to keep it" in out
    r = invoke("solve", "--model", MODEL, "--machine", MACHINE, "--time-limit", "5", "--out",
               tmp_path / "p.json", "--gguf", tmp_path / "m.gguf")
    assert r.exit_code == 0, r.output
    assert f"Plan written to {tmp_path / 'p.json'}" in r.stdout and (tmp_path / "p.json").is_file()
    assert (tmp_path / "p.coli_usage").is_file() and "usage file" in r.stdout
    assert f"llama-server -m {tmp_path / 'm.gguf'} " in r.stdout
    assert not any(ln.startswith("  # llama.cpp: -m:") for ln in r.stdout.splitlines())  # nothing to replace


def test_verbose_adds_the_details_and_the_reserve(tmp_path):
    r = invoke("solve", "--model", MODEL, "--machine", MACHINE, "--time-limit", "5", "--vram", "24", "-v")
    assert r.exit_code == 0, r.output
    assert "Budgets:" in r.stdout and "Solver:" in r.stdout
    assert "cuda:0: --vram 24.00 GB - reserve 2.00 GB (--vram-reserve)" in r.stdout
    assert "22.00 GB" in r.stdout                          # the card's 24 GB less the 2 GB reserve
    assert "LRU slots" in r.stdout and "in all" in r.stdout  # the total, labelled as such


def test_vram_zero_on_five_gpus_is_one_line_not_five_paragraphs():
    r = invoke("solve", "--profile", "published-6x-rtx5090", "--model", MODEL, "--vram", "24,0,0,0,0,0",
               "--time-limit", "5", "-v")
    assert r.exit_code == 0, r.output
    assert "does not fit" not in r.stdout
    assert "cuda:1, cuda:2, cuda:3, cuda:4, cuda:5: no VRAM given (--vram 0 there), not tried" in r.stdout


@pytest.mark.parametrize("args, words", [
    ((), ["--profile", "--machine", "published-6x-rtx5090"]),
    (("--profile", "published-6x-rtx5090", "--machine", MACHINE),
     ["both describe the machine", "one of them"]),
])
def test_the_machine_is_asked_for_once(args, words):
    r = invoke("solve", "--model", MODEL, *args)
    assert r.exit_code == 2 and "Traceback" not in r.output
    for w in words:
        assert w in r.output


def test_unknown_profile_and_bad_machine_say_what_exists():
    r = invoke("solve", "--model", MODEL, "--profile", "rtx-4090")
    assert r.exit_code == 1
    assert "shipped: cpu-2core-virtio, h200-16core-gen5, published-6x-rtx5090" in r.output
    assert "InputError" not in r.output
    r = invoke("solve", "--model", MODEL, "--machine", "gpu=24G nvme=gen4")
    assert r.exit_code == 1 and "give the machine's RAM" in r.output


def test_help_explains_method_and_vram():
    h = " ".join(invoke("solve", "--help").stdout.split())
    assert "'exact' places every expert" in h and "'aggregate'" in h
    assert "card's memory in GB" in h and "is taken off either way and shown" in h


def test_model_list_says_which_models_are_plan_only_and_show_cites_public_sources():
    out = invoke("model", "list").stdout
    rows = {ln.split()[0]: ln for ln in out.splitlines() if ln and not ln.startswith(("name", "-"))}
    assert rows["gpt-oss-20b"].endswith("plan only") and rows["olmoe-1b-7b"].endswith("runs")
    assert "model support" in out
    doc = json.loads(invoke("model", "list", "--json").stdout)
    assert {m["name"]: m.get("engine_runs") for m in doc["models"]}["gpt-oss-20b"] is False
    for name in ("glm-5.2", "qwen3-235b-a22b", "deepseek-v4.1-flash"):
        src = json.loads(invoke("model", "show", name, "--json").stdout)["source"]
        assert "models.md" not in src and "colibri-engine.md" not in src, src


def test_model_support_does_not_pin_the_trunk_to_the_cpu():
    out = invoke("model", "support").stdout
    assert "the dense trunk on the CPU or that device" not in out
    assert "where the plan's trunk puts them" in out and "--trunk" in out
