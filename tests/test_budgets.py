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
    assert got == {"cuda:0": 30 * 10**9}
