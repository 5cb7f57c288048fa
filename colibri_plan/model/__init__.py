"""Model specs: geometry and byte sizes of MoE models, from checkpoints, GGUF headers or the catalogue.

    >>> from colibri_plan.model import load_model_spec
    >>> spec = load_model_spec("glm-5.2")
    >>> spec.n_routed_experts, spec.expert_bytes("int4"), spec.expert_bytes("int4-g64")
    (19456, 18915328, 21233664)
"""

from __future__ import annotations

import os
from pathlib import Path

from colibri_plan.errors import InputError
from colibri_plan.formats.model_spec import ModelSpec, load_spec_file, save_model_spec
from colibri_plan.model.catalogue import catalogue_names, catalogue_spec

__all__ = ["ModelSpec", "load_model_spec", "catalogue_names", "save_model_spec"]

def _pack_spec(path: Path) -> ModelSpec:
    """The ModelSpec a pack stores, with the format its dense trunk is stored in (``dense_format``)."""
    import dataclasses

    from colibri_plan.formats.pack_index import pack_dense_format, read_index, spec_from_pack

    spec = spec_from_pack(path)
    return dataclasses.replace(spec, dense_format=pack_dense_format(path, read_index(path)))


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
            spec = load_spec_file(path)
    elif path.exists():  # /dev/null, a pipe...
        raise InputError(f"{text} is not a regular file (expected a checkpoint folder, a .gguf file or a "
                         "spec JSON file)")
    elif looks_like_path:
        raise InputError(f"{text} does not exist (expected a checkpoint folder, a .gguf file or a spec "
                         "JSON file)")
    else:
        spec = catalogue_spec(text)
    return spec.with_format(quant) if quant else spec
