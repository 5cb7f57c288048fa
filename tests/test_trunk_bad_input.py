"""Bad input around the whole-model placement (issue 13): each refusal says what was wrong and what to do.

`solve --trunk split` where no split can exist, a hand-edited trunk section with a bogus format or a
split that is not a list, and `run --backend <GPU>` on a machine without that backend or device.
"""

from __future__ import annotations

import pytest
from _cli_fixtures import assert_one_line, invoke
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.plan_trunk import kv_bytes, parse_trunk
from colibri_plan.planner import make
from colibri_plan.planner.make import make_plan
from colibri_plan.planner.options import SolveOptions

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}     # 60 MB of expert budget after the 2 GB reserve


@pytest.fixture
def no_solve(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("solved before refusing")

    monkeypatch.setattr(make, "_solve", refuse)


def test_split_without_two_gpus_says_so(no_solve):
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    for gpus, n in (((), 0), ([GPU], 1)):
        with pytest.raises(InputError, match=rf"--trunk split: no layer split to choose: it needs at least "
                                             rf"two discrete GPUs and the profile has {n}; choose auto, cpu"):
            make_plan(toy_profile(gpus=gpus, ram_available_bytes=3 * 10**9), spec, None,
                      SolveOptions(ram="2", context_tokens=100, trunk="split"))


def test_split_over_gpus_too_small_together_gives_the_bytes(no_solve):
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[GPU, GPU], ram_available_bytes=16 * 10**9)
    # 50k tokens x 1024 B of KV (51.2 MB) fit the two 60 MB budgets together; with the trunk they do not
    need = make.dense_read_bytes(spec, "int4") + kv_bytes(50_000, 1024)
    assert kv_bytes(50_000, 1024) < 120_000_000 < need
    with pytest.raises(InputError, match=r"--trunk split: no layer split fits: the dense trunk and KV cache "
                                         rf"need {need} B "
                                         r"\(0\.151 GB\) and the 2 GPUs' budgets together hold 120000000 B "
                                         r"\(0\.12 GB\); give a smaller --context"):
        make_plan(prof, spec, None, SolveOptions(ram="12", context_tokens=50_000, trunk="split"))


def _section(**kw):
    sec = {"device": "cpu", "dense_format": "int8", "dense_bytes": 10,
           "kv": {"device": "cpu", "context_tokens": 64, "page_tokens": 64, "bytes_per_token": 2,
                  "bytes": 128}}
    sec.update(kw)
    return {"trunk": sec}


def test_trunk_section_format_and_split_types_are_checked():
    assert parse_trunk(_section(), []).dense_format == "int8"
    with pytest.raises(FormatError, match=r"trunk\.dense_format must be a format name \(f32, .*\), got "
                                          r"'int9'; re-create the plan with `colibri-plan solve`"):
        parse_trunk(_section(dense_format="int9"), [])
    for bad, kind in (({"first_layer": 0, "last_layer": 3, "device": "cpu"}, "dict"), ("0-3", "str")):
        with pytest.raises(FormatError, match=rf"trunk\.split must be a list of .*, got {kind}; re-create"):
            parse_trunk(_section(split=bad), [], 4)
    with pytest.raises(FormatError, match=r"trunk\.device is 'cuda:0'; the plan knows cpu: solve the plan "
                                          r"again"):
        parse_trunk(_section(device="cuda:0"), [])


class _Missing:
    """A GPU backend this machine lacks (or has no device of)."""

    available = False

    @classmethod
    def is_available(cls):
        return cls.available

    @staticmethod
    def unavailable_reason():
        return "its driver is not installed"

    @staticmethod
    def list_devices():
        return []


