"""The expert pack's layout and index, and the whole-pack integrity check.

A pack is a folder (see ``docs/pack-format.md``)::

    OUT/pack.json          index: kind "pack", schema_version 1 (read with fileio.read_document)
    OUT/experts.bin        every routed expert as one 4096-byte-aligned block, layer-major, expert-ascending
    OUT/dense.safetensors  dense tensors (float32) under the engine's canonical names

One expert block holds six parts in this order, each starting on a 64-byte boundary so numpy views of
float32 scales are aligned: gate data, gate scales, up data, up scales, down data, down scales (float
formats have no scales parts). The block is zero-padded to a multiple of 4096 bytes, so one O_DIRECT
read of ``nbytes`` at ``offset`` fetches a whole expert; its crc32 (``zlib.crc32``) covers the padded
block, exactly the bytes such a read returns. Every block of a pack has the same layout (``block`` in
the index); the per-expert entries are ``[layer, expert, offset, nbytes, crc32]``.

Also here (light, no safetensors): :func:`is_pack`, :func:`spec_from_pack` (the ModelSpec a pack stores,
what ``load_model_spec(PACK)`` returns) and :func:`pack_summary`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_plan.errors import FormatError, InputError, IntegrityError
from colibri_plan.fileio import read_document
from colibri_plan.formats import fields as f
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.formats.fields import At
from colibri_plan.formats.pack_spec import check_pack_spec
from colibri_plan.quant import check_format, data_shape, scale_dtype, scales_shape

PACK_KIND = "pack"
PACK_SCHEMA_VERSION = 1
INDEX_NAME = "pack.json"
EXPERTS_NAME = "experts.bin"
DENSE_NAME = "dense.safetensors"
#: alignment of every expert block (offset and length): the O_DIRECT / page granularity
BLOCK_ALIGN = 4096
#: alignment of the parts inside a block (keeps float32 scales aligned for numpy views)
PART_ALIGN = 64
_DATA_DTYPE = {"f32": "float32", "f16": "float16", "bf16": "uint16", "int8": "int8"}


def align_up(n: int, a: int) -> int:
    """Smallest multiple of ``a`` that is >= ``n``."""
    return -(-int(n) // a) * a


@dataclass(frozen=True)
class Part:
    """One array inside an expert block: ``name`` ("gate.data", "gate.scales", ...), byte ``offset``
    from the block start, ``nbytes``, numpy ``dtype`` name and ``shape``."""

    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def to_list(self) -> list:
        return [self.name, self.offset, self.nbytes, self.dtype, list(self.shape)]


@dataclass(frozen=True)
class BlockLayout:
    """Layout of one expert block: gate [I, H], up [I, H], down [H, I] in format ``fmt``.

    Attributes:
        fmt: quant format of the three matrices.
        hidden_size, width: H and the expert width I.
        parts: the arrays in file order (gate, up, down; data then scales).
        payload_bytes: end of the last part (bytes that carry data).
        block_bytes: ``payload_bytes`` rounded up to 4096: the block's size on disk and read length.
    """

    fmt: str
    hidden_size: int
    width: int
    parts: tuple[Part, ...]
    payload_bytes: int
    block_bytes: int

    def part(self, name: str) -> Part:
        for p in self.parts:
            if p.name == name:
                return p
        raise KeyError(name)

    def to_dict(self) -> dict:
        return {"format": self.fmt, "hidden_size": self.hidden_size, "width": self.width,
                "payload_bytes": self.payload_bytes, "block_bytes": self.block_bytes,
                "alignment_bytes": BLOCK_ALIGN, "parts": [p.to_list() for p in self.parts]}


def block_layout(fmt: str, hidden_size: int, width: int) -> BlockLayout:
    """The block layout of an expert with hidden size H and width I in ``fmt``.

    Example: GLM-5.2 geometry (H 6144, I 2048) at int4 gives payload 18,915,328 B = block 18,915,328 B
    (already a multiple of 4096).

    Raises:
        UnsupportedError: unknown format.
        InputError: non-positive sizes.
    """
    check_format(fmt)
    if hidden_size < 1 or width < 1:
        raise InputError(f"expert geometry must be positive, got hidden {hidden_size}, width {width}")
    dtype = _DATA_DTYPE.get(fmt, "uint8")
    parts, pos = [], 0
    for name, (o, i) in (("gate", (width, hidden_size)), ("up", (width, hidden_size)),
                         ("down", (hidden_size, width))):
        shape = data_shape(fmt, o, i)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        parts.append(Part(f"{name}.data", pos, n, dtype, tuple(shape)))
        pos = align_up(pos + n, PART_ALIGN)
        s = scales_shape(fmt, o, i)
        if s is not None:
            sd = scale_dtype(fmt)  # float32; float16 for int4-gGh
            n = int(np.prod(s)) * sd.itemsize
            parts.append(Part(f"{name}.scales", pos, n, sd.name, tuple(s)))
            pos = align_up(pos + n, PART_ALIGN)
    payload = parts[-1].offset + parts[-1].nbytes
    return BlockLayout(fmt, int(hidden_size), int(width), tuple(parts), payload,
                       align_up(payload, BLOCK_ALIGN))


def layout_from_dict(d: dict) -> BlockLayout:
    """Rebuild the layout from the index and check it equals :func:`block_layout` of its geometry.

    Raises:
        FormatError: fields missing, or parts that differ from what this version writes.
    """
    try:
        want = block_layout(d["format"], int(d["hidden_size"]), int(d["width"]))
        got = tuple(Part(p[0], int(p[1]), int(p[2]), str(p[3]), tuple(int(x) for x in p[4]))
                    for p in d["parts"])
        block_bytes = int(d["block_bytes"])
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:  # int(inf): OverflowError
        raise FormatError(f"pack index: malformed 'block' layout ({exc}); re-create the pack") from None
    if got != want.parts or block_bytes != want.block_bytes:
        raise FormatError("pack index: the expert block layout differs from the layout of its format and "
                          "geometry; the index is corrupt or from another version; re-create the pack")
    return want


def parse_block(buf, layout: BlockLayout, copy: bool = False):
    """Split an expert block into (gate, up, down) QuantTensors.

    Args:
        buf: bytes-like of at least ``layout.payload_bytes`` (a bytes object, memoryview, mmap or a
            uint8 numpy array, e.g. an O_DIRECT read buffer).
        copy: when False the arrays are views of ``buf`` (valid while ``buf`` is unchanged).

    Raises:
        IntegrityError: ``buf`` is shorter than the payload.
    """
    from colibri_plan.quant import QuantTensor

    mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if len(mv) < layout.payload_bytes:
        raise IntegrityError(f"expert block has {len(mv)} bytes, its layout needs {layout.payload_bytes}")
    arrays = {}
    for p in layout.parts:
        a = np.frombuffer(mv, dtype=p.dtype, count=p.nbytes // np.dtype(p.dtype).itemsize,
                          offset=p.offset).reshape(p.shape)
        arrays[p.name] = a.copy() if copy else a
    H, I = layout.hidden_size, layout.width
    fmt = layout.fmt
    return tuple(QuantTensor(fmt, o, i, arrays[f"{n}.data"], arrays.get(f"{n}.scales"))
                 for n, (o, i) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))))


def read_index(path: str | os.PathLike) -> dict:
    """Read and structurally check ``pack.json`` of the pack folder ``path``.

    Raises:
        InputError: ``path`` is not a folder or has no index.
        FormatError: wrong kind/schema, or missing sections.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise InputError(f"pack {folder} does not exist or is not a folder; create it with "
                         "`colibri-plan model pack` or `colibri-plan model fixture`")
    if not (folder / INDEX_NAME).is_file():
        raise InputError(f"{folder} is not an expert pack: it has no {INDEX_NAME}")
    doc = read_document(folder / INDEX_NAME, PACK_KIND, PACK_SCHEMA_VERSION)
    where = folder / INDEX_NAME
    for key in ("arch", "format", "block", "model"):
        if not isinstance(doc.get(key), dict):
            raise FormatError(f"{where}: missing or malformed section {key!r}; re-create the pack")
    if not isinstance(doc.get("experts"), list):
        raise FormatError(f"{where}: missing or malformed section 'experts'; re-create the pack")
    if doc["format"].get("expert_format") not in (doc["block"].get("format"),):
        raise FormatError(f"{where}: expert_format disagrees with the block layout")
    check_index_fields(where, doc)
    return doc


