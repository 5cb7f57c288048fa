"""profiler/run: a probe that fails on a path the user gave is an error, not a skipped section."""

from __future__ import annotations

import pytest

from colibri_plan.errors import InputError


def test_profile_explicit_path_that_fails_is_an_error(tmp_path, monkeypatch):
    from colibri_plan.profiler import disk as disk_mod
    from colibri_plan.profiler.run import ProfileOptions, run_profile

    def broken(*_a, **_k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(disk_mod, "probe_disk", broken)
    with pytest.raises(InputError, match="Read-only file system"):
        run_profile(ProfileOptions(path=str(tmp_path), quick=True, backends=("numpy",), probes=("disk",)))


# ---- a real unified-memory profile: lavapipe named with --backends (issue 16 follow-up) ----------------

def _vulkan_reason() -> str | None:
    from colibri_plan.profiler.machine import list_all_devices

    devs, skipped = list_all_devices(["vulkan"])
    if any(d["kind"] == "cpu" for d in devs):
        return None
    return "no CPU-type Vulkan device (lavapipe) here: " + "; ".join(s["reason"] for s in skipped)


@pytest.fixture(scope="module")
def lavapipe(tmp_path_factory):
    """A fixture pack and a real quick profile of this machine with --backends cpu,vulkan."""
    reason = _vulkan_reason()
    if reason:
        pytest.skip(reason)
    from _cli_fixtures import invoke

    from colibri_plan.engine.fixture import FixtureConfig, build_fixture

    d = tmp_path_factory.mktemp("lava")
    build_fixture(d / "fx", FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    r = invoke("profile", "--quick", "--backends", "cpu,vulkan", "--model", d / "fx", "--path", d,
               "--out", d / "profile.json")
    assert r.exit_code == 0, r.output
    return d


def _solve(d, profile: str, out: str) -> dict:
    import json

    from _cli_fixtures import invoke

    r = invoke("solve", "--profile", d / profile, "--model", d / "fx", "--heat", "uniform", "--ram", "0.503",
               "--context", "100", "--out", d / out, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_quick_profile_lists_lavapipe_as_unified_and_the_plan_chooses_by_speed(lavapipe):
    import json

    from colibri_plan.formats.plan import load_plan
    from colibri_plan.formats.profile import load_profile

    prof = load_profile(lavapipe / "profile.json")
    (lava,) = [g for g in prof.gpus() if g["backend"] == "vulkan"]
    assert lava["unified_memory"] is True and lava["kind"] == "igpu" and lava["host_memory_device"] is True
    assert all(r["device_kind"] == "igpu" for r in prof.doc["matmul"] if r["backend"] == "vulkan")
    doc = _solve(lavapipe, "profile.json", "plan.json")
    plan = load_plan(lavapipe / "plan.json")          # budgets: lavapipe's experts come out of the RAM once
    c, b = plan.counts(), plan.expert_bytes
    assert doc["budgets"]["vram_budget_bytes"]["vulkan:0"] == 0
    assert (c["ram_pinned"] + c["lru_slots"] + c.get("vulkan:0", 0)) * b <= doc["budgets"]["ram_budget_bytes"]
    explain = doc["compute_explain"]
    for tier in ("ram_pinned", "disk"):   # the choice is the faster processor of the real figures
        assert doc["compute"][tier] == min(explain[tier], key=explain[tier].get)
    assert json.loads((lavapipe / "plan.json").read_text())["compute"] == doc["compute"]


def test_a_faster_vulkan_figure_streams_experts_on_lavapipe_token_exact(lavapipe):
    import json

    from _cli_fixtures import invoke

    prof = json.loads((lavapipe / "profile.json").read_text())

    def scale(stat: dict, f: float) -> dict:
        return {k: v * f if k in ("min", "median", "max") else v for k, v in stat.items()}

    for r in prof["matmul"] + prof["expert_ffn"]:     # lavapipe edited to 1000x its measured speed
        if r["backend"] == "vulkan":
            r["seconds"] = scale(r["seconds"], 1e-3)
            if "weight_gbps" in r:
                r["weight_gbps"] = scale(r["weight_gbps"], 1e3)
    (lavapipe / "fast.json").write_text(json.dumps(prof))
    doc = _solve(lavapipe, "fast.json", "fast-plan.json")
    assert doc["compute"]["disk"] == "vulkan:0" and doc["compute"]["lru"] == "vulkan:0"
    assert doc["counts"]["disk"] > 0
    v = invoke("verify", "--plan", lavapipe / "fast-plan.json", "--model", lavapipe / "fx", "--tokens", "6",
               "--json", "--report", lavapipe / "v.json")
    assert v.exit_code == 0, v.output
    assert json.loads(v.stdout)["verdict"]["token_exact"] is True


def test_profile_default_path_that_fails_warns_to_give_path(monkeypatch):
    from colibri_plan.profiler import disk as disk_mod
    from colibri_plan.profiler.run import ProfileOptions, run_profile

    def broken(*_a, **_k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(disk_mod, "probe_disk", broken)
    prof = run_profile(ProfileOptions(quick=True, backends=("numpy",), probes=("disk",)))
    assert "Read-only file system" in prof.doc["disk"]["unavailable"]
    assert any("--path DIR" in w and "Read-only" in w for w in prof.doc["warnings"])
