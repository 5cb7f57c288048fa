"""`colibri-plan export PLAN --to colibri|llama.cpp`: the command to paste, priced as that engine runs it."""

from __future__ import annotations

import click

from colibri_plan.cli.common import emit, json_option, verbose_option


def _priced(plan, paths, engine: str) -> tuple[dict | None, str | None]:
    """The :func:`~colibri_plan.planner.compare.engine_rows` row of ``engine`` from the plan alone, or
    (None, why) when the plan lacks what the prediction needs (an older plan)."""
    from colibri_plan.errors import ColibriError
    from colibri_plan.planner.compare import engine_rows
    from colibri_plan.planner.whatif import setup_from_plan

    try:
        setup, _ = setup_from_plan(plan)
        rows = engine_rows(setup, plan, paths)
    except ColibriError as exc:
        return None, str(exc)
    return next(r for r in rows if r["engine"] == engine), None


def _prediction(row: dict | None, why: str | None) -> str:
    if row is None:
        return f"# no prediction for these arguments: {why}"
    ttft = f", first token {row['ttft_s']:.2f} s" if row.get("ttft_s") is not None else ""
    return f"# predicted {row['tok_s']:.3f} tok/s{ttft} as this engine runs exactly these arguments"


@click.command("export")
@click.argument("plan_path")
@click.option("--to", "target", type=click.Choice(["colibri", "llama.cpp"]), required=True)
@click.option("--out", "out_path", default=None,
              help="colibri: the usage file to write (default: PLAN with .coli_usage); llama.cpp: also "
                   "write the command here (one shell-quoted line).")
@click.option("--gguf", default=None, help="llama.cpp: the model's GGUF file (-m).")
@click.option("--colibri-model", "colibri_model", default=None,
              help="colibri: colibrì's converted model folder (COLI_MODEL).")
@json_option
@verbose_option
def export(plan_path, target, out_path, gguf, colibri_model):
    """Export a plan as the command to paste: colibrì (usage file + environment + ./coli chat) or llama.cpp
    (llama-server -m MODEL.gguf -ngl ... -ot ...), with the predicted tok/s of exactly those arguments."""
    from pathlib import Path

    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.planner.compare import DeployPaths
    from colibri_plan.planner.exports import colibri_command, export_colibri, export_llama_cpp

    if out_path is not None:  # either target; never over the plan itself ("" is refused)
        check_output_path(out_path, (plan_path,))
    plan = load_plan(plan_path)

    def absolute(p):
        return str(Path(p).expanduser().resolve()) if p else None

    if target == "colibri":
        out_path = str(Path(plan_path).with_suffix(".coli_usage")) if out_path is None else out_path
        check_output_path(out_path, (plan_path,))  # the default PLAN.coli_usage too
        data = export_colibri(plan, out_path)
        for k in ("vram_experts", "pinned_experts"):   # the placement itself is the usage file
            data.pop(k)
        paths = DeployPaths(plan=absolute(plan_path), usage=data["usage_file"], written=True,
                            colibri_model=absolute(colibri_model))
        row, why = _priced(plan, paths, "colibri")
        model_dir = paths.colibri_model or f"/path/to/{plan.doc['model'].get('name', 'model')}-colibri"
        data["command"] = colibri_command(data, model_dir)
        notes = ([] if colibri_model else [f"COLI_MODEL: colibrì's converted model folder (replace "
                                           f"{model_dir}, or pass --colibri-model DIR)"]) + data["notes"]
    else:
        data = export_llama_cpp(plan, absolute(gguf))
        if out_path is not None:
            from colibri_plan.fileio import atomic_write_text

            data["command_file"] = str(atomic_write_text(out_path, data["command"] + "\n"))
        usage = absolute(Path(plan_path).with_suffix(".coli_usage"))
        paths = DeployPaths(plan=absolute(plan_path), usage=usage, gguf=absolute(gguf))
        row, why = _priced(plan, paths, "llama.cpp")
        notes = ([] if gguf else [f"-m: the model's GGUF file (replace {data['model_path']}, or pass --gguf "
                                  "FILE)"]) + data["notes"]
        if "command_file" in data:
            notes.append(f"written to {data['command_file']}")
    data["predicted"] = None if row is None else {"tok_s": row["tok_s"], "ttft_s": row["ttft_s"]}
    data["prediction_missing"] = why
    emit(data, lambda: "\n".join([data["command"], _prediction(row, why), *(f"# {n}" for n in notes)]))