def _whole(v) -> bool:
    return f.is_whole(v) and v >= 0


def check_index_fields(where, doc: dict) -> None:
    """Field-level check of a pack index (run by :func:`read_index`, so ``run``, ``model verify``,
    ``model show`` and ``solve`` all refuse a hand-edited index before any work): the architecture
    (:class:`ArchConfig` types and ranges), file names (plain names: no folders, no ".."), known
    formats, sizes and crc32s as non-negative whole numbers, the block layout against its format and
    the arch geometry, and every expert entry ``[layer, expert, offset, nbytes, crc32]`` (whole numbers,
    crc32 < 2**32, inside the ``experts_file_bytes`` the index records).

    Raises:
        FormatError: the first bad field, named as ``<where>: <section>.<field> ...``.
    """
    from colibri_plan.quant import FORMATS

    try:
        arch = ArchConfig.from_dict(doc["arch"])
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}; re-create the pack") from None
    fmt = doc["format"]
    for key, want in (("experts_file", EXPERTS_NAME), ("dense_file", DENSE_NAME)):
        name = fmt.get(key, want)
        if (not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..")
                or ".." in name.split(os.sep)):
            raise FormatError(f"{where}: format.{key} must be a plain file name inside the pack folder, "
                              f"got {name!r}")
        if name != want:
            raise FormatError(f"{where}: format.{key} is {name!r}; this version reads only {want!r}")
    for key in ("expert_format", "dense_format"):
        if key in fmt or key == "expert_format":
            if fmt.get(key) not in FORMATS:
                raise FormatError(f"{where}: format.{key} {fmt.get(key)!r} is not a known format "
                                  f"({', '.join(FORMATS)})")
    tensors = fmt.get("dense_tensors", {})
    if not isinstance(tensors, dict) or any(not isinstance(n, str) or f not in FORMATS or f == "int2"
                                            for n, f in tensors.items()):
        raise FormatError(f"{where}: format.dense_tensors must map tensor names to dense formats, "
                          f"got {str(tensors)[:80]}")
    at = At(str(where), repr_values=True)
    for key in ("experts_file_bytes", "dense_file_bytes", "dense_crc32"):
        if key in fmt:
            f.whole(fmt, key, at / "format", lo=0, want="a non-negative whole number")
    if "dense_crc32" in fmt and fmt["dense_crc32"] >= 1 << 32:
        raise FormatError(f"{where}: format.dense_crc32 {fmt['dense_crc32']} is not a 32-bit crc")
    block = doc["block"]
    for key in ("hidden_size", "width", "payload_bytes", "block_bytes"):
        f.whole(block, key, at / "block", lo=0, want="a non-negative whole number")
    if (block["hidden_size"], block["width"]) != (arch.hidden_size, arch.moe_intermediate_size):
        raise FormatError(f"{where}: block geometry (hidden {block['hidden_size']}, width {block['width']}) "
                          f"differs from arch (hidden_size {arch.hidden_size}, moe_intermediate_size "
                          f"{arch.moe_intermediate_size})")
    want = block_layout(block["format"], block["hidden_size"], block["width"])
    for key in ("payload_bytes", "block_bytes"):
        if block[key] != getattr(want, key):
            raise FormatError(f"{where}: block.{key} is {block[key]}, but {block['format']} experts of "
                              f"hidden {want.hidden_size} x width {want.width} take {getattr(want, key)}")
    check_pack_spec(where, doc, arch)
    limit = fmt.get("experts_file_bytes")
    for i, row in enumerate(doc["experts"]):
        if not (isinstance(row, list) and len(row) == 5 and all(_whole(v) for v in row)):
            raise FormatError(f"{where}: experts[{i}] must be [layer, expert, offset, nbytes, crc32] of "
                              f"non-negative whole numbers, got {row!r}")
        if row[4] >= 1 << 32:
            raise FormatError(f"{where}: experts[{i}] crc32 {row[4]} is not a 32-bit crc")
        if limit is not None and row[2] + row[3] > limit:
            raise FormatError(f"{where}: experts[{i}] bytes {row[2]}..{row[2] + row[3]} lie beyond "
                              f"format.experts_file_bytes ({limit})")


