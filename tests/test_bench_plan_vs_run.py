"""bench/plan_vs_run.py on the CPU backend: a plan of the fixture pack run on the peer's kind of traffic,
its predicted and measured figures side by side; bad --plan arguments refused."""

from __future__ import annotations

import pytest
from _cli_fixtures import pack_and_profile
from test_bench_bad_args import bench


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "planvsrun", plan=True)


def test_a_plan_runs_and_its_figures_are_side_by_side(files, tmp_path, capsys):
    m = bench("plan_vs_run")
    doc = m.main(["--pack", str(files / "fx"), "--plan", f"synth={files / 'plan.json'}", "--backend", "cpu",
                  "--requests", "2", "--decode-tokens", "3", "--depth", "3", "--prefill", "4",
                  "--context", "64", "--out", str(tmp_path / "out.json")])
    r = doc["rows"]["synth"]
    assert len(r["measured_tok_s"]["runs"]) == 2 and r["measured_tok_s"]["median"] > 0
    assert r["measured_over_predicted"] == pytest.approx(r["measured_tok_s"]["median"] / r["predicted_tok_s"])
    assert r["measured_vram"] == 0.0 and r["predicted_vram"] == 0.0  # a CPU-only profile: nothing in VRAM
    assert (tmp_path / "out.json").exists() and "synth" in capsys.readouterr().out


def test_bad_plan_arguments_are_refused(files):
    m = bench("plan_vs_run")
    with pytest.raises(SystemExit) as e:
        m.main(["--pack", str(files / "fx"), "--plan", str(files / "plan.json")])  # no NAME=
    assert e.value.code == 2


def test_bad_inputs_are_refused_before_any_worker_starts(files, tmp_path, tmp_path_factory):
    from _cli_fixtures import toy_plan

    m = bench("plan_vs_run")
    good = f"g={files / 'plan.json'}"
    (tmp_path / "nj.json").write_text("{not json")
    other = toy_plan(tmp_path_factory) / "plan.json"   # a plan of another model
    cases = [(["--plan", good, "--plan", f"g={files / 'plan.json'}"], 2, None),   # a name twice
             (["--plan", f"={files / 'plan.json'}"], 2, None),                    # no name
             (["--plan", good, "--out", str(tmp_path)], 2, None),                  # --out a folder
             (["--plan", f"a={tmp_path / 'missing.json'}"], None, "missing.json"),
             (["--plan", f"a={tmp_path / 'nj.json'}"], None, "nj.json"),
             (["--plan", f"a={other}"], None, "solve a plan for this pack")]
    for extra, code, match in cases:
        with pytest.raises(SystemExit, match=match) as e:
            m.main(["--pack", str(files / "fx"), "--backend", "cpu", *extra])
        if code is not None:
            assert e.value.code == code
    with pytest.raises(SystemExit, match="nopack"):
        m.main(["--pack", str(tmp_path / "nopack"), "--plan", good, "--backend", "cpu"])