def test_run_on_a_missing_gpu_backend_names_the_backend_not_a_plan(monkeypatch, tmp_path):
    import colibri_plan.backends as backends

    real = backends.get_backend
    monkeypatch.setattr(backends, "get_backend", lambda n: _Missing if n == "cuda" else real(n))
    model = tmp_path / "nothing-here"        # refused before the model is opened
    r = invoke("run", "--model", model, "--backend", "cuda", "--prompt-ids", "1,2", "--tokens", 2)
    assert_one_line(r, "--backend cuda: unavailable here (its driver is not installed); run with "
                       "--backend cpu")
    monkeypatch.setattr(_Missing, "available", True)
    r = invoke("run", "--model", model, "--backend", "cuda", "--device", 2, "--prompt-ids", "1,2",
               "--tokens", 2, "--trunk", "device")
    assert_one_line(r, "--device 2: cuda has 0 device(s) here")
    assert not model.exists()


@pytest.mark.parametrize("opt", ["--probes", "--formats", "--dense-formats"])
def test_profile_list_option_naming_nothing_is_a_usage_error(opt, tmp_path):
    out = tmp_path / "p.json"
    r = invoke("profile", "--quick", opt, ",", "--out", out)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert f"Invalid value for {opt}: names nothing (',')" in r.stderr
    assert not out.exists()


@pytest.mark.parametrize("section", ["trunk_layer", "dense_gemv", "disk"])
def test_profile_unavailable_without_a_reason_names_the_section(section):
    from colibri_plan.formats.profile_check import validate_profile

    doc = toy_profile().doc
    doc[section] = {"unavailable": 5}
    with pytest.raises(FormatError, match=rf"profile {section}: 'unavailable' must give a reason \(a "
                                          r"non-empty string\), got 5; re-measure"):
        validate_profile(doc)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["budgets"].update(trunk_vram_bytes={}), "budgets.trunk_vram_bytes is empty"),
    (lambda d: d["budgets"].update(trunk_vram_bytes={"cuda:0": 5}), "plan budgets take 5 B of VRAM"),
    (lambda d: d["trunk"].update(dense_bytes=10**14), r"less than its 100000000000000 B dense \+ 262144 B"),
    (lambda d: d["budgets"].update(trunk_vram_bytes={"cuda:0": -1}), "must map devices to bytes"),
    (lambda d: d["budgets"]["trunk_vram_bytes"].update({"cuda:9": 1}), "names cuda:9, whose expert budget"),
])
def test_a_hand_edited_gpu_trunk_is_checked_against_the_budgets_on_load(tmp_path, edit, message):
    import json

    from colibri_plan.formats.plan import load_plan, save_plan

    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": 2_300_000_000}], ram_available_bytes=3 * 10**9)
    plan, _, _ = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=100, trunk="cuda:0"))
    doc = json.loads(save_plan(plan, tmp_path / "p.json").read_text())
    took = load_plan(tmp_path / "p.json").doc["budgets"]["trunk_vram_bytes"]   # the solved plan loads
    assert took == {"cuda:0": doc["trunk"]["dense_bytes"] + 262144}    # 2 pages x 64 x 2048 B (float32)
    edit(doc)
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=message + ".*re-create the plan"):
        load_plan(tmp_path / "bad.json")


@pytest.fixture(scope="module")
def pack_files(tmp_path_factory):
    from _cli_fixtures import pack_and_profile

    d = pack_and_profile(tmp_path_factory, "ctxfiles")
    r = invoke("solve", "--profile", d / "profile.json", "--model", d / "fx", "--heat", "synth",
               "--context", 8, "--out", d / "plan.json")
    assert r.exit_code == 0, r.output
    return d


