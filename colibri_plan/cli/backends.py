"""`colibri-plan backends` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("backends", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def backends(args):
    """Not built yet."""
    raise UnsupportedError("'backends' is not built yet")
