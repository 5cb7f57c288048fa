"""One report type for what a placement predicts and what a run measured, and the verify-report file.

:class:`RunReport` is what `run` prints, what `verify` compares and what `calibrate` fits on. The plan's
``predicted`` section (docs/plan-format.md) is the vocabulary: a run's measurements serialise to the same
keys (:meth:`RunReport.to_dict`), so predicted and measured read alike and no key is mapped by hand::

    {"tok_s", "decode_s_per_token", "disk_bytes_per_token",
     "terms": {"dense_s", "attention_s", "expert_layers_s", "expert_compute_s": {"cpu", "<device>"...},
               "disk_wait_s", "disk_read_s", "disk_busy_s", "transfer_s", "gpu_calls"},
     "hit_rate": {"vram", "ram_pinned", "lru", "disk"}, "lru_hit_rate", ...measured-only figures}

Every figure is per decode token unless its name says otherwise; a figure one side does not have
(a run on the CPU trunk does not time attention apart from the dense trunk; a plan has no peak RSS) is
None and left out. Measured ``dense_s + attention_s`` is always everything outside the routed experts:
where the run times attention (a device trunk), ``dense_s`` is the rest without it.

The verify report (JSON kind ``"verify-report"``, schema_version 2) holds a plan's ``predicted``
section, the run's ``measured`` one (this layout), the comparison and the verdict. ``measured`` may hold
``prefill_terms`` (the prompt's forward pass, :class:`RunReport`); it is optional, so version 2 reports
written before it load as they are (``prefill_terms`` None) and readers that predate it ignore it.
Version 1 reports (measured ``hit_rates`` with ``pinned``, ``expert_wall_s`` / ``expert_cpu_s`` /
``device_s``) are refused: re-run ``colibri-plan verify``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from colibri_plan.errors import FormatError
from colibri_plan.fileio import read_document, read_json_object, write_document

KIND = "verify-report"
SCHEMA_VERSION = 2
#: largest figure a report may hold (seconds, layers or calls per token): beyond it the report is corrupt
MAX_S_PER_TOKEN = 1e6
#: the tiers of ``hit_rate``, as the plan names them
HIT_TIERS = ("vram", "ram_pinned", "lru", "disk")
#: RunReport field -> key under ``terms`` (the plan's names)
TERM_KEYS = (("dense_s_per_token", "dense_s"), ("attention_s_per_token", "attention_s"),
             ("expert_layers_s_per_token", "expert_layers_s"),
             ("expert_compute_s_per_token", "expert_compute_s"),
             ("disk_wait_s_per_token", "disk_wait_s"), ("disk_read_s_per_token", "disk_read_s"),
             ("disk_busy_s_per_token", "disk_busy_s"), ("transfer_s_per_token", "transfer_s"),
             ("gpu_calls_per_token", "gpu_calls"))
_TERM_FIELDS = dict(TERM_KEYS)
#: the seconds of ``prefill_terms`` (totals over the prompt's forward pass); besides them it holds
#: ``expert_compute_s`` (per device), ``disk_bytes`` and ``hit_rate``
PREFILL_TERM_KEYS = ("experts_s", "disk_wait_s", "disk_read_s", "disk_busy_s")


@dataclass
class RunReport:
    """Decode speed of one placement, predicted (from a plan) or measured (from a run).

    Attributes (seconds and bytes per decode token unless the name says otherwise; None = not known):
        tok_s: decode tokens per second (1 / decode_s_per_token; 0.0 when no decode step was timed).
        decode_s_per_token: mean wall time of a decode step; decode_s_median: its median (measured).
        dense_s_per_token: everything outside the routed experts (measured: attention included unless
            attention_s_per_token is measured too, then without it); attention_s_per_token: KV-cache read
            (predicted; measured by a device trunk: KV append + attention of every layer).
        expert_layers_s_per_token: wall time inside the MoE layers' expert calls.
        expert_compute_s_per_token: {"cpu": s, "<backend>:<index>": s} expert compute per device
            (measured device time includes its activation transfers).
        disk_wait_s_per_token: time the CPU path waited for reads; disk_read_s_per_token: read time
            (predicted: all reads; measured: reader-thread time, overlapped); disk_busy_s_per_token: time
            the reads of a wave were in flight (measured).
        transfer_s_per_token, gpu_calls_per_token: activation transfers + call overhead, GPU layer calls
            (predicted).
        hit_rate: share of expert uses per tier {vram, ram_pinned, lru, disk} (disk = misses);
            lru_hit_rate: hits among the experts that go through the LRU (lru / (lru + disk)).
        disk_bytes_per_token; disk_read_gbps: disk bytes / busy time (the throughput streaming reached).
        tokens: generated ids (prompt excluded); prompt_tokens; decode_steps (tokens - 1); load_s:
            start-up (experts uploaded/read); prefill_s: the prompt's forward pass.
        expert_uses_per_token, peak_rss_bytes, resident_bytes {tier: bytes}, o_direct, io_warning,
            placement {tier: experts} (measured).
        cpu_path_layers, per_layer_s: the plan's per-layer CPU-path parts and layer times (predicted).
        repins, repin_bytes, repin_s: live re-pinning swaps over the decode, the bytes they read and the
            seconds they took (totals, not per token; measured, only when re-pinning is on).
        trunk_device: where the dense trunk, attention and KV cache ran ("cpu" or a device key like
            "cuda:0"; measured). trunk_bytes: {"dense": B, "kv": B} the device trunk held (measured,
            None on the CPU trunk).
        prefill_terms: the residency manager's figures of the prompt's forward pass (measured; totals
            over the whole prefill, not per token; None when the run did not collect them):
            {"experts_s" (wall time inside the MoE layers' expert calls, as the plan's
            ``predicted.prefill.terms.experts_s``), "expert_compute_s": {"cpu": s, "<device>": s},
            "disk_wait_s", "disk_read_s", "disk_busy_s" (as the decode terms), "disk_bytes",
            "hit_rate": {vram, ram_pinned, lru, disk}} (:data:`PREFILL_TERM_KEYS`).
    """

    # speed and its terms (seconds per decoded token)
    tok_s: float = 0.0
    decode_s_per_token: float = 0.0
    decode_s_median: float | None = None
    dense_s_per_token: float | None = None
    attention_s_per_token: float | None = None
    expert_compute_s_per_token: dict[str, float] = field(default_factory=dict)
    expert_layers_s_per_token: float | None = None
    transfer_s_per_token: float | None = None
    gpu_calls_per_token: float | None = None
    # where the experts were served from, and the disk
    hit_rate: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HIT_TIERS, 0.0))
    lru_hit_rate: float | None = None
    expert_uses_per_token: float | None = None
    disk_bytes_per_token: float = 0.0
    disk_wait_s_per_token: float | None = None
    disk_read_s_per_token: float | None = None
    disk_busy_s_per_token: float | None = None
    disk_read_gbps: float | None = None
    # the run (measured only)
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    decode_steps: int | None = None
    load_s: float | None = None
    prefill_s: float | None = None
    resident_bytes: dict[str, int] = field(default_factory=dict)
    peak_rss_bytes: int | None = None
    o_direct: bool | None = None
    io_warning: str | None = None
    placement: dict = field(default_factory=dict)
    cpu_path_layers: dict | None = None
    per_layer_s: list[float] | None = None
    # live re-pinning (measured, decode only; None when the plan's repin policy is off)
    repins: int | None = None
    repin_bytes: int | None = None
    repin_s: float | None = None
    # the trunk (measured)
    trunk_device: str | None = None
    trunk_bytes: dict | None = None
    # the prompt's forward pass (measured totals; None when not collected)
    prefill_terms: dict | None = None

    @property
    def memory_hit_rate(self) -> float:
        """Share of expert uses served without a disk read: 1 − hit_rate["disk"]."""
        return 1.0 - float(self.hit_rate.get("disk", 0.0))

    def to_dict(self) -> dict:
        """The plan's ``predicted`` layout (module docstring); None figures are left out."""
        out: dict = {}
        terms: dict = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name in _TERM_FIELDS:
                terms[_TERM_FIELDS[f.name]] = dict(v) if isinstance(v, dict) else v
            else:
                out[f.name] = v
        out["terms"] = terms
        return out

    @classmethod
    def from_dict(cls, d: dict, where: str = "report", section: str = "") -> RunReport:
        """From a plan's ``predicted`` section or a report's ``measured`` one (same layout).

        Raises:
            FormatError: not an object, ``terms`` missing, or a figure that is not a finite number
                >= 0 and <= MAX_S_PER_TOKEN (naming ``where`` and the field's path).
        """
        check_figures(d, where, section)
        terms = d["terms"]
        kw = {name: terms.get(key) for name, key in TERM_KEYS}
        kw["expert_compute_s_per_token"] = dict(terms.get("expert_compute_s") or {})
        names = {f.name for f in fields(cls)} - set(_TERM_FIELDS)
        kw.update({k: v for k, v in d.items() if k in names and k != "terms" and v is not None})
        hr = d.get("hit_rate")
        kw["hit_rate"] = {k: float((hr or {}).get(k, 0.0)) for k in HIT_TIERS}
        if kw.get("lru_hit_rate") is None and isinstance(hr, dict):
            streamed = kw["hit_rate"]["lru"] + kw["hit_rate"]["disk"]
            kw["lru_hit_rate"] = kw["hit_rate"]["lru"] / streamed if streamed else 0.0
        return cls(**kw)