def check_entries(doc: dict, layout: BlockLayout, moe_layers, n_experts: int, file_bytes: int) -> list[str]:
    """Problems with the per-expert entries: coverage of every (layer, expert) once, 4096 alignment,
    block size, bounds within ``file_bytes`` and overlaps. Returns messages (empty when fine)."""
    problems = []
    want = {(int(l), e) for l in moe_layers for e in range(n_experts)}
    seen, spans = set(), []
    for row in doc["experts"]:
        if not (isinstance(row, list) and len(row) == 5 and all(isinstance(v, int) for v in row)):
            problems.append(f"malformed expert entry {row!r}")
            continue
        l, e, off, nb, _ = row
        if (l, e) in seen:
            problems.append(f"expert (layer {l}, expert {e}) listed twice")
        seen.add((l, e))
        if (l, e) not in want:
            problems.append(f"expert entry (layer {l}, expert {e}) is not in the model")
        if off % BLOCK_ALIGN or nb % BLOCK_ALIGN:
            problems.append(f"expert (layer {l}, expert {e}): offset {off} / nbytes {nb} not 4096-aligned")
        if nb != layout.block_bytes:
            problems.append(f"expert (layer {l}, expert {e}): nbytes {nb} != block size {layout.block_bytes}")
        if off < 0 or off + nb > file_bytes:
            problems.append(f"expert (layer {l}, expert {e}): bytes {off}..{off + nb} lie beyond the end of "
                            f"{EXPERTS_NAME} ({file_bytes} B): truncated file or wrong offset")
        spans.append((off, nb, l, e))
    missing = want - seen
    if missing:
        problems.append(f"{len(missing)} expert(s) missing from the index, e.g. (layer, expert) "
                        f"{sorted(missing)[0]}")
    spans.sort()
    for (o1, n1, l1, e1), (o2, _, l2, e2) in zip(spans, spans[1:]):
        if o1 + n1 > o2:
            problems.append(f"experts (layer {l1}, expert {e1}) and (layer {l2}, expert {e2}) overlap "
                            f"at byte {o2}")
    return problems