def test_a_run_past_the_planned_context_warns_with_the_context_to_solve_for(pack_files):
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.verify import context_warning

    plan = load_plan(pack_files / "plan.json")
    assert plan.doc["trunk"]["kv"]["context_tokens"] == 8
    assert context_warning(plan, 8) is None
    args = ("--model", pack_files / "fx", "--plan", pack_files / "plan.json", "--prompt-ids", "1,2,3,4")
    fits = invoke("run", *args, "--tokens", 4)
    assert fits.exit_code == 0 and "context" not in fits.stderr, fits.output   # (a toy profile's machine)
    past = invoke("run", *args, "--tokens", 6)      # 4 + 6 = 10 tokens of context > 8
    assert past.exit_code == 0, past.output
    assert ("warning: this run's context (10 tokens: prompt + new tokens) passes the 8 the plan budgeted its "
            "KV cache for (solve --context)") in past.stderr
    assert "solve again with --context 10 or more" in past.stderr
    r = invoke("verify", "--plan", pack_files / "plan.json", "--model", pack_files / "fx", "--prompt-ids",
               "1,2,3,4", "--tokens", 5, "--no-reference", "--report", pack_files / "v.json")
    assert r.exit_code == 0 and "passes the 8 the plan budgeted" in r.stderr and "--context 10" in r.stderr


def test_a_plan_priced_in_another_dense_format_than_the_pack_warns(pack_files):
    r = invoke("solve", "--profile", pack_files / "profile.json", "--model", pack_files / "fx", "--heat",
               "synth", "--dense-format", "int8", "--out", pack_files / "plan-int8.json")
    assert r.exit_code == 0, r.output
    args = ("--model", pack_files / "fx", "--prompt-ids", "1,2", "--tokens", 2)
    same = invoke("run", *args, "--plan", pack_files / "plan.json")       # solved in the pack's own f32
    assert same.exit_code == 0 and "dense trunk" not in same.stderr, same.output
    other = invoke("run", *args, "--plan", pack_files / "plan-int8.json")
    assert other.exit_code == 0, other.output
    assert ("warning: the plan priced the dense trunk in int8, but the pack stores it in f32: the run holds "
            "f32 bytes") in other.stderr and "solve again with --dense-format f32" in other.stderr


# ---- a hand-edited KV figure, a split trunk's KV cache past the GPUs, an empty --trunk -------------------

def _edited_kv_plan(pack_files, tmp_path, bytes_per_token: int):
    """The solved plan (8-token context) with trunk.kv.bytes_per_token edited and a matching kv.bytes."""
    import json

    from colibri_plan.formats.plan_trunk import kv_bytes

    doc = json.loads((pack_files / "plan.json").read_text())
    kv = doc["trunk"]["kv"]
    kv.update(bytes_per_token=bytes_per_token, bytes=kv_bytes(kv["context_tokens"], bytes_per_token))
    out = tmp_path / f"plan-kv{bytes_per_token}.json"
    out.write_text(json.dumps(doc))
    return out


def test_a_kv_figure_below_the_models_is_refused_on_run_and_verify_before_any_work(pack_files, tmp_path,
                                                                                    monkeypatch):
    from colibri_plan.engine import runner
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.errors import MismatchError
    from colibri_plan.formats.plan import check_model, load_plan

    with open_pack(pack_files / "fx") as pack:
        spec, a = pack.spec(), pack.arch
    per_token = spec.kv_bytes_per_token
    assert per_token == a.n_layers * a.kv_values_per_token * 4 > 1   # a fixture pack's spec: the f32 cache
    bad = _edited_kv_plan(pack_files, tmp_path, 1)
    plan = load_plan(bad)                            # the section itself is consistent: it loads
    with pytest.raises(MismatchError, match=rf"plan trunk\.kv\.bytes_per_token is 1 B, below the "
                                            rf"{per_token:,} B per token of .* KV cache"):
        check_model(plan, spec)
    check_model(load_plan(_edited_kv_plan(pack_files, tmp_path, 2 * per_token)), spec)   # above: priced high
    monkeypatch.setattr(runner, "generate", lambda *a, **k: pytest.fail("ran before refusing"))
    for cmd in (("run", "--prompt-ids", "1,2", "--tokens", 2),
                ("verify", "--tokens", 2, "--no-reference", "--report", tmp_path / "v.json")):
        r = invoke(*cmd, "--model", pack_files / "fx", "--plan", bad)
        assert_one_line(r, "trunk.kv.bytes_per_token is 1 B",
                        f"its 8-token KV cache (64-token pages) at 64 B where the model's takes "
                        f"{64 * per_token:,} B",
                        "re-create the plan with `colibri-plan solve`")
    assert not (tmp_path / "v.json").exists()


