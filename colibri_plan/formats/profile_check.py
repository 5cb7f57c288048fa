"""Field-by-field validation of a machine profile document (see :mod:`colibri_plan.formats.profile`).

Runs on load and before save: a corrupt, hand-edited or incomplete profile fails here with a
FormatError naming the section and field, before any figure is used.
"""

from __future__ import annotations

from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At
from colibri_plan.quant import FORMATS

#: where an ``expert_ffn`` row's experts lived: the device's memory, or mapped host memory (zero-copy)
FFN_MEMORY = ("device", "mapped")
#: sections every profile has (a section the machine lacks is ``{"unavailable": reason}``)
SECTIONS = ("machine", "disk", "ram", "devices", "links", "matmul")


#: the profile's place in messages: fields are named after the record that holds them
PROFILE = At("profile", "re-measure with `colibri-plan profile`", by_parent=True, integer="an integer")


#: physically plausible bounds: a rate in GB/s lies in (MIN_GBPS, MAX_GBPS], a time in seconds is at most
#: MAX_SECONDS; a disk slower than MIN_DISK_GBPS (100 kB/s) is no disk to stream experts from
MIN_GBPS, MAX_GBPS, MAX_SECONDS, MIN_DISK_GBPS = 1e-6, 1e5, 1e6, 1e-4


def _check_stat(d, key, at: At, positive: bool = False) -> dict:
    """``d[key]``, a figure {min, median, max, repetitions}; a ``*gbps`` figure must lie in (MIN_GBPS,
    MAX_GBPS] and a ``seconds`` one be at most MAX_SECONDS (by the key's name)."""
    s = f.mapping(d, key, at, want="a figure {min, median, max, repetitions}")
    here = at / key
    for k in ("min", "median", "max"):
        if f.number(s, k, here) < 0:
            here.fail(f"{k} is negative ({s[k]})")
    if not s["min"] <= s["median"] <= s["max"]:
        here.fail(f"expected min <= median <= max, got {s['min']}, {s['median']}, {s['max']}")
    if positive and not s["min"] > 0:
        here.fail(f"figures must be > 0, got min {s['min']}")
    if str(key).endswith("gbps"):
        if s["max"] > MAX_GBPS:
            here.fail(f"max {s['max']:g} GB/s is not a plausible rate (at most {MAX_GBPS:g} GB/s)")
        if not s["min"] > MIN_GBPS:
            here.fail(f"min {s['min']:g} GB/s is not a plausible rate (more than {MIN_GBPS:g} GB/s)")
    elif str(key).endswith("seconds") and s["max"] > MAX_SECONDS:
        here.fail(f"max {s['max']:g} s is not a plausible time (at most {MAX_SECONDS:g} s)")
    f.whole(s, "repetitions", here, lo=1, want="a positive integer")
    return s


def _entry(e, keys, at: At) -> dict:
    """An object holding ``keys``."""
    if not isinstance(e, dict):
        at.fail(f"expected an object, got {type(e).__name__}")
    f.require(e, keys, at)
    return e


def _unavailable(d, key, at: At) -> bool:
    """True when ``d[key]`` is ``{"unavailable": reason}`` (a reason is a non-empty string)."""
    section = d.get(key)
    if isinstance(section, dict) and "unavailable" in section:
        r = section["unavailable"]
        if not isinstance(r, str) or not r:
            (at / key).fail(f"'unavailable' must give a reason (a non-empty string), got {f.shown(r)}")
        return True
    return False


def _check_list(doc: dict, name: str, nonempty: bool = False) -> list | None:
    """A section that is a list of entries (non-empty with ``nonempty``), or ``{"unavailable": reason}``
    (None)."""
    if _unavailable(doc, name, PROFILE):
        return None
    section = doc[name]
    if not isinstance(section, list):
        (PROFILE / name).fail(f"expected a list or {{'unavailable': reason}}, got {type(section).__name__}")
    if nonempty and not section:  # the profiler writes {"unavailable": reason} instead
        (PROFILE / name).fail("empty list; expected entries or {'unavailable': reason}")
    return section


