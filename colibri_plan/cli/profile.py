"""`colibri-plan profile`: measure this machine and write a profile file."""

from __future__ import annotations

import re

import click

from colibri_plan.cli.common import Steps, emit, json_option, progress, table, warn
from colibri_plan.errors import InputError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(text: str | None) -> int | None:
    """'64MiB', '1GiB', '1048576' -> bytes (None stays None).

    Raises:
        InputError: not a size.
    """
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"{text!r} is not a size; write e.g. 1048576, 64MiB or 1GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals or min(vals) < 1:
        raise InputError(f"{text!r}: give positive integers, e.g. 1,4,8")
    return vals


def _names(values) -> list[str] | None:
    out = [v.strip() for item in values or () for v in item.split(",") if v.strip()]
    return out or None


def _fig(s: dict, digits: int = 2) -> str:
    if not isinstance(s, dict) or "unavailable" in s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def render(doc: dict) -> str:
    """The human-readable tables of a profile document."""
    m = doc["machine"]
    out = [f"machine  {m['cpu_model']}, {m['cores']} cores, RAM {m['ram_total_bytes'] / 2**30:.1f} GiB "
           f"({m['ram_available_bytes'] / 2**30:.1f} GiB available), {m['os']}  [{m['fingerprint']}]"]
    d = doc["disk"]
    if "unavailable" in d:
        out.append(f"disk     unavailable: {d['unavailable']}")
    else:
        fs = d["filesystem"]
        fs = fs if isinstance(fs, dict) else {"fstype": fs, "device": "?"}
        out.append(f"\ndisk     {d['path']} ({fs['fstype']} on {fs['device']}), block {d['block_bytes']} B, "
                   f"page cache kept out by: {d['page_cache_method']}")
        def row(name, e):
            lat = e.get("latency_ms") or {}
            return [name, _fig(e.get("read_gbps")), f"{lat['p50']:.1f}" if "p50" in lat else "-",
                    f"{lat['p99']:.1f}" if "p99" in lat else "-", e.get("reads", "-")]

        rows = [row(e["queue_depth"], e) for e in d["random"]] + [row("seq", d["sequential"])]
        out.append(table(rows, ["QD", "read GB/s median (min-max)", "p50 ms", "p99 ms", "reads"]))
    r = doc["ram"]
    crc = f"; crc32 checks {_fig(r['checksum_gbps'], 1)} GB/s" if r.get("checksum_gbps") else ""
    out.append("\nram      " + (f"unavailable: {r['unavailable']}" if "unavailable" in r else
                               f"read {_fig(r['read_gbps'], 1)} GB/s with {r['threads']} thread(s){crc}"))
    links = doc["links"]
    if isinstance(links, dict):
        out.append(f"\nlinks    unavailable: {links['unavailable']}")
    else:
        rows = [[f"{e['backend']}:{e['device_index']}", e["device_name"][:32],
                 "unified" if e["unified_memory"] else "copy", _fig(e.get("h2d_pinned_gbps")),
                 _fig(e.get("h2d_pageable_gbps")), _fig(e.get("d2h_pinned_gbps")),
                 _fig(e.get("d2h_pageable_gbps"))] for e in links]
        out.append("\nlinks (GB/s, median (min-max))")
        out.append(table(rows, ["device", "name", "link", "H2D pinned", "H2D pageable", "D2H pinned",
                                "D2H pageable"]))
    mm = doc["matmul"]
    if isinstance(mm, dict):
        out.append(f"\nmatmul   unavailable: {mm['unavailable']}")
    else:
        rows = [[f"{e['backend']}:{e['device_index']}", e["fmt"], f"{e['out_features']}x{e['in_features']}",
                 e["tokens"], _fig(e["weight_gbps"]), f"{e['seconds']['median'] * 1e3:.3f}"] for e in mm]
        out.append("\nmatmul (weight GB/s through the backend's own matmul)")
        out.append(table(rows, ["device", "fmt", "out x in", "tokens", "weight GB/s", "ms"]))
    ffn = doc.get("expert_ffn")
    if isinstance(ffn, list) and ffn:
        rows = [[f"{e['backend']}:{e['device_index']}", e["fmt"], e["experts"], _fig(e["weight_gbps"]),
                 f"{e['seconds']['median'] * 1e3:.3f}"] for e in ffn]
        out.append("\nexpert_ffn (k experts, 1 token each)")
        out.append(table(rows, ["device", "fmt", "k", "weight GB/s", "ms"]))
    if doc.get("skipped"):
        out.append("\nskipped")
        for s in doc["skipped"]:
            where = s["backend"] + (f":{s['device_index']}" if "device_index" in s else "")
            out.append(f"  {s.get('what', '')} {where}{' ' + s['fmt'] if 'fmt' in s else ''}: {s['reason']}")
    return "\n".join(out)


