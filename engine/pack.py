"""The expert pack: write a model's routed experts as 4096-byte-aligned blocks, read them back.

Format (details and field list in ``docs/pack-format.md``; layout code in
:mod:`colibri_plan.formats.pack_index`): a folder with ``pack.json`` (index), ``experts.bin`` (one block
per expert: gate/up/down data and scales contiguous, zero-padded to 4096 bytes so one O_DIRECT read
fetches a whole expert) and ``dense.safetensors`` (float32 dense tensors under canonical engine names).

Packs are written atomically: everything goes to a hidden temp folder next to ``OUT``; files are
fsynced, then the folder is renamed to ``OUT``. A failure (or Ctrl-C) removes the temp folder, so a
half-written pack never exists under ``OUT``.
"""

from __future__ import annotations

import os
import shutil
import uuid
import zlib
from pathlib import Path

import numpy as np

from colibri_plan import __version__
from colibri_plan.engine.dense_quant import decode_dense, encode_dense
from colibri_plan.engine.pack_target import check_pack_output  # noqa: F401 - re-exported
from colibri_plan.engine.pack_text import copy_tokenizer
from colibri_plan.engine.weights import ModelWeights
from colibri_plan.errors import FormatError, InputError, IntegrityError
from colibri_plan.fileio import fsync_dir, write_document
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.formats.pack_index import (
    BLOCK_ALIGN,
    DENSE_NAME,
    EXPERTS_NAME,
    INDEX_NAME,
    PACK_KIND,
    PACK_SCHEMA_VERSION,
    block_layout,
    check_entries,
    layout_from_dict,
    parse_block,
    read_index,
    spec_from_arch,
)
from colibri_plan.formats.pack_verify import file_crc32, trunk_problems
from colibri_plan.quant import QuantTensor, check_format, dequantize, quantize

__all__ = ["PackWriter", "PackedModel", "check_pack_output", "write_pack", "open_pack"]


