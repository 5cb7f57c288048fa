"""The plan file: where every expert lives, the budgets it was made for, and what it predicts.

JSON document of kind ``"plan"``, schema_version 1 (docs/plan-format.md), written atomically. The engine's
residency manager reads only this file. :func:`load_plan` checks the structure before anything uses it:
every expert of every MoE layer exactly once, ids in range, known devices, non-negative slots, and the
budgets (:func:`validate_plan`); a corrupt file raises FormatError.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_plan.errors import FormatError, InputError, MismatchError
from colibri_plan.fileio import read_document, write_document
from colibri_plan.formats.plan_model import check_model  # noqa: F401 - re-exported
from colibri_plan.formats.plan_prefill import check_prefill
from colibri_plan.formats.plan_trunk import check_trunk_budgets, parse_trunk

KIND = "plan"
SCHEMA_VERSION = 1
TIER_RAM = -1
TIER_DISK = -2
#: the host tiers a plan's ``compute`` section assigns a processor ("cpu" or a unified device key)
COMPUTE_TIERS = ("ram_pinned", "lru", "disk")
_TOP_KEYS = ("model", "profile", "heat", "budgets", "expert_format", "devices", "layers", "predicted",
             "solver")


@dataclass
class Plan:
    """A plan document (``doc``, the parsed JSON including kind and schema_version) with accessors."""

    doc: dict

    @property
    def model_fingerprint(self) -> str:
        return self.doc["model"]["fingerprint"]
    @property
    def profile_fingerprint(self) -> str | None:
        return self.doc["profile"].get("fingerprint")

    @property
    def n_experts(self) -> int:
        return int(self.doc["model"]["n_experts"])
    @property
    def expert_bytes(self) -> int:
        return int(self.doc["model"]["expert_bytes"])

    @property
    def device_keys(self) -> list[str]:
        return [d["key"] for d in self.doc["devices"]]

    @property
    def layer_ids(self) -> list[int]:
        return [int(entry["layer"]) for entry in self.doc["layers"]]

    @property
    def read_threads(self) -> int:
        """Concurrent O_DIRECT reads the engine should use: ``resources.disk_queue_depth``, the queue depth
        whose disk figure the cost model assumed (8 when the plan does not record one)."""
        qd = (self.doc.get("resources") or {}).get("disk_queue_depth")
        return max(1, int(qd)) if isinstance(qd, (int, float)) and not isinstance(qd, bool) else 8

    def layer(self, layer_id: int) -> dict:
        """Tiers of one MoE layer: {"layer", "vram": {key: [ids]}, "ram_pinned", "lru_slots", "disk"}.

        Raises:
            MismatchError: the plan has no such layer.
        """
        for entry in self.doc["layers"]:
            if int(entry["layer"]) == int(layer_id):
                return entry
        raise MismatchError(f"plan has no MoE layer {layer_id} (layers {self.layer_ids[:3]}...)")

    def tiers(self) -> np.ndarray:
        """int64 ``[rows, E]``: device position in ``devices`` (0..), TIER_RAM (-1) or TIER_DISK (-2)."""
        out = np.full((len(self.doc["layers"]), self.n_experts), TIER_DISK, dtype=np.int64)
        keys = self.device_keys
        for i, entry in enumerate(self.doc["layers"]):
            for key, ids in entry["vram"].items():
                out[i, ids] = keys.index(key)
            out[i, entry["ram_pinned"]] = TIER_RAM
        return out

    def lru_slots(self) -> np.ndarray:
        """int64 ``[rows]`` LRU slots per layer."""
        return np.array([int(e["lru_slots"]) for e in self.doc["layers"]], dtype=np.int64)

    def counts(self) -> dict:
        """Experts per tier over the whole model: {"<device>": n, "ram_pinned", "lru_slots", "disk"}."""
        t = self.tiers()
        out = {k: int(np.sum(t == i)) for i, k in enumerate(self.device_keys)}
        out.update(ram_pinned=int(np.sum(t == TIER_RAM)), lru_slots=int(self.lru_slots().sum()),
                   disk=int(np.sum(t == TIER_DISK)))
        return out


def layers_from_tiers(layer_ids, tiers: np.ndarray, lru_slots: np.ndarray, device_keys: list[str],
                      probs: np.ndarray | None = None) -> list:
    """Per-layer tier lists for a plan document from a tier array ``[rows, E]`` (see :meth:`Plan.tiers`).

    With ``probs`` ``[rows, E]`` each list is ordered hottest first and the layer carries ``"p"``, the
    selection probability of every expert (id order, 6 significant digits).
    """
    out = []
    probs = None if probs is None else np.asarray(probs, dtype=np.float64)
    for i, (lid, row, slots) in enumerate(zip(layer_ids, np.asarray(tiers), np.asarray(lru_slots))):
        def ids(mask, i=i):
            sel = np.flatnonzero(mask)
            if probs is not None:
                sel = sel[np.argsort(-probs[i, sel], kind="stable")]
            return sel.tolist()

        entry = {"layer": int(lid),
                 "vram": {k: ids(row == d) for d, k in enumerate(device_keys) if np.any(row == d)},
                 "ram_pinned": ids(row == TIER_RAM), "lru_slots": int(slots), "disk": ids(row == TIER_DISK)}
        if probs is not None:
            entry["p"] = [float(f"{v:.6g}") for v in probs[i]]
        out.append(entry)
    return out


def layer_probabilities(plan: Plan) -> np.ndarray | None:
    """float64 ``[rows, E]`` selection probabilities stored in the plan (None if it has none)."""
    if not all("p" in e for e in plan.doc["layers"]):
        return None
    return np.array([e["p"] for e in plan.doc["layers"]], dtype=np.float64)


def _fail(where: str, what: str):
    raise FormatError(f"plan {where}: {what}; re-create the plan with `colibri-plan solve`")


# (dotted path, type, constraint) of every section and figure a plan's readers use: "object", "list",
# "str", "bool", "int" or "num" (a finite JSON number, bools excluded); the constraint is a closed range
# (lo, hi) with None for no bound. A "?" suffix marks an optional entry (absent or null is fine); the
# figures under "predicted." are required of plan files (plan show, run and verify report them).
_FIELDS = (
    ("model", "object", None), ("model.name", "str", None), ("model.fingerprint", "str", None),
    ("model.n_experts", "int", (1, None)), ("model.expert_bytes", "int", (1, None)),
    ("model.moe_layers", "list", None), ("model.top_k?", "int", (1, None)),
    ("model.n_layers?", "int", (1, None)),
    ("profile", "object", None), ("profile.fingerprint?", "str", None),
    ("heat", "object", None), ("heat.source?", "str", None),
    ("budgets", "object", None), ("budgets.ram_budget_bytes", "num", (0, None)),
    ("budgets.vram_budget_bytes", "object", None), ("budgets.dense_bytes?", "num", (0, None)),
    ("budgets.kv_bytes?", "num", (0, None)), ("budgets.context_tokens?", "int", (0, None)),
    ("expert_format", "str", None), ("devices", "list", None), ("layers", "list", None),
    ("dense_format?", "str", None),
    ("predicted", "object", None), ("predicted.tok_s", "num", (0, None)),
    ("predicted.decode_s_per_token", "num", (0, None)), ("predicted.disk_bytes_per_token", "num", (0, None)),
    ("predicted.terms", "object", None),
    *((f"predicted.terms.{k}", "num", (0, None))
      for k in ("dense_s", "attention_s", "expert_layers_s", "disk_wait_s", "transfer_s")),
    ("predicted.terms.expert_compute_s?", "object", None), ("predicted.terms.gpu_calls?", "num", (0, None)),
    ("predicted.hit_rate", "object", None),
    *((f"predicted.hit_rate.{k}", "num", (0, 1)) for k in ("vram", "ram_pinned", "lru", "disk")),
    ("predicted.prefill?", "object", None),   # its figures: formats/plan_prefill.py
    ("solver", "object", None), ("solver.method?", "str", None), ("solver.status?", "str", None),
    ("solver.seconds?", "num", (0, None)), ("solver.gap?", "num", (0, None)),   # baselines have neither
    # the engine reads with this many threads (run --read-threads accepts 1..64); re-pinning reads rates
    ("resources?", "object", None), ("resources.disk_queue_depth?", "int", (1, 64)),
    ("resources.disk_read_gbps?", "num", (0, None)), ("resources.gpus?", "list", None),
    ("coefficients?", "object", None), ("model.mtp_expert_bytes?", "int", (1, None)),
    # the engine knobs the plan was solved for (issue #16; docs/plan-format.md), all optional
    ("knobs?", "object", None), ("knobs.target?", "str", None), ("knobs.queue_depth?", "int", (1, 64)),
    ("knobs.o_direct?", "bool", None), ("knobs.keep_host_copies?", "bool", None),
    ("knobs.vram_overhead_bytes_per_expert?", "int", (0, None)), ("knobs.host_copy_bytes?", "num", (0, None)),
    ("knobs.cache_model?", "object", None), ("knobs.page_cache?", "object", None),
    ("knobs.page_cache.capacity_bytes?", "num", (0, None)), ("knobs.ram_warnings?", "list", None),
    # which processor computes each host tier; live re-pinning policy (issue #16), both optional
    ("compute?", "object", None), ("compute_explain?", "object", None), ("repin?", "object", None),
    ("repin.enabled", "bool", None), ("repin.every_tokens", "int", (1, 1_000_000)),
    ("repin.window_tokens", "int", (1, 1_000_000)), ("repin.max_swaps?", "int", (1, None)),
)
_PY_TYPES = {"object": dict, "list": list, "str": str, "bool": bool}
_TYPE_NAMES = {"object": "an object", "list": "a list", "str": "a string", "bool": "true or false",
               "int": "a whole number", "num": "a finite number"}


def _is(v, kind: str) -> bool:
    if kind in _PY_TYPES:
        return isinstance(v, _PY_TYPES[kind])
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    return kind == "num" or float(v).is_integer()


def _check_field(doc: dict, path: str, kind: str, limits, where: str, predictions: bool) -> None:
    optional = path.endswith("?") or (not predictions and path.startswith("predicted."))
    path = path.rstrip("?")
    *parents, last = path.split(".")
    node = doc
    for part in parents:   # a missing parent was reported by its own entry (or is optional)
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict):
        return
    v = node.get(last)
    if v is None and optional:
        return
    if last not in node:
        _fail(where, f"{path} is missing")
    rng = ""
    if limits is not None:
        lo, hi = limits
        rng = f" >= {lo}" if hi is None else f" in {lo}..{hi}"
    if not _is(v, kind) or (limits is not None and ((limits[0] is not None and v < limits[0])
                                                     or (limits[1] is not None and v > limits[1]))):
        _fail(where, f"{path} must be {_TYPE_NAMES[kind]}{rng}, got {json.dumps(v, default=str)[:60]}")


def _check_values(doc: dict, where: str) -> None:
    """Cross-field checks after the types: known quant formats, top_k <= n_experts, a positive decode
    time and tok/s = 1 / decode time (1e-6 relative)."""
    from colibri_plan.quant import FORMATS

    for key in ("expert_format", "dense_format"):
        if doc.get(key) is not None and doc[key] not in FORMATS:
            _fail(where, f"{key} {doc[key]!r} is not a known quant format ({', '.join(FORMATS)})")
    model = doc["model"]
    if _is(model.get("top_k"), "int") and _is(model.get("n_experts"), "int") \
            and model["top_k"] > model["n_experts"]:
        _fail(where, f"model.top_k {model['top_k']} is more than model.n_experts {model['n_experts']}")
    pred = doc["predicted"]
    dec, tok = pred.get("decode_s_per_token"), pred.get("tok_s")
    if _is(dec, "num"):
        if dec <= 0:
            _fail(where, f"predicted.decode_s_per_token must be > 0, got {dec!r}")
        if _is(tok, "num") and abs(tok * dec - 1.0) > 1e-6:
            _fail(where, f"predicted.tok_s {tok!r} is not 1 / predicted.decode_s_per_token ({1.0 / dec:.6g})")


def check_structure(doc: dict, where: str = "file", predictions: bool = False) -> None:
    """Structural checks of a plan document (see module docstring), and every section and figure its
    readers use has the right type and a finite value in range (``_FIELDS``); with ``predictions`` (plan
    files: :func:`load_plan`, :func:`save_plan`) the predicted figures must also be there.

    Raises:
        FormatError: naming the field, what it must be and what it holds.
    """
    if not isinstance(doc, dict):
        _fail(where, "expected a JSON object")
    missing = [k for k in _TOP_KEYS if k not in doc]
    if missing:
        _fail(where, f"missing {', '.join(missing)}")
    for path, kind, limits in _FIELDS:
        _check_field(doc, path, kind, limits, where, predictions)
    _check_values(doc, where)
    check_prefill(doc["predicted"], lambda what: _fail(where, what))   # formats/plan_prefill.py
    for k, v in doc["budgets"]["vram_budget_bytes"].items():
        if not _is(v, "num") or v < 0:
            _fail(where, f"budgets.vram_budget_bytes.{k} must be a finite number >= 0, got {v!r}")
    for k, v in ((doc["predicted"].get("terms") or {}).get("expert_compute_s") or {}).items():
        if not _is(v, "num") or v < 0:
            _fail(where, f"predicted.terms.expert_compute_s.{k} must be a finite number >= 0, got {v!r}")
    for i, d in enumerate(doc["devices"]):
        if not isinstance(d, dict) or not isinstance(d.get("key"), str):
            _fail(where, f"devices[{i}] must be an object with a string key, got {d!r}")
        if not isinstance(d.get("unified", False), bool):
            _fail(where, f"devices[{i}].unified must be true or false, got {d.get('unified')!r}")
    if doc.get("coefficients") is not None:
        from colibri_plan.formats.coefficients import Coefficients

        try:
            Coefficients.from_dict(doc["coefficients"], where="coefficients")
        except InputError as exc:  # the plan's own advice (re-solve) replaces the coefficients' advice
            _fail(where, str(exc).split("; re-create the coefficients")[0])
    _check_compute(doc, where)
    model = doc["model"]
    for k in ("name", "fingerprint", "n_experts", "expert_bytes", "moe_layers"):
        if k not in model:
            _fail(where, f"model section lacks {k}")
    n = model["n_experts"]
    if not isinstance(n, int) or n < 1:
        _fail(where, f"model.n_experts must be a positive integer, got {n!r}")
    keys = [d.get("key") for d in doc["devices"]] if isinstance(doc["devices"], list) else None
    if keys is None or len(set(keys)) != len(keys):
        _fail(where, "devices must be a list of {key, ...} with unique keys")
    # the optional trunk section (formats/plan_trunk.py), and the VRAM its budgets took for it
    check_trunk_budgets(doc, parse_trunk(doc, keys, model.get("n_layers")))
    layers = doc["layers"]
    if not isinstance(layers, list):
        _fail(where, "layers must be a list")
    ids = [e.get("layer") if isinstance(e, dict) else None for e in layers]
    if ids != list(model["moe_layers"]):
        _fail(where, f"layers {ids[:4]}... do not match the model's MoE layers {model['moe_layers'][:4]}...")
    for e in layers:
        lid = e["layer"]
        for k in ("vram", "ram_pinned", "lru_slots", "disk"):
            if k not in e:
                _fail(where, f"layer {lid} lacks {k}")
        if not isinstance(e["vram"], dict) or set(e["vram"]) - set(keys):
            _fail(where, f"layer {lid}: vram names unknown devices {sorted(set(e['vram']) - set(keys))}")
        lists = list(e["vram"].values()) + [e["ram_pinned"], e["disk"]]
        flat = [x for lst in lists for x in (lst if isinstance(lst, list) else [None])]
        if any(isinstance(x, bool) or not isinstance(x, int) for x in flat):
            _fail(where, f"layer {lid}: expert ids must be integers")
        if any(x < 0 or x >= n for x in flat):
            _fail(where, f"layer {lid}: expert id out of range 0..{n - 1}")
        if len(flat) != n or len(set(flat)) != n:
            dup = len(flat) - len(set(flat))
            _fail(where, f"layer {lid}: every expert must appear exactly once ({len(set(flat))} of {n} "
                         f"present, {dup} repeated)")
        if "p" in e and (not isinstance(e["p"], list) or len(e["p"]) != n
                         or any(not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in e["p"])):
            _fail(where, f"layer {lid}: p must list {n} probabilities in [0, 1]")
        s = e["lru_slots"]
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            _fail(where, f"layer {lid}: lru_slots must be an integer >= 0, got {s!r}")


def _check_compute(doc: dict, where: str) -> None:
    """``compute``: host tiers -> "cpu" or a unified device of the plan; ``repin``: the policy's keys."""
    unified = {d.get("key") for d in doc["devices"] if isinstance(d, dict) and d.get("unified")}
    for tier, who in (doc.get("compute") or {}).items():
        if tier not in COMPUTE_TIERS:
            _fail(where, f"compute has unknown tier {tier!r} (tiers: {', '.join(COMPUTE_TIERS)})")
        if who != "cpu" and who not in unified:
            _fail(where, f"compute.{tier} must be 'cpu' or a unified-memory device of the plan "
                         f"({', '.join(sorted(unified)) or 'none'}), got {who!r}")
    extra = set(doc.get("repin") or {}) - {"enabled", "every_tokens", "window_tokens", "max_swaps"}
    if extra:
        _fail(where, f"repin has unknown keys {sorted(extra)}")


