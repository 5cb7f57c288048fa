"""`colibri-plan solve` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("solve", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def solve(args):
    """Not built yet."""
    raise UnsupportedError("'solve' is not built yet")
