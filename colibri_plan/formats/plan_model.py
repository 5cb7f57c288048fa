"""Whether a plan fits the model pack it is run or verified with (:func:`check_model`).

Kept apart from ``formats/plan.py`` (the file's structure checks); ``formats.plan.check_model`` is this
function.
"""

from __future__ import annotations

from colibri_plan.errors import MismatchError
from colibri_plan.formats.plan_trunk import check_trunk_kv_figure, parse_trunk


def check_model(plan, spec, where: str | None = None) -> None:
    """Refuse a plan made for another model, or for another expert format than ``spec`` stores (its
    byte budgets would be wrong), or whose trunk section prices fewer KV bytes per token than the model's
    (:func:`~colibri_plan.formats.plan_trunk.check_trunk_kv_figure`). ``plan`` is a
    :class:`~colibri_plan.formats.plan.Plan`; ``where`` names the pack the spec came from, for the message.

    The placement must also cover the model: the same MoE layers, each with the model's expert count.

    Raises:
        MismatchError: naming both fingerprints (or both formats, or both KV figures with the bytes, or
            the layers the placement leaves out).
    """
    held = f"{where} holds {spec.name}" if where else spec.name
    if plan.model_fingerprint != spec.fingerprint():
        raise MismatchError(f"plan was made for {plan.doc['model']['name']} (model fingerprint "
                            f"{plan.model_fingerprint}), but {held} ({spec.fingerprint()}); "
                            "solve a plan for this model")
    fmt = plan.doc.get("expert_format")
    if fmt and fmt != spec.expert_format:
        raise MismatchError(f"plan was solved for {fmt} experts, but {held} with "
                            f"{spec.expert_format} experts: its memory budgets do not hold; solve again with "
                            f"--quant {spec.expert_format}")
    # the fingerprint is a stored string: an edited layer list keeps it, so the placement itself must cover
    # the model (a layer left out would silently stream from disk)
    want = [int(x) for x in spec.moe_layers]
    have = plan.layer_ids if "layers" in plan.doc else want   # a Plan built in code without a placement
    n = plan.n_experts if "n_experts" in plan.doc["model"] else spec.n_experts
    if have != want or n != spec.n_experts:
        lost, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        if lost:
            what = f"leaves out MoE layer(s) {lost[:8]}"
        elif extra:
            what = f"places layer(s) {extra[:8]} the model does not route"
        elif n != spec.n_experts:
            what = f"places {n} experts per layer"
        else:
            what = "lists the MoE layers out of order"
        raise MismatchError(f"plan {what} ({held}: MoE layers {want[:4]}{'...' if len(want) > 4 else ''}, "
                            f"{spec.n_experts} experts each); the plan was edited or made for another model: "
                            "solve a plan for this model")
    if plan.doc.get("trunk") is not None:
        check_trunk_kv_figure(parse_trunk(plan.doc, plan.device_keys), spec.kv_bytes_per_token,
                              f"{spec.name} in {where}" if where else spec.name)
