"""Model specs: geometry and byte sizes of MoE models, from checkpoints, GGUF headers or the catalogue.

    >>> from colibri_plan.model import load_model_spec
    >>> spec = load_model_spec("glm-5.2")
    >>> spec.n_routed_experts, spec.expert_bytes("int4"), spec.expert_bytes("int4-g64")
    (19456, 18915328, 21233664)
"""

from __future__ import annotations

import os
from pathlib import Path

from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import read_json_object
from colibri_plan.model.catalogue import catalogue_names, catalogue_spec
from colibri_plan.model.spec import ModelSpec

__all__ = ["ModelSpec", "load_model_spec", "catalogue_names", "save_model_spec"]

SPEC_KIND = "model_spec"
SPEC_SCHEMA_VERSION = 1


def _load_json_spec(path: Path) -> ModelSpec:
    doc = read_json_object(path, "model spec file")
    if doc.get("kind") not in (None, SPEC_KIND):
        raise FormatError(f"{path} is a {doc.get('kind')!r} file, not a model spec")
    if doc.get("kind") == SPEC_KIND and doc.get("schema_version") != SPEC_SCHEMA_VERSION:
        raise FormatError(f"{path} has model_spec schema_version {doc.get('schema_version')!r}; this "
                          f"colibri-plan reads version {SPEC_SCHEMA_VERSION}")
    if "model_type" in doc or "architectures" in doc:
        raise InputError(f"{path} is a Hugging Face config.json; pass its checkpoint folder instead "
                         "(config.json alone is enough; safetensors headers there are checked against it)")
    return ModelSpec.from_dict(doc.get("spec", doc))


def save_model_spec(spec: ModelSpec, path: str | os.PathLike) -> Path:
    """Write ``spec`` as a JSON document (kind "model_spec", schema_version 1), atomically."""
    from colibri_plan import fileio
    return fileio.write_document(path, SPEC_KIND, SPEC_SCHEMA_VERSION,
                                 {"spec": spec.to_dict(), "fingerprint": spec.fingerprint()})


def load_model_spec(name_or_path: str | os.PathLike, quant: str | None = None) -> ModelSpec:
    """A ModelSpec from a catalogue name, a Hugging Face checkpoint folder (config.json + safetensors
    headers, or config.json alone before the weights are downloaded), a GGUF file (header only) or a JSON
    spec file (``save_model_spec`` output or ``colibri-plan model show --json`` output).

    Args:
        name_or_path: "glm-5.2" (see :func:`catalogue_names`) or a path.
        quant: override the spec's ``expert_format`` (a :data:`colibri_plan.quant.FORMATS` name).

    Raises:
        InputError: unknown name, or a path that does not exist.
        FormatError: a corrupt or inconsistent file.
        UnsupportedError: not an MoE model, an unknown quant format, or a partial catalogue entry.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    looks_like_path = os.sep in text or text.startswith(".") or path.suffix in (".gguf", ".json")
    if path.is_dir() and (path / "pack.json").is_file():
        # an expert pack (colibri-plan model pack / model fixture) stores the spec it was made from
        from colibri_plan.engine.pack import spec_from_pack
        spec = spec_from_pack(path)
    elif path.is_dir():
        from colibri_plan.model.checkpoint import checkpoint_spec
        spec = checkpoint_spec(path)
    elif path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or path.suffix == ".gguf":
            from colibri_plan.model.gguf_header import gguf_spec
            spec = gguf_spec(path)
        else:
            spec = _load_json_spec(path)
    elif looks_like_path:
        raise InputError(f"{text} does not exist (expected a checkpoint folder, a .gguf file or a spec "
                         "JSON file)")
    else:
        spec = catalogue_spec(text)
    return spec.with_format(quant) if quant else spec