def _stage_progress(bar: Steps, stages: list[str]):
    """A ``fn(message)`` callback for :func:`run_profile`: every message is a line (or the bar's text);
    the bar counts the probes done, read from the message's ``probe:`` prefix."""

    def cb(message: str) -> None:
        stage = message.split(":", 1)[0]
        bar.say(message)
        if stage in stages:
            bar.set(stages.index(stage))

    return cb


@click.command("profile")
@click.option("--path", type=click.Path(), default=None,
              help="Folder or file on the disk to probe (default: a temporary file in the current folder).")
@click.option("--model", default=None, help="Model whose expert size/shapes to measure at (default GLM-5.2).")
@click.option("--quick", is_flag=True, help="Fewer repetitions, smaller test file, queue depths 1 and 4.")
@click.option("--out", "out", type=click.Path(), default="profile.json", show_default=True,
              help="Where to write the profile ('-' to write nothing).")
@click.option("--backends", multiple=True, help="Backends to use (comma-separated or repeated; default all).")
@click.option("--probes", default=None, hidden=True, help="Subset of disk,ram,links,matmul.")
@click.option("--block-bytes", default=None, hidden=True)
@click.option("--file-bytes", default=None, hidden=True)
@click.option("--ram-bytes", default=None, hidden=True)
@click.option("--queue-depths", default=None, hidden=True)
@click.option("--disk-seconds", type=float, default=None, hidden=True)
@click.option("--hidden", "hidden_size", type=int, default=None, hidden=True)
@click.option("--width", type=int, default=None, hidden=True)
@click.option("--formats", default=None,
              help="Quant formats to time matmul at (comma-separated; default int4,int4-g64 + the model's).")
@json_option
def profile(path, model, quick, out, backends, probes, block_bytes, file_bytes, ram_bytes, queue_depths,
            disk_seconds, hidden_size, width, formats):
    """Measure NVMe reads (O_DIRECT, expert-sized blocks, queue depth 1..N), RAM bandwidth, host<->GPU
    links and the matmul throughput of every backend; write the profile file."""
    from colibri_plan.formats.profile import save_profile
    from colibri_plan.profiler.run import PROBES, ProfileOptions, run_profile

    if out != "-":
        from pathlib import Path

        from colibri_plan.fileio import check_output_path

        # before minutes of measuring; a --path folder may take the output, a --path file may not
        check_output_path(out, [p for p in (model, path) if p and Path(p).exists()
                                and not (p == path and Path(p).is_dir())])
    for name, v in (("--hidden", hidden_size), ("--width", width), ("--disk-seconds", disk_seconds)):
        if v is not None and v <= 0:
            raise click.BadParameter(f"must be positive, got {v}", param_hint=name)  # a usage error: exit 2
    opts = ProfileOptions(
        path=path, model=model, quick=quick, backends=_names(backends),
        probes=_names([probes]) if probes else PROBES, block_bytes=parse_bytes(block_bytes),
        file_bytes=parse_bytes(file_bytes), ram_bytes=parse_bytes(ram_bytes),
        queue_depths=_ints(queue_depths), hidden=hidden_size, width=width, disk_seconds=disk_seconds,
        formats=_names([formats]) if formats else ("int4", "int4-g64"))
    stages = ["machine", *[p for p in PROBES if p in opts.probes]]
    with Steps("profile", total=len(stages)) as bar:
        prof = run_profile(opts, progress=_stage_progress(bar, stages))
    for w in prof.doc["warnings"]:
        warn(w)
    if out != "-":
        save_profile(prof, out)
        progress(f"profile written to {out} ({prof.doc['duration_s']:.1f} s)")
    emit(prof.doc, lambda: render(prof.doc))
