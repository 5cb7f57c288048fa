"""Whole-pack integrity check: every expert's crc32, file sizes and the dense file against the index.

Reads the whole pack (``model verify``); :func:`colibri_plan.formats.pack_index.read_index` alone checks
only the index document.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from colibri_plan.formats.arch import ArchConfig
from colibri_plan.formats.pack_index import (
    DENSE_NAME,
    EXPERTS_NAME,
    check_entries,
    layout_from_dict,
    read_index,
)


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
    return {"path": str(folder), "ok": not problems, "experts": len(doc["experts"]),
            "experts_bytes": size, "expert_format": fmt.get("expert_format"), "problems": problems}
