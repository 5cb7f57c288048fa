"""Whole-pack integrity check: every expert's crc32, file sizes and the dense file against the index.

Reads the whole pack (``model verify``); :func:`colibri_plan.formats.pack_index.read_index` alone checks
only the index document.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from colibri_plan.errors import FormatError, InputError
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.formats.pack_index import (
    DENSE_NAME,
    EXPERTS_NAME,
    check_entries,
    layout_from_dict,
    read_index,
)
from colibri_plan.formats.st_header import read_header


def file_crc32(path: Path, chunk_bytes: int = 1 << 24) -> int:
    """zlib.crc32 of a whole file, read in chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify_pack(path: str | os.PathLike, progress=None) -> dict:
    """Re-check a pack: index structure, file sizes against the index, every entry, every expert's crc32
    and the dense file's crc32.

    Args:
        progress: optional callable(done_experts, total) called every few experts.

    Returns:
        ``{"path", "ok", "experts", "experts_bytes", "problems": [messages]}``; ``ok`` is False when
        anything is wrong (a flipped byte, a truncated file, a wrong index entry, ...).

    Raises:
        InputError / FormatError: not a pack, or an unreadable index (nothing else can be checked).
    """
    folder = Path(path)
    doc = read_index(folder)
    layout = layout_from_dict(doc["block"])
    arch = ArchConfig.from_dict(doc["arch"])
    fmt = doc["format"]
    problems: list[str] = []
    exp_path, dense_path = folder / EXPERTS_NAME, folder / DENSE_NAME
    size = exp_path.stat().st_size if exp_path.is_file() else -1
    if size < 0:
        problems.append(f"{EXPERTS_NAME} is a folder, not a file" if exp_path.is_dir()
                        else f"{EXPERTS_NAME} is missing")
    elif size != fmt.get("experts_file_bytes"):
        problems.append(f"{EXPERTS_NAME} has {size} bytes, the index says {fmt.get('experts_file_bytes')}: "
                        "the file was truncated or replaced")
    # no file: entries are checked against the size the index records (one problem, not one per expert)
    bound = size if size >= 0 else int(fmt.get("experts_file_bytes") or 0)
    problems += check_entries(doc, layout, arch.moe_layers, arch.n_experts, bound)
    bad = 0
    if size >= 0:
        fd = os.open(exp_path, os.O_RDONLY)
        try:
            rows = doc["experts"]
            for i, row in enumerate(rows):
                if not (isinstance(row, list) and len(row) == 5):
                    continue
                l, e, off, nb, crc = row
                buf = os.pread(fd, nb, off)
                if len(buf) != nb:
                    continue  # already reported as beyond the end
                if zlib.crc32(buf) != crc:
                    bad += 1
                    if bad <= 10:
                        problems.append(f"expert (layer {l}, expert {e}) at offset {off}: crc32 "
                                        f"{zlib.crc32(buf):08x} != index {crc:08x} "
                                        "(corrupt data or wrong index entry)")
                if progress is not None and (i % 16 == 15 or i == len(rows) - 1):
                    progress(i + 1, len(rows))
        finally:
            os.close(fd)
    if bad > 10:
        problems.append(f"... {bad - 10} more experts with a crc32 mismatch")
    if not dense_path.is_file():
        problems.append(f"{DENSE_NAME} is missing")
    elif dense_path.stat().st_size != fmt.get("dense_file_bytes"):
        problems.append(f"{DENSE_NAME} has {dense_path.stat().st_size} bytes, the index says "
                        f"{fmt.get('dense_file_bytes')}")
    elif file_crc32(dense_path) != fmt.get("dense_crc32"):
        problems.append(f"{DENSE_NAME}: crc32 mismatch (corrupt dense tensors)")
    else:
        problems += trunk_problems(dense_path, arch, fmt.get("dense_tensors"))
    if not arch.moe_layers:
        problems.append("arch.moe_layers is empty: the pack has no routed experts to run; re-create it")
    return {"path": str(folder), "ok": not problems, "experts": len(doc["experts"]),
            "experts_bytes": size, "expert_format": fmt.get("expert_format"), "problems": problems}


