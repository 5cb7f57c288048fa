"""formats/pack_verify: `model verify` checks what `run` needs, and a runaway layer count in a pack is a
typed error before anything is sized by it (issue 17)."""

from __future__ import annotations

import json
import shutil

import pytest
from _cli_fixtures import invoke

from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.runner import open_weights
from colibri_plan.errors import FormatError
from colibri_plan.formats.pack_verify import verify_pack


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("pv") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=4, top_k=2, hidden=32, width=16, vocab=48,
                                           head_dim=8))
    return out


def _edited(pack, tmp_path, edit):
    work = tmp_path / "p"
    shutil.copytree(pack, work)
    doc = json.loads((work / "pack.json").read_text())
    edit(doc)
    _resync_spec(doc)
    (work / "pack.json").write_text(json.dumps(doc))
    return work


def _resync_spec(doc):
    """Make model.spec (and its fingerprint) agree with an edited arch, so the edit reaches the checks
    past the index's own consistency check."""
    from colibri_plan.formats.model_spec import ModelSpec
    from colibri_plan.formats.pack_spec import SPEC_ARCH_FIELDS

    spec = doc["model"]["spec"]
    for s_key, a_key in SPEC_ARCH_FIELDS:
        if isinstance(doc["arch"].get(a_key), (int, list)):
            spec[s_key] = doc["arch"][a_key]
    try:
        doc["model"]["fingerprint"] = ModelSpec.from_dict(spec).fingerprint()
    except Exception:  # noqa: BLE001 - an arch edit the spec cannot take: the index check refuses it
        pass


def _refused_by_verify_and_run(work, match):
    report = verify_pack(work)
    assert not report["ok"] and any(match in p for p in report["problems"]), report["problems"]
    res = invoke("model", "verify", work)
    assert res.exit_code == 1 and match in res.output and "Traceback" not in res.output
    with pytest.raises(FormatError, match=match):
        open_weights(work)
    res = invoke("run", "--model", work, "--prompt-ids", "1,2", "--tokens", "1")
    assert res.exit_code == 1 and "Traceback" not in res.output


def test_vocab_off_by_one_fails_verify_as_it_fails_run(pack, tmp_path):
    work = _edited(pack, tmp_path, lambda d: d["arch"].__setitem__("vocab_size", d["arch"]["vocab_size"] + 1))
    _refused_by_verify_and_run(work, "wrong shape embed")


def test_empty_moe_layers_fails_verify_as_it_fails_run(pack, tmp_path):
    def edit(d):
        d["arch"]["moe_layers"] = []
        d["arch"]["dense_intermediate_size"] = 8
        d["experts"] = []
        d["format"]["experts_file_bytes"] = 0
    work = _edited(pack, tmp_path, edit)
    (work / "experts.bin").write_bytes(b"")
    # a spec cannot have no MoE layer: the index's model section refuses it before any other check
    for call in (lambda: verify_pack(work), lambda: open_weights(work)):
        with pytest.raises(FormatError, match="moe_layers must be a non-empty list"):
            call()
    for args in (("model", "verify", work), ("run", "--model", work, "--prompt-ids", "1", "--tokens", "1")):
        res = invoke(*args)
        assert res.exit_code == 1 and "moe_layers" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("value", [10**9, 2**64, 2**70])
def test_a_huge_layer_count_is_refused_before_anything_is_sized(pack, tmp_path, value):
    work = _edited(pack, tmp_path, lambda d: d["arch"].__setitem__("n_layers", value))
    for call in (lambda: verify_pack(work), lambda: open_weights(work)):
        with pytest.raises(FormatError, match="n_layers .*more than 4,096|larger than any field"):
            call()
    for args in (("model", "verify", work), ("run", "--model", work, "--prompt-ids", "1", "--tokens", "1")):
        res = invoke(*args)
        assert res.exit_code == 1 and "Traceback" not in res.output, res.output


def test_the_good_pack_verifies_and_opens(pack):
    assert verify_pack(pack)["ok"]
    open_weights(pack).close()


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["model"]["spec"].__setitem__("top_k", 3), "model.spec.top_k is 3 but the pack's arch has"),
    (lambda d: d["model"]["spec"].__setitem__("n_experts", 8), "model.spec.n_experts"),
    (lambda d: d["model"]["spec"].__setitem__("hidden_size", 64), "model.spec.hidden_size"),
    (lambda d: d["model"].__setitem__("fingerprint", "0" * 16), "stored model fingerprint"),
])
def test_an_edited_model_spec_is_refused_by_verify_show_and_run(pack, tmp_path, edit, match):
    work = tmp_path / "p"
    shutil.copytree(pack, work)
    doc = json.loads((work / "pack.json").read_text())
    edit(doc)
    (work / "pack.json").write_text(json.dumps(doc))
    for call in (lambda: verify_pack(work), lambda: open_weights(work)):
        with pytest.raises(FormatError, match=match):
            call()
    for args in (("model", "verify", work), ("model", "show", work),
                 ("run", "--model", work, "--prompt-ids", "1", "--tokens", "1")):
        res = invoke(*args)
        assert res.exit_code == 1 and "re-create the pack" in res.output and "Traceback" not in res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
