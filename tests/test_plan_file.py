"""Plan files: round trip, corruption caught before use, budgets re-checked, exports, baselines."""

import json
import math
import re

import numpy as np
import pytest
from _cli_fixtures import assert_one_line, cli_run, edited
from _solver_fixtures import toy_profile, toy_spec

from colibri_plan.errors import FormatError, MismatchError
from colibri_plan.formats.heat import read_usage_text
from colibri_plan.formats.plan import TIER_DISK, TIER_RAM, check_model, load_plan, save_plan
from colibri_plan.planner.baselines import BASELINES, fit_layers, hot_first, uniform
from colibri_plan.planner.exports import export_colibri, export_llama_cpp, fnv1a32
from colibri_plan.planner.make import build_setup, make_plan
from colibri_plan.planner.options import SolveOptions
from colibri_plan.planner.solve import validate_placement

GPU = {"gbps": 60.0, "free_bytes": 2_060_000_000}   # 60 MB of experts after the 2 GB reserve


@pytest.fixture(scope="module")
def planned():
    spec = toy_spec(n_experts=16, hidden=2048, inter=1024)          # 3.15 MB experts, 48 in all
    prof = toy_profile(gpus=[GPU], ram_available_bytes=3 * 10**9)
    plan, sol, setup = make_plan(prof, spec, None, SolveOptions(ram="0.58", context_tokens=100,
                                                                trunk="cpu"))   # ~21 experts in RAM
    return spec, prof, plan, sol, setup


def test_roundtrip_and_contents(tmp_path, planned):
    spec, prof, plan, sol, _ = planned
    save_plan(plan, tmp_path / "p.json")
    back = load_plan(tmp_path / "p.json")
    assert back.model_fingerprint == spec.fingerprint() and back.profile_fingerprint == prof.fingerprint
    assert np.array_equal(back.tiers(), sol.tiers) and np.array_equal(back.lru_slots(), sol.lru_slots)
    c = back.counts()
    assert c["cuda:0"] > 0 and c["ram_pinned"] > 0 and c["disk"] > 0 and c["lru_slots"] > 0
    entry = back.layer(2)
    assert sorted(sum(entry["vram"].values(), []) + entry["ram_pinned"] + entry["disk"]) == list(range(16))
    p = np.array(entry["p"])
    assert all(p[a] >= p[b] for a, b in zip(entry["ram_pinned"], entry["ram_pinned"][1:]))  # hottest first
    pred = back.doc["predicted"]
    assert pred["tok_s"] == pytest.approx(1 / pred["decode_s_per_token"])
    assert set(pred["terms"]) >= {"dense_s", "attention_s", "expert_compute_s", "disk_wait_s", "transfer_s"}
    assert back.doc["solver"]["method"].startswith("HiGHS")
    with pytest.raises(MismatchError):
        back.layer(99)
    with pytest.raises(MismatchError, match="fingerprint"):
        check_model(back, toy_spec(n_experts=8))


def _corrupt(tmp_path, plan, edit):
    doc = json.loads(json.dumps(plan.doc))
    edit(doc)
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(doc))
    return f


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["layers"][0]["disk"].append(d["layers"][0]["ram_pinned"][0]), "exactly once"),
    (lambda d: d["layers"][1]["ram_pinned"].append(16), "out of range"),
    (lambda d: d["layers"][1]["disk"].pop(), "exactly once"),
    (lambda d: d["layers"].pop(), "do not match"),
    (lambda d: d["layers"][0].__setitem__("lru_slots", -1), "lru_slots"),
    (lambda d: d["layers"][0]["vram"].__setitem__("cuda:7", []), "unknown devices"),
    (lambda d: d["budgets"].__setitem__("ram_budget_bytes", 10), "over the RAM budget"),
    (lambda d: d["budgets"]["vram_budget_bytes"].__setitem__("cuda:0", 1), "over its VRAM budget"),
    (lambda d: d.pop("solver"), "missing solver"),
    (lambda d: d.__setitem__("schema_version", 2), "schema_version"),
])
def test_corruption_is_detected(tmp_path, planned, edit, match):
    with pytest.raises(FormatError, match=match):
        load_plan(_corrupt(tmp_path, planned[2], edit))


def test_truncated_file(tmp_path, planned):
    save_plan(planned[2], tmp_path / "p.json")
    raw = (tmp_path / "p.json").read_bytes()
    (tmp_path / "t.json").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(FormatError, match="JSON"):
        load_plan(tmp_path / "t.json")


def test_baselines_respect_budgets_and_shapes(planned):
    setup = planned[4]
    pr = setup.problem
    for fn in BASELINES.values():
        tiers, slots = fn(pr)
        validate_placement(pr, tiers, slots)
    t, _ = hot_first(pr)
    gpu_p = pr.probs[t == 0]
    ram_p = pr.probs[t == TIER_RAM]
    disk_p = pr.probs[t == TIER_DISK]
    assert gpu_p.min() >= ram_p.max() >= disk_p.max()       # one global ranking, VRAM then RAM
    t, _ = fit_layers(pr)
    assert all(len(set(row.tolist())) == 1 or TIER_DISK in row for row in t)   # whole layers
    assert (t[-1] == 0).all()                                 # the last layer goes to the GPU first
    t, _ = uniform(pr)
    assert len({int(np.sum(row == 0)) for row in t}) == 1    # the same share in every layer


