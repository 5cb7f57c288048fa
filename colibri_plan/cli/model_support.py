"""`colibri-plan model support`: which model families the engine runs and which it can only plan for.

The matrix is read from the family registry (:data:`colibri_plan.families.FAMILIES`, a family runs when
it is in ``ENGINE_FAMILIES``) and the backend names, never written by hand: the README's copy between the
``support-matrix`` markers is ``colibri-plan model support --markdown``, and a test checks they agree.
"""

from __future__ import annotations

import click

from colibri_plan.cli.common import emit, json_option, table

#: (model type -> backends) an engine test has run: every GQA family's device trunk on every backend
#: (tests/test_engine_trunk.py; cuda on an H200 host, bench/results/h200-trunk/gpu-tests.txt), each
#: MLA/DSA type against transformers on numpy (tests/test_engine_mla.py), deepseek_v3 decode on cpu
_GQA_TESTED = ("numpy", "cpu", "opencl", "vulkan", "cuda")
TESTED = {**{mt: _GQA_TESTED for mt in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe")},
          **{mt: ("numpy",) for mt in ("deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa",
                                       "glm4_moe_lite")},
          # tests/test_engine_mla.py's device-trunk test, every backend (CUDA on an H200 host:
          # bench/results/h200-onepass/h200-gpu-tests.txt)
          **{mt: _GQA_TESTED for mt in ("deepseek_v2", "deepseek_v3", "glm_moe_dsa")}}
#: cell markers: run per backend, inferred (the backend's kernel oracle passes and the type runs on
#: another backend, but this pair never ran), never run at all (Metal: no macOS machine)
TESTED_MARK, INFERRED_MARK, UNVERIFIED_MARK = "tested", "inferred", "unverified"


def backend_status(model_type: str, backend: str) -> str:
    """The support-matrix cell of an engine model type on a backend: :data:`TESTED_MARK`,
    :data:`INFERRED_MARK`, or :data:`UNVERIFIED_MARK` for Metal."""
    if backend == "metal":
        return UNVERIFIED_MARK
    return TESTED_MARK if backend in TESTED.get(model_type, ()) else INFERRED_MARK


#: README markers around the generated matrix
BEGIN, END = "<!-- support-matrix:begin (colibri-plan model support --markdown) -->", \
    "<!-- support-matrix:end -->"


def support_matrix() -> list[dict]:
    """One row per ``model_type`` of the registry: family module, plan/pack/run/verify, the backends an
    engine family runs on (None for a plan-only one) and why a plan-only family cannot run."""
    from colibri_plan.backends import BACKEND_NAMES
    from colibri_plan.families import ENGINE_FAMILIES, FAMILIES

    rows = []
    for mt, module in FAMILIES.items():
        runs = mt in ENGINE_FAMILIES
        why = module.REFUSE.get(mt) if isinstance(module.REFUSE, dict) else module.REFUSE  # per type or all
        rows.append({"model_type": mt, "family": module.__name__.rsplit(".", 1)[-1], "plan": True,
                     "pack": runs, "run": runs, "verify": runs, "text": runs,   # text: colibri_plan/text
                     "backends": {b: backend_status(mt, b) if runs else None for b in BACKEND_NAMES},
                     "plan_only_reason": None if runs else str(why)})
    return rows


def _cells(r: dict) -> list[str]:
    yes = {True: "yes", False: "-"}
    return [r["model_type"], r["family"], *(yes[r[k]] for k in ("plan", "pack", "run", "verify", "text")),
            *(v or "-" for v in r["backends"].values())]


def _header(rows: list[dict]) -> list[str]:
    return ["model_type", "family", "plan", "pack", "run", "verify", "text", *rows[0]["backends"]]


def support_markdown(rows: list[dict] | None = None) -> str:
    """The matrix as a Markdown table (the README's copy; the reasons stay out of it, in the registry)."""
    rows = support_matrix() if rows is None else rows
    head = _header(rows)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(f"`{c}`" if i < 2 else c for i, c in enumerate(_cells(r))) + " |"
              for r in rows]
    return "\n".join(lines)


def _reasons(rows: list[dict]) -> list[str]:
    """Why each plan-only model type cannot run, one line per reason."""
    why: dict[str, list[str]] = {}  # reason -> the model types it holds back
    for r in rows:
        if r["plan_only_reason"]:
            why.setdefault(r["plan_only_reason"], []).append(r["model_type"])
    return [f"  {', '.join(mts)}: {reason}" for reason, mts in why.items()]


@click.command("support")
@click.option("--markdown", is_flag=True, help="Print the Markdown table (the README's copy).")
@json_option
def support(markdown):
    """Which model families (config.json model_type) colibri-plan can plan for, and which the bundled
    engine can also pack, run and verify, on which backends."""
    rows = support_matrix()
    if markdown:
        emit({"models": rows}, support_markdown(rows))
        return
    emit({"models": rows}, lambda: "\n".join([
        table([_cells(r) for r in rows], _header(rows)), "",
        "plan: `solve` from config.json, safetensors headers or GGUF; pack/run/verify: the bundled engine; "
        "backends: where `run`/`verify` compute the experts (the dense trunk, attention and KV cache "
        "where the plan's trunk puts them, or `run --trunk cpu|device`: the CPU or that backend's device); "
        "tested: an engine test ran this model type there; inferred: never run there (the backend's kernels "
        "pass their oracle and the type runs elsewhere); unverified: the backend never ran",
        *(["", "plan only, because:", *_reasons(rows)] if any(r["plan_only_reason"] for r in rows) else [])]))
