"""Heat against a model: check that routing counts belong to a model spec and give one row per MoE
layer of it, or make uniform heat when there are no counts (see :mod:`colibri_plan.formats.heat`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from colibri_plan.errors import MismatchError
from colibri_plan.formats.heat import Heat, fnv1a32, load_heat


def uniform_heat(spec, tokens: int = 1_000_000) -> tuple[Heat, str]:
    """A heat where every expert of every MoE layer is equally likely (``top_k / E``).

    Returns:
        (heat, warning): the warning says that placement from uniform heat cannot exploit skew.
    """
    p = spec.top_k / spec.n_experts
    counts = np.full((spec.n_moe_layers, spec.n_experts), p * tokens)
    heat = Heat(n_experts=spec.n_experts, layers=tuple(spec.moe_layers), counts=counts, top_k=spec.top_k,
                tokens=tokens, source="uniform fallback", model_fingerprint=spec.fingerprint(),
                n_model_layers=spec.n_layers, engine_id=fnv1a32(spec.family))
    msg = (f"no routing statistics for {spec.name}: assuming uniform expert heat; a plan from uniform heat "
           "cannot favour hot experts — record real statistics (colibri-plan run --stats-out, or "
           "colibrì STATS=) and solve again with --heat")
    heat.warnings.append(msg)
    return heat, msg


def align_heat(heat: Heat, spec) -> Heat:
    """Check ``heat`` belongs to ``spec`` and return it with one row per MoE layer of the spec, in order.

    Missing layers get the mean probability profile of the layers present (a warning is recorded in
    ``heat.warnings``); ``top_k`` is taken from the spec when the heat lacks it.

    Raises:
        MismatchError: expert count, top-k, model fingerprint or layer ids belong to another model.
    """
    if heat.model_fingerprint and heat.model_fingerprint != spec.fingerprint():
        raise MismatchError(f"heat ({heat.source}) was recorded for model fingerprint "
                            f"{heat.model_fingerprint}, "
                            f"not {spec.name} ({spec.fingerprint()}); use heat recorded with this model")
    if heat.n_experts != spec.n_experts:
        raise MismatchError(f"heat ({heat.source}) has {heat.n_experts} experts per layer but "
                            f"{spec.name} has "
                            f"{spec.n_experts}: this heat is for another model")
    if heat.top_k is not None and heat.top_k != spec.top_k:
        raise MismatchError(f"heat ({heat.source}) has top-k {heat.top_k} but {spec.name} routes top-"
                            f"{spec.top_k}: this heat is for another model")
    extra = sorted(set(heat.layers) - set(spec.moe_layers))
    if extra:
        raise MismatchError(f"heat ({heat.source}) has rows for layers {extra[:6]} that are not MoE layers "
                            f"of {spec.name} ({spec.moe_layers[0]}..{spec.moe_layers[-1]}): "
                            "heat for another model")
    if not heat.layers or not np.any(heat.counts > 0):
        raise MismatchError(f"heat ({heat.source}) is empty: no routing counts to plan from; record "
                            "statistics with `colibri-plan run --stats-out`, or use --heat synth")
    base = replace(heat, top_k=spec.top_k, warnings=list(heat.warnings))
    p = base.probabilities()
    tokens = base.tokens or 1_000_000
    mean = p.mean(axis=0)
    rows = []
    missing = []
    for layer in spec.moe_layers:
        if layer in heat.layers:
            rows.append(p[heat.layers.index(layer)] * tokens)
        else:
            missing.append(layer)
            rows.append(mean * tokens)
    out = Heat(n_experts=spec.n_experts, layers=tuple(spec.moe_layers), counts=np.array(rows),
               top_k=spec.top_k, tokens=tokens, source=heat.source,
               model_fingerprint=spec.fingerprint(), n_model_layers=heat.n_model_layers or spec.n_layers,
               engine_id=heat.engine_id if heat.engine_id is not None else fnv1a32(spec.family),
               warnings=list(heat.warnings))
    if missing:
        out.warnings.append(f"heat has no counts for {len(missing)} MoE layers ({missing[:5]}...); used the "
                            "mean profile of the other layers for them")
    return out


def load_heat_arg(heat: str | None) -> Heat | str | None:
    """A ``--heat`` option value: None, "synth" and "uniform" pass through (the planner makes that heat);
    anything else is read as a heat file with :func:`load_heat` (same errors)."""
    if heat in (None, "synth", "uniform"):
        return heat
    return load_heat(heat)
