"""The support matrix's backend cells tell a run from an inference (colibri_plan/cli/model_support.py):
every `tested` cell is backed by the engine test that runs it, and the MLA / DSA types never run on a GPU
backend themselves read `inferred`."""

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


def _device_trunk_names(src: str) -> list[str]:
    """The tiny-model names the MLA device-trunk test is parametrized over (its ``name`` list)."""
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_mla_on_a_device_trunk"):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and ast.literal_eval(d.args[0]) == "name":
                    return ast.literal_eval(d.args[1])
    return []


def _tiny_type(name: str) -> str:
    """A tiny model's model_type (tests/_tiny_models.py: "deepseek_v2_lite" is a deepseek_v2)."""
    return "deepseek_v2" if name == "deepseek_v2_lite" else name


def test_every_tested_cell_names_a_test_that_runs_it():
    trunk_families = {family for family, _ in _assigned(TESTS / "test_engine_trunk.py", "VARIANTS").values()}
    mla_types = set(_assigned(TESTS / "_tiny_models.py", "MLA_SEEDS"))
    mla_src = (TESTS / "test_engine_mla.py").read_text(encoding="utf-8")
    # the device-trunk test: parametrized over every backend and these tiny models (name -> model_type)
    device = _device_trunk_names(mla_src)
    assert device and "backend_params())" in mla_src.split("def test_mla_on_a_device_trunk")[0][-400:]
    device_types = {_tiny_type(n) for n in device}
    assert "parametrize(\"backend\", backend_params())" in (TESTS / "test_engine_trunk.py").read_text()
    for mt, backends in TESTED.items():
        assert mt in ENGINE_FAMILIES
        for b in backends:
            if mt in trunk_families:      # the device-trunk test is parametrized over every backend
                continue
            assert mt in mla_types, f"{mt} on {b}: no engine test runs it"
            if mt in device_types:
                continue
            if b != "numpy":              # the parity test runs on numpy; other backends are named tests
                assert f'tiny("{mt}")' in mla_src and f'backend_name="{b}"' in mla_src, (mt, b)


def test_cells_carry_one_of_three_markers():
    rows = {r["model_type"]: r["backends"] for r in support_matrix()}
    assert rows["mixtral"]["opencl"] == TESTED_MARK and rows["mixtral"]["cuda"] == TESTED_MARK
    assert rows["deepseek_v3"]["cuda"] == TESTED_MARK and rows["glm_moe_dsa"]["vulkan"] == TESTED_MARK
    for mt in ("deepseek_v32", "kimi_k2", "glm4_moe_lite"):   # never ran on a GPU backend themselves
        assert {rows[mt][b] for b in ("opencl", "vulkan", "cuda")} == {INFERRED_MARK}
    assert {r["metal"] for r in rows.values() if r["metal"]} == {UNVERIFIED_MARK}
    assert backend_status("mixtral", "metal") == UNVERIFIED_MARK
