"""formats/st_header: corrupt safetensors headers and shard maps are named FormatErrors in sizing,
loading and packing a checkpoint, never a SafetensorError traceback (issue 17)."""

from __future__ import annotations

import json
import struct

import pytest
from _cli_fixtures import invoke
from _tiny_models import SHARD, write_numpy_mixtral

from colibri_plan.engine.weights import load_checkpoint
from colibri_plan.errors import FormatError
from colibri_plan.formats.st_header import read_header
from colibri_plan.model import load_model_spec

EMBED = "model.embed_tokens.weight"


def _rewrite(path, edit, tail=b""):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:] + tail)


def _double_shape(h):
    h[EMBED]["shape"] = [h[EMBED]["shape"][0] * 2, h[EMBED]["shape"][1]]


def _negative_shape(h):
    h[EMBED]["shape"] = [-32, 16]


def _past_end(h):
    h[EMBED]["data_offsets"][1] += 10**9


def _overlap(h):
    name = next(n for n in h if n not in ("__metadata__", EMBED) and h[n]["data_offsets"][0] > 0)
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b - 4, e - 4]


def _dtype(h):
    h[EMBED]["dtype"] = "F16"


def _metadata(h):
    h["__metadata__"] = {"format": 1}


def _dtype_list(h):
    h[EMBED]["dtype"] = ["F32"]


CASES = {"shape doubled": (_double_shape, b"", "needs"),
         "negative shape": (_negative_shape, b"", "malformed"),
         "offsets past the end": (_past_end, b"", "past the end"), "overlap": (_overlap, b"", "overlaps"),
         "dtype/size mismatch": (_dtype, b"", "needs"),
         "trailing bytes": (lambda h: None, b"xx", "after the last"),
         "non-string metadata": (_metadata, b"", "__metadata__"),
         "dtype a list": (_dtype_list, b"", "malformed")}


@pytest.mark.parametrize("case", list(CASES))
def test_corrupt_headers_are_named_everywhere(tmp_path, case):
    edit, tail, match = CASES[case]
    ck = write_numpy_mixtral(tmp_path / "ck")
    _rewrite(ck / SHARD, edit, tail)
    with pytest.raises(FormatError, match=match):
        read_header(ck / SHARD)
    with pytest.raises(FormatError, match=match):
        load_model_spec(ck)
    with pytest.raises(FormatError, match=match):
        load_checkpoint(ck)
    res = invoke("model", "pack", ck, tmp_path / "out", "--quant", "int8")
    assert res.exit_code == 1 and "Traceback" not in res.output and "SafetensorError" not in res.output
    assert not (tmp_path / "out").exists()
    res = invoke("run", "--model", ck, "--prompt-ids", "1,2", "--tokens", "1")
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output


def test_a_good_numpy_checkpoint_loads(tmp_path):
    ck = write_numpy_mixtral(tmp_path / "ck")
    assert load_model_spec(ck).n_experts == 4
    assert load_checkpoint(ck).arch.n_layers == 2


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    """It used to be taken from the last file read."""
    from safetensors.numpy import load_file, save_file

    ck = write_numpy_mixtral(tmp_path / "ck")
    second = ck / "model-00002-of-00002.safetensors"
    t = load_file(str(second))
    t[EMBED] = load_file(str(ck / SHARD))[EMBED] * 2
    save_file(t, str(second))
    for read in (load_model_spec, load_checkpoint):
        with pytest.raises(FormatError, match="(two shards|maps it to)"):
            read(ck)
    (ck / "model.safetensors.index.json").unlink()  # no index: still refused
    for read in (load_model_spec, load_checkpoint):
        with pytest.raises(FormatError, match="appears in two shards"):
            read(ck)


@pytest.mark.parametrize("weight_map,match", [
    ({EMBED: "model-00002-of-00002.safetensors"}, "maps it to"),
    ({EMBED: "../elsewhere.safetensors"}, "not a plain file name"),
    ({"model.extra.weight": SHARD}, "no shard holds"),
])
def test_the_index_file_map_is_followed(tmp_path, weight_map, match):
    ck = write_numpy_mixtral(tmp_path / "ck")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["weight_map"].update(weight_map)
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    for read in (load_model_spec, load_checkpoint):
        with pytest.raises(FormatError, match=match):
            read(ck)


def test_fewer_config_layers_than_the_weights_is_refused(tmp_path):
    """num_hidden_layers lower than the file's layer count silently dropped the last layers."""
    ck = write_numpy_mixtral(tmp_path / "ck", layers=3, num_hidden_layers=2)
    for read in (load_model_spec, load_checkpoint):
        with pytest.raises(FormatError, match=r"layer\(s\) \[2\] but config.json says num_hidden_layers = 2"):
            read(ck)


def test_an_mtp_layer_is_ignored_and_named(tmp_path):
    """Only MTP-style extra layers (num_nextn_predict_layers, or eh_proj & co) may be skipped."""
    from safetensors.numpy import load_file, save_file

    ck = write_numpy_mixtral(tmp_path / "ck", layers=3, num_hidden_layers=2)
    last = ck / "model-00003-of-00003.safetensors"
    t = load_file(str(last))
    t["model.layers.2.eh_proj.weight"] = t["model.layers.2.input_layernorm.weight"].repeat(2)[None]
    save_file(t, str(last))
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.2.eh_proj.weight"] = last.name
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    w = load_checkpoint(ck)
    assert w.arch.n_layers == 2 and "MTP layer(s) 2 not loaded" in w.source
