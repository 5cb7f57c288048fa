"""The import graph of the installed package, read from source (imports inside functions included).

Used by ``test_architecture.py``: every module of ``colibri_plan`` (``engine/`` and ``backends/`` are
installed as ``colibri_plan.engine`` and ``colibri_plan.backends``) is parsed with :mod:`ast`, each
``import``/``from ... import`` anywhere in it becomes an edge to the project module it names, and the
graph is checked for cycles and for imports against the layer table (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

#: layer of a module: the first rule whose prefix matches its dotted name (without "colibri_plan.")
LAYER_RULES = (
    ("errors", "leaf"), ("fileio", "leaf"), ("quant", "leaf"), ("directio", "leaf"), ("meminfo", "leaf"),
    ("", "leaf"),
    ("formats", "formats"), ("backends", "backends"), ("families", "families"), ("model", "model"),
    ("heatsynth", "heatsynth"), ("profiler", "profiler"), ("planner", "planner"), ("engine", "engine"),
    ("verify", "verify"), ("report_page", "report"), ("report_plots", "report"), ("text", "text"),
    ("serve", "serve"), ("cli", "cli"),
    ("__main__", "cli"),
)

#: which layers a layer may import (its own included); "cli" may import anything
ALLOWED = {
    "leaf": {"leaf"},
    "formats": {"leaf", "formats"},
    "backends": {"leaf", "backends"},
    "families": {"leaf", "formats", "families"},
    "model": {"leaf", "formats", "families", "model"},
    "heatsynth": {"leaf", "formats"},
    "profiler": {"leaf", "formats", "backends", "model", "profiler"},
    "planner": {"leaf", "formats", "heatsynth", "planner"},
    "text": {"leaf", "formats", "text"},
    "engine": {"leaf", "formats", "families", "backends", "heatsynth", "text", "engine"},
    "verify": {"leaf", "formats", "engine", "profiler", "verify"},
    "report": {"leaf", "formats", "planner", "report"},
    "serve": {"leaf", "formats", "engine", "text", "serve"},
    "cli": None,
}

#: compute backends behind the contract, one folder each (numpy: one module): a backend imports the shared
#: parts (the other modules of backends/), never another backend (the cpu backend's numpy fallback aside);
#: a shared part imports no backend
BACKEND_RUNTIMES = ("backends.cpu", "backends.cuda", "backends.metal", "backends.opencl", "backends.vulkan",
                    "backends.numpy_ref")
BACKEND_EXCEPTIONS = {("backends.cpu", "backends.numpy_ref")}
#: CLI command modules import only the CLI's shared helpers (a command split over two files aside)
CLI_EXCEPTIONS = {("cli.model", "cli.model_pack"), ("cli.model", "cli.model_support"),
                  ("cli.profile", "cli.profiles"), ("cli.solve", "cli.solve_text")}


def backend_of(module: str) -> str | None:
    """The backend (a :data:`BACKEND_RUNTIMES` entry) whose folder or module holds ``module``, or None."""
    return next((b for b in BACKEND_RUNTIMES if module == b or module.startswith(b + ".")), None)


def _short(name: str) -> str:
    return name[len("colibri_plan."):] if name.startswith("colibri_plan.") else ""


def layer_of(module: str) -> str:
    """The layer (a key of :data:`ALLOWED`) of a module named without the ``colibri_plan.`` prefix."""
    for prefix, layer in LAYER_RULES:
        if module == prefix or (prefix and module.startswith(prefix + ".")):
            return layer
    return "leaf" if "." not in module else layer_of(module.split(".")[0])


def module_files(roots: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> source file, for package roots ``{"colibri_plan": Path, ...}``."""
    out = {}
    for pkg, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            parts = [pkg, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _target(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """Edges module -> project modules it imports anywhere in its source (short names, no prefix).

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``.
    """
    files = module_files(roots)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                tgt = _target(module, path, node)
                for alias in node.names:
                    out.add(f"{tgt}.{alias.name}" if f"{tgt}.{alias.name}" in files else tgt)
            elif isinstance(node, ast.Import):
                out.update(alias.name for alias in node.names)
        # the package itself is "" (its layer is leaf: it holds only the version)
        graph[_short(module)] = {_short(t) for t in out if t in files and t != module}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def direction_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports against the layer table, as "a -> b (layer x may not import layer y)" lines."""
    bad = []
    for src, targets in sorted(graph.items()):
        src_layer = layer_of(src)
        for tgt in sorted(targets):
            tgt_layer = layer_of(tgt)
            allowed = ALLOWED[src_layer]
            if allowed is not None and tgt_layer not in allowed:
                bad.append(f"{src} -> {tgt} (layer {src_layer} may not import layer {tgt_layer})")
            elif src_layer == tgt_layer == "backends" and _backend_breach(src, tgt):
                bad.append(f"{src} -> {tgt} ({_backend_breach(src, tgt)})")
            elif (src_layer == "cli" and tgt_layer == "cli" and src not in ("cli", "__main__")
                  and tgt not in ("cli", "cli.common") and (src, tgt) not in CLI_EXCEPTIONS):
                bad.append(f"{src} -> {tgt} (a command imports cli.common, not another command)")
    return bad


def _backend_breach(src: str, tgt: str) -> str | None:
    """Why ``src`` may not import ``tgt`` (both under backends/), or None."""
    sb, tb = backend_of(src), backend_of(tgt)
    if tb is None or sb == tb:
        return None
    if sb is None:
        return None if src == "backends" else "a shared part imports no backend"
    if (sb, tb) in BACKEND_EXCEPTIONS:
        return None
    return "a backend imports the shared parts, never another backend"
