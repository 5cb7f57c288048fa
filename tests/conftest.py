"""Fixtures shared by several test modules (module-scoped: each module builds its own copy)."""

from __future__ import annotations

import pytest
from _cli_fixtures import good_plan, tiny_pack_folder, toy_plan
from _require import pytest_sessionstart  # noqa: F401 - the hook: CI fails on a missing required backend


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A folder with a toy profile, model spec and a plan solved from them (and the plan's document)."""
    return good_plan(tmp_path_factory)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A profile, a model spec and a plan solved from them."""
    return toy_plan(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_pack(tmp_path_factory):
    """A tiny expert pack folder."""
    return tiny_pack_folder(tmp_path_factory)