class PackWriter:
    """Streaming, atomic writer of one pack. Experts must be added in layer-major, expert-ascending order.

    Usage::

        with PackWriter(out, arch, "int4", name="m") as w:
            for layer, e in keys: w.add_expert(layer, e, gate, up, down)   # or add_expert_parts
            w.write_dense(dense)
            w.commit()                           # rename into place; without it nothing appears

    Raises:
        InputError: see :func:`check_pack_output`; the parent folder is not writable.
        FormatError: an expert of the wrong format/shape, out of order, or missing at commit.
    """

    def __init__(self, out_dir, arch: ArchConfig, fmt: str, name: str = "", source: str = "",
                 overwrite: bool = False):
        check_format(fmt)
        self.out = check_pack_output(out_dir, overwrite)
        parent = self.out.parent
        self._overwrite = overwrite
        self.arch, self.fmt, self.name, self.source = arch, fmt, name or self.out.name, source
        self.layout = block_layout(fmt, arch.hidden_size, arch.moe_intermediate_size)
        self._order = [(int(l), e) for l in arch.moe_layers for e in range(arch.n_experts)]
        self._entries: list[list[int]] = []
        self._dense_info: dict | None = None
        self._dense_params, self.tokenizer = 0, None   # tokenizer: the index's section (pack_text.py)
        self.tmp = parent / f".{self.out.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.tmp.mkdir()
        except OSError as exc:  # read-only/immutable folder, /proc, no space...
            raise InputError(f"cannot write pack {self.out}: folder {parent} is not writable "
                             f"({exc.strerror})") from exc
        try:
            self._f = open(self.tmp / EXPERTS_NAME, "wb")
        except OSError as exc:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise InputError(f"cannot write pack {self.out}: {exc.strerror}") from exc
        self._pos = 0
        self.committed = False

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if not self.committed:
            self.abort()

    def abort(self) -> None:
        """Delete the temp folder (nothing is left behind)."""
        try:
            self._f.close()
        except OSError:
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _next_key(self, layer: int, e: int) -> None:
        i = len(self._entries)
        if i >= len(self._order) or self._order[i] != (layer, e):
            want = self._order[i] if i < len(self._order) else "nothing (all experts written)"
            raise FormatError(f"pack writer: got expert (layer {layer}, expert {e}), expected {want}")

    def add_expert_parts(self, layer: int, e: int, arrays) -> None:
        """Append one expert from its raw arrays in layout order (gate data, gate scales, up data, ...),
        each C-contiguous with the dtype and shape of ``self.layout.parts``. Streams to disk; the crc32 is
        computed on the fly over the padded block."""
        self._next_key(layer, e)
        if len(arrays) != len(self.layout.parts):
            raise FormatError(f"expert block needs {len(self.layout.parts)} arrays, got {len(arrays)}")
        crc, pos = 0, 0
        for part, a in zip(self.layout.parts, arrays):
            a = np.ascontiguousarray(a)
            if a.dtype != np.dtype(part.dtype) or tuple(a.shape) != part.shape:
                raise FormatError(f"expert (layer {layer}, expert {e}) {part.name}: expected {part.dtype} "
                                  f"{part.shape}, got {a.dtype} {tuple(a.shape)}")
            if part.offset > pos:
                pad = bytes(part.offset - pos)
                crc = zlib.crc32(pad, crc)
                self._f.write(pad)
            mv = memoryview(a).cast("B")
            crc = zlib.crc32(mv, crc)
            self._f.write(mv)
            pos = part.offset + part.nbytes
        pad = bytes(self.layout.block_bytes - pos)
        crc = zlib.crc32(pad, crc)
        self._f.write(pad)
        self._entries.append([int(layer), int(e), self._pos, self.layout.block_bytes, crc])
        self._pos += self.layout.block_bytes

    def add_expert(self, layer: int, e: int, gate: QuantTensor, up: QuantTensor, down: QuantTensor) -> None:
        """Append one expert (QuantTensors in the pack's format; gate/up [I, H], down [H, I])."""
        arrays = []
        for qt in (gate, up, down):
            if qt.fmt != self.fmt:
                raise FormatError(f"expert (layer {layer}, expert {e}) is {qt.fmt}, the pack is {self.fmt}")
            arrays.append(qt.data)
            if qt.scales is not None:
                arrays.append(qt.scales.astype(np.float32, copy=False))
        self.add_expert_parts(layer, e, arrays)

    def write_dense(self, dense: dict[str, np.ndarray], dense_format: str = "f32") -> None:
        """Write ``dense.safetensors``: float32, trunk matrices in ``dense_format`` (dense_quant.py)."""
        from safetensors.numpy import save_file

        tensors, formats = encode_dense(dense, dense_format)
        path = self.tmp / DENSE_NAME
        # one metadata key: safetensors orders several at random, and the file must be reproducible
        save_file(tensors, str(path), metadata={"format": f"colibri-plan pack dense {dense_format}"})
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        self._dense_params = sum(int(np.prod(np.shape(v))) for v in dense.values())
        self._dense_info = {"dense_file": DENSE_NAME, "dense_format": dense_format,
                            "dense_file_bytes": path.stat().st_size, "dense_crc32": file_crc32(path)}
        if formats:
            self._dense_info["dense_tensors"] = formats

    def commit(self, spec=None, extra: dict | None = None) -> Path:
        """Finish: write the index, fsync, rename the temp folder to ``out``. Returns ``out``.

        Args:
            spec: the model's ModelSpec (None = built from the arch with :func:`spec_from_arch`).
            extra: more JSON-ready fields stored under ``"extra"`` in the index (e.g. fixture settings).

        Raises:
            FormatError: experts missing, or the dense tensors were not written.
        """
        if len(self._entries) != len(self._order):
            raise FormatError(f"pack writer: {len(self._entries)} of {len(self._order)} experts written")
        if self._dense_info is None:
            raise FormatError("pack writer: dense tensors were not written (call write_dense)")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        if spec is None:
            spec = spec_from_arch(self.arch, self.fmt, self._dense_params, self.name, f"pack: {self.out}")
        body = {
            "format": {"expert_format": self.fmt, "experts_file": EXPERTS_NAME,
                       "experts_file_bytes": self._pos, "alignment_bytes": BLOCK_ALIGN,
                       "byte_order": "little", **self._dense_info},
            "model": {"name": self.name, "fingerprint": spec.fingerprint(), "spec": spec.to_dict(),
                      "source": self.source},
            "arch": self.arch.to_dict(),
            "block": self.layout.to_dict(),
            "created_by": f"colibri-plan {__version__}",
            "extra": extra or {},
            "experts": self._entries,
            **({"tokenizer": self.tokenizer} if self.tokenizer else {}),
        }
        write_document(self.tmp / INDEX_NAME, PACK_KIND, PACK_SCHEMA_VERSION, body)
        mask = os.umask(0)
        os.umask(mask)
        for f in self.tmp.iterdir():  # temp files are created 0600; give them the usual mode
            os.chmod(f, 0o666 & ~mask)
        os.chmod(self.tmp, 0o777 & ~mask)
        fsync_dir(self.tmp)
        check_pack_output(self.out, self._overwrite)  # again: OUT may have changed during the writing
        old = None
        try:
            if self.out.exists():  # overwrite: move the old pack aside first, delete it after the rename
                old = self.out.parent / f".{self.out.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(self.out, old)
            os.replace(self.tmp, self.out)
        except OSError as exc:
            if old is not None and old.exists():  # put the previous pack back
                os.replace(old, self.out)
            raise InputError(f"cannot write pack {self.out}: {exc.strerror}") from exc
        fsync_dir(self.out.parent)
        self.committed = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.out


