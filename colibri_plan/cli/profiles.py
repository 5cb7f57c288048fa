"""`colibri-plan profile synth|list|show`: a machine from stated figures, the shipped profiles, one profile;
and the tables of a profile document (:func:`render`, which `profile` prints after measuring).

Registered on the `profile` group at the end of :mod:`colibri_plan.cli.profile`.
"""

from __future__ import annotations

import click

from colibri_plan.cli.common import emit, get_ctx, json_option, progress, table, verbose_option

#: the figure table's columns, as `profile show` and `profile synth` print them
_HEAD = ["figure", "value", "origin", "source"]


def figure_table(rows: list[dict]) -> str:
    """The labelled figures (profiler.describe rows) as a table, stated / default / assumed / measured,
    each source once as a numbered note under it (a long source would crop a table on a terminal)."""
    def value(r):
        v = r["value"]
        v = f"{v:,.2f}".rstrip("0").rstrip(".") if isinstance(v, float) else str(v)
        return f"{v} {r['unit']}".strip()

    notes: list[str] = []
    cells = []
    for r in rows:
        src = r.get("source") or ""
        if src and src not in notes:
            notes.append(src)
        cells.append([r["what"], value(r), r["origin"], f"[{notes.index(src) + 1}]" if src else ""])
    return "\n".join([table(cells, _HEAD), *(f"  [{i}] {n}" for i, n in enumerate(notes, 1))])


def _origin_note() -> str:
    return ("origin: stated = you gave it; default = a published figure for what you named or left out "
            "(its source in the notes); assumed = an estimate of this tool; measured = `colibri-plan "
            "profile` on the machine. Measure the real machine to replace every figure.")


@click.command("synth")
@click.option("--gpu", default=None, metavar="SIZE[:GB/s][,...]",
              help="Each discrete GPU's memory (the card's size: 24G, or 2x24G, 24G,16G), optionally with "
                   "its memory bandwidth in GB/s (24G:1008). Default: no GPU.")
@click.option("--ram", default=None, metavar="SIZE", help="The machine's RAM, e.g. 64G (required).")
@click.option("--nvme", default=None, metavar="KIND|GB/s",
              help="The drive the experts stream from: gen3, gen4, gen5, sata, or its rated sequential read "
                   "in GB/s. Default: gen4.")
@click.option("--cpu", default=None, metavar="CORES[:GB/s]",
              help="CPU cores, optionally with the all-core RAM read rate in GB/s (16 or 16:80). Default: 8 "
                   "cores, dual-channel DDR5-5600.")
@click.option("--pcie", default=None, type=click.Choice(["gen3", "gen4", "gen5"]),
              help="The GPUs' link (x16). Default: gen4.")
@click.option("--out", "out", default=None, help="Write the profile here (solve --profile FILE reads it).")
@json_option
def synth(gpu, ram, nvme, cpu, pcie, out):
    """Build a profile from stated figures, without the machine: each figure is labelled stated, default
    (a published figure, named with its source) or assumed. 1 GB = 1e9 B (write GiB for binary).

    Example: colibri-plan profile synth --gpu 24G --ram 64G --nvme gen4 --cpu 16 --out my.json
    """
    from colibri_plan.formats.profile import save_profile
    from colibri_plan.profiler.synth import StatedMachine, synth_profile

    if out is not None:
        from colibri_plan.fileio import check_output_path

        check_output_path(out)
    prof = synth_profile(StatedMachine.from_flags(ram=ram, gpu=gpu, nvme=nvme, cpu=cpu, pcie=pcie))
    if out is not None:
        save_profile(prof, out)
        progress(f"profile written to {out}")
    doc = prof.doc
    emit({**doc, "profile_file": out}, lambda: "\n".join(
        [f"stated machine: {doc['stated']['summary']}", figure_table(doc["figures"]), "", _origin_note(),
         f"Profile written to {out}" if out else "Not written: pass --out FILE to keep it (or give "
         f"solve --machine '{doc['stated']['line']}')"]))


@click.command("list")
@json_option
def list_profiles():
    """List the profiles shipped with colibri-plan (solve --profile NAME)."""
    from colibri_plan.formats.profile import resolve_profile, shipped_profile_names

    rows = []
    for name in shipped_profile_names():
        prof, _ = resolve_profile(name)
        d = prof.doc
        gpus = prof.gpus()
        kind = "stated" if d.get("figures") else ("measured" if d.get("created_utc") else "published")
        rows.append({"name": name, "kind": kind, "cores": d["machine"]["cores"],
                     "ram_bytes": d["machine"]["ram_total_bytes"],
                     "gpus": [f"{g['name']} ({g['total_memory_bytes'] / 1e9:.0f} GB)" for g in gpus],
                     "source": d.get("source", "")})
    emit({"profiles": rows}, lambda: "\n".join([
        table([[r["name"], r["kind"], r["cores"], f"{r['ram_bytes'] / 1e9:.0f} GB",
                _gpu_summary(r["gpus"])] for r in rows], ["name", "figures", "cores", "RAM", "GPUs"]),
        "", "Use one with `colibri-plan solve --profile NAME`; `colibri-plan profile show NAME` prints its "
            "figures; `colibri-plan profile synth` describes another machine."]))


