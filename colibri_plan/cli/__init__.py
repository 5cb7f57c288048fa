"""The ``colibri-plan`` command line (click).

Each command lives in its own module under ``colibri_plan.cli`` and is imported only when invoked, so
``--help`` stays fast and a missing GPU stack never breaks unrelated commands. Library errors
(:class:`~colibri_plan.errors.ColibriError`) become one line on stderr, ``Error: <message>`` (the
message says what was wrong and what to do; the class name is for ``--debug``, which shows the full
traceback instead), and exit 1; usage errors exit 2.
"""

from __future__ import annotations

import importlib
import sys

import click

from colibri_plan import __version__
from colibri_plan.cli.common import Ctx
from colibri_plan.errors import ColibriError

#: command name -> (module under colibri_plan.cli, attribute, one-line help)
COMMANDS = {
    "profile": ("profile", "profile", "Measure this machine: NVMe, RAM, host<->GPU links, matmul."),
    "solve": ("solve", "solve", "Solve where every expert lives; write a plan file."),
    "run": ("run", "run", "Run a model (optionally with a plan) on the streaming engine."),
    "verify": ("verify", "verify", "Run a plan and compare measured with predicted."),
    "serve": ("serve", "serve", "Serve a model (optionally with a plan) over the OpenAI API."),
    "calibrate": ("verify", "calibrate", "Refit cost-model coefficients from verify reports."),
    "model": ("model", "model", "Model specs, packs and fixtures."),
    "heat": ("heat", "heat", "Routing statistics (expert heat)."),
    "plan": ("plan", "plan", "Inspect plan files."),
    "export": ("export", "export", "Export a plan for colibri or llama.cpp."),
    "ep": ("ep", "ep", "Expert placement over GPUs and nodes for SGLang / vLLM expert parallelism."),
    "report": ("report", "report", "Write a self-contained HTML page about a plan and its verify reports."),
    "backends": ("backends", "backends", "List compute backends and their devices."),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use, and which turns library errors into
    clean CLI errors."""

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(f"colibri_plan.cli.{module}"), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, help_) for name, (_, _, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ColibriError as exc:
            obj = ctx.obj if isinstance(ctx.obj, Ctx) else None
            if obj is not None and obj.debug:
                raise
            raise click.ClickException(str(exc)) from None   # the message says what and what to do


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--json", "json_out", is_flag=True, help="Print one JSON document on stdout.")
@click.option("--verbose", "-v", is_flag=True, help="More progress detail on stderr.")
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.version_option(__version__, prog_name="colibri-plan")
@click.pass_context
def cli(ctx, json_out, verbose, debug):
    """colibri-plan: decide where every expert of a Mixture-of-Experts model lives (VRAM, pinned RAM,
    RAM cache, NVMe), then run the plan and verify it.

    Pipeline: profile -> solve -> run -> verify.
    """
    ctx.obj = Ctx(json=json_out, verbose=verbose, debug=debug)


def main(argv=None):
    """Console entry point."""
    cli.main(args=argv, prog_name="colibri-plan", standalone_mode=True)


if __name__ == "__main__":
    main(sys.argv[1:])
