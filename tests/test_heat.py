"""Heat: files (JSON, colibrì usage text, IKU1), probabilities, real counts, synthesis, alignment."""

import json
import struct

import numpy as np
import pytest
from _cli_fixtures import heat_doc, write
from _solver_fixtures import toy_spec

from colibri_plan.errors import FormatError, InputError, MismatchError
from colibri_plan.formats.heat import (
    Heat,
    load_heat,
    read_usage_text,
    save_heat,
    write_usage_text,
)
from colibri_plan.formats.heat_align import align_heat, uniform_heat
from colibri_plan.heatsynth import cap_probabilities, real_heat, resample_profile, sample_trace, synth_heat
from colibri_plan.model import load_model_spec


def test_usage_text_parse_by_hand(tmp_path):
    f = tmp_path / "stats.txt"
    f.write_text("-1 78 4\n-2 1 3815245270\n3 0 5\n3 2 1\n78 3 7\n3 0 2\n")
    h = read_usage_text(f)
    assert h.n_experts == 4 and h.layers == (3, 78) and h.n_model_layers == 78 and h.engine_id == 3815245270
    assert h.counts.tolist() == [[7, 0, 1, 0], [0, 0, 0, 7]]   # repeated rows add up
    assert h.tokens is None and h.top_k is None
    with pytest.raises(InputError, match="top-k"):
        h.probabilities()
    p = h.probabilities(top_k=2)               # counts scaled to sum k; 7/8*2 = 1.75 caps at 1, 0.75 moves on
    assert p[0].tolist() == pytest.approx([1.0, 0, 1.0, 0])
    assert p[1].tolist() == [0, 0, 0, 1.0]     # one selected expert cannot carry more than 1


@pytest.mark.parametrize("text, where", [
    ("-1 78 4\n3 0 x\n", ":2:"),
    ("-1 78 4\n3 9 1\n", ":2: expert 9 out of range"),
    ("-1 78 4\n3 1\n", ":2:"),
    ("-1 78 4\n-2 7 1\n", ":2: usage format version 7"),
    ("-1 78 4\n\n3 1 -4\n", ":3:"),
    ("-1 10 4\n11 1 1\n", "layer 11 out of range"),
    ("-5 1 1\n", "unknown header row"),
])
def test_usage_text_errors_name_the_line(tmp_path, text, where):
    f = tmp_path / "bad.txt"
    f.write_text(text)
    with pytest.raises(FormatError, match=where):
        load_heat(f)


def test_usage_roundtrip_and_zero_byte(tmp_path):
    h = real_heat("olmoe", "github")
    f = tmp_path / "u.txt"
    write_usage_text(h, f)
    lines = f.read_text().splitlines()
    assert lines[0] == "-1 16 64"
    layers = [int(x.split()[0]) for x in lines[1:]]
    assert layers == sorted(layers)                          # layer-major
    back = load_heat(f)
    assert back.layers == h.layers and np.array_equal(back.counts, h.counts)
    empty = Heat(n_experts=4, layers=(1,), counts=np.zeros((1, 4)))
    write_usage_text(empty, tmp_path / "e.txt")
    assert (tmp_path / "e.txt").read_bytes() == b""


def test_json_roundtrip_and_corruption(tmp_path):
    h = real_heat("mixtral", "c4")
    save_heat(h, tmp_path / "h.json")
    back = load_heat(tmp_path / "h.json")
    assert back.fingerprint() == h.fingerprint() and back.tokens == h.tokens and back.top_k == 2
    (tmp_path / "bad.json").write_text('{"kind": "heat", "schema_version": 1, "n_experts": 8, "layers": [0]}')
    with pytest.raises(FormatError, match="has no counts"):
        load_heat(tmp_path / "bad.json")
    (tmp_path / "v2.json").write_text('{"kind": "heat", "schema_version": 2}')
    with pytest.raises(FormatError, match="schema_version"):
        load_heat(tmp_path / "v2.json")


def test_iku1(tmp_path):
    data = np.zeros((3, 4), dtype="<u4")
    data[2] = [1, 2, 3, 4]
    (tmp_path / "u.bin").write_bytes(b"IKU1" + struct.pack("<II", 3, 4) + data.tobytes())
    h = load_heat(tmp_path / "u.bin")
    assert h.layers == (2,) and h.counts.tolist() == [[1, 2, 3, 4]]
    (tmp_path / "t.bin").write_bytes(b"IKU1" + struct.pack("<II", 3, 4) + b"\0" * 8)
    with pytest.raises(FormatError, match="IKU1"):
        load_heat(tmp_path / "t.bin")


