"""Size a Hugging Face checkpoint folder from ``config.json`` and the safetensors headers only.

A safetensors file starts with an unsigned 64-bit little-endian length N, then N bytes of JSON mapping
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte
after the header), optionally a ``__metadata__`` entry; the tensor data follows. We read those N + 8
bytes per shard and never a tensor, so sizing a 700 GB checkpoint reads a few megabytes.

The expert geometry comes from ``config.json`` (read by the model's family file,
:func:`colibri_plan.families.plan_geometry`) and is checked
against the routed-expert tensors the headers list (real tensor names):

- Mixtral: ``model.layers.L.block_sparse_moe.experts.E.{w1,w3}.weight`` [I, H], ``w2`` [H, I];
- Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4.x/5: ``model.layers.L.mlp.experts.E.{gate,up}_proj.weight``
  [I, H], ``down_proj`` [H, I];
- fused layouts: ``model.layers.L.mlp.experts.gate_up_proj`` [E, 2I, H] or [E, H, 2I] (gpt-oss),
  ``down_proj`` [E, H, I] or [E, I, H]; MXFP4 ``*_blocks`` / ``*_scales`` give the expert count only.

MoE rows with ids >= num_hidden_layers that hold experts in the headers are an MTP head (DeepSeek-V3's
layer 61, GLM's layer 78/92) and become extra rows. Dense parameters are counted exactly from the
headers: every tensor outside the routed experts, quantisation side tensors (``*_scale_inv``,
``*.weight_scale`` ...) excluded.

A folder with ``config.json`` and no ``*.safetensors`` file yet (planning before a download) is sized
from the config alone, the catalogue's way: the geometry from :mod:`colibri_plan.families`, MTP rows
from ``num_nextn_predict_layers``, dense parameters counted by transformers on the meta device
(:mod:`colibri_plan.model.metacount`; needs torch and transformers).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from colibri_plan.errors import FormatError, InputError, UnsupportedError
from colibri_plan.families import plan_geometry
from colibri_plan.fileio import read_json_object
from colibri_plan.formats.model_spec import ModelSpec
from colibri_plan.formats.st_header import extra_layers, numel, read_header, regular_file, tensor_files

_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")

_PER_EXPERT = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp|feed_forward|ffn)\.experts\.(\d+)\."
                         r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.(\w+)$")
_FUSED = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp|feed_forward|ffn)\.experts\."
                    r"(gate_up_proj|gate_proj|up_proj|down_proj)(_blocks|_scales|_bias|\.weight|_scale)?$")
_SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_experts?\.(?:gate_proj|w1)\.weight$")
_AUX = re.compile(r"(_scale_inv|\.weight_scale|\.input_scale|\.weight_zero_point|\.weight_shape|"
                  r"\.weight_global_scale)$")
_ROLE = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def read_safetensors_header(path: str | Path) -> dict:
    """The tensor table of one safetensors file: ``{name: {"dtype", "shape", "data_offsets"}}``
    (``__metadata__`` dropped). Reads only the header, checked as the safetensors package checks it
    (:func:`colibri_plan.formats.st_header.read_header`).

    Raises:
        InputError: the file cannot be opened.
        FormatError: truncated, header not JSON, or an entry whose dtype, shape or offsets are malformed,
            disagree with each other, overlap or point past the end of the file.
    """
    return read_header(path)[0]


def read_checkpoint_headers(folder: Path) -> dict:
    """All tensors of a checkpoint folder's safetensors shards (names unique across shards, each in the
    shard ``model.safetensors.index.json`` maps it to).

    Raises:
        InputError: no ``*.safetensors`` file, or a shard named in the index is missing.
        FormatError: a shard's header is corrupt, a tensor appears in two shards or in another shard
            than the index says.
    """
    return {name: t for name, (_, t, _) in tensor_files(Path(folder)).items()}


def _expert_rows(tensors: dict, hidden: int, where: str) -> dict[int, dict]:
    """Per MoE row: {"experts": set of ids or count, "inter": set of I seen, "dtype": set}."""
    rows: dict[int, dict] = {}

    def row(layer: int) -> dict:
        return rows.setdefault(layer, {"ids": set(), "count": None, "inter": set(), "dtypes": set()})

    for name, t in tensors.items():
        shape, dtype = t["shape"], t["dtype"]
        m = _PER_EXPERT.search(name)
        if m:
            r = row(int(m.group(1)))
            r["ids"].add(int(m.group(2)))
            if m.group(4) == "weight" and dtype in _FLOAT_DTYPES:
                r["dtypes"].add(dtype)
                if len(shape) != 2:
                    raise FormatError(f"{where}: expert tensor {name} has shape {shape}, expected 2-D")
                role = _ROLE[m.group(3)]
                i_dim, h_dim = (shape[0], shape[1]) if role != "down" else (shape[1], shape[0])
                if h_dim != hidden:
                    raise FormatError(f"{where}: expert tensor {name} has shape {shape}, which does not "
                                      f"match config hidden_size {hidden}")
                r["inter"].add(i_dim)
            continue
        m = _FUSED.search(name)
        if m:
            r = row(int(m.group(1)))
            suffix = m.group(3) or ""
            if r["count"] is None or suffix in ("", ".weight"):
                r["count"] = shape[0]
            if suffix in ("", ".weight") and dtype in _FLOAT_DTYPES and len(shape) == 3:
                r["dtypes"].add(dtype)
                _, a, b = shape
                fused = 2 if m.group(2) == "gate_up_proj" else 1
                if b == hidden and a % fused == 0:
                    r["inter"].add(a // fused)
                elif a == hidden and b % fused == 0:
                    r["inter"].add(b // fused)
                else:
                    raise FormatError(f"{where}: expert tensor {name} has shape {shape}, which does not "
                                      f"match config hidden_size {hidden}")
    return rows


def checkpoint_spec(folder: str | Path) -> ModelSpec:
    """ModelSpec of a Hugging Face checkpoint folder, from config.json and safetensors headers only; a
    folder without any ``*.safetensors`` file is sized from config.json alone (:func:`config_only_spec`).

    Raises:
        InputError: the folder or its config.json is missing, or a shard named in the index is missing;
            config.json or a shard is not a regular file (a named pipe would block forever).
        UnsupportedError: config.json describes a model without routed experts.
        FormatError: corrupt config/header, or the headers disagree with config.json (layers, expert
            count, widths) — the message names the tensor and the config field.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"checkpoint folder {folder} does not exist")
    cfg_path = folder / "config.json"
    if not regular_file(cfg_path, "config.json"):
        raise InputError(f"{folder} has no config.json; is it a Hugging Face checkpoint folder?")
    cfg = read_json_object(cfg_path, "Hugging Face config.json")
    geo = plan_geometry(cfg, str(cfg_path))
    arch = geo.arch
    where = str(folder)
    if not any(folder.glob("*.safetensors")):
        return config_only_spec(folder, cfg)
    tensors = read_checkpoint_headers(folder)
    rows = _expert_rows(tensors, arch.hidden_size, where)
    n_layers, n_experts = arch.n_layers, arch.n_experts
    found = tuple(sorted(i for i in rows if i < n_layers))
    if found != arch.moe_layers:
        raise FormatError(f"{where}: the safetensors headers hold routed experts in layers "
                          f"{list(found)[:8]}{'...' if len(found) > 8 else ''} ({len(found)} layers) but "
                          f"config.json puts them in {len(arch.moe_layers)} layers "
                          f"{list(arch.moe_layers)[:8]}...; the config does not belong to these weights")
    for layer in sorted(rows):
        r = rows[layer]
        count = r["count"] if r["count"] is not None else len(r["ids"])
        if count != n_experts or (r["ids"] and r["ids"] != set(range(n_experts))):
            raise FormatError(f"{where}: layer {layer} holds {count} routed experts in the headers, "
                              f"config.json says {n_experts}")
        if r["inter"] and r["inter"] != {arch.moe_intermediate_size}:
            raise FormatError(f"{where}: layer {layer} experts are {sorted(r['inter'])} wide in the headers, "
                              f"config.json says moe_intermediate_size {arch.moe_intermediate_size}")
    shared_w = {t["shape"][0] for n, t in tensors.items() if _SHARED.search(n)}
    if shared_w and shared_w != {arch.shared_intermediate_size}:
        raise FormatError(f"{where}: shared experts are {sorted(shared_w)} wide in the headers, config.json "
                          f"says {arch.shared_intermediate_size}")
    extra_layers(tensors, n_layers, geo.mtp_layers, where)
    mtp = tuple(sorted(i for i in rows if i >= n_layers))
    dense = sum(numel(t["shape"]) for n, t in tensors.items()
                if not (_PER_EXPERT.search(n) or _FUSED.search(n) or _AUX.search(n)))
    dtypes = sorted(set().union(*(r["dtypes"] for r in rows.values())))
    return ModelSpec(
        name=folder.resolve().name, **geo.spec_fields(mtp), expert_format="int4", dense_params=dense,
        source=f"checkpoint: {folder.resolve()} (experts stored as {'/'.join(dtypes) or 'packed'})")