def validate_profile(doc: dict) -> dict:
    """Check every section of a profile document; return it unchanged.

    Raises:
        FormatError: a section is missing, malformed, or holds a negative / non-finite figure (the
            message names the field, e.g. ``profile disk.random[0].read_gbps: min must be ...``).
    """
    f.document(doc, PROFILE)
    missing = [s for s in SECTIONS if s not in doc]
    if missing:
        PROFILE.fail(f"missing section(s) {', '.join(missing)}")
    at = PROFILE / "machine"
    m = _entry(doc["machine"], ("cpu_model", "cores", "ram_total_bytes", "ram_available_bytes", "os",
                                "fingerprint"), at)
    for key in ("cores", "ram_total_bytes", "ram_available_bytes"):
        f.whole(m, key, at, lo=1 if key == "cores" else 0)
    if m["ram_available_bytes"] > m["ram_total_bytes"]:   # a hand edit: a budget beyond the machine
        at.fail(f"ram_available_bytes {m['ram_available_bytes']:,} is more than ram_total_bytes "
                f"{m['ram_total_bytes']:,}; a machine cannot have more memory free than it has: re-measure "
                "with `colibri-plan profile` or fix the figure")
    if not _unavailable(doc, "disk", PROFILE):
        at = PROFILE / "disk"
        disk = _entry(doc["disk"], ("path", "filesystem", "o_direct", "page_cache_method", "block_bytes",
                                    "random", "sequential"), at)
        f.whole(disk, "block_bytes", at, lo=1)
        f.flag(disk, "o_direct", at)
        for e, w in f.each(disk, "random", at, nonempty=True, want="a non-empty list of queue-depth entries"):
            _entry(e, ("queue_depth", "read_gbps", "latency_ms"), w)
            f.whole(e, "queue_depth", w, lo=1)
            if _check_stat(e, "read_gbps", w)["median"] < MIN_DISK_GBPS:
                (w / "read_gbps").fail(f"median {e['read_gbps']['median']:g} GB/s is too slow to stream "
                                       f"experts from (under {MIN_DISK_GBPS:g} GB/s); re-profile on a real "
                                       "disk with `colibri-plan profile --path DIR`")
            lat = _entry(e["latency_ms"], ("p50", "p99"), w / "latency_ms")
            for k in ("p50", "p99"):
                f.number(lat, k, w / "latency_ms", lo=0, hi=1e3 * MAX_SECONDS, unit=" ms")
        if not _unavailable(disk, "sequential", at):
            _check_stat(_entry(disk["sequential"], ("read_gbps",), at / "sequential"), "read_gbps",
                        at / "sequential")
    if not _unavailable(doc, "ram", PROFILE):
        at = PROFILE / "ram"
        ram = _entry(doc["ram"], ("read_gbps", "threads"), at)
        _check_stat(ram, "read_gbps", at)
        f.whole(ram, "threads", at, lo=1)
        # optional (older profiles lack it); present, it must be a real figure, never a silent "none"
        if ram.get("checksum_gbps") is not None and not _unavailable(ram, "checksum_gbps", at):
            _check_stat(ram, "checksum_gbps", at, positive=True)
    for i, d in enumerate(_check_list(doc, "devices") or []):
        w = PROFILE / "devices" / i
        _entry(d, ("backend", "index", "name", "kind", "total_memory_bytes", "unified_memory"), w)
        for k in ("backend", "name", "kind"):
            f.text(d, k, w)
        f.whole(d, "index", w, lo=0)
        f.whole(d, "total_memory_bytes", w, lo=0)
        f.whole(d, "free_memory_bytes", w, lo=0, optional=True)
        f.flag(d, "unified_memory", w)
    for i, e in enumerate(_check_list(doc, "links") or []):
        w = PROFILE / "links" / i
        _entry(e, ("backend", "device_index", "device_name", "unified_memory", "block_bytes"), w)
        for k in ("h2d_pinned_gbps", "h2d_pageable_gbps", "d2h_pinned_gbps", "d2h_pageable_gbps"):
            if k in e and not _unavailable(e, k, w):
                _check_stat(e, k, w)
    for i, e in enumerate(_check_list(doc, "matmul") or []):
        w = PROFILE / "matmul" / i
        _entry(e, ("backend", "device_index", "fmt", "out_features", "in_features", "tokens", "weight_gbps",
                   "seconds"), w)
        f.text(e, "backend", w)
        f.text(e, "fmt", w)
        f.whole(e, "device_index", w, lo=0)
        f.text(e, "device_kind", w, optional=True, choices=("cpu", "gpu", "igpu"))
        for k in ("out_features", "in_features", "tokens"):
            f.whole(e, k, w, lo=1)
        _check_stat(e, "weight_gbps", w)
        _check_stat(e, "seconds", w)
    for i, e in enumerate((_check_list(doc, "expert_ffn", nonempty=True) if "expert_ffn" in doc else None)
                          or []):
        w = PROFILE / "expert_ffn" / i
        _entry(e, ("backend", "device_index", "fmt", "experts", "tokens", "seconds"), w)
        f.text(e, "backend", w)
        f.text(e, "fmt", w)
        f.text(e, "memory", w, optional=True, choices=FFN_MEMORY)
        f.whole(e, "device_index", w, lo=0)
        for k in ("experts", "tokens"):
            f.whole(e, k, w, lo=1)
        for k in ("hidden", "width"):
            if k in e:
                f.whole(e, k, w, lo=1)
        _check_stat(e, "seconds", w, positive=True)
        if "weight_gbps" in e:
            _check_stat(e, "weight_gbps", w, positive=True)
    if "peer_links" in doc:
        _check_peer_links(doc)
    _check_trunk(doc)
    return doc