def test_real_counts_probabilities():
    h = real_heat("olmoe", "c4")
    assert h.n_experts == 64 and h.top_k == 8 and h.layers == (0, 7, 15)
    p = h.probabilities()
    assert np.allclose(p.sum(axis=1), 8.0)                   # every token selects 8 experts
    top8 = np.sort(p, axis=1)[:, ::-1][:, :8].sum(axis=1) / 8
    assert np.all((top8 > 0.15) & (top8 < 0.6))              # README: top 8 of 64 carry 20-51%
    with pytest.raises(InputError, match="domain"):
        real_heat("olmoe", "nope")


def test_resample_preserves_lorenz_curve_and_caps():
    p = real_heat("olmoe", "arxiv").probabilities()[1]
    r = resample_profile(p, 256, 8)
    assert r.sum() == pytest.approx(8.0) and np.all(np.diff(r) <= 1e-12) and r.max() <= 1.0
    src = np.sort(p)[::-1]
    # the hottest quarter carries (nearly) the same share after resampling from 64 to 256 experts
    assert r[:64].sum() / 8 == pytest.approx(src[:16].sum() / 8, abs=0.03)
    capped = cap_probabilities(np.array([100.0, 1.0, 1.0, 1.0]), 2)
    assert capped.tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])


def test_synth_heat_for_catalogue_model():
    spec = load_model_spec("glm-5.2")
    h = synth_heat(spec, seed=3)
    assert h.layers == spec.moe_layers and h.counts.shape == (76, 256)
    p = h.probabilities()
    assert np.allclose(p.sum(axis=1), spec.top_k) and p.max() <= 1.0
    assert h.model_fingerprint == spec.fingerprint()
    assert np.array_equal(synth_heat(spec, seed=3).counts, h.counts)
    assert not np.array_equal(synth_heat(spec, seed=4).counts, h.counts)
    assert not np.array_equal(np.argsort(p[0]), np.argsort(p[1]))   # ids permuted per layer


def test_uniform_fallback_warns():
    spec = toy_spec()
    h, msg = uniform_heat(spec)
    assert "uniform" in msg and msg in h.warnings
    assert np.allclose(h.probabilities(), spec.top_k / spec.n_experts)


def test_align_heat_rejects_another_models_heat():
    spec = toy_spec(n_experts=8)
    with pytest.raises(MismatchError, match="experts per layer"):
        align_heat(real_heat("olmoe", "c4"), spec)
    wrong_k = Heat(n_experts=8, layers=(1,), counts=np.ones((1, 8)), top_k=3)
    with pytest.raises(MismatchError, match="top-k"):
        align_heat(wrong_k, spec)
    extra_layer = Heat(n_experts=8, layers=(1, 9), counts=np.ones((2, 8)))
    with pytest.raises(MismatchError, match="not MoE layers"):
        align_heat(extra_layer, spec)
    other_fp = Heat(n_experts=8, layers=(1,), counts=np.ones((1, 8)), model_fingerprint="0" * 16)
    with pytest.raises(MismatchError, match="fingerprint"):
        align_heat(other_fp, spec)
    partial = Heat(n_experts=8, layers=(2,), counts=np.arange(8.0)[None, :])
    a = align_heat(partial, spec)
    assert a.layers == (1, 2, 3) and any("mean profile" in w for w in a.warnings)
    assert np.allclose(a.probabilities().sum(axis=1), 2.0)


def test_sample_trace_rows_are_distinct_topk():
    t = sample_trace(np.linspace(1, 2, 16), 200, 4, seed=1)
    assert t.shape == (200, 4)
    assert all(len(set(row)) == 4 for row in t.tolist())


def test_heat_shape_errors_speak_of_rows_and_experts(tmp_path):
    from colibri_plan.formats.heat import save_heat

    good = Heat(n_experts=64, layers=(0, 1, 2), counts=np.ones((3, 64)), top_k=8)
    save_heat(good, tmp_path / "h.json")
    doc = json.loads((tmp_path / "h.json").read_text())
    doc["layers"] = [0, 1]                                   # 3 rows of 64, 2 layer ids
    (tmp_path / "rows.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match="3 rows but layers lists 2 layer ids"):
        load_heat(tmp_path / "rows.json")
    doc["layers"] = [0, 1, 2]
    doc["counts"][1] = doc["counts"][1][:63]                  # a ragged row
    (tmp_path / "ragged.json").write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=r"row 1 \(layer 1\) has 63 values, expected n_experts = 64"):
        load_heat(tmp_path / "ragged.json")
    with pytest.raises(InputError, match="2 rows x 5 experts, expected 3 rows"):
        Heat(n_experts=64, layers=(0, 1, 2), counts=np.ones((2, 5)))


