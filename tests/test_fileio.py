"""fileio: a folder or a device where a file is expected is named as what it is."""

from __future__ import annotations

import pytest

from colibri_plan.errors import InputError
from colibri_plan.fileio import check_input_file, read_document


def test_check_input_file_says_what_the_path_is(tmp_path):
    f = tmp_path / "f.json"
    f.write_text("{}")
    assert check_input_file(f, "plan file") == f
    with pytest.raises(InputError, match="plan file .* is a folder, expected a file"):
        check_input_file(tmp_path, "plan file")
    with pytest.raises(InputError, match="is not a regular file"):
        check_input_file("/dev/null", "plan file")
    with pytest.raises(InputError, match="does not exist"):
        check_input_file(tmp_path / "nope", "plan file")
    with pytest.raises(InputError, match="is a folder"):
        read_document(tmp_path, "plan", 1)


# ---- issue 17: deep nesting and huge integers are typed errors of the JSON reader ------------------------

@pytest.mark.parametrize("text,match", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),                       # RecursionError in json
    ('{"kind": "plan", "x": ' + "[" * 80 + "]" * 80 + "}", "nested too deeply"),  # parses, still refused
    ('{"kind": "plan", "n": ' + "9" * 400 + "}", "larger than any field"),
    ('{"kind": "plan", "n": 18446744073709551616}', "larger than any field"),   # 2**64
])
def test_json_reader_refuses_deep_nesting_and_huge_integers(tmp_path, text, match):
    from colibri_plan.errors import FormatError
    from colibri_plan.fileio import parse_json, read_json_object

    (tmp_path / "d.json").write_text(text)
    with pytest.raises(FormatError, match=match):
        read_json_object(tmp_path / "d.json", "plan file")
    with pytest.raises(FormatError, match=match):
        read_document(tmp_path / "d.json", "plan", 1)
    assert parse_json('{"a": [[1]], "b": 9223372036854775807}', "x", "y")["b"] == 2**63 - 1


def test_deep_nesting_is_refused_by_every_document_reader(tmp_path):
    from colibri_plan.errors import FormatError
    from colibri_plan.formats.coefficients import load_coefficients
    from colibri_plan.formats.heat import load_heat
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.formats.profile import load_profile
    from colibri_plan.formats.report import load_report
    from colibri_plan.model import load_model_spec

    for kind, reader in (("plan", load_plan), ("profile", load_profile), ("heat", load_heat),
                         ("coefficients", load_coefficients), ("verify-report", load_report),
                         ("model_spec", load_model_spec)):
        p = tmp_path / f"{kind}.json"
        p.write_text(f'{{"kind": "{kind}", "schema_version": 1, "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
        with pytest.raises(FormatError, match="nested too deeply"):
            reader(p)


# ---- round 4 (issue 30): a full disk and the temporaries of killed writers -------------------------

def _dead_pid() -> int:
    """The id of a process that has ended (a child we started and reaped)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fill_disk(monkeypatch) -> None:
    """Every free-space check sees a disk with 0 bytes free."""
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10**9, 10**9, 0))


@pytest.fixture
def full_disk(monkeypatch):
    _fill_disk(monkeypatch)


def test_a_full_disk_refuses_every_writer_before_the_work(full_disk, tmp_path):
    from colibri_plan.fileio import atomic_write_text, check_output_path

    with pytest.raises(InputError, match=r"has 0 B free and this needs .*free some space"):
        check_output_path(tmp_path / "r.verify.json")
    with pytest.raises(InputError, match="free some space"):
        atomic_write_text(tmp_path / "x.json", "{}")
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_part_way_is_one_line_and_leaves_the_old_file(monkeypatch, tmp_path):
    import errno
    import os

    from colibri_plan.fileio import atomic_write_text

    path = atomic_write_text(tmp_path / "x.json", '{"old": 1}')

    def no_space(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(InputError, match=r"No space left on device; nothing was written; free some space"):
        atomic_write_text(path, '{"new": 2}')
    assert path.read_text() == '{"old": 1}' and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_run_and_verify_fail_on_a_full_disk_before_generating(monkeypatch, tmp_path_factory):
    from _cli_fixtures import invoke, pack_and_profile

    d = pack_and_profile(tmp_path_factory, "full-disk", plan=True)
    before = sorted(p.name for p in d.iterdir())
    _fill_disk(monkeypatch)
    for args in (("run", "--model", d / "fx", "--prompt-ids", "1,2", "--tokens", "2", "--backend", "numpy",
                  "--stats-out", d / "heat.json"),
                 ("verify", "--plan", d / "plan.json", "--model", d / "fx", "--tokens", "2",
                  "--report", d / "r.verify.json")):
        res = invoke(*args)
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
        assert len(lines) == 1 and "free some space" in lines[0], res.output
        assert "tok/s" not in res.output   # refused before the generation, not after it
    assert sorted(p.name for p in d.iterdir()) == before


def test_stale_temporaries_of_dead_writers_are_removed_and_live_ones_kept(tmp_path):
    import os

    from colibri_plan.fileio import atomic_write_text

    dead, live = _dead_pid(), os.getppid()
    (tmp_path / f".x.json.{dead}-abc.tmp").write_text("half")
    (tmp_path / f".x.json.{live}-abc.tmp").write_text("in flight")
    (tmp_path / ".x.json.other.tmp").write_text("not ours")
    atomic_write_text(tmp_path / "x.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == \
        [f".x.json.{live}-abc.tmp", ".x.json.other.tmp", "x.json"]


def test_a_killed_model_pack_and_profile_leave_nothing_the_next_run_keeps(tmp_path):
    from colibri_plan.engine.fixture import FixtureConfig, build_fixture
    from colibri_plan.profiler.disk import probe_disk

    dead = _dead_pid()
    stale = tmp_path / f".fx.tmp-{dead}-0badc0de"
    stale.mkdir()
    (stale / "experts.bin").write_bytes(bytes(8192))
    probe = tmp_path / f".colibri-probe-{dead}-x1.bin"
    probe.write_bytes(bytes(8192))
    build_fixture(tmp_path / "fx", FixtureConfig.small(layers=2, experts=4, top_k=2, hidden=32, width=16,
                                                       vocab=48, head_dim=8))
    probe_disk(tmp_path, block_bytes=4096, file_bytes=1 << 16, queue_depths=(1,), repetitions=1,
               seconds=0.01)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fx"]


def test_a_file_without_a_kind_is_named_for_what_it_lacks(tmp_path):
    from colibri_plan.errors import FormatError

    (tmp_path / "e.json").write_text("{}")
    with pytest.raises(FormatError, match='no "kind" field') as e:
        read_document(tmp_path / "e.json", "plan", 1)
    assert "None" not in str(e.value)
    (tmp_path / "p.json").write_text('{"kind": "profile", "schema_version": 1}')
    with pytest.raises(FormatError, match="is a 'profile' file, expected 'plan'"):
        read_document(tmp_path / "p.json", "plan", 1)
