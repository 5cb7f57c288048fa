"""Fuzz suite of the pack and checkpoint loaders (issue 17).

Pack: a small fixture pack whose ``pack.json`` (JSON mutations), ``experts.bin`` or ``dense.safetensors``
(byte mutations) is corrupted; the case runs ``model verify``'s check, opens the pack and generates a
token on the numpy backend. Checkpoint: a tiny Mixtral checkpoint written with numpy (two shards and a
``model.safetensors.index.json``) whose config.json, index, a shard's safetensors header (decoded,
mutated as JSON — doubled, negative or huge shapes, offsets past the end or overlapping, wrong dtypes,
non-string metadata — and re-encoded) or raw bytes are corrupted; the case sizes it
(``load_model_spec``), loads it and packs it, and on failure no pack (nor a hidden temp folder) may be
left. A few cases run ``model pack`` / ``model verify`` through the CLI. Bounds and the contract:
tests/_fuzz.py.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from _cli_fixtures import invoke
from _fuzz import bounded, byte_mutations, check_outcome, fuzz, json_mutations, mutate_bytes, mutate_json
from _tiny_models import SHARD, write_numpy_mixtral
from hypothesis import given
from hypothesis import strategies as st

from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.pack import open_pack, write_pack
from colibri_plan.engine.runner import generate, open_weights
from colibri_plan.engine.weights import load_checkpoint
from colibri_plan.formats.pack_verify import verify_pack
from colibri_plan.model import load_model_spec
from colibri_plan.run_options import RunOptions

N = 50


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz-pack") / "fx"
    build_fixture(out, FixtureConfig.small(layers=2, experts=4, top_k=2, hidden=32, width=16, vocab=48,
                                           head_dim=8))
    return out


def _use_pack(folder):
    verify_pack(folder)
    with open_pack(folder) as p:
        for layer in p.arch.moe_layers:
            p.expert(layer, 0)
    w = open_weights(folder)
    generate(w, [1, 2], RunOptions(tokens=1, backend="numpy"))
    w.close()


def _copy(src, dest):
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    return dest


def test_pack_index_mutations(pack, tmp_path):
    check_outcome(bounded(_use_pack, pack), "the good pack")
    doc = json.loads((pack / "pack.json").read_text())

    @fuzz(N)
    @given(m=json_mutations())
    def case(m):
        work = _copy(pack, tmp_path / "p")
        (work / "pack.json").write_bytes(mutate_json(doc, m))
        check_outcome(bounded(_use_pack, work), f"pack.json {m!r:.200}")

    case()


@pytest.mark.parametrize("name", ["experts.bin", "dense.safetensors"])
def test_pack_data_mutations(pack, tmp_path, name):
    data = (pack / name).read_bytes()
    head = data if name == "experts.bin" else data[:8 + struct.unpack("<Q", data[:8])[0] + 64]

    @fuzz(N // 2)
    @given(m=byte_mutations())
    def case(m):
        work = _copy(pack, tmp_path / "p")
        (work / name).write_bytes(mutate_bytes(head, m) + data[len(head):])
        check_outcome(bounded(_use_pack, work), f"{name} {m!r}")

    case()


# ---- checkpoints -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_numpy_mixtral(tmp_path_factory.mktemp("fuzz-ck") / "ck")


def _use_checkpoint(folder, out):
    load_model_spec(folder)
    w = load_checkpoint(folder, expert_format="f32")
    try:
        write_pack(w, out, "int8")
    finally:
        leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
        assert not leftovers, f"temp folders left: {leftovers}"
    generate(open_weights(out), [1, 2], RunOptions(tokens=1, backend="numpy"))


def _checkpoint_case(checkpoint, tmp_path, edit, case):
    work = _copy(checkpoint, tmp_path / "ck")
    out = tmp_path / "out" / "pack"
    shutil.rmtree(out.parent, ignore_errors=True)
    out.parent.mkdir()
    edit(work)
    res = check_outcome(bounded(_use_checkpoint, work, out), case)
    if res["status"] == "typed":
        assert not out.exists() or (out / "pack.json").is_file(), f"{case}: a partial pack was left"
    return res


def test_the_tiny_checkpoint_packs_and_runs(checkpoint, tmp_path):
    assert _checkpoint_case(checkpoint, tmp_path, lambda w: None, "good")["status"] == "ok"


def _header(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def test_checkpoint_header_mutations(checkpoint, tmp_path):
    header, _ = _header(checkpoint / SHARD)

    @fuzz(N)
    @given(m=json_mutations())
    def case(m):
        def edit(work):
            _, body = _header(work / SHARD)
            raw = mutate_json(header, m)
            (work / SHARD).write_bytes(struct.pack("<Q", len(raw)) + raw + body)

        _checkpoint_case(checkpoint, tmp_path, edit, f"header {m!r:.200}")

    case()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_checkpoint_json_mutations(checkpoint, tmp_path, name):
    doc = json.loads((checkpoint / name).read_text())

    @fuzz(N // 2)
    @given(m=json_mutations())
    def case(m):
        _checkpoint_case(checkpoint, tmp_path, lambda w: (w / name).write_bytes(mutate_json(doc, m)),
                         f"{name} {m!r:.200}")

    case()


def test_checkpoint_byte_mutations(checkpoint, tmp_path):
    @fuzz(N // 2)
    @given(m=byte_mutations(), shard=st.sampled_from([SHARD, "model-00002-of-00002.safetensors"]))
    def case(m, shard):
        def edit(work):
            data = (work / shard).read_bytes()
            (work / shard).write_bytes(mutate_bytes(data, m))

        _checkpoint_case(checkpoint, tmp_path, edit, f"{shard} {m!r}")

    case()


# ---- through the CLI -------------------------------------------------------------------------------

def _cli(*args, out=None):
    res = invoke(*args)
    assert res.exit_code in (0, 1), (res.exit_code, res.output[-2000:], repr(res.exception))
    assert "Traceback" not in res.output, res.output[-2000:]
    if res.exit_code == 1:
        assert len([ln for ln in res.output.splitlines() if ln.startswith("Error:")]) == 1, res.output
        assert out is None or not out.exists(), "the command failed but left its output"


def test_model_pack_and_verify_cli(checkpoint, pack, tmp_path):
    header, _ = _header(checkpoint / SHARD)
    doc = json.loads((pack / "pack.json").read_text())

    @fuzz(10)
    @given(m=json_mutations())
    def case(m):
        work = _copy(checkpoint, tmp_path / "ck")
        _, body = _header(work / SHARD)
        raw = mutate_json(header, m)
        (work / SHARD).write_bytes(struct.pack("<Q", len(raw)) + raw + body)
        out = tmp_path / "out-pack"
        shutil.rmtree(out, ignore_errors=True)
        check_outcome(bounded(_cli, "model", "pack", work, out, "--quant", "int8", out=out),
                      f"pack {m!r:.200}")
        bad = _copy(pack, tmp_path / "p")
        (bad / "pack.json").write_bytes(mutate_json(doc, m))
        check_outcome(bounded(_cli, "model", "verify", bad), f"verify {m!r:.200}")

    case()
