"""What a profile says about its machine, one labelled figure per line (`colibri-plan profile show`).

A stated profile (:mod:`colibri_plan.profiler.synth`) carries its ``figures`` list already; a measured
or published one is read section by section, each figure labelled by how it was obtained: ``measured``
(by `colibri-plan profile`), or ``assumed`` / ``published`` when the section's ``method`` says so (the
shipped published-6x-rtx5090 profile).
"""

from __future__ import annotations

import statistics


def _origin(section: dict | None) -> str:
    method = str((section or {}).get("method", "")).lower()
    for word in ("stated", "assumed", "published", "default"):
        if method.startswith(word) or f" {word}" in method[:40]:
            return word
    return "measured"


def _median(stat) -> float | None:
    return float(stat["median"]) if isinstance(stat, dict) and "median" in stat else None


def describe_profile(doc: dict) -> list[dict]:
    """Rows {what, value, unit, origin, source} of a profile document (see the module docstring): the
    stated profile's own ``figures``, else the machine, disk, RAM, GPU link and matmul figures."""
    if isinstance(doc.get("figures"), list):
        return [dict(r) for r in doc["figures"]]
    m = doc["machine"]
    rows = [{"what": "CPU", "value": f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores", "unit": "",
             "origin": "measured" if doc.get("created_utc") else "published", "source": ""},
            {"what": "RAM", "value": round(m["ram_total_bytes"] / 1e9, 2), "unit": "GB",
             "origin": "measured" if doc.get("created_utc") else "published", "source": ""},
            {"what": "RAM available to programs", "value": round(m["ram_available_bytes"] / 1e9, 2),
             "unit": "GB", "origin": "measured" if doc.get("created_utc") else "published", "source": ""}]
    disk = doc.get("disk")
    if isinstance(disk, dict) and "random" in disk:
        o = _origin(disk)
        for e in sorted(disk["random"], key=lambda e: e["queue_depth"]):
            rows.append({"what": f"expert-block reads at queue depth {e['queue_depth']}",
                         "value": round(_median(e["read_gbps"]), 2), "unit": "GB/s", "origin": o,
                         "source": str(disk.get("method", ""))[:120] if o != "measured" else ""})
    ram = doc.get("ram")
    if isinstance(ram, dict) and "read_gbps" in ram:
        rows.append({"what": "RAM read (all cores)", "value": round(_median(ram["read_gbps"]), 2),
                     "unit": "GB/s", "origin": _origin(ram),
                     "source": str(ram.get("method", ""))[:120] if _origin(ram) != "measured" else ""})
    for e in doc.get("links") if isinstance(doc.get("links"), list) else []:
        rows.append({"what": f"{e['backend']}:{e['device_index']} H2D pinned",
                     "value": round(_median(e.get("h2d_pinned_gbps")) or 0.0, 2), "unit": "GB/s",
                     "origin": _origin(e),
                     "source": str(e.get("method", ""))[:120] if _origin(e) != "measured" else ""})
    by_dev: dict[str, list[dict]] = {}
    for e in doc.get("matmul") if isinstance(doc.get("matmul"), list) else []:
        if e.get("tokens") == 1:
            by_dev.setdefault(f"{e['backend']}:{e['device_index']}", []).append(e)
    for key, es in by_dev.items():
        fmt = "int4" if any(e["fmt"] == "int4" for e in es) else es[0]["fmt"]
        vals = [_median(e["weight_gbps"]) for e in es if e["fmt"] == fmt]
        rows.append({"what": f"{key} expert GEMV ({fmt}, 1 token)",
                     "value": round(statistics.median(vals), 2), "unit": "GB/s", "origin": _origin(es[0]),
                     "source": str(es[0].get("method", ""))[:120] if _origin(es[0]) != "measured" else ""})
    return rows
