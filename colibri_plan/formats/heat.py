"""Expert heat: per (MoE layer, expert) routing counts, and the files that hold them.

Three sources are read:

* the JSON heat document written by :func:`save_heat` (kind ``"heat"``, schema_version 1);
* colibrì's usage/STATS text (``route_trace.h`` format): a ``-1 <n_layers> <n_experts>`` header, an
  optional ``-2 <format_version> <engine_id>`` line, then sparse ``<layer> <expert> <count>`` rows
  (also headerless triples, and the legacy binary ``IKU1`` layout: magic, uint32 n_layers, uint32
  n_experts, then a dense uint32 array);
* the real OLMoE / Mixtral routing counts shipped in ``colibri_plan/data``
  (see :mod:`colibri_plan.heatsynth`).

A *count* is a selection: one (token, layer, expert) routing event. With ``tokens`` known, the selection
probability of an expert is ``count / tokens``; each row then sums to ``top_k``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import (
    atomic_write_bytes,
    atomic_write_text,
    check_input_file,
    fingerprint,
    read_document,
    write_document,
)
from colibri_plan.formats import fields as f
from colibri_plan.formats.arch import MAX_ROUTED_EXPERTS
from colibri_plan.formats.heat_fields import MAX_COUNT, MAX_EXPERTS, check_count_table, heat_at, whole_counts
from colibri_plan.formats.heat_trace import RoutingTrace

HEAT_KIND = "heat"
HEAT_SCHEMA_VERSION = 1
#: colibrì's RT_FORMAT_VERSION of the usage text format.
USAGE_FORMAT_VERSION = 1


@dataclass
class Heat:
    """Routing statistics of one model.

    Attributes:
        n_experts: routed experts per MoE layer (E).
        layers: MoE layer ids the rows of ``counts`` refer to (ascending, unique).
        counts: float64 ``[len(layers), E]`` selection counts (>= 0, finite).
        top_k: experts selected per token and layer (None if unknown).
        tokens: tokens observed (None if unknown).
        source: where the counts came from (free text).
        model_fingerprint: :meth:`ModelSpec.fingerprint` of the model, when known.
        n_model_layers: the ``-1`` header's layer count of a colibrì usage file (None if unknown).
        engine_id: the ``-2`` header's engine hash of a colibrì usage file (None if absent).
        trace: optional token-level routing trace (:class:`RoutingTrace`; `run --stats-out` writes one).

    Raises:
        InputError: shapes disagree, or counts are negative / not finite.
    """

    n_experts: int
    layers: tuple[int, ...]
    counts: np.ndarray
    top_k: int | None = None
    tokens: int | None = None
    source: str = ""
    model_fingerprint: str | None = None
    n_model_layers: int | None = None
    engine_id: int | None = None
    warnings: list[str] = field(default_factory=list, compare=False)
    trace: RoutingTrace | None = field(default=None, compare=False)

    def __post_init__(self):
        self.layers = tuple(int(x) for x in self.layers)
        self.counts = np.asarray(self.counts, dtype=np.float64)
        if self.n_experts < 1:
            raise InputError(f"heat: n_experts must be >= 1, got {self.n_experts}")
        if self.counts.shape != (len(self.layers), self.n_experts):
            got = (f"{self.counts.shape[0]} rows x {self.counts.shape[1]} experts" if self.counts.ndim == 2
                   else f"{self.counts.size} values")
            raise InputError(f"heat: counts are {got}, expected {len(self.layers)} rows (one per layer id) "
                             f"x {self.n_experts} experts")
        if len(set(self.layers)) != len(self.layers) or any(x < 0 for x in self.layers):
            raise InputError(f"heat: layer ids must be unique and >= 0, got {self.layers[:8]}...")
        if not np.all(np.isfinite(self.counts)) or np.any(self.counts < 0):
            raise InputError("heat: counts must be finite and >= 0")
        if self.top_k is not None and not 1 <= self.top_k <= self.n_experts:
            raise InputError(f"heat: top_k {self.top_k} outside 1..{self.n_experts}")
        if self.tokens is not None and self.tokens < 0:
            raise InputError(f"heat: tokens must be >= 0, got {self.tokens}")
        self._check_tokens()

    def _check_tokens(self) -> None:
        """With ``tokens`` known, an expert is chosen at most once per token, and with ``top_k`` too every
        row that saw tokens sums to tokens x top_k (within the rounding of whole counts: one selection per
        expert). A row of zeros is a layer that was not observed (an MTP head).

        Raises:
            InputError: naming the first row that disagrees (probabilities would be off by its ratio).
        """
        if not self.tokens or not self.counts.size:
            return
        if self.counts.max() > self.tokens:
            i, e = np.unravel_index(int(self.counts.argmax()), self.counts.shape)
            raise InputError(f"heat: layer {self.layers[i]} expert {e} was selected {self.counts[i, e]:.0f} "
                             f"times in {self.tokens} tokens (at most once per token); tokens or counts are "
                             "wrong: re-create the heat")
        if self.top_k is None:
            return
        want = float(self.tokens) * self.top_k
        sums = self.counts.sum(axis=1)
        off = np.flatnonzero((sums > 0) & (np.abs(sums - want) > self.n_experts + 1e-9 * want))
        if off.size:
            i = int(off[0])
            raise InputError(f"heat: layer {self.layers[i]} counts sum to {sums[i]:.0f} selections, but "
                             f"{self.tokens} tokens x top_k {self.top_k} make {want:.0f}; tokens or counts "
                             f"are wrong ({off.size} row(s) disagree): re-create the heat")

    def probabilities(self, top_k: int | None = None) -> np.ndarray:
        """Selection probability per token, float64 ``[rows, E]``, each value in [0, 1].

        ``counts / tokens`` when ``tokens`` is known (clipped to 1), else the row's counts scaled to sum
        to ``top_k`` with no value above 1 (water-filling the excess onto the other selected experts; a
        row with no counts becomes uniform ``top_k / E``).

        Raises:
            InputError: neither tokens nor top-k is known.
        """
        k = top_k if top_k is not None else self.top_k
        if self.tokens:
            p = self.counts / float(self.tokens)
        elif k is not None:
            rows = [_waterfill(row, k, self.n_experts) for row in self.counts]
            p = np.array(rows).reshape(self.counts.shape)
        else:
            raise InputError(f"heat from {self.source or 'unknown source'} has neither a token count nor "
                             "a top-k; pass the model (--model) so its top-k can be used")
        return np.clip(p, 0.0, 1.0)

    def row(self, layer: int) -> np.ndarray:
        """Counts ``[E]`` of MoE layer ``layer``. Raises InputError if the layer has no row."""
        try:
            return self.counts[self.layers.index(int(layer))]
        except ValueError:
            raise InputError(f"heat has no row for layer {layer} (rows: {self.layers[0]}..{self.layers[-1]})"
                             ) from None

    def fingerprint(self) -> str:
        """fileio.fingerprint of the counts, layers, top-k and tokens (16 hex chars)."""
        return fingerprint({"n_experts": self.n_experts, "layers": list(self.layers), "top_k": self.top_k,
                            "tokens": self.tokens, "counts": [float(x) for x in self.counts.ravel()]})

    def total(self) -> float:
        """Total selections (sum of counts)."""
        return float(self.counts.sum())

    def to_dict(self) -> dict:
        """JSON-ready body (without kind/schema_version). Counts are written as whole selections (rounded;
        a positive count below 1 is kept as 1), the only counts :meth:`from_dict` reads back."""
        rows = [[int(v) for v in r] for r in whole_counts(self.counts)]
        return {"n_experts": self.n_experts, "layers": list(self.layers), "top_k": self.top_k,
                "tokens": self.tokens, "source": self.source, "model_fingerprint": self.model_fingerprint,
                "n_model_layers": self.n_model_layers, "engine_id": self.engine_id, "counts": rows,
                **({"trace": self.trace.to_dict()} if self.trace is not None else {})}

    @classmethod
    def from_dict(cls, d: dict, where: str = "heat document") -> Heat:
        """Inverse of :meth:`to_dict`. Raises FormatError on missing or malformed fields (a count table
        whose rows or experts do not match ``layers`` / ``n_experts`` is named in those terms; counts must
        be whole JSON numbers in 0..2**53-1, tokens / n_model_layers / top_k / engine_id whole numbers in
        range)."""
        at = heat_at(where)
        f.document(d, at)
        check_count_table(d, at)
        whole = dict(at=at, integral_floats=True)   # JSON writers may print every number as a float
        try:
            n = f.whole(d, "n_experts", lo=1, hi=MAX_EXPERTS, **whole)
            layers = [f.whole(d["layers"], i, at / "layers", lo=0, hi=2**31 - 1, integral_floats=True)
                      for i in range(len(f.items(d, "layers", at)))]
            n_model = f.whole(d, "n_model_layers", lo=1, hi=2**31 - 1, optional=True, **whole)
            if n_model is not None and layers and max(layers) > n_model:
                at.fail(f"layer {max(layers)} is beyond n_model_layers = {n_model}")
            return cls(n_experts=n, layers=tuple(layers),
                       counts=np.asarray(d["counts"], dtype=np.float64).reshape(len(layers), -1)
                       if layers else np.zeros((0, n)),
                       top_k=f.whole(d, "top_k", lo=1, hi=n, optional=True, **whole),
                       tokens=f.whole(d, "tokens", lo=0, hi=MAX_COUNT - 1, optional=True, **whole),
                       source=str(d.get("source", "")),
                       model_fingerprint=d.get("model_fingerprint"), n_model_layers=n_model,
                       engine_id=f.whole(d, "engine_id", lo=0, hi=2**32 - 1, optional=True, **whole),
                       trace=None if d.get("trace") is None else RoutingTrace.from_dict(d["trace"], n, where))
        except KeyError as exc:
            raise FormatError(f"{where} has no {exc.args[0]}; re-create it") from exc
        except (TypeError, ValueError) as exc:
            raise FormatError(f"{where} is malformed ({type(exc).__name__}: {exc}); re-create it") from exc
        except FormatError:
            raise
        except InputError as exc:
            raise FormatError(f"{where} is inconsistent: {exc}") from exc


def fnv1a32(text: str) -> int:
    """FNV-1a 32-bit hash: colibrì's engine id in the usage ``-2`` header ("glm_moe_dsa" -> 3815245270)."""
    h = 0x811C9DC5
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def _waterfill(row: np.ndarray, k: int, n_experts: int) -> np.ndarray:
    """Scale non-negative counts ``[E]`` to sum min(k, #non-zero) with every value <= 1."""
    if row.sum() <= 0:
        return np.full(n_experts, k / n_experts)
    out = np.zeros_like(row)
    capped = np.zeros(row.size, dtype=bool)
    for _ in range(row.size):
        free = np.where(capped, 0.0, row)
        rest = k - capped.sum()
        if free.sum() <= 0 or rest <= 0:
            break
        out = np.where(capped, 1.0, free / free.sum() * rest)
        over = (out > 1.0) & ~capped
        if not over.any():
            break
        capped |= over
    return np.minimum(out, 1.0)


