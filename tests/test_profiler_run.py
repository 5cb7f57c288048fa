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
