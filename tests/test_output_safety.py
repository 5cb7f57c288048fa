"""Outputs never destroy what is not theirs: --force replaces only a pack, an output is never one of the
command's inputs, unwritable folders and wrong input kinds give one typed line, Ctrl-C in the disk probe
stops its readers before the file is closed."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _solver_fixtures import toy_profile, toy_spec
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.engine import pack as pack_mod
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.pack import PackWriter, check_pack_output, open_pack
from colibri_plan.errors import InputError
from colibri_plan.fileio import check_input_file, read_document
from colibri_plan.formats.profile import save_profile
from colibri_plan.model import save_model_spec
from colibri_plan.profiler import disk

TINY = dict(layers=1, experts=8, top_k=2)


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def refused(res, *words):
    """The command failed with one typed error line naming ``words``, and no traceback."""
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output and not isinstance(res.exception, OSError), res.output
    line = [ln for ln in res.output.splitlines() if ln.startswith("Error: ")]
    assert len(line) == 1 and "InputError" in line[0], res.output
    for w in words:
        assert w in line[0], (w, line[0])
    return line[0]


def hidden_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".old-" in p.name or ".tmp-" in p.name)


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("pk") / "tiny"
    build_fixture(out, FixtureConfig.small(**TINY))
    return out


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A profile, a model spec and a plan solved from them."""
    d = tmp_path_factory.mktemp("toy")
    save_profile(toy_profile(ram_available_bytes=3_100_000_000), d / "profile.json")
    save_model_spec(toy_spec(n_experts=16, hidden=2048, inter=1024), d / "model.json")
    res = invoke("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                 "--out", d / "plan.json")
    assert res.exit_code == 0, res.output
    return d


# ---- 1. --force replaces only a pack ----

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


def test_pack_output_is_never_the_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    refused(invoke("model", "pack", ckpt, ckpt / "out"), "is inside the input")
    refused(invoke("model", "pack", ckpt, ckpt, "--force"), "is the input")
    with pytest.raises(InputError, match="contains the input"):
        check_pack_output(tmp_path, True, inputs=(ckpt,))
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json"]


# ---- 3. unwritable folders ----

def test_unwritable_folder_is_an_input_error(tmp_path):
    res = invoke("model", "fixture", "--small", "/proc/colibri-no-such/x")
    refused(res, "/proc/colibri-no-such", "does not exist")
    refused(invoke("model", "fixture", "--small", "--layers", 1, "--experts", 8, "/proc/self/x"),
            "/proc/self", "not writable")


def test_mkdir_failure_is_an_input_error(tmp_path, monkeypatch):
    # root passes every os.access check; an immutable folder or /proc then fails at mkdir
    monkeypatch.setattr(pack_mod.os, "access", lambda *a: True)
    arch = FixtureConfig.small(**TINY).arch()
    with pytest.raises(InputError, match="folder /proc/self is not writable"):
        PackWriter("/proc/self/x", arch, "int4")


# ---- 2. an output is never one of the inputs ----

def same_bytes(path: Path, before: bytes) -> bool:
    return path.read_bytes() == before


@pytest.mark.parametrize("flag", ["--heat", "--profile", "--coefficients"])
def test_solve_out_is_not_an_input(toy, tmp_path, flag):
    src = tmp_path / "in.json"
    src.write_text('{"precious": 1}')
    args = {"--profile": toy / "profile.json", "--heat": "uniform", "--coefficients": None, flag: src}
    cmd = ["solve", "--model", toy / "model.json", "--out", src]
    for k, v in args.items():
        if v is not None:
            cmd += [k, v]
    refused(invoke(*cmd), "is the input")
    assert same_bytes(src, b'{"precious": 1}')


def test_verify_report_is_not_the_plan(toy, tiny_pack):
    plan = toy / "plan.json"
    before = plan.read_bytes()
    refused(invoke("verify", "--plan", plan, "--model", tiny_pack, "--report", plan), "is the input")
    refused(invoke("verify", "--plan", plan, "--model", tiny_pack, "--report", tiny_pack / "r.json"),
            "is inside the input")
    assert same_bytes(plan, before) and not (tiny_pack / "r.json").exists()


def test_export_and_calibrate_do_not_overwrite_their_input(toy, tmp_path):
    plan = toy / "plan.json"
    before = plan.read_bytes()
    for target in ("colibri", "llama.cpp"):
        refused(invoke("export", plan, "--to", target, "--out", plan), "is the input")
    assert same_bytes(plan, before)
    rep = tmp_path / "r.json"
    rep.write_text("{}")
    refused(invoke("calibrate", rep, "--out", rep), "is the input")
    refused(invoke("calibrate", rep, "--base", plan, "--out", plan), "is the input")
    assert rep.read_text() == "{}" and same_bytes(plan, before)


def test_run_stats_never_go_into_the_pack(tiny_pack, tmp_path):
    index = (tiny_pack / "pack.json").read_bytes()
    refused(invoke("run", "--model", tiny_pack, "--prompt-ids", "1,2", "--tokens", 1,
                   "--stats-out", tiny_pack / "pack.json"), "is inside the input")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("1 2")
    refused(invoke("run", "--model", tiny_pack, "--prompt-file", prompt, "--tokens", 1,
                   "--usage-out", prompt), "is the input")
    assert same_bytes(tiny_pack / "pack.json", index) and prompt.read_text() == "1 2"


def test_heat_and_profile_outputs_are_not_inputs(toy, tmp_path):
    spec = toy / "model.json"
    before = spec.read_bytes()
    refused(invoke("heat", "synth", spec, "--out", spec), "is the input")
    refused(invoke("profile", "--model", spec, "--out", spec, "--quick", "--probes", "ram"), "is the input")
    h = tmp_path / "h.usage"
    h.write_text("-1 4 0\n1 0 3\n")
    refused(invoke("heat", "convert", h, h, "--to", "json"), "is the input")
    assert same_bytes(spec, before) and h.read_text() == "-1 4 0\n1 0 3\n"


# ---- 5. a folder or a device where a file is expected ----

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


def test_cli_readers_name_folders_and_devices(toy, tmp_path):
    d = tmp_path / "adir"
    d.mkdir()
    prof, model = toy / "profile.json", toy / "model.json"
    for args in (["plan", "show", d], ["heat", "show", d], ["calibrate", d, "--out", tmp_path / "c.json"],
                 ["solve", "--profile", prof, "--model", model, "--heat", "uniform", "--coefficients", d],
                 ["run", "--model", d, "--prompt-file", d]):
        refused(invoke(*args), str(d), "is a folder, expected a file")
    refused(invoke("solve", "--profile", prof, "--model", "/dev/null"), "/dev/null", "is not a regular file")
    refused(invoke("heat", "show", "/dev/null"), "/dev/null", "is not a regular file")


# ---- 4. Ctrl-C in the disk probe ----

def test_ctrl_c_stops_the_disk_readers_before_the_fd_is_closed(tmp_path):
    f = tmp_path / "probe.bin"
    f.write_bytes(np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes())
    errors = []
    old_hook, threading.excepthook = threading.excepthook, lambda a: errors.append(a.exc_value)
    old_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    fd = os.open(f, os.O_RDONLY)
    try:
        timer.start()
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            disk._timed_reads(fd, 1 << 20, 4096, 4, 30.0, False, 0)
        assert time.perf_counter() - t0 < 10  # stopped early, not after the 30 s
        # a joined thread may still be listed for a moment after it stopped: alive is what matters
        assert not [t for t in threading.enumerate()
                    if t.name.startswith("colibri-disk-reader") and t.is_alive()]
    finally:
        timer.cancel()
        os.close(fd)
        signal.signal(signal.SIGINT, old_sigint)
        time.sleep(0.05)
        threading.excepthook = old_hook
    assert errors == []


def test_stop_readers_releases_threads_waiting_to_start():
    stop, start = threading.Event(), threading.Barrier(3)
    ended = []

    def reader():
        try:
            start.wait()
        except threading.BrokenBarrierError:
            ended.append("aborted")
            return
        while not stop.is_set():
            time.sleep(0.001)
        ended.append("stopped")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    disk.stop_readers(threads, stop, start)
    assert not any(t.is_alive() for t in threads) and ended == ["aborted", "aborted"]