def test_optimised_never_worse_than_baselines(planned):
    setup = planned[4]
    from colibri_plan.planner.make import cost_of

    ours = planned[3].cost["decode_s_per_token"]
    for fn in BASELINES.values():
        assert ours <= cost_of(setup, *fn(setup.problem))["decode_s_per_token"] * (1 + 1e-9)


def test_export_colibri(tmp_path, planned):
    spec, _, plan, _, _ = planned
    out = export_colibri(plan, tmp_path / "plan.coli_usage")
    h = read_usage_text(tmp_path / "plan.coli_usage")
    assert h.engine_id == fnv1a32("qwen3_moe") and h.n_model_layers == spec.n_layers
    ranked = sorted(((-h.counts[i, e], lid, e) for i, lid in enumerate(h.layers) for e in range(16)))
    tiers = plan.tiers()
    codes = [int(tiers[plan.layer_ids.index(lid), e]) for _, lid, e in ranked]
    n_v, n_r = plan.counts()["cuda:0"], plan.counts()["ram_pinned"]
    assert all(c >= 0 for c in codes[:n_v]) and all(c == TIER_RAM for c in codes[n_v:n_v + n_r])
    v = out["vars"]
    b = plan.expert_bytes
    assert v["COLI_GPUS"] == "0" and v["PIN"].endswith("plan.coli_usage") and v["CAP_RAISE"] == "0"
    vram_gb = plan.doc["budgets"]["vram_budget_bytes"]["cuda:0"] / 1e9
    assert n_v * b / 1e9 < float(v["CUDA_EXPERT_GB"]) <= vram_gb      # capped at the plan's budget
    extra = int(out["notes"][-1].split("grows by ")[1].split()[0]) if "grows by" in out["notes"][-1] else 0
    assert (n_r + extra) * b / 1e9 < float(v["PIN_GB"]) < (n_r + extra + 1) * b / 1e9
    assert out["env"].startswith("COLI_CUDA=1 ")
    assert fnv1a32("glm_moe_dsa") == 3815245270           # the engine id colibrì documents


def test_export_llama_cpp(planned):
    plan = planned[2]
    out = export_llama_cpp(plan)
    pats = [re.compile(p.split("=")[0]) for p in out["patterns"]]
    devs = [p.split("=")[1] for p in out["patterns"]]
    for lid in plan.layer_ids:
        for kind in ("gate", "up", "down"):
            name = f"blk.{lid}.ffn_{kind}_exps.weight"
            hits = [d for p, d in zip(pats, devs) if p.search(name)]
            assert len(hits) == 1                                 # every expert tensor matched exactly once
    assert not any(p.search("blk.13.ffn_up_exps.weight") for p in pats)   # layer 1 must not match 13
    assert "not expressible" in out["notes"][0] and out["moved_experts"] >= 0


def test_setup_mtp_rows_have_no_decode_weight():
    spec = toy_spec(n_layers=4, moe_layers=(1, 2, 3, 4))       # row 4 = an MTP head
    setup = build_setup(toy_profile(), spec, None)
    assert setup.problem.weights.tolist() == [1.0, 1.0, 1.0, 0.0]


def test_plan_records_the_queue_depth_the_engine_reads_with():
    from colibri_plan.formats.plan import Plan
    from colibri_plan.planner.budgets import best_queue_depth

    prof = toy_profile(disk_gbps=2.0)            # QD 1: 1.0 GB/s, QD 4: 2.0 GB/s
    assert best_queue_depth(prof, top_k=8) == 4
    assert best_queue_depth(prof, top_k=2) == 1  # a token never has 4 reads of a layer in flight
    # a disk that is slower at the deeper queue: the shallower, faster depth wins
    prof.doc["disk"]["random"].append({"queue_depth": 8, "read_gbps": {"median": 1.5},
                                       "latency_ms": {"p50": 9.0, "p99": 9.0}})
    assert best_queue_depth(prof, top_k=8) == 4
    prof.doc["disk"]["random"][2]["read_gbps"] = {"median": 3.0}
    assert best_queue_depth(prof, top_k=8) == 8
    spec = toy_spec(n_experts=16, top_k=4, hidden=2048, inter=1024)
    plan, _, setup = make_plan(toy_profile(), spec, None, SolveOptions(ram="0.58", context_tokens=100,
                                                                       trunk="cpu"))
    assert setup.res.disk_queue_depth == 4 and setup.res.disk_read_gbps == pytest.approx(2.0)
    assert plan.doc["resources"]["disk_queue_depth"] == 4 and plan.read_threads == 4
    doc = json.loads(json.dumps(plan.doc))
    del doc["resources"]["disk_queue_depth"]
    assert Plan(doc).read_threads == 8           # plans that do not record it: the engine's default


