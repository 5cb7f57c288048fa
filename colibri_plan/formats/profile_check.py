"""Field-by-field validation of a machine profile document (see :mod:`colibri_plan.formats.profile`).

Runs on load and before save: a corrupt, hand-edited or incomplete profile fails here with a
FormatError naming the section and field, before any figure is used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from colibri_plan.errors import FormatError
from colibri_plan.quant import FORMATS

#: sections every profile has (a section the machine lacks is ``{"unavailable": reason}``)
SECTIONS = ("machine", "disk", "ram", "devices", "links", "matmul")


def _fail(where: str, what: str):
    raise FormatError(f"profile {where}: {what}; re-measure with `colibri-plan profile`")


#: physically plausible bounds: a rate in GB/s lies in (MIN_GBPS, MAX_GBPS], a time in seconds is at most
#: MAX_SECONDS; a disk slower than MIN_DISK_GBPS (100 kB/s) is no disk to stream experts from
MIN_GBPS, MAX_GBPS, MAX_SECONDS, MIN_DISK_GBPS = 1e-6, 1e5, 1e6, 1e-4


def _check_stat(s, where: str, positive: bool = False) -> None:
    """A figure {min, median, max, repetitions}; a ``*gbps`` figure must lie in (MIN_GBPS, MAX_GBPS] and
    a ``seconds`` one be at most MAX_SECONDS (the name is ``where``'s last part)."""
    if not isinstance(s, dict):
        _fail(where, f"expected a figure {{min, median, max, repetitions}}, got {type(s).__name__}")
    for key in ("min", "median", "max"):
        v = s.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            _fail(where, f"{key} must be a finite number, got {v!r}")
        if v < 0:
            _fail(where, f"{key} is negative ({v})")
    if not s["min"] <= s["median"] <= s["max"]:
        _fail(where, f"expected min <= median <= max, got {s['min']}, {s['median']}, {s['max']}")
    if positive and not s["min"] > 0:
        _fail(where, f"figures must be > 0, got min {s['min']}")
    if where.endswith("gbps"):
        if s["max"] > MAX_GBPS:
            _fail(where, f"max {s['max']:g} GB/s is not a plausible rate (at most {MAX_GBPS:g} GB/s)")
        if not s["min"] > MIN_GBPS:
            _fail(where, f"min {s['min']:g} GB/s is not a plausible rate (more than {MIN_GBPS:g} GB/s)")
    elif where.endswith("seconds") and s["max"] > MAX_SECONDS:
        _fail(where, f"max {s['max']:g} s is not a plausible time (at most {MAX_SECONDS:g} s)")
    r = s.get("repetitions")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        _fail(where, f"repetitions must be a positive integer, got {r!r}")


def _check_int(d: dict, key: str, where: str, minimum: int = 0) -> None:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        _fail(where, f"{key} must be an integer >= {minimum}, got {v!r}")


def _check_keys(d, keys: Iterable[str], where: str) -> None:
    if not isinstance(d, dict):
        _fail(where, f"expected an object, got {type(d).__name__}")
    missing = [k for k in keys if k not in d]
    if missing:
        _fail(where, f"missing {', '.join(missing)}")


def _unavailable(section, where: str) -> bool:
    """True when ``section`` (named ``where`` in a refusal) is ``{"unavailable": reason}``."""
    if isinstance(section, dict) and "unavailable" in section:
        if not isinstance(section["unavailable"], str) or not section["unavailable"]:
            _fail(where, f"'unavailable' must give a reason (a non-empty string), got "
                  f"{section['unavailable']!r}")
        return True
    return False


def _check_list(doc: dict, name: str) -> list | None:
    section = doc[name]
    if _unavailable(section, name):
        return None
    if not isinstance(section, list):
        _fail(name, f"expected a list or {{'unavailable': reason}}, got {type(section).__name__}")
    return section


def validate_profile(doc: dict) -> dict:
    """Check every section of a profile document; return it unchanged.

    Raises:
        FormatError: a section is missing, malformed, or holds a negative / non-finite figure.
    """
    if not isinstance(doc, dict):
        raise FormatError("profile: expected a JSON object")
    missing = [s for s in SECTIONS if s not in doc]
    if missing:
        _fail("document", f"missing section(s) {', '.join(missing)}")
    m = doc["machine"]
    _check_keys(m, ("cpu_model", "cores", "ram_total_bytes", "ram_available_bytes", "os", "fingerprint"),
                "machine")
    for key in ("cores", "ram_total_bytes", "ram_available_bytes"):
        _check_int(m, key, "machine", 1 if key == "cores" else 0)
    disk = doc["disk"]
    if not _unavailable(disk, "disk"):
        _check_keys(disk, ("path", "filesystem", "o_direct", "page_cache_method", "block_bytes", "random",
                           "sequential"), "disk")
        _check_int(disk, "block_bytes", "disk", 1)
        if not isinstance(disk["o_direct"], bool):
            _fail("disk", "o_direct must be true or false")
        if not isinstance(disk["random"], list) or not disk["random"]:
            _fail("disk.random", "expected a non-empty list of queue-depth entries")
        for i, e in enumerate(disk["random"]):
            w = f"disk.random[{i}]"
            _check_keys(e, ("queue_depth", "read_gbps", "latency_ms"), w)
            _check_int(e, "queue_depth", w, 1)
            _check_stat(e["read_gbps"], w + ".read_gbps")
            if e["read_gbps"]["median"] < MIN_DISK_GBPS:
                _fail(w + ".read_gbps", f"median {e['read_gbps']['median']:g} GB/s is too slow to stream "
                      f"experts from (under {MIN_DISK_GBPS:g} GB/s); re-profile on a real disk with "
                      "`colibri-plan profile --path DIR`")
            _check_keys(e["latency_ms"], ("p50", "p99"), w + ".latency_ms")
            for k in ("p50", "p99"):
                v = e["latency_ms"][k]
                if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                        or v > 1e3 * MAX_SECONDS):
                    _fail(w + ".latency_ms", f"{k} must be a number in [0, {1e3 * MAX_SECONDS:g}] ms, "
                          f"got {v!r}")
        if not _unavailable(disk["sequential"], "disk.sequential"):
            _check_keys(disk["sequential"], ("read_gbps",), "disk.sequential")
            _check_stat(disk["sequential"]["read_gbps"], "disk.sequential.read_gbps")
    ram = doc["ram"]
    if not _unavailable(ram, "ram"):
        _check_keys(ram, ("read_gbps", "threads"), "ram")
        _check_stat(ram["read_gbps"], "ram.read_gbps")
        _check_int(ram, "threads", "ram", 1)
        # optional (older profiles lack it); present, it must be a real figure, never a silent "none"
        ck = ram.get("checksum_gbps")
        if ck is not None and not _unavailable(ck, "ram.checksum_gbps"):
            _check_stat(ck, "ram.checksum_gbps", positive=True)
    for i, d in enumerate(_check_list(doc, "devices") or []):
        w = f"devices[{i}]"
        _check_keys(d, ("backend", "index", "name", "kind", "total_memory_bytes", "unified_memory"), w)
        for k in ("backend", "name", "kind"):
            if not isinstance(d[k], str):
                _fail(w, f"{k} must be a string, got {d[k]!r}")
        _check_int(d, "index", w)
        _check_int(d, "total_memory_bytes", w)
        if d.get("free_memory_bytes") is not None:
            _check_int(d, "free_memory_bytes", w)
        if not isinstance(d["unified_memory"], bool):
            _fail(w, f"unified_memory must be true or false, got {d['unified_memory']!r}")
    for i, e in enumerate(_check_list(doc, "links") or []):
        w = f"links[{i}]"
        _check_keys(e, ("backend", "device_index", "device_name", "unified_memory", "block_bytes"), w)
        for k in ("h2d_pinned_gbps", "h2d_pageable_gbps", "d2h_pinned_gbps", "d2h_pageable_gbps"):
            if k in e and not _unavailable(e[k], f"{w}.{k}"):
                _check_stat(e[k], f"{w}.{k}")
    for i, e in enumerate(_check_list(doc, "matmul") or []):
        w = f"matmul[{i}]"
        _check_keys(e, ("backend", "device_index", "fmt", "out_features", "in_features", "tokens",
                        "weight_gbps", "seconds"), w)
        for k in ("backend", "fmt"):
            if not isinstance(e[k], str):
                _fail(w, f"{k} must be a string, got {e[k]!r}")
        _check_int(e, "device_index", w)
        if e.get("device_kind") is not None and e["device_kind"] not in ("cpu", "gpu", "igpu"):
            _fail(w, f"device_kind must be 'cpu', 'gpu' or 'igpu', got {e['device_kind']!r}")
        for k in ("out_features", "in_features", "tokens"):
            _check_int(e, k, w, 1)
        _check_stat(e["weight_gbps"], w + ".weight_gbps")
        _check_stat(e["seconds"], w + ".seconds")
    if "expert_ffn" in doc:
        ffn = _check_list(doc, "expert_ffn")
        if ffn is not None and not ffn:  # the profiler writes {"unavailable": reason} instead
            _fail("expert_ffn", "empty list; expected entries or {'unavailable': reason}")
        for i, e in enumerate(ffn or []):
            w = f"expert_ffn[{i}]"
            _check_keys(e, ("backend", "device_index", "fmt", "experts", "tokens", "seconds"), w)
            for k in ("backend", "fmt"):
                if not isinstance(e[k], str):
                    _fail(w, f"{k} must be a string, got {e[k]!r}")
            _check_int(e, "device_index", w)
            for k in ("experts", "tokens"):
                _check_int(e, k, w, 1)
            for k in ("hidden", "width"):
                if k in e:
                    _check_int(e, k, w, 1)
            _check_stat(e["seconds"], w + ".seconds", positive=True)
            if "weight_gbps" in e:
                _check_stat(e["weight_gbps"], w + ".weight_gbps", positive=True)
    if "peer_links" in doc:
        _check_peer_links(doc)
    _check_trunk(doc)
    return doc