def test_a_split_trunk_whose_kv_cache_passes_the_gpus_gets_the_vram_figures_not_the_ram_budget(no_solve):
    from colibri_plan.errors import BudgetError

    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    prof = toy_profile(gpus=[GPU, GPU], ram_available_bytes=3 * 10**9)
    # 3M tokens x 1024 B = 3.07 GB of KV: more than the 2 GB of RAM too, but a split keeps it in VRAM
    with pytest.raises(BudgetError, match=r"^--trunk split: the KV cache of --context 3000000 tokens needs "
                                          r"3072000000 B \(3\.07 GB\) and the 2 GPUs' budgets together hold "
                                          r"120000000 B \(0\.12 GB\) after their reserves; give a smaller "
                                          r"--context, --trunk cpu, or more VRAM"):
        make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=3_000_000, trunk="split"))


def test_split_on_the_published_profile_with_a_huge_context_names_vram(tmp_path):
    r = invoke("solve", "--trunk", "split", "--context", 10_000_000, "--profile", "published-6x-rtx5090",
               "--model", "glm-5.2", "--out", tmp_path / "p.json")
    assert r.exit_code == 1 and "Traceback" not in r.output, r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("Error: ")]   # after the "solving" line
    assert errors == ["Error: --trunk split: the KV cache of --context 10000000 tokens needs "
                      "2967040000000 B (2967.04 GB) and the 6 GPUs' budgets together hold 189600000000 B "
                      "(189.60 GB) after their reserves; give a smaller --context, --trunk cpu, or more VRAM "
                      "for the plan (a larger --vram or a smaller --vram-reserve)"]
    assert not (tmp_path / "p.json").exists()


def test_an_empty_trunk_choice_is_quoted(no_solve):
    prof = toy_profile(gpus=[GPU], ram_available_bytes=3 * 10**9)
    with pytest.raises(InputError, match=r"^--trunk '': the profile has no device ''; choose auto, cpu, "
                                         r"cuda:0$"):
        make_plan(prof, toy_spec(), None, SolveOptions(ram="2", context_tokens=100, trunk=""))


@pytest.mark.parametrize("trunk", ["cuda:0", "split"])
def test_a_gpu_trunk_whose_kv_cache_fits_the_vram_but_not_the_ram_is_solved(trunk):
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024, dense_params=200_000_000)
    # 3M tokens x 1024 B = 3.07 GB of KV: past the 2 GB RAM budget, within one 8 GB GPU (the engine's
    # float32 device cache: 2048 B a token, 6.14 GB) or two 2 GB ones (a split: llama.cpp's 16-bit cache)
    free = 2 * 10**9 + (8 if trunk == "cuda:0" else 2) * 10**9
    prof = toy_profile(gpus=[{"gbps": 500.0, "free_bytes": free}] * 2, ram_available_bytes=3 * 10**9)
    plan, _, setup = make_plan(prof, spec, None, SolveOptions(ram="2", context_tokens=3_000_000, trunk=trunk))
    kv = kv_bytes(3_000_000, 2048 if trunk == "cuda:0" else 1024)
    assert plan.doc["trunk"]["kv"]["bytes"] == kv and plan.doc["trunk"]["device"] == trunk.replace("split",
                                                                                                    "cuda:0")
    took = plan.doc["budgets"]["trunk_vram_bytes"]
    assert sum(took.values()) == kv + make.dense_read_bytes(spec, "int4")
    ram = plan.doc["budgets"]["ram_budget_bytes"]
    assert 0 <= ram == setup.budgets.ram_budget_bytes
    rows = {r["option"]: r for r in plan.doc["solver"]["trunk"]["options"]}
    assert not rows["cpu"]["feasible"] and "RAM" in rows["cpu"]["why"]      # the host cannot hold the cache