def save_heat(heat: Heat, path: str | os.PathLike) -> Path:
    """Write ``heat`` as a JSON document (kind "heat", schema_version 1), atomically."""
    return write_document(path, HEAT_KIND, HEAT_SCHEMA_VERSION, heat.to_dict())


def load_heat(path: str | os.PathLike) -> Heat:
    """Read a heat file: JSON heat document, colibrì usage/STATS text, or binary IKU1 (auto-detected).

    Raises:
        InputError: the file does not exist.
        FormatError: the file is corrupt; the message names the line.
    """
    path = check_input_file(path, "heat file")
    head = path.read_bytes()[:64]
    if head.startswith(b"IKU1"):
        return read_iku1(path)
    if head.lstrip().startswith(b"{"):
        return Heat.from_dict(read_document(path, HEAT_KIND, HEAT_SCHEMA_VERSION), where=str(path))
    return read_usage_text(path)


def read_usage_text(path: str | os.PathLike, n_experts: int | None = None) -> Heat:
    """Parse colibrì's usage/STATS text (``-1`` header, optional ``-2``, ``<layer> <expert> <count>``).

    A zero-byte file is an empty history. Without a ``-1`` header (legacy headerless triples) the expert
    count is ``n_experts`` if given, else the largest expert id + 1. Repeated (layer, expert) rows add up.
    Rows: the MoE layers that appear in the file, ascending.

    Raises:
        InputError: the file does not exist.
        FormatError: a line is not 3 integers, a count is negative, or an id is out of range; the message
            names the file and line number.
    """
    path = check_input_file(path, "usage file")
    try:
        text = path.read_text(encoding="ascii")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: not a colibrì usage text file (non-ASCII byte at {exc.start})") from exc
    n_model_layers, engine_id, entries = None, None, []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        try:
            a, b, c = (int(x) for x in parts) if len(parts) == 3 else (None, None, None)
        except ValueError:
            a = None
        if a is None:
            raise FormatError(f"{path}:{lineno}: expected three integers '<layer> <expert> <count>', "
                              f"got {line[:60]!r}")
        if a == -1:
            if not (1 <= b < 2**31 and 1 <= c <= MAX_EXPERTS):
                raise FormatError(f"{path}:{lineno}: header '-1 {b} {c}' needs n_layers >= 1 and "
                                  f"1 <= n_experts <= {MAX_EXPERTS}")
            n_model_layers, n_experts = b, c
        elif a == -2:
            if b != USAGE_FORMAT_VERSION:
                raise FormatError(f"{path}:{lineno}: usage format version {b}; this reader knows "
                                  f"version {USAGE_FORMAT_VERSION}")
            engine_id = c
        elif a < 0:
            raise FormatError(f"{path}:{lineno}: unknown header row {a}")
        else:
            if b < 0 or c < 0:
                raise FormatError(f"{path}:{lineno}: expert id and count must be >= 0, got {line!r}")
            if b >= MAX_EXPERTS or c >= MAX_COUNT or a >= 2**31:
                raise FormatError(f"{path}:{lineno}: layer, expert id or count too large in {line[:60]!r} "
                                  f"(ids below {MAX_EXPERTS} experts, counts below 2**53)")
            if n_experts is not None and b >= n_experts:
                raise FormatError(f"{path}:{lineno}: expert {b} out of range "
                                  f"(header says {n_experts} experts)")
            if n_model_layers is not None and a > n_model_layers:  # the MTP row may be n_layers itself
                raise FormatError(f"{path}:{lineno}: layer {a} out of range "
                                  f"(header says {n_model_layers} layers)")
            entries.append((a, b, c))
    if n_experts is None:
        n_experts = max((e for _, e, _ in entries), default=-1) + 1
        if n_experts == 0:
            raise FormatError(f"{path}: no header and no rows: cannot tell the expert count")
    layers = sorted({layer for layer, _, _ in entries})
    if len(layers) * n_experts > MAX_ROUTED_EXPERTS:  # a few short lines must not size a huge table
        raise FormatError(f"{path}: {len(layers)} layers x {n_experts} experts is more than "
                          f"{MAX_ROUTED_EXPERTS:,} routed experts; the file is corrupt")
    index = {layer: i for i, layer in enumerate(layers)}
    counts = np.zeros((len(layers), n_experts), dtype=np.float64)
    for layer, e, c in entries:
        counts[index[layer], e] += c
    return Heat(n_experts=n_experts, layers=tuple(layers), counts=counts, source=f"colibri usage: {path}",
                n_model_layers=n_model_layers, engine_id=engine_id)


