"""fileio: a folder or a device where a file is expected is named as what it is."""

from __future__ import annotations

import pytest

from colibri_plan.errors import InputError
from colibri_plan.fileio import check_input_file, read_document


def test_check_input_file_says_what_the_path_is(tmp_path):
    f = tmp_path / "f.json"
    f.write_text("{}")
    assert check_input_file(f, "plan file") == f
    with pytest.raises(InputError, match="plan file .* is a folder, expected a file"):
        check_input_file(tmp_path, "plan file")
    with pytest.raises(InputError, match="is not a regular file"):
        check_input_file("/dev/null", "plan file")
    with pytest.raises(InputError, match="does not exist"):
        check_input_file(tmp_path / "nope", "plan file")
    with pytest.raises(InputError, match="is a folder"):
        read_document(tmp_path, "plan", 1)


# ---- issue 17: deep nesting and huge integers are typed errors of the JSON reader ------------------------

@pytest.mark.parametrize("text,match", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),                       # RecursionError in json
    ('{"kind": "plan", "x": ' + "[" * 80 + "]" * 80 + "}", "nested too deeply"),  # parses, still refused
    ('{"kind": "plan", "n": ' + "9" * 400 + "}", "larger than any field"),
    ('{"kind": "plan", "n": 18446744073709551616}', "larger than any field"),   # 2**64
])
def test_json_reader_refuses_deep_nesting_and_huge_integers(tmp_path, text, match):
    from colibri_plan.errors import FormatError
    from colibri_plan.fileio import parse_json, read_json_object

    (tmp_path / "d.json").write_text(text)
    with pytest.raises(FormatError, match=match):
        read_json_object(tmp_path / "d.json", "plan file")
    with pytest.raises(FormatError, match=match):
        read_document(tmp_path / "d.json", "plan", 1)
    assert parse_json('{"a": [[1]], "b": 9223372036854775807}', "x", "y")["b"] == 2**63 - 1


def test_deep_nesting_is_refused_by_every_document_reader(tmp_path):
    from colibri_plan.errors import FormatError
    from colibri_plan.formats.coefficients import load_coefficients
    from colibri_plan.formats.heat import load_heat
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.formats.profile import load_profile
    from colibri_plan.formats.report import load_report
    from colibri_plan.model import load_model_spec

    for kind, reader in (("plan", load_plan), ("profile", load_profile), ("heat", load_heat),
                         ("coefficients", load_coefficients), ("verify-report", load_report),
                         ("model_spec", load_model_spec)):
        p = tmp_path / f"{kind}.json"
        p.write_text(f'{{"kind": "{kind}", "schema_version": 1, "x": ' + "[" * 50_000 + "]" * 50_000 + "}")
        with pytest.raises(FormatError, match="nested too deeply"):
            reader(p)
