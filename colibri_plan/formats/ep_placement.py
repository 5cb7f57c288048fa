"""The expert-parallel placement document (kind ``"ep-placement"``, schema_version 1; docs/ep.md).

Written by ``colibri-plan ep solve``, read by ``ep show`` and ``ep export``. One physical slot is one
expert's weights in one MoE layer on one GPU; GPU g holds ``topology.gpu_slots[g]`` consecutive slots
(GPU 0's first), the same slots in every layer, and a layer's ``physical_to_logical`` says which
logical expert each slot holds. Fields:

- ``model``: name, fingerprint, family, n_layers (transformer layers, MTP excluded), moe_layers,
  n_experts, top_k, n_group, topk_group, hidden_size, moe_intermediate_size, expert_format,
  expert_bytes (one expert in that format);
- ``heat``: source, fingerprint, tokens;
- ``topology``: gpus, nodes, gpus_per_node, redundant, slots, gpu_slots ``[G]``;
- ``memory``: slot_bytes (one slot over every MoE layer), gpu_expert_memory_bytes and max_slots_per_gpu
  (null without a profile or a given memory), source;
- ``cost_model``: the :class:`~colibri_plan.planner.ep_cost.EpCostModel` fields;
- ``layers``: per MoE layer: layer, load ``[E]`` (selections per token), physical_to_logical ``[P]``,
  replicas ``[E]``, gpu_loads ``[G]``, balancedness, max_load, sends_per_token, layer_s, method,
  candidates, and ``eplb`` {physical_to_logical, balancedness, max_load, sends_per_token, layer_s};
- ``summary``: balancedness, balancedness_layer_mean, sends_per_token, moe_s_per_token, methods, and
  the same of eplb under ``eplb`` (+ its policy);
- ``solver``: seconds, trace (where the routing traces came from).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from colibri_plan.errors import FormatError
from colibri_plan.fileio import read_document, write_document

EP_KIND = "ep-placement"
EP_SCHEMA_VERSION = 1
_SECTIONS = ("model", "heat", "topology", "memory", "cost_model", "layers", "summary", "solver")


class EpPlacement:
    """A validated placement document with array accessors.

    Attributes:
        doc: the JSON document (dict, with kind and schema_version).

    Raises:
        FormatError: on construction, when a section is missing or a table has the wrong shape or ids
            out of range (the message names the layer).
    """

    def __init__(self, doc: dict, where: str = "ep placement"):
        self.doc = doc
        self.where = where
        self._check()

    # --- accessors ----------------------------------------------------------------------------------
    @property
    def n_experts(self) -> int:
        return int(self.doc["model"]["n_experts"])

    @property
    def n_slots(self) -> int:
        return int(self.doc["topology"]["slots"])

    @property
    def n_gpus(self) -> int:
        return int(self.doc["topology"]["gpus"])

    @property
    def gpu_slots(self) -> list[int]:
        return [int(c) for c in self.doc["topology"]["gpu_slots"]]

    @property
    def even(self) -> bool:
        """Every GPU holds the same number of slots (SGLang and vLLM need that)."""
        return len(set(self.gpu_slots)) == 1

    @property
    def moe_layers(self) -> list[int]:
        return [int(e["layer"]) for e in self.doc["layers"]]

    def phy2log(self) -> np.ndarray:
        """int64 ``[MoE layers, P]`` logical expert of every slot."""
        return np.array([e["physical_to_logical"] for e in self.doc["layers"]], dtype=np.int64)

    def replicas(self) -> np.ndarray:
        """int64 ``[MoE layers, E]`` replicas of every logical expert."""
        return np.array([e["replicas"] for e in self.doc["layers"]], dtype=np.int64)

    def loads(self) -> np.ndarray:
        """float ``[MoE layers, E]`` selections per token of every logical expert (the heat used)."""
        return np.array([e["load"] for e in self.doc["layers"]], dtype=np.float64)

    def slot_gpu(self) -> np.ndarray:
        """GPU of every slot ``[P]``."""
        return np.repeat(np.arange(self.n_gpus), self.gpu_slots)

    # --- validation ---------------------------------------------------------------------------------
    def _check(self) -> None:
        d, where = self.doc, self.where
        for s in _SECTIONS:
            if s not in d:
                raise FormatError(f"{where} has no {s!r} section; re-create it with `colibri-plan ep solve`")
        try:
            e, p, g = self.n_experts, self.n_slots, self.n_gpus
            caps = self.gpu_slots
            nodes = int(d["topology"]["nodes"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: malformed model/topology section ({exc}); re-create it") from None
        if e < 1 or g < 1 or nodes < 1 or g % nodes or len(caps) != g or sum(caps) != p or min(caps) < 1 \
                or p < e:
            raise FormatError(f"{where}: topology does not add up ({g} GPUs, {nodes} nodes, slots {p}, "
                              f"gpu_slots summing to {sum(caps)}, {e} experts); re-create it")
        if not isinstance(d["layers"], list) or not d["layers"]:
            raise FormatError(f"{where}: no layers; re-create it")
        for entry in d["layers"]:
            layer = entry.get("layer") if isinstance(entry, dict) else None
            try:
                row = np.asarray(entry["physical_to_logical"])
                rep = np.asarray(entry["replicas"])
                load = np.asarray(entry["load"], dtype=np.float64)
            except (KeyError, TypeError, ValueError) as exc:
                raise FormatError(f"{where}: layer {layer} is malformed ({exc}); re-create it") from None
            if row.shape != (p,) or rep.shape != (e,) or load.shape != (e,) or row.dtype.kind not in "iu":
                raise FormatError(f"{where}: layer {layer} has physical_to_logical of shape {row.shape} and "
                                  f"replicas {rep.shape}; expected ({p},) and ({e},)")
            if row.min() < 0 or row.max() >= e:
                raise FormatError(f"{where}: layer {layer} names an expert outside 0..{e - 1}")
            if not np.array_equal(np.bincount(row, minlength=e), rep) or rep.min() < 1:
                raise FormatError(f"{where}: layer {layer}: replicas disagree with physical_to_logical, or "
                                  "an expert has no slot; re-create it")
            if not np.all(np.isfinite(load)) or load.min() < 0:
                raise FormatError(f"{where}: layer {layer}: loads must be finite and >= 0")


def save_ep_placement(placement: EpPlacement, path: str | os.PathLike) -> Path:
    """Write the document atomically (temp file, fsync, rename); returns the path."""
    body = {k: v for k, v in placement.doc.items() if k not in ("kind", "schema_version")}
    return write_document(path, EP_KIND, EP_SCHEMA_VERSION, body)


def load_ep_placement(path: str | os.PathLike) -> EpPlacement:
    """Read and validate a placement file.

    Raises:
        InputError: the file does not exist.
        FormatError: not JSON, another kind or version, or an inconsistent table.
    """
    doc = read_document(path, EP_KIND, EP_SCHEMA_VERSION)
    return EpPlacement(doc, where=str(path))
