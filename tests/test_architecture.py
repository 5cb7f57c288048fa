"""The documented import direction (docs/architecture.md) holds, and the checker would catch a breach."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _imports import direction_violations, find_cycles, import_graph, layer_of

import colibri_plan
import colibri_plan.backends
import colibri_plan.engine


def _roots() -> dict[str, Path]:
    # installed names: engine/ and backends/ are mapped under colibri_plan by pyproject's package-dir
    return {"colibri_plan": Path(colibri_plan.__file__).parent,
            "colibri_plan.engine": Path(colibri_plan.engine.__file__).parent,
            "colibri_plan.backends": Path(colibri_plan.backends.__file__).parent}


@pytest.fixture(scope="module")
def graph():
    return import_graph(_roots())


def test_graph_sees_function_level_imports(graph):
    # colibri_plan.cli imports each command inside a function; the engine is imported lazily by `run`
    assert len(graph) > 60
    assert any(t.startswith("engine.") for t in graph["cli.run"])


def test_no_import_cycle(graph):
    assert find_cycles(graph) == []


def test_imports_follow_the_documented_direction(graph):
    assert direction_violations(graph) == []


def test_layers_of_the_pipeline_modules():
    assert layer_of("formats.plan") == "formats"
    assert layer_of("planner.costmodel") == "planner"
    assert layer_of("engine.session") == "engine"
    assert layer_of("errors") == layer_of("quant") == "leaf"


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / "colibri_plan"
    for name, text in {"__init__.py": "", **files}.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return {"colibri_plan": root}


def test_a_deliberate_cycle_is_found_even_inside_functions(tmp_path):
    roots = _tree(tmp_path, {
        "formats/__init__.py": "",
        "formats/a.py": "from colibri_plan.formats import b\n",
        "formats/b.py": "def f():\n    from colibri_plan.formats.a import X\n    return X\n",
    })
    assert find_cycles(import_graph(roots)) == [["formats.a", "formats.b"]]


def test_a_relative_import_cycle_is_found(tmp_path):
    roots = _tree(tmp_path, {
        "planner/__init__.py": "",
        "planner/x.py": "from .y import f\n",
        "planner/y.py": "from . import x\n",
    })
    assert find_cycles(import_graph(roots)) == [["planner.x", "planner.y"]]


def test_an_import_against_the_direction_is_reported(tmp_path):
    roots = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/run.py": "def go():\n    from colibri_plan.planner.solve import solve\n",
        "planner/__init__.py": "",
        "planner/solve.py": "import colibri_plan.backends.cuda\n",
        "backends/__init__.py": "",
        "backends/cuda/__init__.py": "",
        "backends/cuda/device.py": "from colibri_plan.backends.opencl import device\n"
                                   "from colibri_plan.backends import staging\n",
        "backends/opencl/__init__.py": "",
        "backends/opencl/device.py": "from colibri_plan.backends.opencl import backend\n",
        "backends/opencl/backend.py": "",
        "backends/staging.py": "from colibri_plan.backends.cuda import device\n",
        "formats/__init__.py": "",
        "formats/plan.py": "from colibri_plan.engine import run\n",
        "cli/__init__.py": "",
        "cli/verify.py": "from colibri_plan.cli.run import x\n",
        "cli/run.py": "",
    })
    bad = direction_violations(import_graph(roots))
    assert bad == [
        "backends.cuda.device -> backends.opencl.device (a backend imports the shared parts, never another "
        "backend)",
        "backends.staging -> backends.cuda.device (a shared part imports no backend)",
        "cli.verify -> cli.run (a command imports cli.common, not another command)",
        "engine.run -> planner.solve (layer engine may not import layer planner)",
        "formats.plan -> engine.run (layer formats may not import layer engine)",
        "planner.solve -> backends.cuda (layer planner may not import layer backends)",
    ]



def _probed_names() -> set[str]:
    """Module names transformers looks for as optional packages (its import_utils' availability checks)."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("transformers.utils.import_utils")
    except ImportError:
        return set()
    if spec is None or not spec.origin:
        return set()
    text = Path(spec.origin).read_text()
    return set(re.findall(r'_is_package_available\(\s*"([A-Za-z0-9_]+)"', text))


def test_bench_and_test_modules_shadow_no_installed_or_probed_module():
    # tests put bench/ and tests/ on sys.path; a script named like a package transformers probes for
    # (bench/kernels.py against the `kernels` package) broke every later transformers import in CI
    import importlib.util
    import sys

    repo = Path(__file__).resolve().parents[1]
    ours = {str(repo / "bench"), str(repo / "tests"), str(repo)}
    probed = _probed_names()
    saved = sys.path[:]
    clashes = []
    try:
        sys.path[:] = [p for p in sys.path if p and str(Path(p).resolve()) not in ours]
        for folder in ("bench", "tests"):
            for f in sorted((repo / folder).glob("*.py")):
                if f.stem in probed:
                    clashes.append(f"{folder}/{f.name} (transformers probes for a package {f.stem!r})")
                    continue
                mod = sys.modules.get(f.stem)
                origin = getattr(mod, "__file__", None) if mod is not None else None
                if mod is None:
                    spec = importlib.util.find_spec(f.stem)
                    origin = spec.origin if spec is not None else None
                if origin and not str(origin).startswith(str(repo)):
                    clashes.append(f"{folder}/{f.name} (shadows {origin})")
    finally:
        sys.path[:] = saved
    assert clashes == [], f"rename these: {clashes}"