@pytest.mark.parametrize("value", [1e30, "5", 1.5, -1, True, float("nan"), 2**53])
def test_heat_count_must_be_a_whole_json_number(tmp_path, value):
    doc = heat_doc(tmp_path)
    doc["counts"][0][2] = value
    with pytest.raises(FormatError, match="count of layer 1 expert 2 .*whole numbers"):
        load_heat(write(tmp_path / "bad.json", doc))


@pytest.mark.parametrize("field,value", [("tokens", float("nan")), ("tokens", "7"), ("tokens", 2.5),
                                         ("tokens", -1), ("n_model_layers", -3), ("n_model_layers", 1.5),
                                         ("n_experts", "4"), ("top_k", 9), ("engine_id", 2**32)])
def test_heat_scalar_fields_checked(tmp_path, field, value):
    with pytest.raises(FormatError, match=f"{field} must be a whole number"):
        load_heat(write(tmp_path / "bad.json", heat_doc(tmp_path, **{field: value})))


def test_heat_layer_beyond_model_layers_refused(tmp_path):
    with pytest.raises(FormatError, match="layer 2 is beyond n_model_layers = 1"):
        load_heat(write(tmp_path / "bad.json", heat_doc(tmp_path, n_model_layers=1)))


def test_whole_float_counts_accepted_and_fractions_written_whole(tmp_path):
    doc = heat_doc(tmp_path, tokens=7.0)
    doc["counts"][0][0] = 5.0
    back = load_heat(write(tmp_path / "ok.json", doc))
    assert back.tokens == 7 and isinstance(back.tokens, int) and back.counts[0, 0] == 5
    frac = Heat(n_experts=3, layers=(0,), counts=np.array([[0.3, 2.6, 0.0]]), tokens=3)
    again = load_heat(save_heat(frac, tmp_path / "frac.json"))   # the writer's output reads back
    assert again.counts.tolist() == [[1.0, 3.0, 0.0]]


def test_usage_text_bounds(tmp_path):
    (tmp_path / "wide.txt").write_text("-1 2 99999999999\n0 0 1\n")
    with pytest.raises(FormatError, match="n_experts <="):
        read_usage_text(tmp_path / "wide.txt")
    (tmp_path / "big.txt").write_text(f"-1 2 4\n0 0 {2**53}\n")
    with pytest.raises(FormatError, match=":2: .*too large"):
        read_usage_text(tmp_path / "big.txt")
    huge = Heat(n_experts=2, layers=(0,), counts=np.array([[1e30, 1.0]]))
    with pytest.raises(InputError, match="too large for a usage file"):
        write_usage_text(huge, tmp_path / "never.txt")
    assert not (tmp_path / "never.txt").exists()


# ---- issue 17: tokens must agree with the counts ---------------------------------------------------------

@pytest.mark.parametrize("tokens", [1, 2, 50])
def test_heat_tokens_disagreeing_with_counts_is_refused(tmp_path, tokens):
    """Rows sum to tokens x top_k (7 x 2 = 14 here): another token count would scale every probability
    (x7 for tokens=1... or /3.6 for 50) and move the pinned set, so it is refused, naming the row."""
    doc = heat_doc(tmp_path, tokens=tokens)
    with pytest.raises(FormatError, match=r"layer 1 .*(sum to 14 selections|selected 5 times in)"):
        load_heat(write(tmp_path / "bad.json", doc))
    with pytest.raises(InputError, match="tokens or counts are wrong"):
        Heat(n_experts=4, layers=(1,), counts=np.array([[5, 0, 4, 5]]), top_k=2, tokens=tokens)


def test_heat_rows_without_tokens_and_unobserved_rows_pass(tmp_path):
    assert load_heat(write(tmp_path / "ok.json", heat_doc(tmp_path))).tokens == 7
    # an unobserved (MTP) row of zeros passes
    Heat(n_experts=4, layers=(1, 2), counts=np.array([[5, 0, 4, 5], [0, 0, 0, 0]]), top_k=2, tokens=7)
    Heat(n_experts=4, layers=(1,), counts=np.array([[50, 0, 4, 5]]), top_k=2)  # no tokens: nothing to check


def test_heat_without_counts_says_so(tmp_path):
    f = tmp_path / "h.json"
    f.write_text(json.dumps({"kind": "heat", "schema_version": 1, "n_experts": 4, "layers": [0],
                             "top_k": 1, "tokens": 1}))
    with pytest.raises(FormatError, match="has no counts") as err:
        load_heat(f)
    assert "KeyError" not in str(err.value)