def _bad_number(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return True
    if isinstance(v, int):  # math.isfinite overflows on an integer beyond a float (10**400)
        return not 0 <= v <= MAX_S_PER_TOKEN
    return not math.isfinite(v) or v < 0 or v > MAX_S_PER_TOKEN


def check_figures(d, where: str, section: str = "") -> None:
    """Check one predicted/measured section: an object with ``decode_s_per_token``, ``tok_s`` and
    ``terms``, every number in ``terms`` (and its per-device objects) finite, >= 0 and <= 1e6; the
    optional ``prefill_s`` too (or null), ``prompt_tokens`` a whole number >= 1 (or null).

    Raises:
        FormatError: naming ``where``, the field's path and the value.
    """
    pre = f"{section}." if section else ""
    if not isinstance(d, dict):
        raise FormatError(f"{where}: {section or 'section'} must be an object; re-run `colibri-plan verify`")
    for k in ("decode_s_per_token", "tok_s"):
        v = d.get(k)
        if _bad_number(v):
            raise FormatError(f"{where}: {pre}{k} must be a finite number >= 0 and <= {MAX_S_PER_TOKEN:g}, "
                              f"got {v!r}; re-run `colibri-plan verify` to get a clean report")
    terms = d.get("terms")
    if not isinstance(terms, dict):
        raise FormatError(f"{where}: {pre}terms is missing or not an object; re-run `colibri-plan verify`")
    for k, v in terms.items():
        items = v.items() if isinstance(v, dict) else [(None, v)]
        for kk, x in items:
            if x is None or isinstance(x, list):
                continue
            if _bad_number(x):
                name = f"{pre}terms.{k}" + (f".{kk}" if kk is not None else "")
                raise FormatError(f"{where}: {name} must be a finite number >= 0 and <= {MAX_S_PER_TOKEN:g}, "
                                  f"got {x!r}; re-run `colibri-plan verify` to get a clean report")
    # the prefill figures verify compares (a run's prompt forward pass; absent or null without one)
    v = d.get("prefill_s")
    if v is not None and _bad_number(v):
        raise FormatError(f"{where}: {pre}prefill_s must be a finite number >= 0 and <= {MAX_S_PER_TOKEN:g} "
                          f"(seconds) or null, got {v!r}; re-run `colibri-plan verify` to get a clean report")
    v = d.get("prompt_tokens")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise FormatError(f"{where}: {pre}prompt_tokens must be a whole number >= 1 or null, got {v!r}; "
                          "re-run `colibri-plan verify` to get a clean report")
    _check_shares(d.get("hit_rate"), where, f"{pre}hit_rate")
    _check_prefill_terms(d.get("prefill_terms"), where, f"{pre}prefill_terms")


def _check_shares(hr, where: str, name: str) -> None:
    if hr is not None and (not isinstance(hr, dict)
                           or any(_bad_number(x) or x > 1 for x in hr.values())):
        raise FormatError(f"{where}: {name} must map {', '.join(HIT_TIERS)} to shares in [0, 1], "
                          f"got {hr!r}; re-run `colibri-plan verify`")


def _check_prefill_terms(pt, where: str, name: str) -> None:
    """``prefill_terms`` absent or null (a report written before it existed, or a predicted section), or an
    object of seconds (finite, >= 0, <= 1e6), ``expert_compute_s`` of such seconds per device,
    ``disk_bytes`` a finite number >= 0 and ``hit_rate`` shares in [0, 1]."""
    if pt is None:
        return
    again = "; re-run `colibri-plan verify` to get a clean report"
    if not isinstance(pt, dict):
        raise FormatError(f"{where}: {name} must be an object or null, got {pt!r}{again}")
    seconds = [(k, pt.get(k)) for k in PREFILL_TERM_KEYS]
    comp = pt.get("expert_compute_s")
    comp = {} if comp is None else comp
    if not isinstance(comp, dict):  # [] or 0 too: only null stands for "none"
        raise FormatError(f"{where}: {name}.expert_compute_s must map devices to seconds, got {comp!r}"
                          + again)
    seconds += [(f"expert_compute_s.{k}", v) for k, v in comp.items()]
    for k, v in seconds:
        if v is not None and _bad_number(v):
            raise FormatError(f"{where}: {name}.{k} must be a finite number >= 0 and <= {MAX_S_PER_TOKEN:g} "
                              f"(seconds) or null, got {v!r}{again}")
    b = pt.get("disk_bytes")
    if b is not None and not (_finite(b, null=False) and b >= 0):
        raise FormatError(f"{where}: {name}.disk_bytes must be a finite number >= 0 or null, got {b!r}"
                          + again)
    _check_shares(pt.get("hit_rate"), where, f"{name}.hit_rate")


def save_report(report: dict, path: str | os.PathLike) -> Path:
    """Write a verify report atomically (kind "verify-report", schema_version :data:`SCHEMA_VERSION`)."""
    body = {k: v for k, v in report.items() if k not in ("kind", "schema_version")}
    return write_document(path, KIND, SCHEMA_VERSION, body)


def load_report(path: str | os.PathLike) -> dict:
    """Read and check a verify report (sections plan, verdict, predicted and measured; the last two as
    :func:`check_figures` says).

    Raises:
        InputError: missing file. FormatError: bad JSON or kind; an older schema_version (re-run
        verify); a missing section or a figure out of range (the message names it).
    """
    try:
        doc = read_document(path, KIND, SCHEMA_VERSION)
    except FormatError:
        old = read_json_object(path, "verify report")
        v = old.get("schema_version")
        if old.get("kind") == KIND and isinstance(v, int) and not isinstance(v, bool) and v < SCHEMA_VERSION:
            raise FormatError(f"{path} is a verify report of schema_version {v}, whose measured section "
                              "used other names than the plan's (hit_rates/pinned, expert_wall_s, "
                              f"expert_cpu_s, device_s); this colibri-plan reads version {SCHEMA_VERSION}: "
                              "re-run `colibri-plan verify` to make a new report") from None
        raise
    for section in ("predicted", "measured", "plan", "verdict"):
        if not isinstance(doc.get(section), dict):
            raise FormatError(f"verify report {path} lacks its {section!r} section; "
                              "re-run `colibri-plan verify`")
    for section in ("predicted", "measured"):
        check_figures(doc[section], f"verify report {path}", section)
    check_sections(doc, f"verify report {path}")
    return doc


def _finite(v, null: bool = True) -> bool:
    """A finite JSON number (bool excluded; an integer beyond a float is not), or None when ``null``."""
    if v is None:
        return null
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _bad(where: str, name: str, want: str, v) -> FormatError:
    shown = repr(v)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return FormatError(f"{where}: {name} must be {want}, got {shown}; re-run `colibri-plan verify`")


#: verdict field -> (check, what it must be)
_VERDICT = {"ok": (lambda v: isinstance(v, bool), "true or false"),
            "tok_s_ok": (lambda v: isinstance(v, bool), "true or false"),
            "hit_rate_ok": (lambda v: isinstance(v, bool), "true or false"),
            "token_exact": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
            "tok_s_ratio": (lambda v: _finite(v) and (v is None or v >= 0), "a finite number >= 0 or null"),
            "prefill_ratio": (lambda v: _finite(v) and (v is None or v >= 0), "a finite number >= 0 or null"),
            "prefill_ok": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
            "hit_rate_diff_points": (lambda v: _finite(v, null=False), "a finite number")}
_ROW_NUMBERS = ("predicted", "measured", "ratio")


def check_sections(doc: dict, where: str) -> None:
    """Check the sections the report page and ``calibrate`` read besides predicted/measured: ``model``,
    ``machine``, ``settings`` objects (when present), the ``verdict`` fields and the ``comparison`` rows
    (a list of objects; ``term`` and ``unit`` strings, ``predicted``/``measured``/``ratio`` finite numbers
    or null, ``diff_points`` a finite number).

    Raises:
        FormatError: naming ``where`` and the field.
    """
    for section in ("model", "machine", "settings", "reference"):
        if doc.get(section) is not None and not isinstance(doc[section], dict):
            raise _bad(where, section, "an object", doc[section])
    for section, key in (("model", "fingerprint"), ("machine", "fingerprint"), ("plan", "fingerprint")):
        v = (doc.get(section) or {}).get(key)
        if v is not None and not isinstance(v, str):
            raise _bad(where, f"{section}.{key}", "a string", v)
    for key, (ok, want) in _VERDICT.items():
        if key in doc["verdict"] and not ok(doc["verdict"][key]):
            raise _bad(where, f"verdict.{key}", want, doc["verdict"][key])
    rows = doc.get("comparison", [])
    if not isinstance(rows, list):
        raise _bad(where, "comparison", "a list of rows", rows)
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise _bad(where, f"comparison[{i}]", "an object", r)
        for key in ("term", "unit"):
            if key in r and not isinstance(r[key], str):
                raise _bad(where, f"comparison[{i}].{key}", "a string", r[key])
        for key in _ROW_NUMBERS:
            if not _finite(r.get(key)):
                raise _bad(where, f"comparison[{i}].{key}", "a finite number or null", r[key])
        if "diff_points" in r and not _finite(r["diff_points"], null=False):
            raise _bad(where, f"comparison[{i}].diff_points", "a finite number", r["diff_points"])
