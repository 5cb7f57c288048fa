"""`colibri-plan backends`: every compute backend, whether it can run here (or why not), its devices."""

from __future__ import annotations

import click

from colibri_plan.cli.common import emit, json_option, table


def backend_report() -> list[dict]:
    """One dict per backend in ``BACKEND_NAMES``: name, available, reason, devices (DeviceInfo dicts).

    Never raises: a backend whose module fails to import, or whose discovery raises, is reported as
    unavailable with the error as its reason.
    """
    from colibri_plan.backends import BACKEND_NAMES, get_backend

    out = []
    for name in BACKEND_NAMES:
        entry = {"name": name, "available": False, "reason": None, "devices": []}
        try:
            cls = get_backend(name)
            entry["reason"] = cls.unavailable_reason()
            if entry["reason"] is None:
                entry["devices"] = [d.to_dict() for d in cls.list_devices()]
                entry["available"] = bool(entry["devices"])
                if not entry["devices"]:
                    entry["reason"] = "no devices found"
        except Exception as exc:  # noqa: BLE001 - listing must survive any broken stack
            entry["reason"] = f"{type(exc).__name__}: {exc}"
            entry["devices"] = []
        out.append(entry)
    return out


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f}"


def _human(report: list[dict]) -> str:
    rows = []
    for b in report:
        if not b["available"]:
            rows.append([b["name"], "-", "unavailable", "", "", "", "", b["reason"] or ""])
            continue
        for d in b["devices"]:
            rows.append([b["name"], d["index"], d["name"], d["kind"],
                         f"{_gib(d['free_memory_bytes'])}/{_gib(d['total_memory_bytes'])}",
                         "yes" if d["unified_memory"] else "no", ",".join(d["formats"]), d["driver"]])
    return table(rows, ["backend", "dev", "name", "kind", "free/total GiB", "unified", "formats",
                        "driver / reason"])


@click.command("backends")
@json_option
def backends():
    """List compute backends with their devices (memory, unified-memory flag, quant formats, driver),
    or the reason a backend cannot run on this machine."""
    report = backend_report()
    emit({"backends": report}, lambda: _human(report))