#: the ``source`` note of a spec sized without weights
CONFIG_ONLY_NOTE = "config.json only (no weights: dense bytes computed from the config)"


def config_only_spec(folder: str | Path, cfg: dict) -> ModelSpec:
    """ModelSpec of a folder that holds ``config.json`` but no weights yet, built as a catalogue entry is
    (:func:`colibri_plan.model.catalogue.spec_from_entry`): routed-expert geometry, MTP rows
    (``num_nextn_predict_layers``) and KV bytes from the config; ``dense_params`` counted by transformers'
    own model class on torch's meta device (:func:`colibri_plan.model.metacount.count_params`), so no
    weight is read or allocated. ``source`` says so (:data:`CONFIG_ONLY_NOTE`).

    Nothing checks the config against weights here; size the folder again once they are downloaded.

    Raises:
        UnsupportedError: torch/transformers are not installed, or transformers cannot build the config.
        FormatError: the config has no ``model_type`` or lacks a needed field.
    """
    from colibri_plan.model.catalogue import spec_from_entry

    folder = Path(folder)
    where = str(folder / "config.json")
    mtp = plan_geometry(cfg, where).mtp_layers
    # the meta-device build needs only the architecture; a quantised checkpoint's recipe is irrelevant
    arch = {k: v for k, v in cfg.items() if k != "quantization_config"}
    try:
        from colibri_plan.model.metacount import count_params

        dense = count_params(arch, mtp)["dense"]
    except ImportError as exc:
        raise UnsupportedError(f"{folder} holds config.json but no *.safetensors files; sizing it from the "
                               f"config alone needs torch and transformers ({exc}): pip install torch "
                               "transformers, or download the safetensors files") from exc
    except UnsupportedError:
        raise
    except Exception as exc:  # transformers' own validation of a config it cannot build
        raise UnsupportedError(f"{where}: transformers cannot build model_type {cfg['model_type']!r} to "
                               f"count its dense parameters ({type(exc).__name__}: {exc}); download the "
                               "safetensors files and size the folder from their headers") from exc
    entry = {"name": folder.resolve().name, "config": cfg, "mtp_layers": mtp, "dense_params": dense,
             "source": ""}
    spec = spec_from_entry(entry)
    return dataclasses.replace(spec, source=f"{CONFIG_ONLY_NOTE}: {folder.resolve()}")
