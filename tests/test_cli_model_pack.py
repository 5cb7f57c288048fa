"""`colibri-plan model pack / verify / fixture`: usage errors before any work, --force replaces only a
pack, an output is never the input, unwritable folders give one typed line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from _cli_fixtures import TINY, hidden_leftovers, invoke, pack_and_profile, refused

from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.pack import check_pack_output, open_pack
from colibri_plan.errors import InputError


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "polish")


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


def test_force_refuses_a_folder_that_is_not_a_pack(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("victimdir").mkdir()
    Path("victimdir/notes.txt").write_text("important\n")
    res = invoke("model", "fixture", "--small", "--force", "victimdir")
    line = refused(res, "victimdir", "not an expert pack")
    assert "--force only replaces" in line
    assert Path("victimdir/notes.txt").read_text() == "important\n"
    # a pack.json of another kind does not make a folder a pack
    Path("victimdir/pack.json").write_text(json.dumps({"kind": "plan", "schema_version": 1}))
    refused(invoke("model", "fixture", "--small", "--force", "victimdir"), "not an expert pack")
    assert Path("victimdir/notes.txt").is_file() and hidden_leftovers(tmp_path) == []


def test_force_refuses_files_dot_root_and_empty_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("victim2.json").write_text("{}")
    refused(invoke("model", "fixture", "--small", "--force", "victim2.json"), "victim2.json", "a file")
    assert Path("victim2.json").read_text() == "{}"
    for target in (".", "/", "..", "./"):
        refused(invoke("model", "fixture", "--small", "--force", target), "current folder")
    refused(invoke("model", "fixture", "--small", "--force", ""), "empty")
    os.symlink("victim2.json", "link")
    refused(invoke("model", "fixture", "--small", "--force", "link"), "symbolic link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "victim2.json"]


def test_force_replaces_an_existing_pack_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "p"
    build_fixture(out, FixtureConfig.small(**TINY, seed=1))
    before = (out / "experts.bin").read_bytes()
    res = invoke("model", "fixture", "--small", "--layers", 1, "--experts", 8, "--top-k", 2, "--seed", 2,
                 "--force", out)
    assert res.exit_code == 0, res.output
    assert (out / "experts.bin").read_bytes() != before
    assert open_pack(out).arch.n_experts == 8
    assert hidden_leftovers(tmp_path) == []
    # without --force an existing pack is still refused
    refused(invoke("model", "fixture", "--small", out), "already exists")


def test_pack_output_is_never_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    refused(invoke("model", "pack", ckpt, ckpt / "out"), "is inside the input")
    refused(invoke("model", "pack", ckpt, ckpt, "--force"), "is the input")
    with pytest.raises(InputError, match="contains the input"):
        check_pack_output(tmp_path, True, inputs=(ckpt,))
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"]


def test_unwritable_folder_is_an_input_error(tmp_path):
    res = invoke("model", "fixture", "--small", "/proc/colibri-no-such/x")
    refused(res, "/proc/colibri-no-such", "does not exist")
    refused(invoke("model", "fixture", "--small", "--layers", 1, "--experts", 8, "/proc/self/x"),
            "/proc/self", "not writable")


def test_fixture_inside_an_existing_pack_is_refused(files, tmp_path):
    work = tmp_path / "small"
    shutil.copytree(files / "fx", work)
    before = sorted(p.name for p in work.iterdir())
    refused(invoke("model", "fixture", "--small", work / "sub"), "is an expert pack", "write outputs outside")
    assert sorted(p.name for p in work.iterdir()) == before
    with pytest.raises(InputError, match="is an expert pack"):
        check_pack_output(work / "sub", overwrite=True)
    check_pack_output(tmp_path / "fresh")    # beside the pack is fine
