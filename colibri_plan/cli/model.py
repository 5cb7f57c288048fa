"""`colibri-plan model` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("model", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def model(args):
    """Not built yet."""
    raise UnsupportedError("'model' is not built yet")
