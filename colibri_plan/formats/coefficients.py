"""Cost-model coefficients: per-term multipliers of the cost model and the document ``calibrate`` writes.

A coefficients file (kind ``coefficients``, schema_version 1) holds the fitted multipliers, how they were
fitted and the fingerprints of the machines whose verify reports they came from (see
``docs/calibration.md``). The plan file embeds the coefficients it was predicted with.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import read_document, write_document
from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

KIND = "coefficients"
SCHEMA_VERSION = 1
#: what a refusal of a coefficients file advises
_REDO = "re-create the coefficients with `colibri-plan calibrate`"


@dataclass(frozen=True)
class Coefficients:
    """Per-term multipliers of the cost model (1.0 = the raw roofline); refitted by ``calibrate``."""

    dense: float = 1.0
    attention: float = 1.0
    cpu_expert: float = 1.0
    gpu_expert: float = 1.0
    disk: float = 1.0
    transfer: float = 1.0
    layer_overhead_s: float = 0.0   # fixed seconds per MoE layer per token (router, dispatch)
    # fixed seconds per MoE layer per token for each GPU holding experts of the layer: the host's call
    # (hand-off to the device thread, launch, synchronisation), paid however few experts it computes
    gpu_call_s: float = 0.0
    # the share of the shorter of (resident compute + checks, disk reads) that hides behind the longer
    # one in a layer's CPU path: 1 = full overlap (max), 0 = one after the other (sum)
    overlap: float = 1.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    #: largest accepted multiplier (a fit or a hand edit beyond it is a broken file, not a slow machine)
    MAX_MULTIPLIER = 1e3
    #: seconds-valued fields (per MoE layer per token) and their largest accepted value
    SECONDS = {"layer_overhead_s": 1.0, "gpu_call_s": 1.0}
    #: fractions (0..1)
    FRACTIONS = ("overlap",)

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "cost coefficients") -> Coefficients:
        """Build from a dict (``where`` names its source in messages, e.g. "FILE: coefficients").

        Each value must be a JSON number (not a bool), finite, >= 0, at most :attr:`MAX_MULTIPLIER` for a
        multiplier and at most 1 s for the seconds fields; not all may be zero (that predicts 0 s/token).

        Raises:
            InputError: an unknown key. FormatError (an InputError): not an object, or a bad value (the
                message names the key).
        """
        at = At(where, _REDO, repr_values=True)
        if d is None:
            d = {}
        if not isinstance(d, dict):
            at.bad("an object of coefficient: number", d)
        names = [fl.name for fl in dataclasses.fields(cls)]
        unknown = set(d) - set(names)
        if unknown:
            raise InputError(f"{where}: unknown cost coefficient(s) {sorted(unknown)} (known: {names})")
        for k in d:
            hi = 1.0 if k in cls.FRACTIONS else cls.SECONDS.get(k, cls.MAX_MULTIPLIER)
            f.number(d, k, at, lo=0, hi=hi, unit=" s" if k in cls.SECONDS else "")
        out = cls(**{k: float(v) for k, v in d.items()})
        if not any(dataclasses.asdict(out).values()):
            at.fail("every coefficient is 0 (that predicts 0 s per token)")
        return out


def save_coefficients(coef, path: str | os.PathLike, detail: dict | None = None,
                      sources: list[str] | None = None) -> Path:
    """Write a coefficients document atomically."""
    detail = detail or {}
    body = {"created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "method": "least squares on the CPU path (compute, crc32 checks, reads and their overlap), ratio "
                      "of sums for dense and GPU terms, GPU time beyond the kernel rate as per-call overhead "
                      "(docs/calibration.md)",
            "coefficients": coef.to_dict(), "detail": detail, "fitted_from": list(sources or []),
            # the machines the reports were measured on: solve warns when its profile is of another one
            "machine_fingerprints": list(detail.get("machine_fingerprints", []))}
    return write_document(path, KIND, SCHEMA_VERSION, body)


def read_coefficients(path: str | os.PathLike, missing: list | None = None) -> tuple:
    """Read a coefficients document -> (:class:`Coefficients`, the
    machine fingerprints it was fitted on (``[]`` when it does not record them)).

    ``missing``: a list that gets the coefficient names the file lacks (they take their default value,
    1.0 for a multiplier), for the caller to warn about.

    Raises:
        InputError: missing file. FormatError: bad document, or a coefficient that is not a finite number
        in range (the message names the file and the key).
    """
    doc = read_document(path, KIND, SCHEMA_VERSION)
    at = At(str(path), _REDO, repr_values=True)
    c = f.mapping(doc, "coefficients", at)
    try:
        coef = Coefficients.from_dict(c, where=f"{path}: coefficients")
    except InputError as exc:
        raise FormatError(str(exc)) from None
    if missing is not None:
        missing += [fl.name for fl in dataclasses.fields(Coefficients) if fl.name not in c]
    machines = doc.get("machine_fingerprints") or []
    if not isinstance(machines, list) or not all(isinstance(m, str) for m in machines):
        (at / "machine_fingerprints").bad("a list of strings", machines)
    return coef, machines


def load_coefficients(path: str | os.PathLike):
    """Read a coefficients document -> :class:`Coefficients`
    (see :func:`read_coefficients`; same errors)."""
    return read_coefficients(path)[0]
