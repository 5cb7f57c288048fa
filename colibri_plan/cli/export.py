"""`colibri-plan export` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("export", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def export(args):
    """Not built yet."""
    raise UnsupportedError("'export' is not built yet")
