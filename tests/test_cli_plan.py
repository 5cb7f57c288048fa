"""`colibri-plan plan show`: messages about a bad plan name the file and advise once; the engine knobs,
MTP experts, and plans from before the knobs."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke, pack_and_profile, refused, write


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "morevalid", plan=True)


def test_plan_messages_name_the_file_and_advise_once(files, tmp_path):
    doc = json.loads((files / "plan.json").read_text())
    bad = dict(doc, coefficients=dict(doc.get("coefficients") or {}, dense=float("nan")))
    r = invoke("plan", "show", write(tmp_path / "nan.json", bad))
    refused(r, 1, "coefficients", "re-create the plan")
    assert "calibrate" not in r.output and r.output.count("re-create") == 1
    big = json.loads(json.dumps(doc))
    big["layers"][0]["lru_slots"] = 10**12
    refused(invoke("plan", "show", write(tmp_path / "lru.json", big)), 1, "lru.json", "RAM tiers hold")


def _show(path, *extra):
    r = invoke("plan", "show", path, *extra)
    assert r.exit_code == 0, r.output
    return r


def test_plan_show_prints_the_knobs(files):
    out = _show(files / "plan.json").stdout
    lines = out.splitlines()
    knobs = next(line for line in lines if line.startswith("Knobs: "))
    assert knobs.startswith("Knobs: target colibri-plan; O_DIRECT reads; VRAM overhead 0.000 MiB/expert; "
                            "host copies released (0.00 GB); queue depth 4, disk 2.00 GB/s (")
    assert "LRU model: Che (independent requests; no routing trace in the heat); slots auto" in out
    assert any(line.startswith("Page cache: could hold ") and line.endswith("not used: O_DIRECT")
               for line in lines)
    assert "LRU slots tried" not in out and "MTP experts" not in out
    doc = json.loads(_show(files / "plan.json", "--json").stdout)
    saved = json.loads((files / "plan.json").read_text())
    assert doc["knobs"] == saved["knobs"] and "mtp_expert_bytes" not in doc


def test_plan_show_prints_a_trace_search_and_mtp_experts(files, tmp_path):
    doc = json.loads((files / "plan.json").read_text())
    doc["model"]["mtp_expert_bytes"] = 37_790_000
    doc["knobs"]["cache_model"].update(kind="trace", trace_decode_calls=40, trace_layers=2,
                                       lru_slots_mode="search (routing trace)",
                                       lru_search=[{"slots": 2, "tok_s": 3.5, "lru_hit_rate": 0.25},
                                                   {"slots": 4, "tok_s": 3.75, "lru_hit_rate": 0.5},
                                                   {"slots": 8, "error": "does not fit"}])
    path = write(tmp_path / "trace.json", doc)
    out = _show(path).stdout
    assert "MTP experts: 37.79 MB each (colibrì's int8)" in out
    assert "LRU model: routing trace, 40 decode calls over 2 layers; slots search (routing trace): max" in out
    assert ("LRU slots tried: 2 -> 3.500 tok/s (LRU hit 25.0%), 4 -> 3.750 tok/s (LRU hit 50.0%, kept), "
            "8 -> does not fit") in out
    assert json.loads(_show(path, "--json").stdout)["mtp_expert_bytes"] == 37_790_000


def test_a_plan_without_knobs_still_shows(files, tmp_path):
    doc = json.loads((files / "plan.json").read_text())
    del doc["knobs"]
    path = write(tmp_path / "old.json", doc)
    out = _show(path).stdout
    assert "predicted " in out and "solver: " in out
    assert not any(w in out for w in ("Knobs:", "LRU model:", "Page cache:"))
    assert json.loads(_show(path, "--json").stdout)["knobs"] is None
    doc["knobs"] = {"target": "colibri"}                  # every key of knobs is optional
    out = _show(write(tmp_path / "partial.json", doc)).stdout
    assert "Knobs: target colibri\n" in out and "LRU model:" not in out


def test_plan_show_prints_the_compute_choice_and_the_repin_policy(files, tmp_path):
    doc = json.loads((files / "plan.json").read_text())
    out = _show(files / "plan.json").stdout      # a CPU-only plan: both said, as their defaults
    assert "Compute: host tiers (pinned, LRU hits, streamed) on the CPU" in out
    assert "Re-pinning: off (solve --repin-every N turns it on)" in out
    doc["devices"].append({"key": "vulkan:0", "name": "llvmpipe", "unified": True, "matmul_gbps": 0.1})
    doc["budgets"]["vram_budget_bytes"]["vulkan:0"] = 0
    doc["compute"] = {"ram_pinned": "cpu", "lru": "vulkan:0", "disk": "vulkan:0"}
    doc["compute_explain"] = {"ram_pinned": {"cpu": 1e-4, "vulkan:0": 4e-4},
                              "lru": {"cpu": 1e-4, "vulkan:0": 5e-5}, "disk": {"cpu": 1e-4, "vulkan:0": 6e-5}}
    doc["repin"] = {"enabled": True, "every_tokens": 16, "window_tokens": 64, "max_swaps": 4}
    path = write(tmp_path / "unified.json", doc)
    out = _show(path).stdout
    assert "Compute: pinned on cpu, LRU hits on vulkan:0, streamed on vulkan:0" in out
    assert ("Compute per expert: pinned cpu 0.1 ms / vulkan:0 0.4 ms; LRU hits cpu 0.1 ms / vulkan:0 "
            "0.05 ms") in out
    assert "streamed cpu 0.1 ms / vulkan:0 0.06 ms" in out
    assert "Re-pinning: every 16 tokens, window 64 tokens, at most 4 swaps per layer and round" in out
    shown = json.loads(_show(path, "--json").stdout)
    assert shown["compute"] == doc["compute"] and shown["compute_explain"] == doc["compute_explain"]
    assert shown["repin"] == doc["repin"]
    del doc["knobs"]                              # a plan without knobs still shows both sections
    out = _show(write(tmp_path / "noknobs.json", doc)).stdout
    assert "Compute: pinned on cpu" in out and "Re-pinning: every 16 tokens" in out and "Knobs:" not in out


def test_plan_show_budgets_prints_how_the_budgets_were_reached(files, tmp_path):
    doc = json.loads((files / "plan.json").read_text())
    out = _show(files / "plan.json", "--budgets").stdout
    steps = doc["budgets"]["explain"]
    assert "Budgets:" in out and steps
    for e in steps:   # each step with its bytes, in the plan's order
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(e["what"]))
        assert line.rstrip().endswith(f"{e['bytes'] / 1e9:.2f} GB")
    assert "Budgets:" not in _show(files / "plan.json").stdout   # only when asked
    old = json.loads(json.dumps(doc))
    del old["budgets"]["explain"]
    out = _show(write(tmp_path / "old.json", old), "--budgets").stdout
    assert "Budgets: the plan records no steps" in out
