"""`verify`: a plan run on a small fixture is compared with its predictions using the run's own counters."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.engine.fixture import FixtureConfig, build_fixture, fixture_prompt
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import Placement
from colibri_plan.engine.session import run_placement
from colibri_plan.errors import FormatError, MismatchError
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM, Plan, layers_from_tiers, load_plan, save_plan
from colibri_plan.formats.report import RunReport
from colibri_plan.run_options import RunOptions
from colibri_plan.verify import check_plan_model, load_report, machine_warning, make_verdict, verify_plan

N_TOKENS = 4


@pytest.fixture(scope="module")
def small_pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("verify") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=16, top_k=4))
    return out


def _plan_doc(pack, tiers, slots, predicted: dict, fingerprint: str | None = None) -> dict:
    spec = pack.spec()
    b = spec.expert_bytes()
    return {"model": {"name": spec.name, "fingerprint": fingerprint or spec.fingerprint(),
                      "n_experts": spec.n_experts, "expert_bytes": b, "moe_layers": list(spec.moe_layers)},
            "profile": {"fingerprint": None}, "heat": {}, "budgets": {"ram_budget_bytes": 10**12,
                                                                      "vram_budget_bytes": {}},
            "expert_format": spec.expert_format, "devices": [],
            "layers": layers_from_tiers(spec.moe_layers, tiers, slots, []),
            "predicted": predicted, "solver": {"status": "hand-made"}, "coefficients": {"cpu_expert": 2.0}}


def _mixed(pack):
    a = pack.arch
    tiers = np.full((len(a.moe_layers), a.n_experts), TIER_DISK)
    tiers[0, :8] = TIER_RAM        # layer 0: half pinned, the rest streams through 2 slots
    return tiers, np.array([2, 1])  # layer 1: everything streams through 1 slot


PREDICTED = {"decode_s_per_token": 0.5, "tok_s": 2.0,
             "terms": {"dense_s": 0.1, "attention_s": 0.0, "expert_layers_s": 0.4,
                       "expert_compute_s": {"cpu": 0.3}, "disk_wait_s": 0.1, "transfer_s": 0.0},
             "hit_rate": {"vram": 0.0, "ram_pinned": 0.25, "lru": 0.05, "disk": 0.70},
             "disk_bytes_per_token": 1e6}


@pytest.fixture(scope="module")
def report(small_pack, tmp_path_factory):
    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        path = tmp_path_factory.mktemp("plan") / "plan.json"
        save_plan(_plan_doc(pack, tiers, slots, PREDICTED), path)
        plan = load_plan(path)
        prompt = fixture_prompt(pack.arch.vocab_size, 5, seed=3)
        return verify_plan(plan, pack, prompt, RunOptions(tokens=N_TOKENS, backend="numpy"),
                           plan_path=str(path))


def _row(rep, term):
    return next(r for r in rep["comparison"] if r["term"] == term)


def test_verify_is_token_exact_and_uses_the_runs_counters(small_pack, report):
    assert report["verdict"]["token_exact"] is True
    assert len(report["measured"]["tokens"]) == N_TOKENS + 1
    # an independent run of the same placement and prompt: routing and the LRU are deterministic, so the
    # tier counters must be identical to the ones the report compared
    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        pl = Placement.from_plan(Plan(_plan_doc(pack, tiers, slots, PREDICTED)))
        # verify times N_TOKENS decode steps, so it generates N_TOKENS + 1 ids (the first from the prefill)
        again = run_placement(pack, pl, report["settings"]["prompt_ids"], N_TOKENS + 1, cpu_backend="numpy")
        block = pack.expert_location(0, 0)[1]
    assert report["measured"]["tokens"] == again.tokens
    # predicted and measured share the plan's keys: every row pairs a key with itself
    assert set(report["measured"]["hit_rate"]) == set(PREDICTED["hit_rate"])
    assert set(PREDICTED["terms"]) - {"attention_s", "transfer_s"} <= set(report["measured"]["terms"])
    for key in ("ram_pinned", "lru", "disk"):
        assert _row(report, f"share {key}")["measured"] == pytest.approx(again.hit_rate[key])
    assert _row(report, "hit rate (memory)")["measured"] == pytest.approx(1 - again.hit_rate["disk"])
    # layer 0 pins 8 of 16 experts and everything else streams: the pinned share is well inside (0, 0.5)
    assert 0.0 < again.hit_rate["ram_pinned"] < 0.5 and again.hit_rate["disk"] > 0.3
    # disk bytes per token = misses per token x one expert block
    misses = again.hit_rate["disk"] * again.expert_uses_per_token
    assert _row(report, "disk bytes/token")["measured"] == pytest.approx(misses * block)


def test_verify_ratios_and_verdict_follow_the_numbers(report):
    m = report["measured"]
    tok = _row(report, "tok/s")
    assert tok["predicted"] == 2.0 and tok["measured"] == pytest.approx(m["tok_s"])
    assert tok["ratio"] == pytest.approx(m["tok_s"] / 2.0)
    hit = _row(report, "hit rate (memory)")
    assert hit["predicted"] == pytest.approx(0.30)
    assert hit["diff_points"] == pytest.approx(100 * (hit["measured"] - 0.30))
    v = report["verdict"]
    assert v["tok_s_ok"] == (abs(m["tok_s"] / 2.0 - 1) <= 0.25)
    assert v["hit_rate_ok"] == (abs(hit["measured"] - 0.30) <= 0.05)
    assert report["plan"]["coefficients"] == {"cpu_expert": 2.0}


def test_verdict_by_hand():
    def rep(tok_s, disk):
        return RunReport(tok_s=tok_s, hit_rate={"disk": disk})

    pred = rep(10.0, 0.4)
    v = make_verdict(pred, rep(12.4, 0.44), True)
    assert v["ok"] and v["tok_s_ratio"] == pytest.approx(1.24)
    assert v["hit_rate_diff_points"] == pytest.approx(-4)
    v = make_verdict(pred, rep(7.4, 0.4), True)
    assert not v["tok_s_ok"] and not v["ok"]
    v = make_verdict(pred, rep(10.0, 0.34), True)
    assert not v["hit_rate_ok"] and v["hit_rate_diff_points"] == pytest.approx(6)
    assert not make_verdict(pred, rep(10.0, 0.4), False)["ok"]
    assert RunReport(hit_rate={"vram": 0.2, "disk": 0.25}).memory_hit_rate == 0.75


def test_plan_for_another_model_is_refused(small_pack, tmp_path):
    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        doc = _plan_doc(pack, tiers, slots, PREDICTED, fingerprint="0123456789abcdef")
        save_plan(doc, tmp_path / "p.json")
        with pytest.raises(MismatchError, match="0123456789abcdef"):
            check_plan_model(load_plan(tmp_path / "p.json"), pack)
    res = CliRunner().invoke(cli, ["verify", "--plan", str(tmp_path / "p.json"), "--model", str(small_pack),
                                   "--tokens", "1"])
    assert res.exit_code == 1 and "Error: " in res.output
    assert "solve a plan for this model" in res.output
    assert not (tmp_path / "p.verify.json").exists()


def test_cli_writes_a_report_and_json(small_pack, tmp_path):
    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        save_plan(_plan_doc(pack, tiers, slots, PREDICTED), tmp_path / "p.json")
    res = CliRunner().invoke(cli, ["verify", "--plan", str(tmp_path / "p.json"), "--model", str(small_pack),
                                   "--tokens", "2", "--backend", "numpy", "--no-reference", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    saved = load_report(tmp_path / "p.verify.json")
    assert saved["measured"]["tokens"] == doc["measured"]["tokens"]
    assert saved["verdict"]["token_exact"] is None   # --no-reference: not checked, and said so


def test_corrupt_report_is_rejected(tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text('{"kind": "verify-report", "schema_version": 2, "predicted": {}}')
    with pytest.raises(FormatError, match="measured"):
        load_report(bad)
    # a version-1 report (measured hit_rates/pinned, expert_wall_s...) is refused with what to do
    bad.write_text('{"kind": "verify-report", "schema_version": 1, "predicted": {}, "measured": {}}')
    with pytest.raises(FormatError, match=r"schema_version 1.*re-run `colibri-plan verify`"):
        load_report(bad)
    bad.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_report(bad)
    res = CliRunner().invoke(cli, ["calibrate", str(bad), "--out", str(tmp_path / "c.json")])
    assert res.exit_code == 1 and "Error: " in res.output and not (tmp_path / "c.json").exists()


def test_machine_warning_names_both_fingerprints(small_pack, tmp_path):
    from colibri_plan.verify import machine_warning

    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        doc = _plan_doc(pack, tiers, slots, PREDICTED)
    doc["profile"] = {"fingerprint": "aaaaaaaaaaaaaaaa"}
    save_plan(doc, tmp_path / "p.json")
    plan = load_plan(tmp_path / "p.json")
    w = machine_warning(plan, "bbbbbbbbbbbbbbbb")
    assert "aaaaaaaaaaaaaaaa" in w and "bbbbbbbbbbbbbbbb" in w
    assert machine_warning(plan, "aaaaaaaaaaaaaaaa") is None
    assert machine_warning(plan, None) is None      # this machine's fingerprint unknown: nothing to say


def test_verify_reads_with_the_plans_queue_depth(small_pack, report, tmp_path, monkeypatch):
    # a plan without resources.disk_queue_depth runs with the engine's default 8 read threads
    assert report["settings"]["read_threads"] == 8
    import colibri_plan.engine.session as session

    seen = []
    real = session.run_placement

    def spy(*args, **kwargs):
        seen.append(kwargs.get("read_threads"))
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "run_placement", spy)
    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        doc = _plan_doc(pack, tiers, slots, PREDICTED)
        doc["resources"] = {"disk_queue_depth": 3}
        save_plan(doc, tmp_path / "plan.json")
        plan = load_plan(tmp_path / "plan.json")
        rep = verify_plan(plan, pack, fixture_prompt(pack.arch.vocab_size, 5, seed=3),
                          RunOptions(tokens=2, backend="numpy"), plan_path="p", reference=False)
    assert seen == [3] and rep["settings"]["read_threads"] == 3


def test_report_machine_warning_is_the_machine_one_beside_a_context_warning(small_pack, tmp_path):
    """The report's machine.warning holds the other-machine warning even when a later warning (the run's
    context past the plan's) is given too; each warning reaches ``warn`` once."""
    warned = []
    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        doc = _plan_doc(pack, tiers, slots, PREDICTED)
        doc["profile"]["fingerprint"] = "hostA"
        doc["budgets"]["context_tokens"] = 2  # the run's 5 + 3 tokens pass it
        save_plan(doc, tmp_path / "plan.json")
        plan = load_plan(tmp_path / "plan.json")
        rep = verify_plan(plan, pack, fixture_prompt(pack.arch.vocab_size, 5, seed=3),
                          RunOptions(tokens=2, backend="numpy"), plan_path="p", reference=False,
                          machine_fp="hostB", warn=warned.append)
    assert rep["machine"]["warning"] == machine_warning(plan, "hostB")
    assert "hostA" in rep["machine"]["warning"] and "hostB" in rep["machine"]["warning"]
    assert len(warned) == 2 and warned[0] == rep["machine"]["warning"]
    assert "passes the 2 the plan budgeted" in warned[1]


def test_strict_exit_code_follows_the_verdict(small_pack, tmp_path):
    """--strict: exit 3 on FAIL (a prediction 1000x off), 0 without --strict."""
    with open_pack(small_pack) as pack:
        tiers, slots = _mixed(pack)
        predicted = json.loads(json.dumps(PREDICTED))  # a copy: other tests use PREDICTED
        doc = _plan_doc(pack, tiers, slots, predicted)
        doc["predicted"]["tok_s"] = 1e6  # no run on this machine gets within 25% of that
        doc["predicted"]["decode_s_per_token"] = 1e-6
        save_plan(doc, tmp_path / "p.json")
    args = ["verify", "--plan", str(tmp_path / "p.json"), "--model", str(small_pack), "--tokens", "2",
            "--backend", "numpy", "--no-reference"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    res = CliRunner().invoke(cli, args + ["--strict"])
    assert res.exit_code == 3, res.output
    assert "FAIL" in res.output