def write_usage_text(heat: Heat, path: str | os.PathLike) -> Path:
    """Write ``heat`` as colibrì usage text, atomically: ``-1 <n_layers> <E>``, ``-2 1 <engine_id>`` when
    the engine id is known, then non-zero rows layer-major, expert-ascending, counts rounded to integers
    (a positive count below 1 is kept as 1). An all-zero heat gives a zero-byte file, as colibrì writes."""
    n_layers = heat.n_model_layers if heat.n_model_layers is not None else (max(heat.layers, default=-1) + 1)
    if heat.counts.size and heat.counts.max() >= MAX_COUNT:
        raise InputError(f"heat ({heat.source}): a count of {heat.counts.max():.3g} selections is too large "
                         "for a usage file (counts must stay below 2**53)")
    counts = whole_counts(heat.counts).astype(np.int64)
    if not counts.any():
        return atomic_write_bytes(path, b"")
    lines = [f"-1 {n_layers} {heat.n_experts}"]
    if heat.engine_id is not None:
        lines.append(f"-2 {USAGE_FORMAT_VERSION} {heat.engine_id}")
    for i, layer in enumerate(heat.layers):
        for e in np.flatnonzero(counts[i]):
            lines.append(f"{layer} {e} {counts[i, e]}")
    return atomic_write_text(path, "\n".join(lines) + "\n")


def read_iku1(path: str | os.PathLike) -> Heat:
    """Read the legacy binary ``IKU1`` usage layout (little-endian uint32 header and dense counts).

    Raises:
        FormatError: truncated or inconsistent file.
    """
    data = Path(path).read_bytes()
    if len(data) < 12 or data[:4] != b"IKU1":
        raise FormatError(f"{path}: not an IKU1 file (too short or bad magic)")
    n_layers, n_experts = struct.unpack_from("<II", data, 4)
    need = 12 + 4 * n_layers * n_experts
    if n_layers < 1 or n_experts < 1 or len(data) != need:
        raise FormatError(f"{path}: IKU1 header says {n_layers}x{n_experts} counts ({need} bytes), file has "
                          f"{len(data)} bytes")
    counts = np.frombuffer(data, dtype="<u4", offset=12).reshape(n_layers, n_experts).astype(np.float64)
    keep = np.flatnonzero(counts.sum(axis=1) > 0)  # dense rows are all zero
    return Heat(n_experts=n_experts, layers=tuple(int(x) for x in keep), counts=counts[keep],
                source=f"colibri IKU1: {path}", n_model_layers=n_layers)
