"""`colibri-plan heat` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("heat", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def heat(args):
    """Not built yet."""
    raise UnsupportedError("'heat' is not built yet")