def _check_peer_links(doc: dict) -> None:
    """The optional ``peer_links`` section: a non-empty list of ordered GPU pairs, or unavailable."""
    peers = _check_list(doc, "peer_links")
    if peers is not None and not peers:  # the profiler writes {"unavailable": reason} instead
        _fail("peer_links", "empty list; expected entries or {'unavailable': reason}")
    seen = set()
    for i, e in enumerate(peers or []):
        w = f"peer_links[{i}]"
        _check_keys(e, ("src", "dst", "block_bytes", "can_access_peer", "copy_gbps"), w)
        for k in ("src", "dst"):
            if not isinstance(e[k], str) or e[k].count(":") != 1 or not e[k].split(":")[1].isdigit():
                _fail(w, f"{k} must be a device key like 'cuda:0', got {e[k]!r}")
        if e["src"] == e["dst"]:
            _fail(w, f"src and dst are the same device ({e['src']})")
        if (e["src"], e["dst"]) in seen:
            _fail(w, f"pair {e['src']} -> {e['dst']} is listed twice")
        seen.add((e["src"], e["dst"]))
        _check_int(e, "block_bytes", w, 1)
        for k in ("can_access_peer", "peer_access_enabled"):
            if k in e and not isinstance(e[k], bool):
                _fail(w, f"{k} must be true or false, got {e[k]!r}")
        if not _unavailable(e["copy_gbps"], w + ".copy_gbps"):
            _check_stat(e["copy_gbps"], w + ".copy_gbps", positive=True)


