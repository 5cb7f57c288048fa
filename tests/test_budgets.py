"""planner/budgets: budget figures from the command line: non-finite values and VRAM beyond a card are
refused."""

from __future__ import annotations

import pytest

from colibri_plan.errors import BudgetError, InputError
from colibri_plan.planner.budgets import parse_gb, vram_budgets

GPU = {"backend": "cuda", "index": 0, "name": "RTX 5090", "total_memory_bytes": 32 * 10**9,
       "free_memory_bytes": 31 * 10**9, "unified_memory": False}


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_budgets_are_refused(value):
    with pytest.raises(InputError, match="finite"):
        parse_gb(value, "--ram")


def test_negative_budget_is_a_budget_error():
    with pytest.raises(BudgetError, match="negative"):
        parse_gb("-3", "--ram")


def test_vram_beyond_the_card_is_refused():
    with pytest.raises(BudgetError, match="more than its 32.00 GB"):
        vram_budgets([GPU], "40")
    got, _ = vram_budgets([GPU], "30")
    assert got == {"cuda:0": 28 * 10**9}   # the card's 30 GB less the default 2 GB reserve


def test_vram_is_the_card_size_and_the_reserve_is_taken_off_and_shown():
    """Issue 29: --vram 24 on a 24 GB card budgeted all 24 GB for experts, nothing for the runtime."""
    got, explain = vram_budgets([GPU], "24", reserve_bytes=int(1.5e9))
    assert got == {"cuda:0": int(22.5e9)}
    assert explain[0]["what"] == "cuda:0: --vram 24.00 GB - reserve 1.50 GB (--vram-reserve)"
    assert vram_budgets([GPU], "1", reserve_bytes=int(2e9))[0] == {"cuda:0": 0}   # never negative
    got, explain = vram_budgets([GPU], "0")
    assert got == {"cuda:0": 0} and "no VRAM tier" in explain[0]["what"]


def test_a_matmul_row_of_unknown_device_kind_is_never_the_cpu_figure():
    """Issue 17: a profile whose CPU matmul row was missing used a GPU row without device_kind (the
    default was "cpu"), so the CPU path looked as fast as the GPU; now it is refused, naming the row."""
    from _solver_fixtures import toy_profile, toy_spec

    from colibri_plan.formats.profile import MachineProfile
    from colibri_plan.planner.budgets import resources_from_profile

    doc = toy_profile(gpus=[{"gbps": 900.0, "free_bytes": 2 * 10**9}]).doc
    doc["matmul"] = [r for r in doc["matmul"] if r["backend"] != "numpy"]  # no CPU figure
    doc["matmul"][0].pop("device_kind")
    doc["devices"] = [d for d in doc["devices"] if d["backend"] != "cuda"]  # nor a device listing it
    with pytest.raises(InputError, match=r"no CPU matmul figure at int4 \(rows of cuda:0 do not say"):
        resources_from_profile(MachineProfile(doc), toy_spec(), {})
    doc = toy_profile(gpus=[{"gbps": 900.0, "free_bytes": 2 * 10**9}]).doc
    doc["matmul"] = [r for r in doc["matmul"] if r["backend"] != "numpy"]
    doc["matmul"][0].pop("device_kind")  # the devices section says cuda:0 is a GPU
    with pytest.raises(InputError, match="no CPU matmul figure at int4"):
        resources_from_profile(MachineProfile(doc), toy_spec(), {})
    good = toy_profile(gpus=[{"gbps": 900.0, "free_bytes": 2 * 10**9}])
    assert resources_from_profile(good, toy_spec(), {}).cpu_matmul_gbps == 20.0


def test_profile_matmul_rows_are_typed():
    from _solver_fixtures import toy_profile

    from colibri_plan.errors import FormatError
    from colibri_plan.formats.profile_check import validate_profile

    for key, value in (("device_kind", "tpu"), ("backend", 3), ("device_index", "0")):
        doc = toy_profile().doc
        doc["matmul"][0][key] = value
        with pytest.raises(FormatError, match=key):
            validate_profile(doc)