def _gpu_summary(gpus: list[str]) -> str:
    if not gpus:
        return "none"
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g] = counts.get(g, 0) + 1
    return ", ".join(f"{n}x {g}" for g, n in counts.items())


@click.command("show")
@click.argument("name_or_path")
@json_option
@verbose_option
def show(name_or_path):
    """Print a profile (a file or a shipped name): its machine and every figure with its origin; -v adds
    the full measurement tables."""
    from colibri_plan.formats.profile import resolve_profile
    from colibri_plan.profiler.describe import describe_profile

    prof, source = resolve_profile(name_or_path)
    rows = describe_profile(prof.doc)

    def human():
        out = [f"profile {source}: {prof.doc.get('source') or 'measured by colibri-plan profile'}",
               figure_table(rows), "", _origin_note()]
        if get_ctx().verbose:
            out += ["", render(prof.doc)]
        return "\n".join(out)

    emit({"profile": source, "figures": rows, "document": prof.doc}, human)


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
        head = ["device", "fmt", "k", "weight GB/s", "ms"]
        if any(e.get("memory") == "mapped" for e in ffn):   # the zero-copy pinned tier's rows
            rows = [r + [e.get("memory", "device")] for r, e in zip(rows, ffn)]
            head.append("memory")
        out.append("\nexpert_ffn (k experts, 1 token each)")
        out.append(table(rows, head))
    out += render_trunk(doc)
    if doc.get("skipped"):
        out.append("\nskipped")
        for s in doc["skipped"]:
            where = s["backend"] + (f":{s['device_index']}" if "device_index" in s else "")
            out.append(f"  {s.get('what', '')} {where}{' ' + s['fmt'] if 'fmt' in s else ''}: {s['reason']}")
    return "\n".join(out)


def render_trunk(doc: dict) -> list[str]:
    """Tables of the optional trunk sections (none when the profile lacks them)."""
    out = []
    for name in ("dense_gemv", "device_ops", "attention", "trunk_layer"):
        sec = doc.get(name)
        if isinstance(sec, dict):
            out.append(f"\n{name}  unavailable: {sec.get('unavailable')}")
    gemv = doc.get("dense_gemv")
    if isinstance(gemv, list):
        rows = [[f"{e['backend']}:{e['device_index']}", e["fmt"], f"{e['out_features']}x{e['in_features']}",
                 e.get("shape_source", "-"), _fig(e["weight_gbps"]), f"{e['seconds']['median'] * 1e6:.1f}"]
                for e in gemv]
        out.append("\ndense_gemv (d_matmul, x on the device, 1 token; weight GB/s median (min-max))")
        out.append(table(rows, ["device", "fmt", "out x in", "shape", "weight GB/s", "us"]))
    ops = doc.get("device_ops")
    if isinstance(ops, list):
        rows = [[f"{e['backend']}:{e['device_index']}", e["device_name"][:32],
                 _fig({k: v * 1e6 for k, v in e["op_seconds"].items() if k != "repetitions"}),
                 _fig({k: v * 1e6 for k, v in e["roundtrip_seconds"].items() if k != "repetitions"})]
                for e in ops]
        out.append("\ndevice_ops (us, median (min-max))")
        out.append(table(rows, ["device", "name", "op (d_add [1, 4096])", "round trip (get + put [1, H])"]))
    att = doc.get("attention")
    if isinstance(att, list):
        rows = [[f"{e['backend']}:{e['device_index']}", f"{e['n_heads']}/{e['n_kv_heads']}x{e['head_dim']}",
                 e["context_tokens"], f"{e['seconds']['median'] * 1e3:.3f}", _fig(e["kv_gbps"])] for e in att]
        out.append("\nattention (one decode d_attention of one layer)")
        out.append(table(rows, ["device", "heads/kv x d", "context", "ms", "KV GB/s"]))
    lay = doc.get("trunk_layer")
    if isinstance(lay, list):
        def us(e, k):
            return f"{e[k]['median'] * 1e6:.0f}" if isinstance(e.get(k), dict) else "-"

        rows = [[f"{e['backend']}:{e['device_index']}", e["path"], e["fmt"], f"H {e['hidden']}",
                 us(e, "block_seconds"), us(e, "handoff_seconds"), us(e, "attention_seconds"),
                 us(e, "attention_long_seconds"), us(e, "expert_one_seconds"), us(e, "expert_topk_seconds")]
                for e in lay]
        out.append("\ntrunk_layer (one decoder layer's op sequence, us per layer, medians; attention at 64 "
                   "and 1024 keys; expert calls of 1 and top-k experts in the engine's rhythm)")
        out.append(table(rows, ["device", "path", "fmt", "shape", "layer", "MoE hand-off", "attn 64",
                                "attn 1024", "experts 1", "experts k"]))
    return out