#: the optional trunk sections: their keys beyond backend, device_index, device_name (see profile.py)
TRUNK_INTS = {"dense_gemv": (("out_features", 1), ("in_features", 1), ("tokens", 1)),
              "device_ops": (("roundtrip_bytes", 1),),
              "attention": (("n_heads", 1), ("n_kv_heads", 1), ("head_dim", 1), ("context_tokens", 1)),
              "trunk_layer": (("hidden", 1), ("n_heads", 1), ("n_kv_heads", 1), ("head_dim", 1),
                              ("context_tokens", 1), ("layers", 1), ("weight_bytes", 1))}
TRUNK_STATS = {"dense_gemv": ("seconds", "weight_gbps"), "device_ops": ("op_seconds", "roundtrip_seconds"),
               "attention": ("seconds", "kv_gbps"),
               "trunk_layer": ("block_seconds", "moe_layer_seconds", "handoff_seconds", "attention_seconds")}
#: sections whose entries name a quant format
TRUNK_FMT = ("dense_gemv", "trunk_layer")
#: ``trunk_layer.path``: the device trunk's d_* ops, or the CPU trunk's host path
LAYER_PATHS = ("device", "host")


def _check_trunk(doc: dict) -> None:
    """The optional ``dense_gemv``, ``device_ops``, ``attention`` and ``trunk_layer`` sections (profiles
    written before the trunk probe, or before its layer figure, lack them): a non-empty list of typed
    entries, or ``{"unavailable": reason}``. A ``trunk_layer`` entry (one decoder layer's op sequence,
    :mod:`colibri_plan.profiler.trunk_layer_probe`) also names its ``fmt`` and its ``path`` ("device":
    the d_* ops of a device trunk; "host": the CPU trunk's host path); its seconds are per layer;
    optional: ``attention_long_seconds`` with ``long_context_tokens``, and on the host path the routed
    experts' calls ``expert_one_seconds``, ``expert_topk_seconds`` with ``expert_width``,
    ``expert_topk``, ``expert_fmt``."""
    for name, ints in TRUNK_INTS.items():
        if name not in doc:
            continue
        entries = _check_list(doc, name)
        if entries is not None and not entries:  # the profiler writes {"unavailable": reason} instead
            _fail(name, "empty list; expected entries or {'unavailable': reason}")
        seen = set()
        for i, e in enumerate(entries or []):
            w = f"{name}[{i}]"
            _check_keys(e, ("backend", "device_index", "device_name", *(k for k, _ in ints),
                            *TRUNK_STATS[name]) + (("fmt",) if name in TRUNK_FMT else ()), w)
            for k in ("backend", "device_name") + (("fmt",) if name in TRUNK_FMT else ()):
                if not isinstance(e[k], str) or not e[k]:
                    _fail(w, f"{k} must be a non-empty string, got {e[k]!r}")
            if name == "trunk_layer" and e.get("path") not in LAYER_PATHS:
                _fail(w, f"path must be one of {', '.join(LAYER_PATHS)}, got {e.get('path')!r}")
            if name == "trunk_layer" and "attention_long_seconds" in e:  # optional: the growth per token
                _check_stat(e["attention_long_seconds"], f"{w}.attention_long_seconds", positive=True)
                _check_int(e, "long_context_tokens", w, 1)
            if name == "trunk_layer" and "expert_one_seconds" in e:  # optional: the host's expert calls
                for k in ("expert_one_seconds", "expert_topk_seconds"):
                    _check_stat(e.get(k), f"{w}.{k}", positive=True)
                _check_int(e, "expert_width", w, 1)
                _check_int(e, "expert_topk", w, 2)
                if e.get("expert_fmt") not in FORMATS:
                    _fail(w, f"expert_fmt {e.get('expert_fmt')!r} is not a quant format")
            if name in TRUNK_FMT and e["fmt"] not in FORMATS:
                _fail(w, f"fmt {e['fmt']!r} is not a quant format (one of {', '.join(FORMATS)})")
            _check_int(e, "device_index", w)
            for k, minimum in ints:
                _check_int(e, k, w, minimum)
            for k in TRUNK_STATS[name]:
                _check_stat(e[k], f"{w}.{k}", positive=True)
            if name == "attention" and e["n_heads"] % e["n_kv_heads"]:
                _fail(w, f"n_heads {e['n_heads']} is not a multiple of n_kv_heads {e['n_kv_heads']}")
            key = (e["backend"], e["device_index"], e.get("fmt"), e.get("out_features"), e.get("in_features"),
                   e.get("context_tokens"), e.get("path"))
            if key in seen:
                _fail(w, "the same device and shape is listed twice")
            seen.add(key)
