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
        raise FormatError(f"{path} has kind {doc.get('kind')!r}, not a model spec: a spec file has kind "
                          f"{SPEC_KIND!r} (or none, as `colibri-plan model show --json` writes it)")
    if doc.get("kind") == SPEC_KIND and doc.get("schema_version") != SPEC_SCHEMA_VERSION:
        raise FormatError(f"{path} has model_spec schema_version {doc.get('schema_version')!r}; this "
                          f"colibri-plan reads version {SPEC_SCHEMA_VERSION}")
    if "model_type" in doc or "architectures" in doc:
        raise InputError(f"{path} is a Hugging Face config.json; pass its checkpoint folder instead "
                         "(config.json alone is enough; safetensors headers there are checked against it)")
    return ModelSpec.from_dict(doc.get("spec", doc))


#: safetensors header dtype -> colibri_plan.quant format of a stored dense trunk
_ST_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def pack_dense_format(folder: Path, index: dict) -> str | None:
    """The format an expert pack stores its dense trunk in: ``format.dense_format`` of ``pack.json``, else
    (an index that does not record it) the dtype of the tensors in the safetensors header of its dense
    file (the widest when they differ: the planner budgets by it). None when neither says.

    Raises:
        FormatError: the dense file's header cannot be read.
    """
    fmt = index.get("format", {})
    if isinstance(fmt.get("dense_format"), str):
        return fmt["dense_format"]
    dense = folder / str(fmt.get("dense_file") or "dense.safetensors")
    if not dense.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(str(dense), framework="numpy") as f:
            names = list(f.keys())
            dtypes = {str(f.get_slice(n).get_dtype()).upper() for n in names}
    except Exception as exc:  # safetensors raises its own error types
        raise FormatError(f"{dense}: cannot read the safetensors header ({exc})") from None
    fmts = [_ST_DTYPES[d] for d in dtypes if d in _ST_DTYPES]
    from colibri_plan import quant

    return max(sorted(fmts), key=quant.bits) if fmts else None


def _pack_spec(path: Path) -> ModelSpec:
    """The ModelSpec a pack stores, with the format its dense trunk is stored in (``dense_format``)."""
    import dataclasses

    from colibri_plan.engine.pack import spec_from_pack
    from colibri_plan.engine.pack_index import read_index

    spec = spec_from_pack(path)
    return dataclasses.replace(spec, dense_format=pack_dense_format(path, read_index(path)))


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
        spec = _pack_spec(path)
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
    elif path.exists():  # /dev/null, a pipe...
        raise InputError(f"{text} is not a regular file (expected a checkpoint folder, a .gguf file or a "
                         "spec JSON file)")
    elif looks_like_path:
        raise InputError(f"{text} does not exist (expected a checkpoint folder, a .gguf file or a spec "
                         "JSON file)")
    else:
        spec = catalogue_spec(text)
    return spec.with_format(quant) if quant else spec
