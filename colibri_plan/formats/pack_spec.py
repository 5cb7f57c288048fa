"""The model section of a pack index against the rest of it (run by
:func:`colibri_plan.formats.pack_index.check_index_fields`, so every reader of a pack refuses a
hand-edited ``model`` before any work): ``model.spec`` must be a valid ModelSpec whose geometry
fingerprint is ``model.fingerprint`` and whose geometry agrees with ``arch`` and the expert format.
"""

from __future__ import annotations

from colibri_plan.errors import FormatError

#: ModelSpec field -> ArchConfig field that must agree
SPEC_ARCH_FIELDS = (("n_layers", "n_layers"), ("moe_layers", "moe_layers"), ("n_experts", "n_experts"),
                    ("top_k", "top_k"), ("n_shared_experts", "n_shared_experts"),
                    ("hidden_size", "hidden_size"), ("moe_intermediate_size", "moe_intermediate_size"),
                    ("shared_intermediate_size", "shared_intermediate_size"), ("vocab_size", "vocab_size"))


def check_pack_spec(where, doc: dict, arch) -> None:
    """Check ``doc["model"]`` (a pack index) against ``arch`` (its :class:`ArchConfig`).

    Raises:
        FormatError: ``<where>: model.spec ...`` naming the field that disagrees.
    """
    from colibri_plan.formats.model_spec import ModelSpec

    model = doc["model"]
    if "spec" not in model:
        return
    try:
        spec = ModelSpec.from_dict(model["spec"])
    except FormatError as exc:
        raise FormatError(f"{where}: model.spec: {exc}; re-create the pack") from None
    for s_key, a_key in SPEC_ARCH_FIELDS:
        s, a = getattr(spec, s_key), getattr(arch, a_key)
        if _plain(s) != _plain(a):
            raise FormatError(f"{where}: model.spec.{s_key} is {s!r} but the pack's arch has {a_key} {a!r}: "
                              "the index was edited; re-create the pack")
    if spec.expert_format != doc["format"].get("expert_format"):
        raise FormatError(f"{where}: model.spec.expert_format {spec.expert_format!r} differs from "
                          f"format.expert_format {doc['format'].get('expert_format')!r}; re-create the pack")
    if spec.fingerprint() != model.get("fingerprint"):
        raise FormatError(f"{where}: stored model fingerprint {model.get('fingerprint')!r} does not match "
                          f"its spec ({spec.fingerprint()}): the index was edited; re-create the pack")


def _plain(v):
    return tuple(v) if isinstance(v, (list, tuple)) else v