def validate_plan(plan: Plan, where: str = "budgets") -> None:
    """Check the plan's placement against its own budgets, independently of any solver.

    VRAM per discrete device: experts x (expert_bytes + ``knobs.vram_overhead_bytes_per_expert``) <=
    budgets.vram_budget_bytes[key]. RAM: pinned + LRU slots + experts on unified devices (+ discrete-GPU
    experts with ``knobs.keep_host_copies``), x expert_bytes <= budgets.ram_budget_bytes.

    ``where`` names the plan in messages (load_plan passes "<path>: budgets").

    Raises:
        FormatError: a budget is exceeded or missing (the message gives the bytes).
    """
    b = plan.expert_bytes
    budgets = plan.doc["budgets"]
    vram = budgets.get("vram_budget_bytes", {})
    counts = plan.counts()
    knobs = plan.doc.get("knobs") or {}
    overhead = int(knobs.get("vram_overhead_bytes_per_expert") or 0)
    ram = (counts["ram_pinned"] + counts["lru_slots"]) * b
    for d in plan.doc["devices"]:
        used = counts[d["key"]] * b
        if d.get("unified"):
            ram += used
            continue
        ram += used if knobs.get("keep_host_copies") else 0
        used += counts[d["key"]] * overhead
        if used > int(vram.get(d["key"], -1)):
            _fail(where, f"{d['key']} holds {used} B of experts, over its VRAM budget "
                             f"{vram.get(d['key'])} B")
    if ram > int(budgets["ram_budget_bytes"]):
        _fail(where, f"RAM tiers hold {ram} B, over the RAM budget {budgets['ram_budget_bytes']} B")


def save_plan(plan: Plan | dict, path: str | os.PathLike) -> Path:
    """Check and write a plan atomically (FormatError and nothing written when it is invalid)."""
    doc = plan.doc if isinstance(plan, Plan) else plan
    check_structure(doc, "to write", predictions=True)
    validate_plan(Plan(doc))
    body = {k: v for k, v in doc.items() if k not in ("kind", "schema_version")}
    return write_document(path, KIND, SCHEMA_VERSION, body)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read, structure-check and budget-check a plan file.

    Raises:
        InputError: missing file; FormatError: bad JSON, kind, version, structure or budgets.
    """
    doc = read_document(path, KIND, SCHEMA_VERSION)
    try:
        check_structure(doc, str(path), predictions=True)
        plan = Plan(doc)
        validate_plan(plan, f"{path}: budgets")
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"plan {path} is malformed ({type(exc).__name__}: {exc}); re-create it") from exc
    return plan

