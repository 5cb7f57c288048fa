"""`colibri-plan report PLAN [VERIFY...] --out report.html`: the plan report page."""

from __future__ import annotations

import click

from colibri_plan.cli.common import Steps, emit, json_option


@click.command("report")
@click.argument("plan_path", metavar="PLAN", type=click.Path())
@click.argument("verify_paths", metavar="[VERIFY]...", nargs=-1, type=click.Path())
@click.option("--out", "out_path", required=True, type=click.Path(), help="The HTML page to write.")
@click.option("--what-if/--no-what-if", "what_if", default=True, show_default=True,
              help="Re-solve the plan at 7 values of RAM (and VRAM, NVMe) for the what-if curves.")
@click.option("--time-limit", default=10.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Solver seconds per what-if point.")
@json_option
def report(plan_path, verify_paths, out_path, what_if, time_limit):
    """Write one self-contained HTML page about PLAN and its VERIFY reports: the machine, the budgets, a
    layer x expert placement heatmap, predicted beside measured for each verify report, the what-if
    curves and the exports. It needs no network to view (inline CSS, embedded PNG pictures)."""
    import math

    from colibri_plan.errors import InputError
    from colibri_plan.fileio import check_output_path
    from colibri_plan.report_page import write_page

    if not math.isfinite(time_limit):
        raise InputError(f"--time-limit must be a finite number, got {time_limit}")
    check_output_path(out_path, (plan_path, *verify_paths))  # before minutes of what-if solves
    with Steps("report") as bar:
        path = write_page(plan_path, verify_paths, out_path, what_if=what_if, time_limit_s=time_limit,
                          progress=bar.count)
    doc = {"out": str(path), "plan": str(plan_path), "verify_reports": [str(p) for p in verify_paths],
           "bytes": path.stat().st_size, "what_if": what_if}
    emit(doc, lambda: f"wrote {path} ({doc['bytes'] / 1e3:.0f} kB): open it in a browser; it needs no "
                      "network")
