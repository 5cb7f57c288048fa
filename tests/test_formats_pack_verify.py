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
    (work / "pack.json").write_text(json.dumps(doc))
    return work


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
    _refused_by_verify_and_run(work, "moe_layers is empty")


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
