"""Options that used to be ignored or mis-reported: a pack's stored dense format, token counts of `run`,
`export --out`, budget options that do not apply, error messages in the user's terms, exit codes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from _solver_fixtures import toy_profile
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.heat import Heat, load_heat
from colibri_plan.formats.pack_index import pack_dense_format
from colibri_plan.formats.profile import save_profile
from colibri_plan.model import load_model_spec
from colibri_plan.planner.make import heat_for

PROMPT = "5,80,200,7"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("polish")
    build_fixture(d / "fx", FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    save_profile(toy_profile(ram_available_bytes=8 * 10**9, shape=(128, 256)), d / "profile.json")
    return d


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def solve_json(files, *extra):
    r = invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", "--json", *extra)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout), r


# --- 1. a pack's dense trunk is budgeted in the format it is stored in ----------------------------------

def test_pack_spec_carries_the_stored_dense_format(files):
    spec = load_model_spec(files / "fx")
    assert spec.dense_format == "f32"            # the pack writer stores dense tensors as float32
    file_bytes = (files / "fx" / "dense.safetensors").stat().st_size
    # f32 trunk: 4 B per parameter; the file adds only its JSON header
    assert spec.dense_bytes("f32") == 4 * spec.dense_params
    assert 0 < file_bytes - spec.dense_bytes("f32") < 64 * 1024
    assert spec.fingerprint() == load_model_spec(files / "fx").with_format("int8").fingerprint()


def test_dense_format_from_the_safetensors_header_when_the_index_lacks_it(files, tmp_path):
    from safetensors.numpy import save_file

    index = json.loads((files / "fx" / "pack.json").read_text())
    index["format"].pop("dense_format")
    assert pack_dense_format(files / "fx", index) == "f32"
    save_file({"a": np.zeros((2, 3), dtype=np.float16)}, str(tmp_path / "dense.safetensors"))
    assert pack_dense_format(tmp_path, {"format": {}}) == "f16"
    assert pack_dense_format(tmp_path / "none", {"format": {}}) is None


def test_solve_on_a_pack_budgets_the_f32_trunk_without_dense_format(files):
    spec = load_model_spec(files / "fx")
    doc, _ = solve_json(files, "--ram", "1.5")
    lines = {e["what"]: e["bytes"] for e in doc["budgets"]["explain"]}
    assert lines["dense trunk (f32)"] == -4 * spec.dense_params
    explicit, _ = solve_json(files, "--ram", "1.5", "--dense-format", "f32")
    assert explicit["budgets"] == doc["budgets"] and explicit["counts"] == doc["counts"]
    int4, _ = solve_json(files, "--ram", "1.5", "--dense-format", "int4")   # an explicit choice still wins
    assert int4["budgets"]["dense_bytes"] == spec.dense_bytes("int4") < doc["budgets"]["dense_bytes"]


def test_model_show_reports_the_stored_format_and_file_bytes(files):
    r = invoke("model", "show", files / "fx")
    assert r.exit_code == 0, r.output
    size = (files / "fx" / "dense.safetensors").stat().st_size
    line = next(x for x in r.stdout.splitlines() if "dense trunk" in x)
    assert "at f32" in line and f"{size:,} B" in line
    doc = json.loads(invoke("model", "show", files / "fx", "--json").stdout)
    assert doc["dense_format"] == "f32" and doc["dense_file_bytes"] == size
    assert doc["dense_bytes"] == 4 * doc["dense_params"]
    glm = invoke("model", "show", "glm-5.2")
    assert "at bf16" in next(x for x in glm.stdout.splitlines() if "dense trunk" in x)


# --- 2. `run --tokens N` gives N ids with and without --plan ---------------------------------------------

def test_run_generates_n_tokens_with_and_without_a_plan(files):
    plain = invoke("run", "--model", files / "fx", "--prompt-ids", PROMPT, "--tokens", 3, "--json")
    assert plain.exit_code == 0, plain.output
    want = json.loads(plain.stdout)["tokens"]
    assert len(want) == 3
    doc, _ = solve_json(files, "--ram", "1.5", "--out", files / "plan.json")
    planned = invoke("run", "--model", files / "fx", "--plan", files / "plan.json", "--prompt-ids", PROMPT,
                     "--tokens", 3, "--json")
    assert planned.exit_code == 0, planned.output
    got = json.loads(planned.stdout)
    assert got["tokens"] == want and got["decode_steps"] == 2
    one = invoke("run", "--model", files / "fx", "--plan", files / "plan.json", "--prompt-ids", PROMPT,
                 "--tokens", 1)
    assert one.exit_code == 0, one.output
    assert one.stdout.split("\n")[0] == str(want[0]) and "no decode step" in one.stdout


def test_run_quant_on_a_pack_is_refused(files):
    r = invoke("run", "--model", files / "fx", "--prompt-ids", PROMPT, "--tokens", 1, "--quant", "int8")
    assert r.exit_code == 1 and "fixed when it is made" in r.output and "int4" in r.output


def test_run_bad_backend_is_a_usage_error_before_any_progress(files):
    r = invoke("run", "--model", files / "fx", "--prompt-ids", PROMPT, "--backend", "bogus")
    assert r.exit_code == 2 and "bogus" in r.output and "loading" not in r.output


# --- 3. options that used to be ignored ------------------------------------------------------------------

def test_export_llama_cpp_out_writes_the_args(files, tmp_path):
    if not (files / "plan.json").is_file():
        solve_json(files, "--ram", "1.5", "--out", files / "plan.json")
    r = invoke("export", files / "plan.json", "--to", "llama.cpp", "--out", tmp_path / "ot.txt", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (tmp_path / "ot.txt").read_text() == doc["args"] + "\n" and doc["args"].startswith("-ot ")


def test_headroom_with_a_fixed_ram_budget_warns(files):
    doc, r = solve_json(files, "--ram", "1.5", "--headroom", "3")
    assert any("--headroom 3 does not apply" in w for w in doc["warnings"])
    assert doc["budgets"]["headroom_bytes"] == 0
    auto, _ = solve_json(files, "--headroom", "3")
    assert not any("--headroom" in w for w in auto["warnings"]) and auto["budgets"]["headroom_bytes"] == 3e9


@pytest.mark.parametrize("vram", ["80", "1,2"])
def test_vram_on_a_profile_without_gpu_is_refused_whatever_the_count(files, vram):
    r = invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", "--vram", vram)
    assert r.exit_code == 1 and "--vram" in r.output
    if vram == "80":
        assert "no GPU" in r.output


def test_vram_zero_without_gpu_is_accepted(files):
    doc, _ = solve_json(files, "--vram", "0")
    assert doc["budgets"]["vram_budget_bytes"] == {}


def test_profile_explicit_path_that_fails_is_an_error(tmp_path, monkeypatch):
    from colibri_plan.profiler import disk as disk_mod
    from colibri_plan.profiler.run import ProfileOptions, run_profile

    def broken(*_a, **_k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(disk_mod, "probe_disk", broken)
    with pytest.raises(InputError, match="Read-only file system"):
        run_profile(ProfileOptions(path=str(tmp_path), quick=True, backends=("numpy",), probes=("disk",)))


def test_disk_probe_names_the_real_size_of_a_small_file(tmp_path):
    from colibri_plan.profiler.disk import probe_disk

    small = tmp_path / "small.json"
    small.write_bytes(b"x" * 1639)
    with pytest.raises(InputError, match="has 1,639 B"):
        probe_disk(small, block_bytes=1 << 20)


# --- 4. messages in the user's terms ---------------------------------------------------------------------

def test_synth_heat_warning_says_synthesised_once():
    spec = load_model_spec("glm-5.2")
    w = heat_for(spec, None).warnings[-1]
    assert w.lower().count("synthesised") == 1 and "--heat" in w


def _heat_doc(layers, counts):
    return {"kind": "heat", "schema_version": 1, "n_experts": 64, "layers": layers, "top_k": 8,
            "tokens": None, "counts": counts}


def test_heat_shape_errors_speak_of_rows_and_experts(tmp_path):
    from colibri_plan.formats.heat import save_heat

    good = Heat(n_experts=64, layers=(0, 1, 2), counts=np.ones((3, 64)), top_k=8)
    save_heat(good, tmp_path / "h.json")
    doc = json.loads((tmp_path / "h.json").read_text())
    doc["layers"] = [0, 1]                                   # 3 rows of 64, 2 layer ids
    (tmp_path / "rows.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="3 rows but layers lists 2 layer ids"):
        load_heat(tmp_path / "rows.json")
    doc["layers"] = [0, 1, 2]
    doc["counts"][1] = doc["counts"][1][:63]                  # a ragged row
    (tmp_path / "ragged.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"row 1 \(layer 1\) has 63 values, expected n_experts = 64"):
        load_heat(tmp_path / "ragged.json")
    with pytest.raises(InputError, match="2 rows x 5 experts, expected 3 rows"):
        Heat(n_experts=64, layers=(0, 1, 2), counts=np.ones((2, 5)))


def test_model_verify_missing_or_folder_experts_file_is_one_problem(files, tmp_path):
    pack = tmp_path / "fx"
    shutil.copytree(files / "fx", pack)
    (pack / "experts.bin").unlink()
    r = invoke("model", "verify", pack)
    assert r.exit_code == 1 and "experts.bin is missing" in r.output
    assert len([x for x in r.output.splitlines() if x.startswith("  ")]) == 1
    (pack / "experts.bin").mkdir()
    r = invoke("model", "verify", pack)
    assert r.exit_code == 1 and "experts.bin is a folder" in r.output


def test_fixture_bad_sizes_are_usage_errors_before_progress(tmp_path):
    r = invoke("model", "fixture", tmp_path / "fx", "--experts", "-64")
    assert r.exit_code == 2 and "fixture:" not in r.output and not (tmp_path / "fx").exists()
    r = invoke("model", "fixture", tmp_path / "fx", "--small", "--experts", 4, "--top-k", 8)
    assert r.exit_code == 2 and "--top-k" in r.output and not (tmp_path / "fx").exists()


@pytest.mark.parametrize("option", [("--ram", "x"), ("--vram", "-1"), ("--headroom", "abc"),
                                    ("--lru-slots", "q")])
def test_bad_budget_option_values_exit_2(files, option):
    r = invoke("solve", "--profile", files / "profile.json", "--model", files / "fx", *option)
    assert r.exit_code == 2 and option[0] in r.output


def test_spec_file_of_another_kind_names_the_expected_kind(tmp_path):
    (tmp_path / "spec.json").write_text(json.dumps({"kind": "model-spec"}))
    with pytest.raises(FormatError, match="has kind 'model-spec', not a model spec: a spec file has kind "
                                          "'model_spec'"):
        load_model_spec(tmp_path / "spec.json")


# --- 6. a plan whose RAM does not fit this machine is refused before anything is allocated ---------------

def test_placement_ram_check(files, monkeypatch):
    from colibri_plan.engine import session
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.placement import Placement
    from colibri_plan.errors import BudgetError

    with open_pack(files / "fx") as pack:
        a = pack.arch
        pl = Placement.all_ram(a.moe_layers, a.n_experts)
        block = pack.expert_location(a.moe_layers[0], 0)[1]
        need = session.placement_ram_bytes(pack, pl)
        assert need == (len(a.moe_layers) * a.n_experts + a.top_k) * block
        session.check_ram_fits(pack, pl, available=need)                 # exactly enough: accepted
        with pytest.raises(BudgetError, match=f"{need:,} B.*{need - 1:,} B, MemAvailable"):
            session.check_ram_fits(pack, pl, available=need - 1)
        monkeypatch.setenv(session.NO_RAM_CHECK_ENV, "1")
        session.check_ram_fits(pack, pl, available=1)                    # the override
        monkeypatch.delenv(session.NO_RAM_CHECK_ENV)
        monkeypatch.setattr(session, "mem_available_bytes", lambda: need - 1)
        with pytest.raises(BudgetError):
            session.run_placement(pack, pl, [1, 2], 1, cpu_backend="numpy")
    avail = session.mem_available_bytes()
    assert avail is None or avail > 0
