"""engine/pack: writing a pack replaces an old one atomically and leaves no temp folder behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _cli_fixtures import TINY, hidden_leftovers

from colibri_plan.engine import pack as pack_mod
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.pack import PackWriter
from colibri_plan.errors import InputError


def test_failed_commit_puts_the_old_pack_back(tmp_path, monkeypatch):
    out = tmp_path / "p"
    build_fixture(out, FixtureConfig.small(**TINY, seed=1))
    before = (out / "experts.bin").read_bytes()
    real_replace = os.replace
    calls = []

    def flaky_replace(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if Path(src).name.startswith(".p.tmp-"):  # the new pack cannot be renamed into place
            raise OSError(16, "Device or resource busy")
        return real_replace(src, dst)

    monkeypatch.setattr(pack_mod.os, "replace", flaky_replace)
    with pytest.raises(InputError, match="Device or resource busy"):
        build_fixture(out, FixtureConfig.small(**TINY, seed=2), overwrite=True)
    monkeypatch.setattr(pack_mod.os, "replace", real_replace)
    assert any(dst.startswith(".p.old-") for _, dst in calls)  # it did move the old pack aside
    assert (out / "experts.bin").read_bytes() == before
    assert hidden_leftovers(tmp_path) == []


def test_error_while_writing_removes_the_temp_folder(tmp_path):
    arch = FixtureConfig.small(**TINY).arch()
    with pytest.raises(RuntimeError):
        with PackWriter(tmp_path / "p", arch, "int4"):
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_mkdir_failure_is_an_input_error(tmp_path, monkeypatch):
    # root passes every os.access check; an immutable folder or /proc then fails at mkdir
    monkeypatch.setattr(pack_mod.os, "access", lambda *a: True)
    arch = FixtureConfig.small(**TINY).arch()
    with pytest.raises(InputError, match="folder /proc/self is not writable"):
        PackWriter("/proc/self/x", arch, "int4")
