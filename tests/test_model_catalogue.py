"""The catalogue's configs, built by transformers' own model classes on the meta device (no weights):
the routed-expert parameters transformers creates must equal rows x E x 3HI from our geometry, and the
stored dense_params must equal transformers' count (plus the MTP trunk)."""

import pytest

from colibri_plan.model import catalogue

pytest.importorskip("torch", reason="torch (test extra) counts parameters on the meta device")
pytest.importorskip("transformers", reason="transformers (test extra) holds the model classes")


@pytest.mark.parametrize("name", catalogue.catalogue_names())
def test_catalogue_entry_matches_transformers(name):
    from colibri_plan.model.metacount import count_params

    entry = catalogue.find_entry(name)
    spec = catalogue.spec_from_entry(entry)
    counts = count_params(entry["config"], int(entry.get("mtp_layers", 0)))
    assert counts["routed"] == len(spec.decode_moe_layers) * spec.n_experts * spec.expert_params
    assert spec.dense_params == counts["dense"]