def trunk_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the dense tensors outside attention that every pack of ``arch`` stores under the
    engine's canonical names (the full list, attention included, is
    ``colibri_plan.engine.weights.expected_dense_shapes``): embed and LM head [V, H], the norms [H], each
    MoE layer's router [E, H], each dense layer's FFN."""
    h = arch.hidden_size
    out = {"embed": (arch.vocab_size, h), "final_norm": (h,)}
    if not arch.tie_word_embeddings:
        out["lm_head"] = (arch.vocab_size, h)
    moe = set(arch.moe_layers)
    for i in range(arch.n_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm": (h,), p + "ffn_norm": (h,)})
        if i in moe:
            out[p + "router"] = (arch.n_experts, h)
        else:
            di = arch.dense_intermediate_size
            out.update({p + "ffn.gate": (di, h), p + "ffn.up": (di, h), p + "ffn.down": (h, di)})
    return out


_ST_DTYPE = {"float32": "F32", "float16": "F16", "uint16": "U16", "int8": "I8", "uint8": "U8"}


def stored_dtype(fmt: str) -> str:
    """The safetensors dtype a dense tensor stored in ``fmt`` has (F32, F16, U16 for bf16 bits, the
    integer formats' data dtype: engine/dense_quant.py's table)."""
    import numpy as np

    from colibri_plan.quant import FLOAT_FORMATS, quantize

    if fmt in FLOAT_FORMATS:
        return {"f32": "F32", "f16": "F16", "bf16": "U16"}.get(fmt, "F32")
    return _ST_DTYPE[str(quantize(np.zeros((1, 256), np.float32), fmt).data.dtype)]


def _format_problems(table: dict, formats: dict) -> list[str]:
    """The stored formats (``format.dense_tensors``) against the tensors: each tensor's dtype is its
    format's (F32 where none is listed), a ``.scales`` tensor belongs to an integer-format tensor. An
    index edited from ``lm_head: "int8"`` to ``"f32"`` would otherwise run int8 codes as float weights."""
    from colibri_plan.quant import FLOAT_FORMATS, FORMATS, HALF_GROUP_FORMATS

    bad = [f"{n}: {f!r}" for n, f in formats.items() if f not in FORMATS]
    if bad:
        return [f"format.dense_tensors names unknown formats ({', '.join(bad[:3])})"]
    out = []
    for name, t in table.items():
        base = name[:-len(".scales")] if name.endswith(".scales") else None
        if base is not None and base in table:
            if formats.get(base) in FLOAT_FORMATS or base not in formats:
                out.append(f"{DENSE_NAME} holds {name} but the index stores {base} as "
                           f"{formats.get(base, 'f32')} (no scales): the index's formats do not match the "
                           "tensors")
            elif t["dtype"] != ("F16" if formats[base] in HALF_GROUP_FORMATS else "F32"):
                want = "F16" if formats[base] in HALF_GROUP_FORMATS else "F32"
                out.append(f"{DENSE_NAME}: {name} is {t['dtype']}, {formats[base]} scales are {want}")
            continue
        want = stored_dtype(formats.get(name, "f32"))
        if t["dtype"] != want:
            out.append(f"{DENSE_NAME}: {name} is stored as {t['dtype']} but the index says "
                       f"{formats.get(name, 'f32')} ({want}): the index's formats do not match the tensors")
    return out[:3]


def trunk_problems(dense_path: Path, arch: ArchConfig, formats: dict | None = None) -> list[str]:
    """What ``run`` would refuse in the dense file: a corrupt safetensors header, a tensor whose stored
    dtype is not the format the index records for it (:func:`_format_problems`), or a trunk tensor of
    :func:`trunk_shapes` missing or of another shape than the index's architecture needs. ``formats``
    (``format.dense_tensors``): name -> stored format; quantized tensors have their data shape and a
    ``<name>.scales`` tensor."""
    from colibri_plan.quant import data_shape, scales_shape

    try:
        table, _ = read_header(dense_path)
    except (FormatError, InputError) as exc:
        return [f"{DENSE_NAME}: {exc}"]
    want = trunk_shapes(arch)
    for n, f in (formats or {}).items():
        if n in want and len(want[n]) == 2:
            want[n] = data_shape(f, *want[n])
            s_shape = scales_shape(f, *trunk_shapes(arch)[n])
            if s_shape is not None:
                want[n + ".scales"] = s_shape
    missing = [n for n in want if n not in table]
    wrong = [f"{n} {tuple(table[n]['shape'])} (the index's arch needs {want[n]})" for n in want
             if n in table and tuple(table[n]["shape"]) != want[n]]
    out = _format_problems(table, formats or {})
    if missing:
        out.append(f"{DENSE_NAME} lacks {len(missing)} tensor(s) the model needs, e.g. "
                   f"{', '.join(missing[:3])}")
    if wrong:
        out.append(f"{DENSE_NAME}: wrong shape {', '.join(wrong[:3])}; the index does not match its tensors")
    return out
