"""`solve --trunk`, its budget table, `plan show`, `--compare` and the exports with the trunk on a GPU."""

from __future__ import annotations

import json
import re

import pytest
from _cli_fixtures import invoke, refused
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.formats.plan_trunk import device_kv_bytes_per_token, kv_bytes
from colibri_plan.formats.profile import save_profile
from colibri_plan.model import load_model_spec, save_model_spec
from colibri_plan.planner.trunk import dense_read_bytes

RTX = "published-6x-rtx5090"
GB = 1e9


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """GLM-5.2 solved on the published 6x RTX 5090 profile (--trunk auto): the plan file, the JSON result
    and the human output of the same solve."""
    d = tmp_path_factory.mktemp("glm")
    r = invoke("solve", "--profile", RTX, "--model", "glm-5.2", "--out", d / "plan.json", "--json")
    assert r.exit_code == 0, r.output
    h = invoke("solve", "--profile", RTX, "--model", "glm-5.2", "-v")
    assert h.exit_code == 0, h.output
    return d, json.loads(r.stdout), h.stdout


def test_glm_on_six_5090s_puts_the_trunk_on_a_gpu_and_shows_the_trade(glm):
    _, doc, human = glm
    spec = load_model_spec("glm-5.2")
    # GLM-5.2 is an MLA model: its attention and latent cache run on the trunk's GPU like GQA's, so the
    # dense trunk and the KV cache (2.43 GB at 4096 tokens: the catalogue's 16-bit figure, 1.22 GB, at
    # the engine's float32) move to the GPU
    dense = dense_read_bytes(spec, "int4")
    kv = kv_bytes(4096, device_kv_bytes_per_token(spec.kv_bytes_per_token, spec.source))
    moved = dense + kv
    assert kv == 2 * kv_bytes(4096, spec.kv_bytes_per_token)
    tr = doc["trunk"]
    assert tr["device"] == tr["chosen"] == "cuda:0" and tr["mode"] == "auto"
    rows = {r["option"]: r for r in tr["options"]}
    assert list(rows) == ["cpu"] + [f"cuda:{i}" for i in range(6)]
    assert all(rows[f"cuda:{i}"]["same_as"] == "cuda:0" for i in range(1, 6))   # identical cards: solved once
    gpu, cpu = rows["cuda:0"], rows["cpu"]
    assert gpu["vram_trunk_bytes"] == {"cuda:0": moved}
    assert gpu["vram_expert_budget_bytes"]["cuda:0"] == 31_600_000_000 - moved
    assert cpu["vram_expert_budget_bytes"]["cuda:0"] == 31_600_000_000
    assert gpu["tok_s"] > 2 * cpu["tok_s"] > 0          # 9.25 GB of int4 trunk: 40 GB/s CPU vs 900 GB/s GPU
    assert doc["budgets"]["vram_budget_bytes"]["cuda:0"] == 31_600_000_000 - moved
    assert doc["budgets"]["vram_budget_bytes"]["cuda:1"] == 31_600_000_000
    assert doc["predicted"]["tok_s"] == pytest.approx(gpu["tok_s"])
    assert doc["predicted"]["trunk"]["device"] == "cuda:0"
    assert "Trunk (dense, attention, KV cache): on cuda:0 (the least predicted decode time)" in human
    placed = r"cuda:0: dense trunk \+ KV cache placed on it"
    assert re.search(rf"{placed} +{-moved / GB:,.2f} GB", human)
    assert doc["trunk"]["options"][1]["kv_bytes"] == kv and "kv_on_host" not in doc["trunk"]["options"][1]
    assert f"cuda:0 {(31.6e9 - moved) / GB:,.2f} GB" in human           # VRAM left for experts
    assert "cuda:1, cuda:2, cuda:3, cuda:4, cuda:5: as cuda:0" in human
    assert (f"takes {moved / GB:,.2f} GB of VRAM from experts (dense {dense / GB:,.2f} GB + KV "
            f"{kv / GB:,.2f} GB)") in human
    assert re.search(r"predicted \d+\.\d{3} tok/s against \d\.\d{3} with it on the CPU", human)


