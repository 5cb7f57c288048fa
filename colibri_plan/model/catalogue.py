"""The built-in catalogue of real MoE models (``colibri_plan/data/models.json``).

Each entry holds the model's language-model ``config`` with the real Hugging Face field names (so the
catalogue and a checkpoint folder go through the same family reader, :mod:`colibri_plan.families`), the
number of MTP heads whose experts are counted as extra MoE rows, ``dense_params`` (counted once by
:mod:`colibri_plan.model.metacount`), an optional ``kv_bytes_per_token`` override, the sources and the
assumptions made where the facts were silent. Facts come from the models' public configs (each entry
names its source) and colibrì's published GLM-5.2 figures.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from colibri_plan.errors import FormatError, InputError, UnsupportedError
from colibri_plan.families import plan_geometry
from colibri_plan.formats.model_spec import ModelSpec


@functools.lru_cache(maxsize=1)
def _document() -> dict:
    text = resources.files("colibri_plan").joinpath("data/models.json").read_text(encoding="utf-8")
    doc = json.loads(text)
    if doc.get("kind") != "model_catalogue" or doc.get("schema_version") != 1:
        raise FormatError("colibri_plan/data/models.json is not a version-1 model catalogue; reinstall")
    return doc


def entries() -> list[dict]:
    """The raw catalogue entries (dicts; do not mutate)."""
    return _document()["models"]


def catalogue_names() -> list[str]:
    """Canonical names of the catalogue's models, in catalogue order."""
    return [e["name"] for e in entries()]


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def find_entry(name: str) -> dict | None:
    """The catalogue entry whose name or alias is ``name`` (case-insensitive), or None."""
    key = _normalise(name)
    for e in entries():
        if key == e["name"] or key in e.get("aliases", ()):
            return e
    return None


def spec_from_entry(entry: dict) -> ModelSpec:
    """Build the ModelSpec of one catalogue entry.

    Raises:
        UnsupportedError: the entry is marked partial (a needed figure is unknown).
        FormatError: the entry lacks dense_params (run ``python -m colibri_plan.model.metacount --write``).
    """
    name = entry["name"]
    if entry.get("partial"):
        raise UnsupportedError(f"catalogue model {name!r} is partial ({entry.get('assumptions')}); "
                               "size it from its checkpoint folder or GGUF file instead")
    geo = plan_geometry(entry["config"], f"catalogue entry {name!r}")
    n_layers, mtp = geo.arch.n_layers, int(entry.get("mtp_layers", 0))
    fields = geo.spec_fields(tuple(range(n_layers, n_layers + mtp)))
    if entry.get("dense_params") is None:
        raise FormatError(f"catalogue entry {name!r} has no dense_params; run "
                          "`python -m colibri_plan.model.metacount --write`")
    if entry.get("kv_bytes_per_token") is not None:  # e.g. colibrì's measured GLM-5.x figure
        fields["kv_bytes_per_token"] = int(entry["kv_bytes_per_token"])
    return ModelSpec(name=name, **fields, expert_format=entry.get("expert_format", "int4"),
                     dense_params=int(entry["dense_params"]), source=f"catalogue: {entry['source']}")


def catalogue_spec(name: str) -> ModelSpec:
    """The ModelSpec of catalogue model ``name`` (or one of its aliases).

    Raises:
        InputError: no such model; the message lists the catalogue's names.
    """
    entry = find_entry(name)
    if entry is None:
        raise InputError(f"{name!r} is neither a file/folder nor a catalogue model; known models: "
                         f"{', '.join(catalogue_names())}")
    return spec_from_entry(entry)