def write_pack(weights: ModelWeights, out_dir, fmt: str, overwrite: bool = False, spec=None,
               progress=None, dense_format: str = "f32") -> Path:
    """Pack ``weights`` (a checkpoint or any ModelWeights) into ``out_dir`` with experts in ``fmt`` and a
    checkpoint's tokenizer files, checked first (engine/pack_text.py; without them the pack runs on ids).
    Experts in ``fmt`` are stored as they are, others dequantized and re-quantized (quant.quantize), one
    in memory at a time. ``spec``: the ModelSpec to store (None: from the arch); ``progress``: fn(done, n).

    Raises:
        InputError: ``out_dir`` refused by :func:`check_pack_output` (exists without ``overwrite``, not a
            pack), or its parent missing / not writable. UnsupportedError: unknown format. FormatError:
            tokenizer files that do not parse or fit.
    """
    check_format(fmt)
    arch = weights.arch
    keys = [(l, e) for l in arch.moe_layers for e in range(arch.n_experts)]
    with PackWriter(out_dir, arch, fmt, name=Path(out_dir).name,
                    source=getattr(weights, "source", ""), overwrite=overwrite) as w:
        if getattr(weights, "folder", None) is not None:   # a checkpoint's text files, checked first
            w.tokenizer = copy_tokenizer(weights.folder, w.tmp, arch.vocab_size)
        for i, (layer, e) in enumerate(keys):
            mats = weights.expert(layer, e)
            mats = [m if m.fmt == fmt else quantize(dequantize(m), fmt) for m in mats]
            w.add_expert(layer, e, *mats)
            if progress is not None:
                progress(i + 1, len(keys))
        w.write_dense(weights.dense, dense_format)
        return w.commit(spec=spec)


