"""The machine profile document: schema, validation and accessors.

A profile is a JSON document (kind ``"profile"``, schema_version 1, written atomically through
:mod:`colibri_plan.fileio`) with the sections of DESIGN.md §3:

- ``machine``: cpu_model, cores, ram_total_bytes, ram_available_bytes, os, python, fingerprint, ...
- ``disk``: path, filesystem, o_direct, page_cache_method, block_bytes, ``random`` (one entry per queue
  depth: queue_depth, read_gbps, latency_ms {p50, p99}), ``sequential`` {read_gbps, ...}
- ``ram``: read_gbps, threads, method
- ``devices``: DeviceInfo dicts of every backend device found
- ``links``: per non-host device: backend, device_index, device_name, unified_memory, block_bytes,
  h2d_pinned_gbps, h2d_pageable_gbps, d2h_pinned_gbps, d2h_pageable_gbps
- ``matmul``: backend, device_index, device_name, device_kind, fmt, out_features, in_features, tokens,
  weight_gbps, seconds
- ``expert_ffn`` (optional): backend, device_index, fmt, experts, tokens, hidden, width, seconds,
  weight_gbps, memory (optional): where the timed experts lived, ``"device"`` (the device's own memory;
  the default, which older profiles imply by leaving it out) or ``"mapped"`` (mapped page-locked host
  memory the device reads over its link: the backend's ``upload_expert_mapped``, the zero-copy pinned
  tier; only backends that support it have such rows)
- ``peer_links`` (optional; older profiles lack it): per ordered pair of CUDA devices: src, dst ("cuda:0"),
  src_name, dst_name, block_bytes, can_access_peer, peer_access_enabled, copy_gbps (GB/s of
  ``cudaMemcpyPeer`` at the expert block), or ``{"unavailable": reason}`` with fewer than two GPUs
- ``dense_gemv`` (optional; written by the trunk probe, :mod:`colibri_plan.profiler.trunk_probe`): backend,
  device_index, device_name, fmt, out_features, in_features, tokens (1), seconds, weight_gbps (stored
  bytes / s / 1e9 of ``d_matmul`` with x already on the device); the host CPU is backend "cpu" (or
  "numpy" without numba), device_index 0
- ``device_ops`` (optional): backend, device_index, device_name, op_seconds (one small device op, a
  ``d_add`` on [1, 4096] in a chain, per op), roundtrip_seconds (``d_get`` + ``d_put`` of [1, H]),
  roundtrip_bytes (both directions)
- ``attention`` (optional): backend, device_index, device_name, n_heads, n_kv_heads, head_dim,
  context_tokens, seconds (one decode ``d_attention`` of one layer), kv_gbps (K+V float32 bytes / s / 1e9)
- ``step_graph`` (optional; GPU backends that declare ``d_capture_step``, measured with ``profile --model``:
  :mod:`colibri_plan.profiler.step_probe`): backend, device_index, device_name, fmt (dense), expert_fmt,
  hidden, n_heads, n_kv_heads, head_dim, vocab, n_experts, top_k, expert_width, expert_bytes,
  layer_trunk_bytes, context_tokens, layers_short, layers_long; step_short_seconds / step_long_seconds (one
  replayed decode token of the synthetic model of that many layers, every expert in VRAM), layer_seconds
  ((long − short) / (layers_long − layers_short): one layer's trunk and its top-k VRAM experts) and
  fixed_seconds (short − layers_short · layer: embedding in, LM head, logits out, host)
  Accessors: :mod:`colibri_plan.formats.profile_trunk`.

Every measured figure is a *stat*: ``{"min", "median", "max", "repetitions"}`` (non-negative, finite,
min <= median <= max). A section the machine lacks is ``{"unavailable": reason}``. Validation runs on
load and before save, so a corrupt or incomplete profile fails with a FormatError before any use.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable
from pathlib import Path

from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import fingerprint as fp_of
from colibri_plan.fileio import read_document, write_document
from colibri_plan.formats.profile_check import validate_profile

KIND = "profile"
SCHEMA_VERSION = 1
MEASURE_HINT = "measure it with `colibri-plan profile --out profile.json`"


def stat(values: Iterable[float], **extra) -> dict:
    """Summarise repeated measurements: ``{"min", "median", "max", "repetitions", **extra}``.

    Raises:
        InputError: no values.
    """
    vals = [float(v) for v in values]
    if not vals:
        raise InputError("no measurements to summarise")
    return {"min": min(vals), "median": statistics.median(vals), "max": max(vals),
            "repetitions": len(vals), **extra}


def machine_fingerprint(machine: dict, devices: list | None = None) -> str:
    """Hostname-free fingerprint of what the machine *is*: CPU model, cores, RAM total and the GPU
    devices (name, kind, total memory). Free/available figures are left out: they change by the minute."""
    gpus = sorted((d.get("name"), d.get("kind"), d.get("total_memory_bytes"))
                  for d in (devices or []) if isinstance(d, dict) and d.get("kind") in ("gpu", "igpu"))
    return fp_of({"cpu_model": machine.get("cpu_model"), "cores": machine.get("cores"),
                  "ram_total_bytes": machine.get("ram_total_bytes"), "gpus": [list(g) for g in gpus]})


# ---- the document and its accessors ------------------------------------------------------------
class MachineProfile:
    """A validated profile document with the accessors the cost model uses.

    Attributes:
        doc: the JSON document (dict) including ``kind`` and ``schema_version``.

    Missing figures raise InputError naming the section and how to measure it.
    """

    def __init__(self, doc: dict):
        doc = dict(doc)
        doc.setdefault("kind", KIND)
        doc.setdefault("schema_version", SCHEMA_VERSION)
        self.doc = validate_profile(doc)

    @property
    def fingerprint(self) -> str:
        """Fingerprint of the machine section (cpu model, cores, RAM total, GPUs)."""
        return self.doc["machine"]["fingerprint"]

    def _section(self, name: str):
        s = self.doc.get(name)
        if s is None or (isinstance(s, dict) and "unavailable" in s):
            why = s["unavailable"] if isinstance(s, dict) else "not in this profile"
            raise InputError(f"profile has no {name} figures ({why}); {MEASURE_HINT}")
        return s

    # disk
    def _disk_entry(self, queue_depth: int) -> dict:
        entries = sorted(self._section("disk")["random"], key=lambda e: e["queue_depth"])
        below = [e for e in entries if e["queue_depth"] <= queue_depth]
        return below[-1] if below else entries[0]

    def disk_read_gbps(self, queue_depth: int = 1) -> float:
        """Median random-read GB/s (1e9 B/s) at expert-sized blocks, at the nearest measured queue depth
        <= ``queue_depth`` (the smallest measured one when all are larger)."""
        return float(self._disk_entry(queue_depth)["read_gbps"]["median"])

    def disk_latency_s(self, queue_depth: int = 1) -> float:
        """p50 seconds per expert-block read at the nearest measured queue depth (as above)."""
        return float(self._disk_entry(queue_depth)["latency_ms"]["p50"]) / 1e3

    def disk_block_bytes(self) -> int:
        """Bytes per read the disk figures were measured at (the model's expert block)."""
        return int(self._section("disk")["block_bytes"])

    def disk_o_direct(self) -> bool:
        """Whether the disk figures bypass the page cache with O_DIRECT."""
        return bool(self._section("disk")["o_direct"])

    # RAM
    def checksum_gbps(self) -> float | None:
        """All-core crc32 GB/s (the engine checks every expert it streams), None in older profiles."""
        v = (self.doc.get("ram") or {}).get("checksum_gbps")
        return float(v["median"]) if isinstance(v, dict) and v.get("median") else None

    def ram_read_gbps(self) -> float:
        """Median all-core RAM read bandwidth, GB/s."""
        return float(self._section("ram")["read_gbps"]["median"])

    def ram_available_bytes(self) -> int:
        """MemAvailable when the profile was measured, bytes."""
        return int(self.doc["machine"]["ram_available_bytes"])

    # matmul
    def _matmul_entries(self, backend: str, device_index: int, fmt: str) -> list[dict]:
        rows = [e for e in self._section("matmul")
                if e["backend"] == backend and e["device_index"] == device_index and e["fmt"] == fmt]
        if not rows:
            have = sorted({f"{e['backend']}:{e['device_index']}:{e['fmt']}" for e in self._section("matmul")})
            raise InputError(f"profile has no matmul figure for {backend}:{device_index} at {fmt} "
                             f"(has {', '.join(have) or 'none'}); measure it with "
                             f"`colibri-plan profile --out profile.json --backends {backend}`")
        return rows

    def matmul_weight_gbps(self, backend: str, device_index: int, fmt: str, tokens: int = 1,
                           out_features: int | None = None, in_features: int | None = None) -> float:
        """Median weight bytes/s / 1e9 of ``matmul`` at the nearest measured token count, and at the
        nearest measured shape (in log out_features + log in_features) when a shape is given, else the
        median over the measured shapes."""
        rows = self._matmul_entries(backend, device_index, fmt)
        t_best = min({e["tokens"] for e in rows}, key=lambda t: (abs(math.log(t / tokens)), t))
        rows = [e for e in rows if e["tokens"] == t_best]
        if out_features and in_features:  # nearest in log(out), log(in): [I, H] and [H, I] differ
            rows = [min(rows, key=lambda e: abs(math.log(e["out_features"] / out_features))
                        + abs(math.log(e["in_features"] / in_features)))]
        return float(statistics.median(e["weight_gbps"]["median"] for e in rows))

    def expert_ffn_s(self, backend: str, device_index: int, fmt: str, experts: int) -> float:
        """Median seconds of one ``expert_ffn`` call over ``experts`` experts at 1 token, scaled linearly
        from the nearest measured expert count; experts in the device's own memory only (rows without
        ``memory`` or with ``"device"``), never the mapped rows of :meth:`mapped_expert_ffn_s`."""
        return self._ffn_s(backend, device_index, fmt, experts, "device")

    def mapped_expert_ffn_s(self, backend: str, device_index: int, fmt: str, experts: int) -> float:
        """As :meth:`expert_ffn_s` for the ``"memory": "mapped"`` rows: the experts in mapped page-locked
        host memory, read by the device over its link (InputError when the profile has none)."""
        return self._ffn_s(backend, device_index, fmt, experts, "mapped")

    def mapped_expert_ffn_gbps(self, backend: str, device_index: int, fmt: str, experts: int) -> float:
        """Weight GB/s (1e9 B/s) of the mapped-memory ``expert_ffn`` row nearest ``experts``: its
        weight_bytes / median seconds (a read over the link: the rate, unlike the seconds, carries over
        to another expert size); InputError without a mapped row. A row without weight_bytes: None
        (the caller sizes the seconds itself)."""
        e = self._ffn_row(backend, device_index, fmt, experts, "mapped")
        return float(e["weight_bytes"]) / float(e["seconds"]["median"]) / 1e9 if e.get("weight_bytes") \
            else None

    def _ffn_row(self, backend: str, device_index: int, fmt: str, experts: int, memory: str) -> dict:
        rows = [e for e in self._section("expert_ffn")
                if e["backend"] == backend and e["device_index"] == device_index and e["fmt"] == fmt
                and e.get("memory", "device") == memory]
        if not rows:
            what = "expert_ffn" if memory == "device" else "mapped-memory expert_ffn"
            raise InputError(f"profile has no {what} figure for {backend}:{device_index} at {fmt}; "
                             f"{MEASURE_HINT} --backends {backend}")
        return min(rows, key=lambda r: abs(r["experts"] - experts))

    def _ffn_s(self, backend: str, device_index: int, fmt: str, experts: int, memory: str) -> float:
        e = self._ffn_row(backend, device_index, fmt, experts, memory)
        return float(e["seconds"]["median"]) * experts / e["experts"]

    # links
    def link(self, backend: str, device_index: int) -> dict:
        """The links entry of one device (InputError when it was not measured)."""
        for e in self._section("links"):
            if e["backend"] == backend and e["device_index"] == device_index:
                return e
        raise InputError(f"profile has no host<->device link figure for {backend}:{device_index}; "
                         f"{MEASURE_HINT}")

    def _link_gbps(self, backend: str, device_index: int, key: str) -> float:
        e = self.link(backend, device_index)
        s = e.get(key)
        if s is None or "unavailable" in s:
            why = s["unavailable"] if isinstance(s, dict) else "not measured"
            raise InputError(f"profile has no {key} for {backend}:{device_index} ({why}); {MEASURE_HINT}")
        return float(s["median"])

    def h2d_gbps(self, backend: str, device_index: int, pinned: bool = True) -> float:
        """Median host-to-device GB/s at expert-sized blocks (RAM bandwidth for unified memory)."""
        return self._link_gbps(backend, device_index, "h2d_pinned_gbps" if pinned else "h2d_pageable_gbps")

    def d2h_gbps(self, backend: str, device_index: int, pinned: bool = True) -> float:
        """Median device-to-host GB/s at expert-sized blocks."""
        return self._link_gbps(backend, device_index, "d2h_pinned_gbps" if pinned else "d2h_pageable_gbps")

    def peer_gbps(self, src: str, dst: str) -> float | None:
        """Median GB/s (1e9 B/s) of GPU->GPU copies from device key ``src`` to ``dst`` ("cuda:0") at the
        expert block size; None when the profile has no such figure (older profile, one GPU, a failed
        pair)."""
        peers = self.doc.get("peer_links")
        for e in peers if isinstance(peers, list) else []:
            if e["src"] == src and e["dst"] == dst and "median" in e["copy_gbps"]:
                return float(e["copy_gbps"]["median"])
        return None

    def gpus(self) -> list[dict]:
        """Physical GPUs, kind gpu/igpu (DeviceInfo dicts: total/free memory, unified_memory flag).

        One card is usually listed by several backends (an H200 under cuda, opencl and vulkan); its
        memory must count once, so for each device name only the devices of the most capable backend
        that lists it are kept (cuda, then metal, vulkan, opencl).
        """
        devs = self.doc["devices"]
        if isinstance(devs, dict):
            return []
        gpus = [d for d in devs if d.get("kind") in ("gpu", "igpu")]
        rank = {"cuda": 0, "metal": 1, "vulkan": 2, "opencl": 3}
        best: dict[str, int] = {}
        for d in gpus:
            r = rank.get(d.get("backend"), 9)
            best[d.get("name")] = min(best.get(d.get("name"), 9), r)
        return [d for d in gpus if rank.get(d.get("backend"), 9) == best[d.get("name")]]

    def summary(self) -> dict:
        """A short machine summary for plan files."""
        m = self.doc["machine"]
        return {"fingerprint": self.fingerprint, "cpu_model": m["cpu_model"], "cores": m["cores"],
                "ram_total_bytes": m["ram_total_bytes"], "gpus": [g["name"] for g in self.gpus()]}


def load_profile(path: str | os.PathLike) -> MachineProfile:
    """Read and validate a profile file.

    Raises:
        InputError: the file does not exist.
        FormatError: bad JSON, another kind or schema version, or an invalid section.
    """
    doc = read_document(path, KIND, SCHEMA_VERSION)
    try:
        return MachineProfile(doc)
    except FormatError as exc:
        raise FormatError(f"{path}: {exc}") from None


def save_profile(profile: MachineProfile | dict, path: str | os.PathLike) -> Path:
    """Validate and write a profile atomically; returns the path.

    Raises:
        FormatError: the document is invalid (nothing is written).
    """
    doc = profile.doc if isinstance(profile, MachineProfile) else profile
    validate_profile(doc)
    body = {k: v for k, v in doc.items() if k not in ("kind", "schema_version")}
    return write_document(path, KIND, SCHEMA_VERSION, body)


def resolve_profile(path: str) -> tuple[MachineProfile, str]:
    """Load a profile file, or a profile shipped in ``colibri_plan/profiles`` by name
    (e.g. "published-6x-rtx5090").

    Returns:
        (profile, where it came from: the path or "shipped profile NAME").

    Raises:
        InputError: neither a file nor a shipped profile. FormatError: as :func:`load_profile`.
    """
    from importlib import resources

    p = Path(path)
    if p.is_file():
        return load_profile(p), str(p)
    name = path if path.endswith(".json") else f"{path}.json"
    shipped = resources.files("colibri_plan.profiles").joinpath(name)
    if shipped.is_file():
        with resources.as_file(shipped) as f:
            return load_profile(f), f"shipped profile {name}"
    raise InputError(f"profile {path} not found: not a file, nor a shipped profile (shipped: "
                     f"{', '.join(shipped_profile_names())}); measure this machine with `colibri-plan "
                     "profile --out profile.json`, or describe one with `colibri-plan profile synth --ram "
                     "64G ...`")


def shipped_profile_names() -> list[str]:
    """Names of the profiles shipped in ``colibri_plan/profiles`` (``--profile NAME``), sorted."""
    from importlib import resources

    return sorted(p.name[:-5] for p in resources.files("colibri_plan.profiles").iterdir()
                  if p.name.endswith(".json"))
