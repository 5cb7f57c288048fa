"""`colibri-plan model support`: the support matrix comes from the family registry, and the README's copy
matches it (so it cannot go stale: after a family change, paste `colibri-plan model support --markdown`
between the README's support-matrix markers)."""

from __future__ import annotations

import json
from pathlib import Path

from _cli_fixtures import invoke

from colibri_plan.backends import BACKEND_NAMES
from colibri_plan.cli.model_support import BEGIN, END, support_markdown, support_matrix
from colibri_plan.families import ENGINE_FAMILIES, FAMILIES

README = Path(__file__).resolve().parents[1] / "README.md"


def test_matrix_rows_are_the_registry():
    rows = support_matrix()
    assert [r["model_type"] for r in rows] == list(FAMILIES)
    for r in rows:
        runs = r["model_type"] in ENGINE_FAMILIES
        assert r["plan"] is True and r["pack"] == r["run"] == r["verify"] == runs
        assert list(r["backends"]) == list(BACKEND_NAMES)
        assert all((v is not None) == runs for v in r["backends"].values())
        assert (r["plan_only_reason"] is None) == runs
        assert r["family"] == FAMILIES[r["model_type"]].__name__.rsplit(".", 1)[-1]


def test_readme_matrix_matches_the_registry():
    text = README.read_text(encoding="utf-8")
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "README lost its support-matrix markers"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
    assert block == support_markdown(), (
        "README's support matrix is stale: replace the block between the support-matrix markers with the "
        "output of `colibri-plan model support --markdown`")


def test_command_prints_table_markdown_and_json():
    r = invoke("model", "support")
    assert r.exit_code == 0, r.output
    assert "model_type" in r.stdout.splitlines()[0] and all(mt in r.stdout for mt in FAMILIES)
    if len(ENGINE_FAMILIES) < len(FAMILIES):
        assert "plan only, because:" in r.stdout
    r = invoke("model", "support", "--markdown")
    assert r.exit_code == 0 and r.stdout.strip("\n") == support_markdown()
    r = invoke("model", "support", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout) == {"models": support_matrix()}