class PackedModel(ModelWeights):
    """A pack opened for reading: a ModelWeights whose experts come from ``experts.bin``.

    Attributes:
        path: the pack folder. index: the parsed ``pack.json``. layout: the BlockLayout of every expert.
        arch, dense, expert_format, source: as in ModelWeights (dense is loaded into RAM at open).
        model_fingerprint: the ModelSpec fingerprint stored at pack time.
        experts_path: path of ``experts.bin`` (the residency manager opens it with O_DIRECT itself).
    """

    def __init__(self, path, check_dense: bool = True):
        from safetensors.numpy import load_file

        self.path = Path(path)
        doc = read_index(self.path)
        self.index = doc
        self.arch = ArchConfig.from_dict(doc["arch"])
        if not self.arch.moe_layers:  # `model verify` reports the same (formats/pack_verify.py)
            raise FormatError(f"pack {self.path}: arch.moe_layers is empty: the pack has no routed experts "
                              "to run; re-create it")
        self.layout = layout_from_dict(doc["block"])
        fmt = doc["format"]
        self.expert_format = fmt["expert_format"]
        self.source = f"pack: {self.path}"
        self.model_fingerprint = doc["model"].get("fingerprint")
        self.experts_path = self.path / EXPERTS_NAME
        if not self.experts_path.is_file():
            raise IntegrityError(f"pack {self.path}: {EXPERTS_NAME} is missing")
        size = self.experts_path.stat().st_size
        if size != fmt.get("experts_file_bytes"):
            raise IntegrityError(f"pack {self.path}: {EXPERTS_NAME} has {size} bytes, the index says "
                                 f"{fmt.get('experts_file_bytes')} (truncated or replaced); re-create it")
        problems = check_entries(doc, self.layout, self.arch.moe_layers, self.arch.n_experts, size)
        if problems:
            raise IntegrityError(f"pack {self.path}: bad index: {problems[0]}"
                                 + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))
        self._loc = {(r[0], r[1]): (r[2], r[3], r[4]) for r in doc["experts"]}
        dense_path = self.path / DENSE_NAME
        if not dense_path.is_file() or dense_path.stat().st_size != fmt.get("dense_file_bytes"):
            raise IntegrityError(f"pack {self.path}: {DENSE_NAME} is missing or has the wrong size")
        if check_dense and file_crc32(dense_path) != fmt.get("dense_crc32"):
            raise IntegrityError(f"pack {self.path}: {DENSE_NAME} fails its crc32 check (corrupt)")
        problems = trunk_problems(dense_path, self.arch, fmt.get("dense_tensors"))  # as `model verify`
        if problems:
            raise FormatError(f"pack {self.path}: {problems[0]}; re-create the pack")
        try:
            raw = load_file(str(dense_path))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise FormatError(f"pack {self.path}: cannot read {DENSE_NAME} ({type(exc).__name__}: {exc}); "
                              "re-create the pack") from None
        self.dense = decode_dense(raw, fmt.get("dense_tensors") or {}, f"pack {self.path}")
        self._fd = os.open(self.experts_path, os.O_RDONLY)

    def spec(self):
        """The stored :class:`~colibri_plan.formats.model_spec.ModelSpec`."""
        from colibri_plan.formats.model_spec import ModelSpec

        return ModelSpec.from_dict(self.index["model"]["spec"])

    def expert_location(self, layer: int, e: int) -> tuple[int, int, int]:
        """(offset, nbytes, crc32) of the expert's block in ``experts.bin``; offset and nbytes are
        multiples of 4096 (ready for an O_DIRECT read).

        Raises:
            InputError: no such (layer, expert).
        """
        try:
            return self._loc[(int(layer), int(e))]
        except KeyError:
            raise InputError(f"pack has no expert (layer {layer}, expert {e}); MoE layers "
                             f"{list(self.arch.moe_layers)}, experts 0..{self.arch.n_experts - 1}") from None

    def expert_from_bytes(self, buf, layer: int, e: int, check: bool = True, copy: bool = False):
        """Parse an expert block read from ``experts.bin`` into (gate, up, down) QuantTensors.

        Args:
            buf: bytes-like / uint8 numpy array holding at least the block's ``nbytes`` bytes (e.g. an
                aligned O_DIRECT buffer); only the first ``nbytes`` are used.
            check: verify the crc32 of the ``nbytes`` bytes against the index first.
            copy: False = views into ``buf`` (valid while the buffer is not reused).

        Raises:
            IntegrityError: short buffer or crc32 mismatch.
        """
        _, nbytes, crc = self.expert_location(layer, e)
        mv = memoryview(buf).cast("B") if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
        if len(mv) < nbytes:
            raise IntegrityError(f"expert (layer {layer}, expert {e}): buffer has {len(mv)} of {nbytes} B")
        mv = mv[:nbytes]
        if check:
            got = zlib.crc32(mv)
            if got != crc:
                raise IntegrityError(f"pack {self.path}: expert (layer {layer}, expert {e}) fails its crc32 "
                                     f"check ({got:08x} != {crc:08x}): the file is corrupt; run "
                                     "`colibri-plan model verify` and re-create the pack")
        return parse_block(mv, self.layout, copy=copy)

    def expert(self, layer: int, e: int) -> tuple[QuantTensor, QuantTensor, QuantTensor]:
        """Read (pread) and check one expert block; returns (gate [I, H], up [I, H], down [H, I]).

        Raises:
            InputError: no such expert. IntegrityError: short read or crc32 mismatch.
        """
        off, nbytes, _ = self.expert_location(layer, e)
        try:
            buf = os.pread(self._fd, nbytes, off)
        except OSError as exc:
            raise IntegrityError(f"pack {self.path}: reading expert (layer {layer}, expert {e}) "
                                 f"failed: {exc}") from exc
        if len(buf) != nbytes:
            raise IntegrityError(f"pack {self.path}: expert (layer {layer}, expert {e}) short read "
                                 f"({len(buf)} of {nbytes} bytes): {EXPERTS_NAME} was truncated")
        return self.expert_from_bytes(buf, layer, e)

    def tensor(self, name: str) -> np.ndarray:
        """``dense[name]``. Raises FormatError naming the pack when absent."""
        try:
            return self.dense[name]
        except KeyError:
            raise FormatError(f"pack {self.path} has no dense tensor {name!r}") from None

    def close(self) -> None:
        """Close ``experts.bin``."""
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_pack(path, check_dense: bool = True) -> PackedModel:
    """Open a pack folder: checks the index (kind, schema, layout, entries), file sizes and the dense
    crc32 (``check_dense``); expert crc32s are checked on each read.

    Raises:
        InputError: not a pack folder. FormatError: bad index. IntegrityError: truncated/corrupt files.
    """
    return PackedModel(path, check_dense=check_dense)
