"""`colibri-plan plan show`: messages about a bad plan name the file and advise once."""

from __future__ import annotations

import json

import pytest
from _cli_fixtures import invoke, pack_and_profile, refused, write


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return pack_and_profile(tmp_path_factory, "morevalid", plan=True)


def test_plan_messages_name_the_file_and_advise_once(files, tmp_path):
    doc = json.loads((files / "plan.json").read_text())
    bad = dict(doc, coefficients=dict(doc.get("coefficients") or {}, dense=float("nan")))
    r = invoke("plan", "show", write(tmp_path / "nan.json", bad))
    refused(r, 1, "coefficients", "re-create the plan")
    assert "calibrate" not in r.output and r.output.count("re-create") == 1
    big = json.loads(json.dumps(doc))
    big["layers"][0]["lru_slots"] = 10**12
    refused(invoke("plan", "show", write(tmp_path / "lru.json", big)), 1, "lru.json", "RAM tiers hold")