def _check_peer_links(doc: dict) -> None:
    """The optional ``peer_links`` section: a non-empty list of ordered GPU pairs, or unavailable."""
    seen = set()
    for i, e in enumerate(_check_list(doc, "peer_links", nonempty=True) or []):
        w = PROFILE / "peer_links" / i
        _entry(e, ("src", "dst", "block_bytes", "can_access_peer", "copy_gbps"), w)
        for k in ("src", "dst"):
            v = e[k]
            if not isinstance(v, str) or v.count(":") != 1 or not v.split(":")[1].isdigit():
                (w / k).bad("a device key like 'cuda:0'", v)
        if e["src"] == e["dst"]:
            w.fail(f"src and dst are the same device ({e['src']})")
        if (e["src"], e["dst"]) in seen:
            w.fail(f"pair {e['src']} -> {e['dst']} is listed twice")
        seen.add((e["src"], e["dst"]))
        f.whole(e, "block_bytes", w, lo=1)
        for k in ("can_access_peer", "peer_access_enabled"):
            if k in e:
                f.flag(e, k, w)
        if not _unavailable(e, "copy_gbps", w):
            _check_stat(e, "copy_gbps", w, positive=True)


#: the optional trunk sections: their keys beyond backend, device_index, device_name (see profile.py)
TRUNK_INTS = {"dense_gemv": (("out_features", 1), ("in_features", 1), ("tokens", 1)),
              "device_ops": (("roundtrip_bytes", 1),),
              "attention": (("n_heads", 1), ("n_kv_heads", 1), ("head_dim", 1), ("context_tokens", 1)),
              "trunk_layer": (("hidden", 1), ("n_heads", 1), ("n_kv_heads", 1), ("head_dim", 1),
                              ("context_tokens", 1), ("layers", 1), ("weight_bytes", 1)),
              "step_graph": (("hidden", 1), ("n_heads", 1), ("n_kv_heads", 1), ("head_dim", 1), ("vocab", 1),
                             ("n_experts", 1), ("top_k", 1), ("expert_width", 1), ("expert_bytes", 1),
                             ("context_tokens", 1), ("layers_short", 1), ("layers_long", 2),
                             ("layer_trunk_bytes", 1))}
TRUNK_STATS = {"dense_gemv": ("seconds", "weight_gbps"), "device_ops": ("op_seconds", "roundtrip_seconds"),
               "attention": ("seconds", "kv_gbps"),
               "trunk_layer": ("block_seconds", "moe_layer_seconds", "handoff_seconds", "attention_seconds"),
               "step_graph": ("layer_seconds", "fixed_seconds", "step_short_seconds", "step_long_seconds")}
#: sections whose entries name a quant format
TRUNK_FMT = ("dense_gemv", "trunk_layer", "step_graph")
#: ``trunk_layer.path``: the device trunk's d_* ops, or the CPU trunk's host path
LAYER_PATHS = ("device", "host")
#: trunk_layer rows the probe writes on one path only: the cpu backend is the CPU trunk's host path, a
#: GPU backend's the device trunk's (numpy, the reference, runs both: its device ops are the oracle's)
HOST_ONLY_BACKENDS = ("cpu",)
EITHER_PATH_BACKENDS = ("numpy",)