def spec_from_arch(arch: ArchConfig, expert_format: str, dense_params: int, name: str, source: str,
                   kv_bytes_per_element: int = 4):
    """A :class:`colibri_plan.formats.model_spec.ModelSpec` of ``arch`` (KV cache counted at
    ``kv_bytes_per_element`` bytes per element, float32 as this engine stores it; MLA layers cache
    their latent and rope rows only, see :meth:`ArchConfig.kv_values_per_token`)."""
    from colibri_plan.formats.model_spec import ModelSpec

    kv = arch.n_layers * arch.kv_values_per_token * kv_bytes_per_element
    return ModelSpec(name=name, family=arch.family, n_layers=arch.n_layers, moe_layers=arch.moe_layers,
                     n_experts=arch.n_experts, top_k=arch.top_k, n_shared_experts=arch.n_shared_experts,
                     hidden_size=arch.hidden_size, moe_intermediate_size=arch.moe_intermediate_size,
                     shared_intermediate_size=arch.shared_intermediate_size, vocab_size=arch.vocab_size,
                     expert_format=expert_format, dense_params=int(dense_params), kv_bytes_per_token=kv,
                     source=source)


def is_pack(path) -> bool:
    """True when ``path`` is a folder holding a pack index (cheap; does not validate)."""
    return (Path(path) / INDEX_NAME).is_file()


def spec_from_pack(path):
    """The ModelSpec stored in a pack's index (geometry fingerprint as ModelSpec.fingerprint()).

    Raises:
        InputError / FormatError: not a pack or a bad index.
    """
    from colibri_plan.formats.model_spec import ModelSpec

    doc = read_index(path)
    spec = ModelSpec.from_dict(doc["model"]["spec"])
    if spec.fingerprint() != doc["model"].get("fingerprint"):
        raise FormatError(f"pack {path}: stored model fingerprint does not match its spec; re-create it")
    return spec


def pack_summary(path) -> dict:
    """Short JSON-ready description of a pack (for ``model verify`` / ``run``)."""
    doc = read_index(path)
    return {"path": str(path), "name": doc["model"].get("name"),
            "fingerprint": doc["model"].get("fingerprint"),
            "expert_format": doc["format"]["expert_format"], "experts": len(doc["experts"]),
            "expert_block_bytes": doc["block"]["block_bytes"],
            "experts_file_bytes": doc["format"]["experts_file_bytes"], "extra": doc.get("extra", {}),
            "arch": doc["arch"]}


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
