"""formats/fields: one reader of typed document fields; every refusal names the document, the field's path
and what was wanted (issue 32)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from colibri_plan.errors import FormatError
from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

DOC = At("profile", "re-measure with `colibri-plan profile`")
GBPS = DOC / "disk" / "read_gbps"          # profile.disk.read_gbps, a list of figures


def _refusal(read, *args, **kw) -> str:
    with pytest.raises(FormatError) as err:
        read(*args, **kw)
    return str(err.value)


def test_paths_are_written_with_keys_and_indices():
    assert (GBPS / 2).dotted == "disk.read_gbps[2]" and str(GBPS / 2) == "profile disk.read_gbps[2]"
    assert (At("plan p.json") / "layers" / 0 / "p" / 3).dotted == "layers[0].p[3]"
    assert At("x").dotted == "" and str(At("x")) == "x"


@pytest.mark.parametrize("value, shown", [
    (math.nan, "NaN"), (math.inf, "Infinity"), (-math.inf, "-Infinity"), (True, "true"), ("1.5", '"1.5"'),
    (None, "null"), ([1], "[1]"), (10**400, "1" + "0" * 56 + "..."),
])
def test_a_number_refuses_nan_inf_bool_text_and_null_naming_the_path(value, shown):
    msg = _refusal(f.number, [1.0, 2.0, value], 2, GBPS, lo=0)
    assert msg == (f"profile: disk.read_gbps[2] must be a finite number >= 0, got {shown}; re-measure with "
                   "`colibri-plan profile`")


@pytest.mark.parametrize("kw, value, want", [
    ({"lo": 0}, -1e-9, "a finite number >= 0"),
    ({"lo": 0, "lo_open": True}, 0.0, "a finite number > 0"),
    ({"lo": 0, "hi": 1e6}, 2e6, "a finite number >= 0 and <= 1e+06"),
    ({"lo": 0, "hi": 1, "hi_open": True, "unit": " s"}, 1, "a finite number >= 0 and < 1 s"),
    ({"hi": 10, "want": "a share"}, 11, "a share"),
])
def test_a_number_out_of_range_says_the_bounds(kw, value, want):
    msg = _refusal(f.number, {"x": value}, "x", DOC / "ram", **kw)
    assert msg.startswith(f"profile: ram.x must be {want}, got ")


def test_a_number_in_range_is_returned_as_it_is():
    assert f.number({"x": 3}, "x", DOC, lo=0, hi=3) == 3 and f.number({"x": 0.5}, "x", DOC, lo=0) == 0.5
    assert f.number({"x": np.float32(2.5)}, "x", DOC) == 2.5                  # numpy numbers are numbers
    assert f.number({}, "x", DOC, optional=True) is None
    assert f.number({"x": None}, "x", DOC, optional=True) is None


@pytest.mark.parametrize("value, ok", [(4, True), (4.0, False), (True, False), (-1, False), (65, False),
                                       ("4", False), (math.nan, False), (np.int64(4), True)])
def test_a_whole_number_is_an_int_in_its_range(value, ok):
    d = {"queue_depth": value}
    if ok:
        assert f.whole(d, "queue_depth", DOC, lo=1, hi=64) == 4
    else:
        assert "queue_depth must be a whole number in 1..64, got" in _refusal(f.whole, d, "queue_depth", DOC,
                                                                            lo=1, hi=64)


def test_integral_floats_and_the_documents_word_for_an_integer():
    assert f.whole({"n": 3.0}, "n", DOC, lo=1, integral_floats=True) == 3
    assert "n must be a whole number >= 1, got 3.5" in _refusal(f.whole, {"n": 3.5}, "n", DOC, lo=1,
                                                                  integral_floats=True)
    prof = At("profile", by_parent=True, integer="an integer")
    assert _refusal(f.whole, {"index": "0"}, "index", prof / "devices" / 1, lo=0) == \
        'profile devices[1]: index must be an integer >= 0, got "0"'


def test_flags_texts_choices_objects_and_lists():
    at = At("plan p.json", "re-create the plan")
    assert _refusal(f.flag, {"o_direct": 1}, "o_direct", at / "knobs") == \
        "plan p.json: knobs.o_direct must be true or false, got 1; re-create the plan"
    assert "path must be one of device, host, got \"gpu\"" in _refusal(f.text, {"path": "gpu"}, "path", at,
                                                                          choices=("device", "host"))
    assert "name must be a non-empty string, got \"\"" in _refusal(f.text, {"name": ""}, "name", at,
                                                                     nonempty=True)
    assert "budgets must be an object, got [1]" in _refusal(f.mapping, {"budgets": [1]}, "budgets", at)
    assert "random must be a non-empty list, got []" in _refusal(f.items, {"random": []}, "random", at,
                                                                   nonempty=True)
    assert [(v, w.dotted) for v, w in f.each({"r": [5, 6]}, "r", at)] == [(5, "r[0]"), (6, "r[1]")]


def test_absent_fields_and_the_document_itself():
    at = At("plan p.json", "re-create the plan")
    assert _refusal(f.number, {}, "tok_s", at / "predicted") == \
        "plan p.json: predicted.tok_s is missing; re-create the plan"
    assert _refusal(f.require, {"a": 1}, ("a", "b", "c"), at / "model") == \
        "plan p.json model: missing b, c; re-create the plan"
    assert _refusal(f.document, [1], at).startswith("plan p.json must be a JSON object, got [1]")


def test_values_as_python_writes_them_and_nesting_too_deep_to_show():
    at = At("trunk", repr_values=True)
    assert _refusal(f.text, {"fmt": "int9"}, "fmt", at, choices=("int8",)).endswith("got 'int9'")
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert "nested too deep to show" in _refusal(f.number, {"x": deep}, "x", at)
