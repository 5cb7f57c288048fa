"""The safetensors header and a checkpoint's shard map: read and checked before any tensor is touched.

A safetensors file is an unsigned 64-bit little-endian length N, N bytes of JSON mapping each tensor name
to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the byte after the header)
plus an optional ``__metadata__`` object of string values, then the tensor data. :func:`read_header`
checks it as strictly as the ``safetensors`` package does when it opens the file (so a file that passes
never raises its ``SafetensorError`` later): known dtypes, non-negative shapes, ``end - begin`` equal to
the shape's element count times the dtype size, tensors that tile the data section exactly (no gap, no
overlap, nothing past the end, no trailing bytes), string metadata.

A sharded checkpoint lists its files in ``model.safetensors.index.json`` (``weight_map``: tensor name ->
shard file name); :func:`checkpoint_shards` reads that map and :func:`tensor_files` follows it, refusing
a tensor that two shards hold or that sits in another shard than the map says.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import parse_json
from colibri_plan.formats.fields import is_whole

#: bytes per element of every safetensors dtype (sub-byte float formats are not read by this tool)
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}
#: the largest header the safetensors package accepts (100 MB)
MAX_HEADER_BYTES = 100_000_000
INDEX_NAME = "model.safetensors.index.json"


def numel(shape) -> int:
    """Element count of a shape (1 for a scalar [])."""
    n = 1
    for d in shape:
        n *= d
    return n


def _whole(v) -> bool:
    return is_whole(v) and v >= 0


def read_header(path: str | Path) -> tuple[dict, int]:
    """The tensor table of one safetensors file and the absolute offset of its data section:
    ``({name: {"dtype", "shape", "data_offsets"}}, 8 + N)`` (``__metadata__`` dropped). Reads only the
    header.

    Raises:
        InputError: the file cannot be opened.
        FormatError: truncated, header not a JSON object, an entry whose dtype, shape or offsets are
            malformed, whose size disagrees with its shape, or tensors that overlap, leave gaps, run past
            the end or leave trailing bytes; non-string metadata. The message names the tensor and says
            to re-download the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{path}: truncated safetensors file ({len(head)} bytes; needs an 8-byte "
                                  "header length); re-download it")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise FormatError(f"{path}: truncated safetensors header (declares {n:,} header bytes, file "
                                  f"has {size:,}): the file is truncated or corrupt; re-download it")
            raw = f.read(n)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from exc
    table = parse_json(raw, f"{path}: safetensors header", "safetensors file")
    if not isinstance(table, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    meta = table.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise FormatError(f"{path}: safetensors __metadata__ must map names to strings; the file is corrupt")
    data_bytes = size - 8 - n
    spans = []
    for name, t in table.items():
        ok = (isinstance(t, dict) and isinstance(t.get("dtype"), str) and t["dtype"] in DTYPE_BYTES
              and isinstance(t.get("shape"), list)
              and all(_whole(d) for d in t["shape"]) and isinstance(t.get("data_offsets"), list)
              and len(t["data_offsets"]) == 2 and all(_whole(o) for o in t["data_offsets"]))
        if not ok:
            raise FormatError(f"{path}: malformed header entry for tensor {name!r}: {str(t)[:200]}; the file "
                              "is corrupt; re-download it")
        begin, end = t["data_offsets"]
        if not begin <= end <= data_bytes:
            raise FormatError(f"{path}: tensor {name!r} lies past the end of the file (offsets "
                              f"{begin}..{end}, {data_bytes:,} data bytes): the file is truncated; "
                              "re-download it")
        want = numel(t["shape"]) * DTYPE_BYTES[t["dtype"]]
        if end - begin != want:
            raise FormatError(f"{path}: tensor {name!r} ({t['dtype']} {t['shape']}) needs {want:,} bytes but "
                              f"its offsets hold {end - begin:,}; the file is corrupt; re-download it")
        spans.append((begin, end, name))
    spans.sort()
    pos = 0
    for begin, end, name in spans:
        if begin != pos:
            what = ("overlaps the tensor before it" if begin < pos
                    else f"leaves a gap of {begin - pos:,} bytes")
            raise FormatError(f"{path}: tensor {name!r} at offsets {begin}..{end} {what}; the file is "
                              "corrupt; re-download it")
        pos = end
    if pos != data_bytes:
        raise FormatError(f"{path}: {data_bytes - pos:,} bytes after the last tensor that no header entry "
                          "describes; the file is corrupt or was appended to; re-download it")
    return table, 8 + n


def checkpoint_shards(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint folder and its ``weight_map`` (None without an index file):
    the files the index names (plain file names inside the folder), else every ``*.safetensors``.

    Raises:
        InputError: no ``*.safetensors`` file, or a shard named in the index is missing.
        FormatError: the index is not JSON, has no ``weight_map`` object of name -> file name, or names a
            file outside the folder.
    """
    folder = Path(folder)
    index = folder / INDEX_NAME
    weight_map = None
    if index.is_file():
        try:
            text = index.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read {index}: {exc.strerror}") from exc
        doc = parse_json(text, str(index), "safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise FormatError(f"{index}: not a safetensors index (needs a 'weight_map' object of tensor name "
                              "-> shard file name); re-download it")
        names = sorted(set(weight_map.values()))
        bad = [s for s in names if not s or "/" in s or "\\" in s or s in (".", "..") or "\0" in s]
        if bad:
            raise FormatError(f"{index}: shard {bad[0][:80]!r} is not a plain file name inside {folder}")
        shards = [folder / s for s in names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise InputError(f"{folder}: shard(s) named in {INDEX_NAME} are missing: "
                             f"{', '.join(missing[:5])}")
    else:
        shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise InputError(f"{folder} holds no *.safetensors files (save the model with safe_serialization, "
                         "or pass a .gguf file)")
    return shards, weight_map


def tensor_files(folder: Path) -> dict[str, tuple[Path, dict, int]]:
    """Every tensor of a checkpoint folder: name -> (shard, header entry, data start of that shard).

    Raises:
        InputError / FormatError: see :func:`checkpoint_shards` and :func:`read_header`; also a tensor
            held by two shards, one the index maps to another shard, or one the index lists that no
            shard holds.
    """
    shards, weight_map = checkpoint_shards(folder)
    out: dict[str, tuple[Path, dict, int]] = {}
    for shard in shards:
        table, start = read_header(shard)
        for name, t in table.items():
            if name in out:
                raise FormatError(f"{folder}: tensor {name!r} appears in two shards ({out[name][0].name} and "
                                  f"{shard.name}); which one is meant is unknown: re-download the checkpoint")
            if weight_map is not None and weight_map.get(name) != shard.name:
                raise FormatError(f"{folder}: tensor {name!r} is in {shard.name} but {INDEX_NAME} maps it to "
                                  f"{weight_map.get(name)!r}; the index does not belong to these shards")
            out[name] = (shard, t, start)
    if weight_map is not None:
        lost = [n for n in weight_map if n not in out]
        if lost:
            raise FormatError(f"{folder}: {INDEX_NAME} lists {len(lost)} tensor(s) no shard holds, e.g. "
                              f"{lost[0][:80]!r} (in {weight_map[lost[0]]!r}); re-download the checkpoint")
    return out


_LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")
#: tensors only a multi-token-prediction head has (DeepSeek-V3 / GLM MTP layers)
_MTP_ONLY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:eh_proj|enorm|hnorm|shared_head)\.")


def extra_layers(names, n_layers: int, declared_mtp: int, where: str) -> tuple[int, ...]:
    """Layer ids >= ``n_layers`` (config ``num_hidden_layers``) that tensor ``names`` hold. Each must be a
    multi-token-prediction head: one of the ``declared_mtp`` (``num_nextn_predict_layers``) layers right
    after the decoder, or a layer with MTP-only tensors (``eh_proj``, ``enorm``, ``hnorm``,
    ``shared_head``). Returns them ascending (callers name them when they ignore them).

    Raises:
        FormatError: a layer beyond ``num_hidden_layers`` that is not an MTP head: the config does not
            belong to the weights (a lowered ``num_hidden_layers`` would silently drop layers).
    """
    extra, marked = set(), set()
    for name in names:
        m = _LAYER_ID.search(name)
        if m and int(m.group(1)) >= n_layers:
            extra.add(int(m.group(1)))
        m = _MTP_ONLY.search(name)
        if m:
            marked.add(int(m.group(1)))
    stray = sorted(i for i in extra if i not in marked and not i < n_layers + declared_mtp)
    if stray:
        raise FormatError(f"{where}: the weights hold layer(s) {stray[:8]} but config.json says "
                          f"num_hidden_layers = {n_layers} (and {declared_mtp} MTP layer(s)); layers beyond "
                          "it would be dropped: the config does not belong to these weights; fix "
                          "num_hidden_layers")
    return tuple(sorted(extra))
