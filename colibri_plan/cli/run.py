"""`colibri-plan run` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def run(args):
    """Not built yet."""
    raise UnsupportedError("'run' is not built yet")
