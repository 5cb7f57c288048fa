"""formats/coefficients: a hand-edited coefficients file fails with one line naming the file and key."""

from __future__ import annotations

import math

import pytest
from _cli_fixtures import assert_one_line, cli_run, coef_file

from colibri_plan.errors import FormatError
from colibri_plan.formats.coefficients import Coefficients, load_coefficients


@pytest.mark.parametrize("key, value, message", [
    ("disk", math.nan, "disk must be a finite number >= 0 and <= 1000"),
    ("disk", math.inf, "disk must be a finite number"),
    ("disk", 1e300, "disk must be a finite number >= 0 and <= 1000"),
    ("disk", True, "disk must be a finite number"),
    ("cpu_expert", -0.5, "cpu_expert must be a finite number >= 0"),
    ("gpu_call_s", 2.0, "gpu_call_s must be a finite number >= 0 and <= 1 s"),
    ("dense", "1.0", "dense must be a finite number"),
])
def test_bad_coefficient_names_file_and_key(tmp_path, good, key, value, message):
    d, _, _ = good
    f = coef_file(tmp_path, **{key: value})
    with pytest.raises(FormatError) as err:
        load_coefficients(f)
    assert message in str(err.value) and str(f) in str(err.value) and "Coefficients(" not in str(err.value)
    r = cli_run("solve", "--profile", d / "profile.json", "--model", d / "model.json", "--ram", "0.58",
                "--coefficients", f)
    assert_one_line(r, str(f), message)


def test_all_zero_coefficients_are_refused(tmp_path):
    zero = {k: 0.0 for k in Coefficients().to_dict()}
    with pytest.raises(FormatError, match="every coefficient is 0"):
        load_coefficients(coef_file(tmp_path, **zero))


@pytest.mark.parametrize("value", [2**64, 10**400, -2**64])
def test_huge_integers_are_typed_errors(tmp_path, value):
    """Issue 17: an integer >= 2**64 gave a TypeError from np.isfinite; now the key is named (or the
    JSON reader refuses the number)."""
    from colibri_plan.errors import InputError

    with pytest.raises(InputError, match="cpu_expert"):
        Coefficients.from_dict({"cpu_expert": value})
    with pytest.raises(InputError, match="cpu_expert|larger than any field"):
        load_coefficients(coef_file(tmp_path, cpu_expert=value))