def test_glm_plan_shows_and_exports_its_gpu_trunk(glm):
    d, _, _ = glm
    show = invoke("plan", "show", d / "plan.json")
    assert show.exit_code == 0, show.output
    assert "trunk: on cuda:0 (int4, dense 9.25 GB + KV 2.43 GB for 4096 tokens): dense " in show.stdout
    env = json.loads(invoke("export", d / "plan.json", "--to", "colibri", "--out", d / "u.coli_usage",
                            "--json").stdout)["vars"]
    assert env["CUDA_DENSE"] == "1" and env["COLI_CUDA_ATTN"] == "1" and env["COLI_GPUS"] == "0,1,2,3,4,5"
    ll = json.loads(invoke("export", d / "plan.json", "--to", "llama.cpp", "--json").stdout)
    assert ll["ngl"] == 79 and ll["tensor_split"] == "78,0,0,0,0,0"
    assert ll["args"].startswith("-ngl 79 --tensor-split 78,0,0,0,0,0 -ot 'blk\\.(")   # six GPUs: a split
    assert ll["command"].startswith("llama-server -m /path/to/glm-5.2.gguf -ngl 79 ")
    assert any(p.endswith("=CPU") for p in ll["patterns"])              # RAM/disk experts stay on the CPU


@pytest.fixture(scope="module")
def good_files(tmp_path_factory):
    """A toy profile with one 500 GB/s GPU (150 MB after its 2 GB reserve) and a toy spec with a 0.11 GB
    int4 trunk, as files."""
    d = tmp_path_factory.mktemp("trunk")
    gpu = {"gbps": 500.0, "free_bytes": 2_150_000_000}
    save_profile(toy_profile(gpus=[gpu], ram_available_bytes=3 * 10**9), d / "profile.json")
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    save_model_spec(spec, d / "model.json")
    return d


def _solve(d, *extra):
    return invoke("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "2",
                  "--context", "100", "--heat", "synth", *extra)


def test_trunk_cpu_against_auto_on_the_toy(good_files, tmp_path):
    auto = json.loads(_solve(good_files, "--json", "--out", tmp_path / "a.json").stdout)
    cpu = json.loads(_solve(good_files, "--json", "--trunk", "cpu", "--out", tmp_path / "c.json").stdout)
    assert auto["trunk"]["device"] == "cuda:0" and cpu["trunk"]["device"] == "cpu"
    # GPU 60 GB/s against min(CPU 20, RAM 40) GB/s for the trunk's weights
    assert cpu["predicted"]["terms"]["dense_s"] > auto["predicted"]["terms"]["dense_s"]
    assert auto["predicted"]["tok_s"] > cpu["predicted"]["tok_s"]
    took = auto["budgets"]["trunk_vram_bytes"]["cuda:0"]
    vram = [x["budgets"]["vram_budget_bytes"]["cuda:0"] for x in (cpu, auto)]
    assert vram[0] - vram[1] == took
    env = json.loads(invoke("export", tmp_path / "c.json", "--to", "colibri", "--json").stdout)["vars"]
    assert "CUDA_DENSE" not in env and "COLI_CUDA_ATTN" not in env
    ll = json.loads(invoke("export", tmp_path / "c.json", "--to", "llama.cpp", "--json").stdout)
    assert ll["ngl"] == 0 and ll["args"].startswith("-ngl 0 -ot ")   # the CPU trunk, said explicitly
    env = json.loads(invoke("export", tmp_path / "a.json", "--to", "colibri", "--json").stdout)["vars"]
    assert (env["CUDA_DENSE"], env["COLI_CUDA_ATTN"], env["COLI_CUDA"]) == ("1", "1", "1")
    args = json.loads(invoke("export", tmp_path / "a.json", "--to", "llama.cpp", "--json").stdout)["args"]
    assert args.startswith("-ngl 5 -ot ") and "--tensor-split" not in args   # one GPU: no split to give


def test_compare_prices_colibri_with_and_without_the_gpu_trunk(good_files):
    doc = json.loads(_solve(good_files, "--json", "--compare").stdout)
    rows = {r["placement"]: r for r in doc["compare"]}
    on_gpu = rows["colibri hot-first (CUDA_DENSE=1 COLI_CUDA_ATTN=1)"]
    assert on_gpu["trunk"] == "cuda:0" and rows["colibri hot-first"]["trunk"] == "cpu"
    assert on_gpu["engine"] == "colibri (DIRECT=1 CUDA_DENSE=1 COLI_CUDA_ATTN=1)"
    assert on_gpu["tok_s"] > rows["colibri hot-first"]["tok_s"]
    assert rows["colibri-plan (optimised)"]["trunk"] == "cuda:0"


def test_trunk_refusals_on_the_command_line(good_files):
    refused(_solve(good_files, "--trunk", "cuda:3"), "--trunk cuda:3: the profile has no device cuda:3",
            "cuda:0")
    r = _solve(good_files, "--trunk", "cuda:0", "--vram-reserve", "2.1")
    assert r.exit_code == 1 and "Error: " in r.output and "trunk on cuda:0" in r.output, r.output
    assert "Traceback" not in r.output
