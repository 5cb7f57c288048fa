"""The support matrix's backend cells tell a run from an inference (colibri_plan/cli/model_support.py):
every `tested` cell is backed by the engine test that runs it, and the MLA / DSA cells never run on a GPU
backend read `inferred`."""

from __future__ import annotations

import ast
from pathlib import Path

from colibri_plan.cli.model_support import (
    INFERRED_MARK,
    TESTED,
    TESTED_MARK,
    UNVERIFIED_MARK,
    backend_status,
    support_matrix,
)
from colibri_plan.families import ENGINE_FAMILIES

TESTS = Path(__file__).resolve().parent


def _assigned(path: Path, name: str):
    """The literal value assigned to ``name`` at the top of a test module (read, not imported: the module
    needs torch)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path.name} has no {name}")


def test_every_tested_cell_names_a_test_that_runs_it():
    trunk_families = {family for family, _ in _assigned(TESTS / "test_engine_trunk.py", "VARIANTS").values()}
    mla_types = set(_assigned(TESTS / "_tiny_models.py", "MLA_SEEDS"))
    mla_src = (TESTS / "test_engine_mla.py").read_text(encoding="utf-8")
    assert "parametrize(\"backend\", backend_params())" in (TESTS / "test_engine_trunk.py").read_text()
    for mt, backends in TESTED.items():
        assert mt in ENGINE_FAMILIES
        for b in backends:
            if mt in trunk_families:      # the device-trunk test is parametrized over every backend
                continue
            assert mt in mla_types, f"{mt} on {b}: no engine test runs it"
            if b != "numpy":              # the parity test runs on numpy; other backends are named tests
                assert f'tiny("{mt}")' in mla_src and f'backend_name="{b}"' in mla_src, (mt, b)


def test_cells_carry_one_of_three_markers():
    rows = {r["model_type"]: r["backends"] for r in support_matrix()}
    assert rows["mixtral"]["opencl"] == TESTED_MARK and rows["mixtral"]["cuda"] == TESTED_MARK
    assert rows["deepseek_v3"]["cpu"] == TESTED_MARK and rows["deepseek_v3"]["vulkan"] == INFERRED_MARK
    for mt in ("deepseek_v32", "glm_moe_dsa", "kimi_k2"):   # MLA / DSA never ran on a GPU backend
        assert {rows[mt][b] for b in ("opencl", "vulkan", "cuda")} == {INFERRED_MARK}
    assert {r["metal"] for r in rows.values() if r["metal"]} == {UNVERIFIED_MARK}
    assert backend_status("mixtral", "metal") == UNVERIFIED_MARK
