"""`colibri-plan profile` (placeholder until its issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("profile", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def profile(args):
    """Not built yet."""
    raise UnsupportedError("'profile' is not built yet")
