"""Typed errors of colibri-plan.

Library code raises these; only the CLI turns them into one-line messages (exit 1). Each message says
what was wrong and what to do about it.
"""

from __future__ import annotations


class ColibriError(Exception):
    """Base class of every error colibri-plan raises on purpose."""


class InputError(ColibriError):
    """A file, folder or argument given by the user is missing, malformed or inconsistent."""


class FormatError(InputError):
    """A plan, profile, heat, pack or model file is corrupt, truncated or of an unknown schema version."""


class MismatchError(InputError):
    """Two files do not belong together (fingerprint of model, heat or profile differs)."""


class UnsupportedError(ColibriError):
    """A model family, attention type, quant format or operation is not supported (yet)."""


class BackendUnavailableError(ColibriError):
    """A compute backend cannot be used on this machine; the message says why."""


class DeviceOutOfMemoryError(ColibriError):
    """An upload would exceed a device's memory.

    Attributes:
        requested_bytes: bytes the failed upload asked for.
        held_bytes: bytes this backend instance already held when it failed.
        capacity_bytes: the device's usable memory, when known (else None).
    """

    def __init__(self, message: str, requested_bytes: int, held_bytes: int,
                 capacity_bytes: int | None = None):
        super().__init__(message)
        self.requested_bytes = int(requested_bytes)
        self.held_bytes = int(held_bytes)
        self.capacity_bytes = capacity_bytes


class BudgetError(ColibriError):
    """A memory budget is negative, too small for the dense trunk, or exceeded by a placement."""


class SolverError(ColibriError):
    """The placement solver failed or returned a placement that breaks a constraint."""


class IntegrityError(ColibriError):
    """Data read at run time does not match its checksum or the file changed under us."""
