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
