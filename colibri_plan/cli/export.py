"""`colibri-plan export PLAN --to colibri|llama.cpp`."""

from __future__ import annotations

import click

from colibri_plan.cli.common import emit, json_option


@click.command("export")
@click.argument("plan_path")
@click.option("--to", "target", type=click.Choice(["colibri", "llama.cpp"]), required=True)
@click.option("--out", "out_path", default=None,
              help="colibri: the usage file to write (default: PLAN with .coli_usage); llama.cpp: also "
                   "write the -ot arguments here (one shell-quoted line).")
@json_option
def export(plan_path, target, out_path):
    """Export a plan: colibrì usage file + environment line, or llama.cpp -ot override patterns."""
    from pathlib import Path

    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.plan import load_plan
    from colibri_plan.planner.exports import export_colibri, export_llama_cpp

    if out_path is not None:  # either target; never over the plan itself ("" is refused)
        check_output_path(out_path, (plan_path,))
    plan = load_plan(plan_path)
    if target == "colibri":
        out_path = str(Path(plan_path).with_suffix(".coli_usage")) if out_path is None else out_path
        check_output_path(out_path, (plan_path,))  # the default PLAN.coli_usage too
        data = export_colibri(plan, out_path)
        emit(data, lambda: "\n".join([data["env"], *(f"# {n}" for n in data["notes"])]))
    else:
        data = export_llama_cpp(plan)
        if out_path is not None:
            from colibri_plan.fileio import atomic_write_text

            data["args_file"] = str(atomic_write_text(out_path, data["args"] + "\n"))
        tail = [f"# written to {data['args_file']}"] if "args_file" in data else []
        emit(data, lambda: "\n".join([data["args"], *(f"# {n}" for n in data["notes"]), *tail]))
