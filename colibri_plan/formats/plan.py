"""The plan file: where every expert lives, the budgets it was made for, and what it predicts.

JSON document of kind ``"plan"``, schema_version 1 (docs/plan-format.md), written atomically. The engine's
residency manager reads only this file. :func:`load_plan` checks the structure before anything uses it:
every expert of every MoE layer exactly once, ids in range, known devices, non-negative slots, and the
budgets (:func:`validate_plan`); a corrupt file raises FormatError.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_plan.errors import FormatError, InputError, MismatchError
from colibri_plan.fileio import read_document, write_document
from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At
from colibri_plan.formats.plan_checks import check_finite, check_resources, check_sizes
from colibri_plan.formats.plan_model import check_model  # noqa: F401 - re-exported
from colibri_plan.formats.plan_prefill import check_prefill
from colibri_plan.formats.plan_trunk import check_trunk_budgets, parse_trunk

KIND = "plan"
SCHEMA_VERSION = 1
TIER_RAM = -1
TIER_DISK = -2
#: the host tiers a plan's ``compute`` section assigns a processor ("cpu" or a unified device key)
COMPUTE_TIERS = ("ram_pinned", "lru", "disk")
#: a prefill of at least this many tokens on a CUDA trunk copies each host-held expert it touches to the GPU
#: and computes it there (engine/offload.py; the prefill cost model prices it: planner/prefill.py)
PREFILL_OFFLOAD_TOKENS = 32
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
        return max(1, int(qd)) if f.is_number(qd) else 8

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


def _at(where: str) -> At:
    """The plan's place in messages (``where``: its path, "to write", ...)."""
    return At(f"plan {where}", "re-create the plan with `colibri-plan solve`")


def _fail(where: str, what: str):
    _at(where).fail(what)


# (dotted path, type, constraint) of every section and figure a plan's readers use: "object", "list",
# "str", "bool", "int" (a whole number; 3.0 counts) or "num" (a finite JSON number, bools excluded); the
# constraint is a closed range (lo, hi) with None for no bound. A "?" suffix marks an optional entry (absent
# or null is fine); the figures under "predicted." are required of plan files (plan show, run and verify
# report them).
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
    # the VRAM share of the heat's decode selections in sample and two-fold held out (planner/holdout.py)
    ("predicted.hit_rate_held_out?", "object", None),
    ("predicted.hit_rate_held_out.in_sample", "num", (0, 1)),
    ("predicted.hit_rate_held_out.held_out", "num", (0, 1)),
    ("predicted.hit_rate_held_out.decode_steps", "int", (1, None)),
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
    # the trunk's GPU split decision (planner/trunk_gpus.py; version 1; older plans lack it)
    ("trunk_gpus?", "object", None), ("trunk_gpus.version", "int", (1, 1)),
    ("trunk_gpus.chosen", "str", None), ("trunk_gpus.devices", "list", None),
    ("trunk_gpus.env?", "object", None),
)
_READ = {"object": f.mapping, "list": f.items, "str": f.text, "bool": f.flag, "int": f.whole, "num": f.number}


def _check_field(doc: dict, path: str, kind: str, limits, at: At, predictions: bool) -> None:
    optional = path.endswith("?") or (not predictions and path.startswith("predicted."))
    *parents, last = path.rstrip("?").split(".")
    node = doc
    for part in parents:   # a missing parent was reported by its own entry (or is optional)
        node = node.get(part) if isinstance(node, dict) else None
        at = at / part
    if not isinstance(node, dict):
        return
    kw: dict = {"optional": optional}
    if limits is not None:
        kw.update(lo=limits[0], hi=limits[1])
        if kind == "num" and limits[1] is not None:   # a share: "in 0..1", as the whole numbers say it
            kw["want"] = f"a finite number in {limits[0]}..{limits[1]}"
    if kind == "int":
        kw["integral_floats"] = True
    _READ[kind](node, last, at, **kw)


def _check_values(doc: dict, where: str) -> None:
    """Cross-field checks after the types: known quant formats, top_k <= n_experts, a positive decode
    time and tok/s = 1 / decode time (1e-6 relative)."""
    from colibri_plan.quant import FORMATS

    for key in ("expert_format", "dense_format"):
        if doc.get(key) is not None and doc[key] not in FORMATS:
            _fail(where, f"{key} {doc[key]!r} is not a known quant format ({', '.join(FORMATS)})")
    model = doc["model"]
    if f.is_whole(model.get("top_k"), True) and f.is_whole(model.get("n_experts"), True) \
            and model["top_k"] > model["n_experts"]:
        _fail(where, f"model.top_k {model['top_k']} is more than model.n_experts {model['n_experts']}")
    pred = doc["predicted"]
    dec, tok = pred.get("decode_s_per_token"), pred.get("tok_s")
    if f.is_number(dec):
        if dec <= 0:
            _fail(where, f"predicted.decode_s_per_token must be > 0, got {dec!r}")
        if f.is_number(tok) and abs(tok * dec - 1.0) > 1e-6:
            _fail(where, f"predicted.tok_s {tok!r} is not 1 / predicted.decode_s_per_token ({1.0 / dec:.6g})")


