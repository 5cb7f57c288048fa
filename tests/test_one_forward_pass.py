"""The decoder layer is written once (issue 32): one engine module runs attention, norms and the FFN on a
backend's device ops, and no engine module keeps a host copy of the layer's maths. The checker reads the
installed engine's source (AST), so a second implementation — a numpy attention, a host RMSNorm, another
module calling ``d_attention`` — fails this test; a deliberate copy in a temporary tree shows it would."""

from __future__ import annotations

import ast
from pathlib import Path

import colibri_plan.engine

#: what only the decoder layer calls: attention over the cache and the layer's norms
LAYER_OPS = {"d_attention", "d_rmsnorm", "d_rope"}
#: names of host re-implementations of the layer's maths (the host path that was removed)
HOST_COPIES = {"rmsnorm", "attention", "apply_rope", "rope_cos_sin", "swiglu", "silu", "mla_attention",
               "moe_block", "softmax", "gqa_attention"}


def layer_modules(root: Path) -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(module -> the LAYER_OPS it calls, module -> HOST_COPIES it defines) of every .py under root."""
    calls, copies = {}, {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        used = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute) and n.func.attr in LAYER_OPS}
        defined = [n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)
                   and n.name.lower().lstrip("_") in HOST_COPIES]
        if used:
            calls[path.stem] = used
        if defined:
            copies[path.stem] = defined
    return calls, copies


def test_the_engine_has_exactly_one_decoder_layer():
    calls, copies = layer_modules(Path(colibri_plan.engine.__file__).parent)
    assert [m for m, ops in calls.items() if "d_attention" in ops] == ["trunk"]
    assert set(calls) == {"trunk"}, calls  # norms and RoPE too: nowhere else in the engine
    assert calls["trunk"] == LAYER_OPS
    others = {m: names for m, names in copies.items() if m != "trunk"}  # the layer's own methods aside
    assert others == {}, f"host copies of the layer's maths in the engine: {others}"


def test_a_second_layer_would_be_found(tmp_path):
    (tmp_path / "trunk.py").write_text(
        "def run(be, q, k, v, x, w):\n"
        "    y = be.d_attention(q, k, v, 1, 0, 1.0)\n"
        "    return y, be.d_rmsnorm(x, w, 1e-6), be.d_rope(q, w, 0, 2, False)\n")
    (tmp_path / "host_path.py").write_text(
        "import numpy as np\n\ndef rmsnorm(x, w, eps):\n"
        "    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w\n\n"
        "def layer(be, x, w):\n    return be.d_rmsnorm(x, w, 1e-6)\n")
    calls, copies = layer_modules(tmp_path)
    assert set(calls) == {"trunk", "host_path"} and copies == {"host_path": ["rmsnorm"]}
