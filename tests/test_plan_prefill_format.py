"""A plan's hand-edited ``predicted.prefill`` section (formats/plan_prefill.py): each bad figure fails on
load with a FormatError naming it, and `plan show` / `verify` say so in one line, without a traceback."""

import copy
import json

import pytest
from _solver_fixtures import write_toy_files
from click.testing import CliRunner

from colibri_plan.cli import cli
from colibri_plan.errors import FormatError
from colibri_plan.formats.plan import load_plan


@pytest.fixture(scope="module")
def plan_doc(tmp_path_factory):
    files = write_toy_files(tmp_path_factory.mktemp("prefill-format"))
    r = CliRunner().invoke(cli, ["solve", "--profile", str(files / "profile.json"), "--model",
                                 str(files / "model.json"), "--ram", "0.58", "--prompt-tokens", "64",
                                 "--out", str(files / "plan.json")], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads((files / "plan.json").read_text())


def edited(doc, tmp_path, change) -> str:
    d = copy.deepcopy(doc)
    change(d["predicted"]["prefill"], d)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))   # json writes NaN / Infinity as the bare tokens a hand edit leaves
    return str(path)


def setter(key, value):
    return lambda p, d: p.__setitem__(key, value)


def term(key, value):
    return lambda p, d: p["terms"].__setitem__(key, value)


BAD = [
    ("missing ttft", lambda p, d: p.pop("ttft_s"), "predicted.prefill.ttft_s is missing"),
    ("missing tok/s", lambda p, d: p.pop("prefill_tok_s"), "predicted.prefill.prefill_tok_s is missing"),
    ("ttft string", setter("ttft_s", "1.7"), 'predicted.prefill.ttft_s must be a finite number > 0 '
                                             '(seconds), got "1.7"'),
    ("ttft negative", setter("ttft_s", -1.0), "ttft_s must be a finite number > 0 (seconds), got -1.0"),
    ("ttft NaN", setter("ttft_s", float("nan")), "ttft_s must be a finite number > 0 (seconds), got NaN"),
    ("tok/s zero", setter("prefill_tok_s", 0), "prefill_tok_s must be a finite number > 0 (tok/s), got 0"),
    ("prefill_s zero", setter("prefill_s", 0.0), "prefill_s must be a finite number > 0 (seconds), got 0.0"),
    ("prefill_s negative", setter("prefill_s", -1.0),
     "predicted.prefill.prefill_s must be a finite number > 0 (seconds), got -1.0"),
    ("missing prompt_tokens", lambda p, d: p.pop("prompt_tokens"),
     "predicted.prefill.prompt_tokens is missing"),
    ("prompt_tokens zero", setter("prompt_tokens", 0),
     "predicted.prefill.prompt_tokens must be a whole number >= 1, got 0"),
    ("prompt_tokens fraction", setter("prompt_tokens", 1.5),
     "predicted.prefill.prompt_tokens must be a whole number >= 1, got 1.5"),
    ("ttft edited alone", lambda p, d: p.__setitem__("ttft_s", p["prefill_s"] * 2),
     "predicted.prefill.ttft_s"),
    ("tok/s edited alone", lambda p, d: p.__setitem__("prefill_tok_s", p["prefill_tok_s"] + 1),
     "is not prompt_tokens / prefill_s"),
    ("no terms", lambda p, d: p.pop("terms"), "predicted.prefill.terms must be an object"),
    ("term missing", lambda p, d: p["terms"].pop("distinct_experts_per_layer"),
     "predicted.prefill.terms.distinct_experts_per_layer is missing"),
    ("term string", term("experts_s", "x"), 'terms.experts_s must be a finite number >= 0, got "x"'),
    ("term infinite", term("dense_s", float("inf")),
     "terms.dense_s must be a finite number >= 0, got Infinity"),
    ("optional term negative", term("verify_s", -0.5),
     "terms.verify_s must be a finite number >= 0, got -0.5"),
    ("curve not a list", setter("curve", "x"),
     "predicted.prefill.curve must be a list of [prompt tokens, prefill s] pairs"),
    ("curve entry", setter("curve", [["a", 1.0]]), 'curve[0] must be [prompt tokens'),
    ("curve short entry", setter("curve", [[1, 0.1], [2]]), "curve[1] must be [prompt tokens"),
    ("curve negative s", setter("curve", [[1, -5.0]]), "curve[0] must be [prompt tokens"),
    ("curve repeats", setter("curve", [[1, 0.1], [1, 0.2]]), "ascending order without repeats"),
    ("figures string", setter("figures", "x"), "predicted.prefill.figures must be an object"),
]


@pytest.mark.parametrize("name,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_prefill_fails_on_load_naming_the_field(plan_doc, tmp_path, name, change, message):
    path = edited(plan_doc, tmp_path, change)
    with pytest.raises(FormatError) as exc:
        load_plan(path)
    assert message in str(exc.value) and "re-create the plan with `colibri-plan solve`" in str(exc.value)
    r = CliRunner().invoke(cli, ["plan", "show", path])
    assert r.exit_code == 1, r.output
    assert "Error: " in r.output and message in r.output and "Traceback" not in r.output


def test_verify_refuses_a_bad_prefill_before_running(plan_doc, tmp_path):
    path = edited(plan_doc, tmp_path, lambda p, d: p.pop("terms"))
    report = tmp_path / "report.json"
    r = CliRunner().invoke(cli, ["verify", "--plan", path, "--model", str(tmp_path / "no-pack"),
                                 "--report", str(report)])
    assert r.exit_code == 1 and "predicted.prefill.terms must be an object" in r.output, r.output
    assert not report.exists()


def test_solved_and_older_plans_still_load(plan_doc, tmp_path):
    pre = load_plan(edited(plan_doc, tmp_path, lambda p, d: None)).doc["predicted"]["prefill"]
    assert pre["prompt_tokens"] == 64 and pre["ttft_s"] == pre["prefill_s"] > 0
    # a plan made before verify_s / disk_read_s were recorded, and one made before prefill predictions
    old_terms = load_plan(edited(plan_doc, tmp_path, lambda p, d: [p["terms"].pop(k) for k in
                                                                   ("verify_s", "disk_read_s")])).doc
    assert "verify_s" not in old_terms["predicted"]["prefill"]["terms"]
    older = load_plan(edited(plan_doc, tmp_path, lambda p, d: d["predicted"].pop("prefill"))).doc
    assert "prefill" not in older["predicted"]
