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

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from colibri_plan.errors import FormatError
from colibri_plan.fileio import read_document, read_json_object, write_document
from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

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
            placement {tier: experts} (measured). page_cache_hit_rate: with buffered reads (a plan that
            chose them), the share of disk uses whose expert the plan's page cache kept (measured; None
            with O_DIRECT), as the plan's ``predicted.page_cache.hit_rate``.
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
    page_cache_hit_rate: float | None = None
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
        for fld in fields(self):
            v = getattr(self, fld.name)
            if v is None:
                continue
            if fld.name in _TERM_FIELDS:
                terms[_TERM_FIELDS[fld.name]] = dict(v) if isinstance(v, dict) else v
            else:
                out[fld.name] = v
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
        names = {fld.name for fld in fields(cls)} - set(_TERM_FIELDS)
        kw.update({k: v for k, v in d.items() if k in names and k != "terms" and v is not None})
        hr = d.get("hit_rate")
        kw["hit_rate"] = {k: float((hr or {}).get(k, 0.0)) for k in HIT_TIERS}
        if kw.get("lru_hit_rate") is None and isinstance(hr, dict):
            streamed = kw["hit_rate"]["lru"] + kw["hit_rate"]["disk"]
            kw["lru_hit_rate"] = kw["hit_rate"]["lru"] / streamed if streamed else 0.0
        return cls(**kw)


def _at(where: str, section: str = "") -> At:
    """A report's place in messages (values shown as Python writes them)."""
    at = At(where, _AGAIN, repr_values=True)
    return at / section if section else at


#: what every refusal of a report advises
_AGAIN = "re-run `colibri-plan verify` to get a clean report"


def _seconds(d: dict, key, at: At, null: bool = True) -> None:
    """``d[key]``: seconds (or per token), a finite number >= 0 and <= MAX_S_PER_TOKEN (null: none)."""
    f.number(d, key, at, lo=0, hi=MAX_S_PER_TOKEN, optional=null, unit=" (seconds) or null" if null else "")


def check_figures(d, where: str, section: str = "") -> None:
    """Check one predicted/measured section: an object with ``decode_s_per_token``, ``tok_s`` and
    ``terms``, every number in ``terms`` (and its per-device objects) finite, >= 0 and <= 1e6; the
    optional ``prefill_s`` too (or null), ``prompt_tokens`` a whole number >= 1 (or null).

    Raises:
        FormatError: naming ``where``, the field's path and the value.
    """
    at = _at(where, section)
    if not isinstance(d, dict):
        at.bad("an object", d)
    for k in ("decode_s_per_token", "tok_s"):
        _seconds(d, k, at, null=False)
    terms = f.mapping(d, "terms", at)
    for k, v in terms.items():
        if isinstance(v, dict):            # per device
            for kk, x in v.items():
                if not isinstance(x, list):
                    f.number(v, kk, at / "terms" / k, lo=0, hi=MAX_S_PER_TOKEN, optional=True)
        elif not isinstance(v, list):      # null: not measured; lists: per layer
            f.number(terms, k, at / "terms", lo=0, hi=MAX_S_PER_TOKEN, optional=True)
    # the prefill figures verify compares (a run's prompt forward pass; absent or null without one)
    _seconds(d, "prefill_s", at)
    f.whole(d, "prompt_tokens", at, lo=1, optional=True, want="a whole number >= 1 or null")
    _check_shares(d, "hit_rate", at)
    _check_prefill_terms(d, at)


def _check_shares(d: dict, key: str, at: At) -> None:
    hr = d.get(key)
    if hr is not None and (not isinstance(hr, dict)
                           or not all(f.is_number(x) and 0 <= x <= 1 for x in hr.values())):
        (at / key).refuse(f"must map {', '.join(HIT_TIERS)} to shares in [0, 1], got {at.show(hr)}")


def _check_prefill_terms(d: dict, at: At) -> None:
    """``prefill_terms`` absent or null (a report written before it existed, or a predicted section), or an
    object of seconds (finite, >= 0, <= 1e6), ``expert_compute_s`` of such seconds per device,
    ``disk_bytes`` a finite number >= 0 and ``hit_rate`` shares in [0, 1]."""
    pt = f.mapping(d, "prefill_terms", at, optional=True, want="an object or null")
    if pt is None:
        return
    here = at / "prefill_terms"
    for k in PREFILL_TERM_KEYS:
        _seconds(pt, k, here)
    comp = pt.get("expert_compute_s")
    if comp is not None and not isinstance(comp, dict):   # [] or 0 too: only null stands for "none"
        (here / "expert_compute_s").refuse(f"must map devices to seconds, got {at.show(comp)}")
    for k in comp or {}:
        _seconds(comp, k, here / "expert_compute_s")
    f.number(pt, "disk_bytes", here, lo=0, optional=True, unit=" or null")
    _check_shares(pt, "hit_rate", here)


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
        if old.get("kind") == KIND and f.is_whole(v) and v < SCHEMA_VERSION:
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


#: verdict field -> (reader, its keyword arguments)
_VERDICT = {"ok": (f.flag, {}), "tok_s_ok": (f.flag, {}), "hit_rate_ok": (f.flag, {}),
            "token_exact": (f.flag, {"optional": True, "want": "true, false or null"}),
            "prefill_ok": (f.flag, {"optional": True, "want": "true, false or null"}),
            "tok_s_ratio": (f.number, {"optional": True, "lo": 0, "unit": " or null"}),
            "prefill_ratio": (f.number, {"optional": True, "lo": 0, "unit": " or null"}),
            "hit_rate_diff_points": (f.number, {})}
_ROW_NUMBERS = ("predicted", "measured", "ratio")


def check_sections(doc: dict, where: str) -> None:
    """Check the sections the report page and ``calibrate`` read besides predicted/measured: ``model``,
    ``machine``, ``settings`` objects (when present), the ``verdict`` fields and the ``comparison`` rows
    (a list of objects; ``term`` and ``unit`` strings, ``predicted``/``measured``/``ratio`` finite numbers
    or null, ``diff_points`` a finite number).

    Raises:
        FormatError: naming ``where`` and the field.
    """
    at = At(where, "re-run `colibri-plan verify`", repr_values=True)
    for section in ("model", "machine", "settings", "reference"):
        f.mapping(doc, section, at, optional=True)
    for section in ("model", "machine", "plan"):
        if doc.get(section) is not None:
            f.text(doc[section], "fingerprint", at / section, optional=True)
    for key, (read, kw) in _VERDICT.items():
        if key in doc["verdict"]:
            read(doc["verdict"], key, at / "verdict", **kw)
    if "comparison" not in doc:
        return
    for r, here in f.each(doc, "comparison", at, want="a list of rows"):
        if not isinstance(r, dict):
            here.bad("an object", r)
        for key in ("term", "unit"):
            f.text(r, key, here, optional=key not in r)
        for key in _ROW_NUMBERS:
            f.number(r, key, here, optional=True, unit=" or null")
        if "diff_points" in r:
            f.number(r, "diff_points", here)
