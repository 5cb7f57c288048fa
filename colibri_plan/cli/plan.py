"""`colibri-plan plan` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("plan", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def plan(args):
    """Not built yet."""
    raise UnsupportedError("'plan' is not built yet")
