"""Exports of an expert-parallel placement for the engines that serve it (docs/ep.md).

* ``sglang`` — SGLang's ``--init-expert-location`` JSON, mapping form: ``{"physical_to_logical_map":
  [num_hidden_layers][E + R]}``. SGLang sizes the table by the model's transformer layers
  (``num_hidden_layers``, dense layers included) and reads slot p as GPU ``p // ((E + R) / ep_size)``;
  rows of layers without routed experts hold the trivial map ``p % E``. The document holds that one key
  only: SGLang passes the dict's keys on as arguments.
* ``sglang-count`` — the same option's ``{"logical_count": [num_hidden_layers][E]}`` form (whole
  selection counts), for SGLang to balance with its own eplb at start-up.
* ``vllm`` — the per-layer, per-device expert lists that vLLM-Ascend reads from ``expert_map_path``
  (``{"moe_layer_count", "layer_list": [{"layer_id", "device_count", "device_list": [{"device_id",
  "device_expert"}]}]}``, MoE layers numbered from 0); upstream vLLM starts from its own trivial map and
  takes only the EPLB config (``num_redundant_experts``), given in the export's command line.
* ``eplb`` — DeepSeek eplb's three outputs for the MoE layers: ``physical_to_logical_map`` [layers, P],
  ``logical_to_physical_map`` [layers, E, X] (-1 padded) and ``expert_count`` [layers, E].

SGLang and vLLM need the same number of slots on every GPU; a placement with uneven slots is refused
for them with what to change.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from colibri_plan.errors import UnsupportedError
from colibri_plan.fileio import atomic_write_text
from colibri_plan.formats.ep_placement import EpPlacement

TARGETS = ("sglang", "sglang-count", "vllm", "eplb")


def _need_even(pl: EpPlacement, target: str) -> None:
    if not pl.even:
        e, g = pl.n_experts, pl.n_gpus
        up = -(-pl.n_slots // g) * g - e
        raise UnsupportedError(f"{target} needs the same slot count on every GPU, but {pl.n_slots} slots on "
                               f"{g} GPUs is {min(pl.gpu_slots)}-{max(pl.gpu_slots)} per GPU; solve with "
                               f"--redundant {up} (or {max(up - g, 0)}) so {g} divides experts + redundant")


def sglang_mapping(pl: EpPlacement) -> dict:
    """``{"physical_to_logical_map": [num_hidden_layers][P]}`` (module docstring)."""
    _need_even(pl, "SGLang")
    n_layers = int(pl.doc["model"]["n_layers"])
    rows = np.tile(np.arange(pl.n_slots) % pl.n_experts, (n_layers, 1))
    rows[pl.moe_layers] = pl.phy2log()
    return {"physical_to_logical_map": rows.tolist()}


def sglang_logical_count(pl: EpPlacement) -> dict:
    """``{"logical_count": [num_hidden_layers][E]}`` whole selection counts (heat tokens x probability,
    1,000,000 tokens when the heat had no count); layers without routed experts count 0."""
    n_layers = int(pl.doc["model"]["n_layers"])
    tokens = pl.doc["heat"].get("tokens") or 1_000_000
    counts = np.zeros((n_layers, pl.n_experts), dtype=np.int64)
    counts[pl.moe_layers] = np.rint(pl.loads() * tokens).astype(np.int64)
    return {"logical_count": counts.tolist()}


def vllm_expert_map(pl: EpPlacement) -> dict:
    """vLLM-Ascend's ``expert_map_path`` document: each device's logical experts per MoE layer."""
    _need_even(pl, "vLLM")
    per = pl.gpu_slots[0]
    table = pl.phy2log().reshape(len(pl.moe_layers), pl.n_gpus, per)
    return {"moe_layer_count": len(pl.moe_layers),
            "layer_list": [{"layer_id": i, "device_count": pl.n_gpus,
                            "device_list": [{"device_id": g, "device_expert": table[i, g].tolist()}
                                            for g in range(pl.n_gpus)]}
                           for i in range(len(pl.moe_layers))]}


def eplb_tensors(pl: EpPlacement) -> dict:
    """DeepSeek eplb's outputs as nested lists (module docstring); slots of one expert by slot order."""
    p2l = pl.phy2log()
    count = pl.replicas()
    width = int(count.max())
    l2p = np.full((p2l.shape[0], pl.n_experts, width), -1, dtype=np.int64)
    for i, row in enumerate(p2l):
        for e in range(pl.n_experts):
            slots = np.flatnonzero(row == e)
            l2p[i, e, :slots.size] = slots
    return {"physical_to_logical_map": p2l.tolist(), "logical_to_physical_map": l2p.tolist(),
            "expert_count": count.tolist()}


def export_body(pl: EpPlacement, target: str) -> dict:
    """The export document of ``target`` (one of :data:`TARGETS`).

    Raises:
        UnsupportedError: unknown target, or uneven slots for SGLang / vLLM.
    """
    fn = {"sglang": sglang_mapping, "sglang-count": sglang_logical_count, "vllm": vllm_expert_map,
          "eplb": eplb_tensors}.get(target)
    if fn is None:
        raise UnsupportedError(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    return fn(pl)


def launch_hint(pl: EpPlacement, target: str, path: str) -> str:
    """The engine options that go with the exported file (one line)."""
    t = pl.doc["topology"]
    if target in ("sglang", "sglang-count"):
        return (f"sglang.launch_server --ep-size {t['gpus']} --nnodes {t['nodes']} "
                f"--ep-num-redundant-experts {t['redundant']} --init-expert-location {path}")
    if target == "vllm":
        return (f"vllm serve --enable-expert-parallel --enable-eplb --eplb-config "
                f"'{{\"num_redundant_experts\": {t['redundant']}}}' (vLLM-Ascend: --additional-config "
                f"'{{\"expert_map_path\": \"{path}\"}}')")
    return f"eplb-shaped tensors for {len(pl.moe_layers)} MoE layers x {pl.n_slots} slots in {path}"


def write_export(pl: EpPlacement, target: str, path: str | os.PathLike) -> Path:
    """Write ``target``'s document as JSON, atomically (nothing is written when it is refused)."""
    body = export_body(pl, target)
    return atomic_write_text(path, json.dumps(body, separators=(",", ":")) + "\n", kind=None)