def test_output_paths_are_checked_before_work(tmp_path):
    """A folder or a device as output is refused with a clear error; nothing is replaced."""
    import pytest

    from colibri_plan.errors import InputError
    from colibri_plan.fileio import atomic_write_text, check_output_path

    with pytest.raises(InputError, match="is a folder"):
        check_output_path(tmp_path)
    with pytest.raises(InputError, match="not a regular file"):
        atomic_write_text("/dev/null", "x")
    with pytest.raises(InputError, match="does not exist"):
        check_output_path(tmp_path / "missing" / "plan.json")
    out = atomic_write_text(tmp_path / "p.json", "{}")
    assert out.read_text() == "{}"
    assert (out.stat().st_mode & 0o777) == 0o666 & ~_umask()


def _umask() -> int:
    import os

    m = os.umask(0)
    os.umask(m)
    return m


def test_check_model_refuses_another_expert_format():
    """Same geometry, other format: the plan's byte budgets would not hold, so it is refused."""
    import pytest

    from colibri_plan.errors import MismatchError
    from colibri_plan.formats.plan import Plan, check_model
    from colibri_plan.model import load_model_spec

    spec = load_model_spec("olmoe-1b-7b", quant="int4")
    plan = Plan({"model": {"name": spec.name, "fingerprint": spec.fingerprint()}, "expert_format": "int8"})
    with pytest.raises(MismatchError, match="solved for int8 experts.*int4"):
        check_model(plan, spec, where="/packs/olmoe")
    check_model(Plan({"model": {"name": spec.name, "fingerprint": spec.fingerprint()},
                      "expert_format": "int4"}), spec)  # same format: accepted
    other = Plan({"model": {"name": "x", "fingerprint": "0" * 16}, "expert_format": "int4"})
    with pytest.raises(MismatchError, match="/packs/olmoe holds"):
        check_model(other, spec, where="/packs/olmoe")


PLAN_CASES = [
    ("budgets", None, "budgets must be an object"),
    ("devices", [1, 2], "devices[0] must be an object"),
    ("budgets.ram_budget_bytes", math.inf, "budgets.ram_budget_bytes must be a finite number"),
    ("budgets.vram_budget_bytes.cuda:0", "big", "budgets.vram_budget_bytes.cuda:0 must be a finite"),
    ("predicted", {}, "predicted.tok_s is missing"),
    ("predicted", None, "predicted must be an object"),
    ("predicted.tok_s", "fast", "predicted.tok_s must be a finite number"),
    ("predicted.tok_s", math.nan, "predicted.tok_s must be a finite number"),
    ("predicted.terms.dense_s", -1.0, "predicted.terms.dense_s must be a finite number >= 0"),
    ("predicted.hit_rate.lru", 1.5, "predicted.hit_rate.lru must be a finite number in 0..1"),
    ("profile", None, "profile must be an object"),
    ("solver", None, "solver must be an object"),
    ("solver.seconds", "slow", "solver.seconds must be a finite number"),
    ("resources.disk_queue_depth", math.nan, "resources.disk_queue_depth must be a whole number in 1..64"),
    ("resources.disk_queue_depth", math.inf, "resources.disk_queue_depth must be a whole number in 1..64"),
    ("resources.disk_queue_depth", 0, "resources.disk_queue_depth must be a whole number in 1..64"),
    ("model.expert_bytes", -5, "model.expert_bytes must be a whole number >= 1"),
    ("heat", None, "heat must be an object"),
    ("coefficients.disk", True, "coefficients: disk must be a finite number >= 0"),
    ("coefficients", "x", "coefficients must be an object"),
]


@pytest.mark.parametrize("path, value, message", PLAN_CASES,
                         ids=[c[0] + "=" + repr(c[1]) for c in PLAN_CASES])
def test_bad_plan_field_is_a_format_error(tmp_path, good, path, value, message):
    _, doc, _ = good
    f = edited(tmp_path, doc, path, value)
    with pytest.raises(FormatError) as err:
        load_plan(f)
    text = str(err.value)
    assert message in text and str(f) in text and "colibri-plan solve" in text
    for command in (["plan", "show", f], ["plan", "show", f, "--json"],
                    ["export", f, "--to", "colibri", "--out", tmp_path / "x.env"]):
        assert_one_line(cli_run(*command), str(f), message)


def test_good_plan_still_loads_and_reads_its_queue_depth(good):
    d, doc, _ = good
    plan = load_plan(d / "plan.json")
    assert plan.read_threads == doc["resources"]["disk_queue_depth"] >= 1
    r = cli_run("plan", "show", d / "plan.json", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["predicted"]["tok_s"] == doc["predicted"]["tok_s"]
