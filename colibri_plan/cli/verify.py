"""`colibri-plan verify` and `calibrate` (placeholders until their issue lands)."""

import click

from colibri_plan.errors import UnsupportedError


@click.command("verify", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def verify(args):
    """Not built yet."""
    raise UnsupportedError("'verify' is not built yet")


@click.command("calibrate", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
def calibrate(args):
    """Not built yet."""
    raise UnsupportedError("'calibrate' is not built yet")
