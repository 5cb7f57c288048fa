"""The expert pack: layout, round trip, engine equality with the checkpoint, corruption, atomic writes."""

from __future__ import annotations

import json
import mmap
import os
import zlib

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("torch", reason="torch is needed to build the tiny reference checkpoints")
pytest.importorskip("transformers", reason="transformers is needed to build the tiny reference checkpoints")

from _tiny_models import build  # noqa: E402

from colibri_plan.cli import cli  # noqa: E402
from colibri_plan.engine.forward import Model  # noqa: E402
from colibri_plan.engine.pack import open_pack, write_pack  # noqa: E402
from colibri_plan.engine.weights import load_checkpoint  # noqa: E402
from colibri_plan.errors import InputError, IntegrityError  # noqa: E402
from colibri_plan.formats.pack_index import block_layout, spec_from_pack  # noqa: E402
from colibri_plan.formats.pack_verify import verify_pack  # noqa: E402
from colibri_plan.quant import quantize, tensor_bytes  # noqa: E402

PROMPT = [3, 17, 99, 42, 5, 120, 64, 7]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny GLM-4.x-MoE checkpoint (router bias, shared expert, a dense layer) and a Mixtral one."""
    out = {}
    for family in ("glm4_moe", "mixtral"):
        folder = tmp_path_factory.mktemp(family)
        build(family, folder, seed=1)
        out[family] = folder
    return out


@pytest.fixture(scope="module")
def packs(ckpt, tmp_path_factory):
    root = tmp_path_factory.mktemp("packs")
    out = {}
    for family, folder in ckpt.items():
        for fmt in ("f32", "int4"):
            out[(family, fmt)] = write_pack(load_checkpoint(folder, "f32"), root / f"{family}-{fmt}", fmt)
    return out


def test_layout_matches_glm_geometry_and_quant_sizes():
    lay = block_layout("int4", 6144, 2048)
    want = 2 * tensor_bytes("int4", 2048, 6144) + tensor_bytes("int4", 6144, 2048)
    assert lay.payload_bytes == want == 18_915_328  # colibrì's 18.92 MB per int4 expert
    assert lay.block_bytes % 4096 == 0 and lay.block_bytes >= lay.payload_bytes
    for fmt in ("f32", "bf16", "int8", "int4-g64", "int4-g32h", "int2"):
        lay = block_layout(fmt, 96, 40)
        data = sum(p.nbytes for p in lay.parts)
        assert data == 2 * tensor_bytes(fmt, 40, 96) + tensor_bytes(fmt, 96, 40)
        assert all(p.offset % 64 == 0 for p in lay.parts)
        ends = [p.offset + p.nbytes for p in lay.parts]
        assert all(e <= s.offset for e, s in zip(ends, lay.parts[1:]))  # no overlap, file order
    half = block_layout("int4-g32h", 96, 40)
    assert {p.dtype for p in half.parts if p.name.endswith("scales")} == {"float16"}


@pytest.mark.parametrize("family", ["glm4_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["f32", "int4"])
def test_pack_round_trip_and_same_tokens_as_checkpoint(ckpt, packs, family, fmt):
    ref = load_checkpoint(ckpt[family], fmt)
    pk = open_pack(packs[(family, fmt)])
    assert pk.arch == ref.arch and pk.expert_format == fmt
    assert set(pk.dense) == set(ref.dense)
    for k, v in ref.dense.items():
        np.testing.assert_array_equal(pk.dense[k], v)
    for layer, e in ref.expert_keys():
        for a, b in zip(pk.expert(layer, e), ref.expert(layer, e)):
            assert a.fmt == b.fmt == fmt
            np.testing.assert_array_equal(a.data, b.data)
            if fmt != "f32":
                np.testing.assert_array_equal(a.scales, b.scales)
    assert Model(pk).generate(PROMPT, 12) == Model(ref).generate(PROMPT, 12)


def test_index_offsets_alignment_and_crc(packs):
    pk = open_pack(packs[("glm4_moe", "int4")])
    raw = pk.experts_path.read_bytes()
    assert len(raw) == pk.index["format"]["experts_file_bytes"]
    seen = []
    for layer, e in pk.expert_keys():
        off, nbytes, crc = pk.expert_location(layer, e)
        assert off % 4096 == 0 and nbytes % 4096 == 0
        assert zlib.crc32(raw[off:off + nbytes]) == crc
        seen.append(off)
    assert len(set(seen)) == len(seen)
    with pytest.raises(InputError, match="no expert"):
        pk.expert_location(0, 0)  # layer 0 is the dense layer of this model


def test_expert_from_aligned_buffer(packs):
    """What the residency manager does: O_DIRECT-style read into a page-aligned buffer, then parse."""
    pk = open_pack(packs[("mixtral", "int4")])
    off, nbytes, _ = pk.expert_location(1, 5)
    buf = mmap.mmap(-1, nbytes + 4096)
    arr = np.frombuffer(buf, dtype=np.uint8)
    with open(pk.experts_path, "rb") as f:
        f.seek(off)
        arr[:nbytes] = np.frombuffer(f.read(nbytes), np.uint8)
    gate, up, down = pk.expert_from_bytes(arr, 1, 5)
    ref = pk.expert(1, 5)
    np.testing.assert_array_equal(gate.data, ref[0].data)
    np.testing.assert_array_equal(down.scales, ref[2].scales)
    arr[100] ^= 0xFF
    with pytest.raises(IntegrityError, match="crc32"):
        pk.expert_from_bytes(arr, 1, 5)
    with pytest.raises(IntegrityError, match="buffer has"):
        pk.expert_from_bytes(arr[: nbytes - 4096], 1, 5)
    del gate, up, down


def test_spec_from_pack_matches_checkpoint_spec(ckpt, packs):
    from colibri_plan.model import load_model_spec

    spec = spec_from_pack(packs[("glm4_moe", "int4")])
    assert spec.expert_format == "int4"
    assert spec.fingerprint() == load_model_spec(str(ckpt["glm4_moe"])).fingerprint()
    assert open_pack(packs[("glm4_moe", "int4")]).model_fingerprint == spec.fingerprint()


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_flipped_byte_is_detected(packs, tmp_path):
    p = _copy(packs[("mixtral", "int4")], tmp_path / "p")
    pk = open_pack(p)
    off, nbytes, _ = pk.expert_location(1, 3)
    with open(p / "experts.bin", "r+b") as f:
        f.seek(off + nbytes // 2)
        b = f.read(1)
        f.seek(off + nbytes // 2)
        f.write(bytes([b[0] ^ 0x10]))
    report = verify_pack(p)
    assert not report["ok"] and len(report["problems"]) == 1
    assert "layer 1, expert 3" in report["problems"][0] and "crc32" in report["problems"][0]
    with pytest.raises(IntegrityError, match="layer 1, expert 3"):
        open_pack(p).expert(1, 3)
    open_pack(p).expert(1, 2)  # its neighbours are fine
    res = CliRunner().invoke(cli, ["model", "verify", str(p)])
    assert res.exit_code == 1 and "layer 1, expert 3" in res.output


def test_truncated_file_is_detected(packs, tmp_path):
    p = _copy(packs[("mixtral", "f32")], tmp_path / "p")
    size = (p / "experts.bin").stat().st_size
    os.truncate(p / "experts.bin", size - 4096)
    report = verify_pack(p)
    assert not report["ok"]
    assert any("truncated" in m for m in report["problems"])
    assert any("beyond the end" in m and "layer 1, expert 7" in m for m in report["problems"])
    with pytest.raises(IntegrityError, match="truncated"):
        open_pack(p)


def test_wrong_index_entries_are_detected(packs, tmp_path):
    p = _copy(packs[("mixtral", "int4")], tmp_path / "p")
    doc = json.loads((p / "pack.json").read_text())
    rows = doc["experts"]
    rows[0][2], rows[1][2] = rows[1][2], rows[0][2]  # swap the offsets of experts (0, 0) and (0, 1)
    (p / "pack.json").write_text(json.dumps(doc))
    report = verify_pack(p)
    assert not report["ok"]
    assert sum("crc32" in m for m in report["problems"]) == 2
    rows[0][2], rows[1][2] = rows[1][2], rows[0][2]
    rows[2][2] += 512  # misaligned offset
    rows[3][0] = 5  # a layer the model does not have
    (p / "pack.json").write_text(json.dumps(doc))
    problems = " | ".join(verify_pack(p)["problems"])
    assert "not 4096-aligned" in problems and "not in the model" in problems and "missing" in problems
    with pytest.raises(IntegrityError, match="bad index"):
        open_pack(p)
    doc["block"]["parts"][1][1] += 64  # a layout that is not the one of its format
    (p / "pack.json").write_text(json.dumps(doc))
    with pytest.raises(InputError, match="layout"):
        open_pack(p)


def test_corrupt_dense_file_is_detected(packs, tmp_path):
    p = _copy(packs[("mixtral", "f32")], tmp_path / "p")
    with open(p / "dense.safetensors", "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03\x04\x05\x06\x07")
    assert any("dense" in m for m in verify_pack(p)["problems"])
    with pytest.raises(IntegrityError, match="dense"):
        open_pack(p)


def test_failure_mid_pack_leaves_nothing(ckpt, tmp_path):
    weights = load_checkpoint(ckpt["mixtral"], "f32")
    calls = {"n": 0}
    real = weights.expert

    def flaky(layer, e):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk went away")
        return real(layer, e)

    weights.expert = flaky
    out = tmp_path / "out"
    with pytest.raises(InputError, match="disk went away; nothing was written"):   # one line, typed
        write_pack(weights, out, "int4")
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temp folder left either
    weights.expert = real
    write_pack(weights, out, "int8")
    with pytest.raises(InputError, match="already exists"):
        write_pack(weights, out, "int4")
    write_pack(weights, out, "int4", overwrite=True)
    assert open_pack(out).expert_format == "int4"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out"]


def test_quantized_pack_holds_quantize_output(ckpt, packs):
    ref = load_checkpoint(ckpt["glm4_moe"], "f32")
    pk = open_pack(packs[("glm4_moe", "int4")])
    layer = ref.arch.moe_layers[-1]
    want = quantize(ref.expert(layer, 2)[2].data, "int4")
    got = pk.expert(layer, 2)[2]
    np.testing.assert_array_equal(got.data, want.data)
    np.testing.assert_array_equal(got.scales, want.scales)


def test_pack_cli(ckpt, tmp_path):
    out = tmp_path / "cli-pack"
    res = CliRunner().invoke(cli, ["model", "pack", str(ckpt["mixtral"]), str(out), "--quant", "int8",
                                   "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["expert_format"] == "int8" and doc["experts"] == 16
    res = CliRunner().invoke(cli, ["model", "verify", str(out), "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["ok"] is True
    runs = [CliRunner().invoke(cli, ["run", "--model", str(m), "--prompt-ids", "3,17,99", "--tokens", "8",
                                     "--backend", "numpy", "--quant", "int8", "--json"])
            for m in (out, ckpt["mixtral"])]
    assert [r.exit_code for r in runs] == [0, 0], runs[0].output + runs[1].output
    assert json.loads(runs[0].stdout)["tokens"] == json.loads(runs[1].stdout)["tokens"]
    res = CliRunner().invoke(cli, ["model", "pack", str(ckpt["mixtral"]), str(out)])
    assert res.exit_code == 1 and "already exists" in res.output
    res = CliRunner().invoke(cli, ["model", "verify", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "does not exist" in res.output