def check_structure(doc: dict, where: str = "file", predictions: bool = False) -> None:
    """Structural checks of a plan document (see module docstring), and every section and figure its
    readers use has the right type and a finite value in range (``_FIELDS``); with ``predictions`` (plan
    files: :func:`load_plan`, :func:`save_plan`) the predicted figures must also be there.

    Raises:
        FormatError: naming the field, what it must be and what it holds.
    """
    at = _at(where)
    if not isinstance(doc, dict):
        at.fail("expected a JSON object")
    missing = [k for k in _TOP_KEYS if k not in doc]
    if missing:
        at.fail(f"missing {', '.join(missing)}")
    for path, kind, limits in _FIELDS:
        _check_field(doc, path, kind, limits, at, predictions)
    _check_values(doc, where)
    check_resources(doc, at)
    check_sizes(doc, at)
    check_prefill(doc["predicted"], at / "predicted")   # formats/plan_prefill.py
    for k in doc["budgets"]["vram_budget_bytes"]:
        f.number(doc["budgets"]["vram_budget_bytes"], k, at / "budgets" / "vram_budget_bytes", lo=0)
    comp = (doc["predicted"].get("terms") or {}).get("expert_compute_s") or {}
    for k in comp:
        f.number(comp, k, at / "predicted" / "terms" / "expert_compute_s", lo=0)
    for d, here in f.each(doc, "devices", at):
        if not isinstance(d, dict):
            here.bad("an object with a string key", d)
        f.text(d, "key", here)
        if "unified" in d:
            f.flag(d, "unified", here)
    if doc.get("coefficients") is not None:
        from colibri_plan.formats.coefficients import Coefficients

        try:
            Coefficients.from_dict(doc["coefficients"], where="coefficients")
        except InputError as exc:  # the plan's own advice (re-solve) replaces the coefficients' advice
            at.fail(str(exc).split("; re-create the coefficients")[0])
    _check_compute(doc, where)
    model = doc["model"]
    n = f.whole(model, "n_experts", at / "model", lo=1)   # an int here: it sizes the tier tables
    keys = [d["key"] for d in doc["devices"]]
    if len(set(keys)) != len(keys):
        at.fail("devices must be a list of {key, ...} with unique keys")
    # the optional trunk section (formats/plan_trunk.py), and the VRAM its budgets took for it
    check_trunk_budgets(doc, parse_trunk(doc, keys, model.get("n_layers")))
    layers = doc["layers"]
    ids = [e.get("layer") if isinstance(e, dict) else None for e in layers]
    if ids != list(model["moe_layers"]):
        at.fail(f"layers {ids[:4]}... do not match the model's MoE layers {model['moe_layers'][:4]}...")
    for i, e in enumerate(layers):
        _check_layer(e, n, keys, at / "layers" / i, at)
    check_finite(doc, at)   # last (the named checks say more): NaN / Infinity anywhere else


def _check_layer(e: dict, n: int, keys: list[str], here: At, at: At) -> None:
    """One ``layers`` entry: its tier lists hold every expert id 0..n-1 once, on known devices; ``p`` (if
    present) n probabilities; ``lru_slots`` a whole number >= 0. Messages name the MoE layer id."""
    lid = e["layer"]
    f.require(e, ("vram", "ram_pinned", "lru_slots", "disk"), here)
    if not isinstance(e["vram"], dict) or set(e["vram"]) - set(keys):
        at.fail(f"layer {lid}: vram names unknown devices {sorted(set(e['vram']) - set(keys))}")
    lists = list(e["vram"].values()) + [e["ram_pinned"], e["disk"]]
    flat = [x for lst in lists for x in (lst if isinstance(lst, list) else [None])]
    if not all(f.is_whole(x) for x in flat):
        at.fail(f"layer {lid}: expert ids must be integers")
    if any(x < 0 or x >= n for x in flat):
        at.fail(f"layer {lid}: expert id out of range 0..{n - 1}")
    if len(flat) != n or len(set(flat)) != n:
        dup = len(flat) - len(set(flat))
        at.fail(f"layer {lid}: every expert must appear exactly once ({len(set(flat))} of {n} present, "
                f"{dup} repeated)")
    if "p" in e and (not isinstance(e["p"], list) or len(e["p"]) != n
                     or not all(f.is_number(v) and 0 <= v <= 1 for v in e["p"])):
        at.fail(f"layer {lid}: p must list {n} probabilities in [0, 1]")
    f.whole(e, "lru_slots", here, lo=0)


def _trunk_device(doc: dict) -> str | None:
    """The discrete device that holds the whole trunk (the ``trunk`` section's device, not split), else
    the resources' GPU marked ``holds_trunk``; None: the trunk runs on the CPU."""
    trunk = doc.get("trunk")
    if isinstance(trunk, dict) and isinstance(trunk.get("device"), str) and not trunk.get("split"):
        return trunk["device"] if trunk["device"] != "cpu" else None
    gpus = (doc.get("resources") or {}).get("gpus") or []
    return next((g.get("key") for g in gpus if isinstance(g, dict) and g.get("holds_trunk")
                 and not g.get("unified")), None)


def _check_compute(doc: dict, where: str) -> None:
    """``compute``: host tiers -> "cpu" or a unified device of the plan, and ``ram_pinned`` also the
    discrete device that holds the trunk (zero-copy pins in mapped host memory); ``repin``: the
    policy's keys."""
    unified = {d.get("key") for d in doc["devices"] if isinstance(d, dict) and d.get("unified")}
    for tier, who in (doc.get("compute") or {}).items():
        if tier not in COMPUTE_TIERS:
            _fail(where, f"compute has unknown tier {tier!r} (tiers: {', '.join(COMPUTE_TIERS)})")
        if tier == "ram_pinned" and who not in unified and who != "cpu":
            trunk = _trunk_device(doc)
            if who != trunk:
                holder = trunk or "none: the trunk is on the cpu"
                _fail(where, f"compute.ram_pinned names {who!r}, but only 'cpu', a unified-memory device or "
                             f"the discrete device that holds the trunk ({holder}) can compute them")
            continue
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