def _check_trunk(doc: dict) -> None:
    """The optional ``dense_gemv``, ``device_ops``, ``attention``, ``trunk_layer`` and ``step_graph``
    sections (profiles written before the trunk probe, or before its layer or step figure, lack them): a
    non-empty list of typed
    entries, or ``{"unavailable": reason}``. A ``trunk_layer`` entry (one decoder layer's op sequence,
    :mod:`colibri_plan.profiler.trunk_layer_probe`) also names its ``fmt`` and its ``path`` ("device":
    the d_* ops of a device trunk; "host": the CPU trunk's host path); its seconds are per layer;
    optional: ``attention_long_seconds`` with ``long_context_tokens``, and on the host path the routed
    experts' calls ``expert_one_seconds``, ``expert_topk_seconds`` with ``expert_width``,
    ``expert_topk``, ``expert_fmt``. A ``step_graph`` entry (the replayed decode step,
    :mod:`colibri_plan.profiler.step_probe`) names its dense ``fmt`` and its experts' ``expert_fmt``; its
    ``layers_long`` is more than its ``layers_short``."""
    for name, ints in TRUNK_INTS.items():
        if name not in doc:
            continue
        seen = set()
        fmt_key = ("fmt",) if name in TRUNK_FMT else ()
        for i, e in enumerate(_check_list(doc, name, nonempty=True) or []):
            w = PROFILE / name / i
            _entry(e, ("backend", "device_index", "device_name", *(k for k, _ in ints), *TRUNK_STATS[name],
                       *fmt_key), w)
            for k in ("backend", "device_name", *fmt_key):
                f.text(e, k, w, nonempty=True)
            if name == "trunk_layer":
                f.text(e, "path", w, choices=LAYER_PATHS)
                want = "host" if e["backend"] in HOST_ONLY_BACKENDS else "device"
                # a relabelled row would price one trunk with another path's figures
                if e["path"] != want and e["backend"] not in EITHER_PATH_BACKENDS:
                    w.fail(f"path {e['path']!r} on backend {e['backend']!r}: the probe measures a "
                           f"{e['backend']} row on the {want} path only; re-measure with `colibri-plan "
                           "profile` or restore the path")
            if name == "trunk_layer" and "attention_long_seconds" in e:  # optional: the growth per token
                _check_stat(e, "attention_long_seconds", w, positive=True)
                f.whole(e, "long_context_tokens", w, lo=1)
            if name == "trunk_layer" and "expert_one_seconds" in e:  # optional: the host's expert calls
                for k in ("expert_one_seconds", "expert_topk_seconds"):
                    _check_stat(e, k, w, positive=True)
                f.whole(e, "expert_width", w, lo=1)
                f.whole(e, "expert_topk", w, lo=2)
                if e.get("expert_fmt") not in FORMATS:
                    w.fail(f"expert_fmt {e.get('expert_fmt')!r} is not a quant format")
            if name == "step_graph":
                if e.get("expert_fmt") not in FORMATS:
                    w.fail(f"expert_fmt {e.get('expert_fmt')!r} is not a quant format")
                if not (isinstance(e["layers_long"], int) and isinstance(e["layers_short"], int)
                        and e["layers_long"] > e["layers_short"]):
                    w.fail(f"layers_long {e['layers_long']!r} must be more than layers_short "
                           f"{e['layers_short']!r} (the per-layer figure is their difference)")
            if fmt_key and e["fmt"] not in FORMATS:
                w.fail(f"fmt {e['fmt']!r} is not a quant format (one of {', '.join(FORMATS)})")
            f.whole(e, "device_index", w, lo=0)
            for k, minimum in ints:
                f.whole(e, k, w, lo=minimum)
            for k in TRUNK_STATS[name]:
                _check_stat(e, k, w, positive=True)
            if name == "attention" and e["n_heads"] % e["n_kv_heads"]:
                w.fail(f"n_heads {e['n_heads']} is not a multiple of n_kv_heads {e['n_kv_heads']}")
            key = (e["backend"], e["device_index"], e.get("fmt"), e.get("out_features"), e.get("in_features"),
                   e.get("context_tokens"), e.get("path"))
            if key in seen:
                w.fail("the same device and shape is listed twice")
            seen.add(key)
