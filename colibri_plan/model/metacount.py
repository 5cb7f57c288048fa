"""Count a catalogue model's parameters exactly, without weights: transformers on the meta device.

``python -m colibri_plan.model.metacount`` builds every catalogue entry's ``config`` with transformers'
own model classes on torch's ``meta`` device (shapes only, no memory), sums the parameters outside the
routed experts (``*.experts.*``), adds each MTP head's trunk (one more decoder layer's non-expert
parameters plus the ``eh_proj`` [H, 2H] projection and its three H-wide norms; its routed experts are a
MoE row of their own) and checks that the routed parameters equal rows · E · 3·H·I — an independent check
of the geometry read by the family files (:mod:`colibri_plan.families`). ``--write`` stores
``dense_params`` in ``colibri_plan/data/models.json``; without it the command only reports differences.

Needs torch and transformers (the ``test`` extra); the library imports this module only to size a
checkpoint folder that holds config.json alone (:func:`colibri_plan.model.checkpoint.config_only_spec`).
"""

from __future__ import annotations

import json
import re
import sys
from importlib import resources

from colibri_plan.errors import UnsupportedError
from colibri_plan.families import plan_geometry
from colibri_plan.model.catalogue import spec_from_entry

_LAYER = re.compile(r"layers\.(\d+)\.")


def count_params(config: dict, mtp_layers: int = 0) -> dict:
    """Parameter counts of a config built by transformers on the meta device.

    Returns:
        {"total", "routed", "dense" (MTP trunk included), "mtp_trunk"} — integers.

    Raises:
        UnsupportedError: transformers has no causal-LM class for the config's model_type.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type")
    try:
        hf_cfg = AutoConfig.for_model(model_type, **cfg)
    except ValueError as exc:
        raise UnsupportedError(f"transformers does not know model_type {model_type!r}: {exc}") from exc
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    total = routed = 0
    per_layer_dense: dict[int, int] = {}
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if ".experts." in name:  # routed experts; shared ones are "shared_expert(s)."
            routed += n
            continue
        m = _LAYER.search(name)
        if m:
            per_layer_dense[int(m.group(1))] = per_layer_dense.get(int(m.group(1)), 0) + n
    h = plan_geometry(config).arch.hidden_size
    last = max(per_layer_dense)
    mtp_trunk = mtp_layers * (per_layer_dense[last] + 2 * h * h + 3 * h)
    return {"total": total, "routed": routed, "dense": total - routed + mtp_trunk, "mtp_trunk": mtp_trunk}


def main(argv: list[str]) -> int:
    """Count every catalogue entry, print one line each; with ``--write`` store dense_params. Exit
    status 1 when transformers and our geometry disagree on the routed parameters."""
    write = "--write" in argv
    path = resources.files("colibri_plan").joinpath("data/models.json")
    doc = json.loads(path.read_text(encoding="utf-8"))
    bad = 0
    for entry in doc["models"]:
        counts = count_params(entry["config"], int(entry.get("mtp_layers", 0)))
        probe = dict(entry, dense_params=counts["dense"])
        spec = spec_from_entry(probe)
        rows = len(spec.decode_moe_layers)
        want_routed = rows * spec.n_experts * spec.expert_params
        ok = counts["routed"] == want_routed
        bad += not ok
        print(f"{entry['name']:22s} dense {counts['dense']:>16,d} (stored {entry.get('dense_params')}) "
              f"routed {counts['routed']:>18,d} {'ok' if ok else f'!= {want_routed:,d} from families'} "
              f"total(no MTP) {(counts['total']) / 1e9:8.2f} B")
        entry["dense_params"] = counts["dense"]
    if write:
        from colibri_plan.fileio import atomic_write_text

        atomic_write_text(str(path), json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
