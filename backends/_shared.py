"""What the GPU backends (``opencl``, ``vulkan``, ``cuda``, ``metal``) share, so that each backend file
holds driver calls only (the way tinygrad keeps its runtimes thin over one orchestration):

- :class:`GPUBackend`: discovery that never raises, the padded weight record, typed out-of-memory errors
  and the batched expert FFN (which experts run fused, the token offsets of a batch, the split of the
  result per expert). A backend implements ``_ffn_batch``: gate/up fused with SiLU·mul, then down, over
  a batch of experts of one kind.
- :func:`padded_layout`, the weight layout the kernels read; :func:`pack`, several inputs of one op
  (attention's queries and cache rows) in one buffer with their offsets.
- Staging: :func:`stage_rows` (activations zero-padded into pinned, mapped or shared memory),
  :class:`WorkBuffers` (named grow-only buffers: activations in, FFN intermediate, results, pinned
  staging) and :func:`copy_in_chunks` (uploads through a bounded staging buffer).
- :class:`Replays`: recorded work per call shape (CUDA graphs, Vulkan command buffers), LRU-bounded.
- Cache folders: :func:`cache_dir` and checksummed cache files (OpenCL program binaries, the Vulkan
  pipeline cache).

Timed calls (``timed``, ``timing``, ``last_device_seconds``) belong to every backend: see ``base``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import importlib.util
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from colibri_plan.backends.base import Backend, DeviceInfo, ExpertWeights
from colibri_plan.errors import ColibriError, DeviceOutOfMemoryError
from colibri_plan.fileio import atomic_write_bytes
from colibri_plan.quant import FORMATS, QuantTensor, bits, group_size

#: the ``FMT`` every kernel source switches on (.cl, .cu, .metal, .comp); see :func:`kernel_format`
KERNEL_FORMAT = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3, "int4": 4, "int2": 5}
STAGE_BYTES = 64 << 20  # staging chunk of uploads through host memory: bounds the host memory held


def kernel_format(fmt: str) -> int:
    """``FMT`` of ``fmt`` in the .cl, .cu and .metal kernels: grouped int4 formats are 6 (with ``GROUP``);
    the Vulkan shader takes int4's 4 plus a ``GROUP`` constant instead."""
    return 6 if group_size(fmt) else KERNEL_FORMAT[fmt]


def kernel_source(folder: str, name: str, binary: bool = False) -> str | bytes:
    """A kernel file of ``shaders/<folder>`` (package data): .cl/.cu/.metal text, or .spv bytes."""
    path = importlib.resources.files("colibri_plan.shaders").joinpath(folder, name)
    return path.read_bytes() if binary else path.read_text()


def import_problem(module: str, missing: str, check: Callable[[Any], str | None],
                   broken: str = "{exc}") -> str | None:
    """Why a backend whose driver package is ``module`` cannot run, or None: ``missing`` when the package
    is not installed (found without importing it), else ``check(imported module)``; an exception on the
    way becomes ``broken.format(exc=...)`` (a broken driver stack raises many kinds). Never raises."""
    if importlib.util.find_spec(module) is None:
        return missing
    try:
        return check(importlib.import_module(module))
    except Exception as exc:  # noqa: BLE001 - discovery never raises
        return broken.format(exc=exc)


def padded_layout(qt: QuantTensor, multiple: int = 128) -> tuple[np.ndarray, np.ndarray, int]:
    """The row-padded device layout the GPU kernels (OpenCL, CUDA, Metal) read.

    Columns are padded from ``in_features`` up to ``in_pad``, a multiple of ``multiple`` (128 divides
    by every group size and makes every row start 16-byte aligned for every format), with the zero
    code (0.0 for float formats, 8 for int4, 2 for int2, 0 for int8), so kernels need no tail loop and
    activations padded with zeros give exact sums. Group scales are padded to ``in_pad / G`` groups
    with 0.0.

    Returns:
        data: uint8 [out, row_bytes], the rows of ``qt.data`` as bytes plus padding.
        scales: float32, [out] (per-row), [out, in_pad / G] (groups) or [1] (float formats, unused).
        in_pad: padded column count.
    """
    in_f, out_f = qt.in_features, qt.out_features
    in_pad = -(-in_f // multiple) * multiple
    b = bits(qt.fmt)
    row_bytes = in_pad * b // 8
    pad_byte = 0xAA if qt.fmt == "int2" else 0x88 if b == 4 else 0  # zero codes 2 (x4) / 8 (x2)
    src = np.ascontiguousarray(qt.data).view(np.uint8).reshape(out_f, -1)
    if src.shape[1] == row_bytes:
        data = src
    else:  # quantize already filled the unused codes of the last stored byte with the zero code
        data = np.full((out_f, row_bytes), pad_byte, np.uint8)
        data[:, : src.shape[1]] = src
    g = group_size(qt.fmt)
    if qt.scales is None:
        scales = np.zeros(1, np.float32)
    elif g is None:
        scales = np.ascontiguousarray(qt.scales, np.float32)
    else:
        scales = np.zeros((out_f, in_pad // g), np.float32)
        scales[:, : qt.scales.shape[1]] = qt.scales
    return data, scales, in_pad


def pack(arrays: Sequence[np.ndarray], alloc: Callable[[int], np.ndarray] | None = None, head: int = 0
         ) -> tuple[np.ndarray, list[int]]:
    """Several host inputs of one op in one float32 buffer (one copy to the device, one binding; kernels
    get the offsets): float32 ``arrays`` one after another after ``head`` spare floats (a header), each
    at a 16-byte boundary. ``alloc(n)`` gives the float32 view to fill, of n floats (mapped or shared
    memory); default a new array. Gaps are left as they are. Returns (the view, float offsets)."""
    offs, n = [], head
    for a in arrays:
        n = -(-n // 4) * 4
        offs.append(n)
        n += a.size
    out = (alloc or (lambda k: np.empty(k, np.float32)))(n)
    for a, o in zip(arrays, offs):
        out[o:o + a.size] = a.reshape(-1)
    return out, offs


# ---- cache folders -------------------------------------------------------------------------------
def cache_dir(kind: str) -> Path:
    """Folder of one kind of compiled-program cache (``opencl`` binaries, ``vulkan`` pipeline caches):
    ``$COLIBRI_PLAN_CACHE_DIR/<kind>``, else ``$XDG_CACHE_HOME/colibri-plan/<kind>`` (default
    ``~/.cache``). Created on first write."""
    root = os.environ.get("COLIBRI_PLAN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "colibri-plan")
    return Path(root) / kind


def cache_file(kind: str, *ident: str) -> Path:
    """``cache_dir(kind) / <sha256 of ident>.bin``: a change of anything in ``ident`` (driver version,
    compile options, source text) names another file, so stale programs are never loaded."""
    return cache_dir(kind) / (hashlib.sha256("\0".join(ident).encode()).hexdigest()[:32] + ".bin")


def read_cache_file(path: Path, magic: bytes) -> tuple[bytes, str]:
    """(blob, state) of a file written by :func:`write_cache_file`; state is "loaded", "absent" or
    "corrupt: bad magic or checksum" (the blob is then b"")."""
    try:
        raw = path.read_bytes()
    except OSError:
        return b"", "absent"
    blob = raw[40:]
    if raw[:8] != magic or hashlib.sha256(blob).digest() != raw[8:40]:
        return b"", "corrupt: bad magic or checksum"
    return blob, "loaded"


def write_cache_file(path: Path, magic: bytes, blob: bytes) -> bool:
    """Write 8 bytes of ``magic``, the sha256 of ``blob``, then ``blob``, atomically (a crash or a second
    process never leaves a torn file); False when the folder is not writable: a missing cache only costs
    compile time on the next run."""
    assert len(magic) == 8
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, magic + hashlib.sha256(blob).digest() + blob)
    except (OSError, ColibriError):
        return False
    return True


# ---- staging -------------------------------------------------------------------------------------
def token_offsets(counts: Sequence[int]) -> list[int]:
    """[0, T_0, T_0 + T_1, ...]: expert i owns rows tok[i] .. tok[i+1]-1 of a batch's x, h and y."""
    tok = [0]
    for T in counts:
        tok.append(tok[-1] + int(T))
    return tok


def stage_rows(xs: Sequence[np.ndarray], in_pad: int, out: np.ndarray) -> np.ndarray:
    """Write activations x_i [T_i, in] float32 one after another into ``out`` float32 [Σ T_i, in_pad] (a
    view of pinned, mapped or shared memory), with zeros in columns in .. in_pad-1: the weights' padding
    holds the zero code, so the padded sums are exact and kernels need no tail loop. Returns ``out``."""
    n_in = xs[0].shape[1]
    if n_in == in_pad:
        np.concatenate(xs, axis=0, out=out)
        return out
    out[:, n_in:] = 0.0
    t = 0
    for x in xs:
        out[t:t + x.shape[0], :n_in] = x
        t += x.shape[0]
    return out


def copy_in_chunks(src: np.ndarray, stage: np.ndarray, put: Callable[[int, int], None]) -> None:
    """Upload ``src`` through a staging buffer (pinned host memory, a mapped staging buffer): its bytes go
    into ``stage`` (uint8) one chunk at a time and ``put(offset, n)`` moves stage[:n] to byte ``offset``
    of the destination; ``put`` must have finished when it returns, as the next chunk overwrites it."""
    src = src.reshape(-1).view(np.uint8)
    for off in range(0, src.nbytes, stage.nbytes):
        n = min(stage.nbytes, src.nbytes - off)
        stage[:n] = src[off:off + n]
        put(off, n)


class WorkBuffers:
    """Named buffers that only grow (activations in, FFN intermediate, results, pinned staging), so a
    steady stream of calls of one size allocates nothing.

    Args:
        alloc: ``alloc(name, nbytes)`` -> a new buffer of ``nbytes`` bytes (may raise out of memory).
        release: frees a replaced buffer; None when dropping the last reference frees it.
        grow: bytes to allocate for a request of n bytes (default: n, at least 64 KiB).
        before_grow: ``before_grow(name, nbytes)``, called before a buffer is replaced: it may raise
            (nothing is released then) or drop what still refers to the old buffer.
    """

    def __init__(self, alloc: Callable[[str, int], Any], release: Callable[[Any], None] | None = None,
                 grow: Callable[[int], int] | None = None,
                 before_grow: Callable[[str, int], None] | None = None):
        self._alloc, self._release, self._before = alloc, release, before_grow
        self._grow = grow or (lambda n: max(n, 1 << 16))
        self._bufs: dict[str, tuple[int, Any]] = {}

    def get(self, name: str, nbytes: int) -> Any:
        """The buffer ``name``, of at least ``nbytes`` bytes (replaced by a larger one when smaller)."""
        have = self._bufs.get(name)
        if have is not None and have[0] >= nbytes:
            return have[1]
        if self._before is not None:
            self._before(name, nbytes)
        self.drop(name)
        size = int(self._grow(int(nbytes)))
        self._bufs[name] = (size, self._alloc(name, size))
        return self._bufs[name][1]

    def __getitem__(self, name: str) -> Any:
        return self._bufs[name][1]

    def drop(self, name: str) -> None:
        have = self._bufs.pop(name, None)
        if have is not None and self._release is not None:
            self._release(have[1])

    def clear(self) -> None:
        for name in list(self._bufs):
            self.drop(name)


class Replays:
    """Recorded work per call shape (CUDA graphs, Vulkan command buffers), replayed instead of recorded
    again: host time per call is what bounds small decode batches. Past ``keep`` entries the least
    recently used is dropped and ``release``d."""

    def __init__(self, keep: int, release: Callable[[Any], None] | None = None):
        self.keep, self._release = keep, release
        self._items: OrderedDict = OrderedDict()
        self._seen: set = set()

    def get(self, key) -> Any:
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
        return item

    def put(self, key, item) -> Any:
        self._items[key] = item
        while len(self._items) > self.keep:
            self._free(self._items.popitem(last=False)[1])
        return item

    def seen_before(self, key) -> bool:
        """True from the second time ``key`` is asked about: CUDA captures a graph only then, since a
        one-off call shape would waste the capture (remembers up to 4096 keys)."""
        if key in self._seen:
            return True
        if len(self._seen) > 4096:
            self._seen.clear()
        self._seen.add(key)
        return False

    def drop(self, pred: Callable[[Any], bool] = lambda item: True) -> None:
        """Drop (and release) every entry ``pred`` holds true of, e.g. those using a freed buffer."""
        for key in [k for k, v in self._items.items() if pred(v)]:
            self._free(self._items.pop(key))

    def clear(self) -> None:
        self.drop()
        self._seen.clear()

    def _free(self, item) -> None:
        if self._release is not None:
            self._release(item)

    def __len__(self) -> int:
        return len(self._items)


# ---- the GPU backends' base class ----------------------------------------------------------------
@dataclass
class PaddedWeight:
    """A weight in the layout of :func:`padded_layout` on a device."""

    data: Any  # the rows, uint8 [out, row_bytes]: cl.Buffer, MTLBuffer or a CUDA device address
    scales: Any  # float32 scales (per row, per group, or a 1-element dummy), same kinds of handle
    in_pad: int  # padded columns: activations are zero-padded to this many floats
    mem: Any = None  # the allocation owning both when data/scales are addresses into it (CUDA)


class FFNBatch(NamedTuple):
    """Experts of one kind (formats and shapes) in one fused call: gate/up [I, H], down [H, I]."""

    counts: list[int]  # T_i, tokens of expert i
    tok: list[int]  # token_offsets(counts): expert i owns rows tok[i] .. tok[i+1]-1 of x, h and y
    H: int  # hidden size (columns of x, rows of y)
    I: int  # expert width (rows of gate/up)
    Hp: int  # H padded: x is staged [Σ T_i, Hp]
    Ip: int  # I padded: h is [Σ T_i, Ip], zero in its padding (down reads it)


class GPUBackend(Backend):
    """Base class of the GPU backends: see the module docstring. Subclasses implement ``_devices``
    (discovery, may raise: :meth:`list_devices` turns failures into no devices) and ``_ffn_batch``."""

    formats = FORMATS

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        try:
            return [] if cls.unavailable_reason() is not None else cls._devices()
        except Exception:  # noqa: BLE001 - discovery never raises
            return []

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        raise NotImplementedError

    @classmethod
    def _info(cls, index: int, name: str, kind: str, total: int, free: int | None, driver: str) -> DeviceInfo:
        """DeviceInfo of device ``index``; kind "cpu" and "igpu" compute on host memory (unified)."""
        return DeviceInfo(cls.name, index, name, kind, int(total), None if free is None else int(free),
                          kind != "gpu", cls.formats, driver)

    def _oom(self, what: str, requested_bytes: int) -> DeviceOutOfMemoryError:
        """The typed error of an allocation the device refused; ``what`` says which and why."""
        return DeviceOutOfMemoryError(
            f"{self.name} device {self.device.name!r}: {what} ({self.held_bytes} B of weights held); "
            "place fewer experts on this device", requested_bytes=requested_bytes,
            held_bytes=self.held_bytes, capacity_bytes=self.capacity_bytes())

    # ---- batched expert FFN ------------------------------------------------------------------------
    def _expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        """One fused call (``_ffn_batch``) when every expert has the same formats and shapes; a mixed
        batch runs one fused call per expert; an expert the kernels cannot fuse (``_ffn_fusable``) runs
        as three matmuls."""
        if len({self._ffn_kind(e) for e in experts}) > 1:
            return [y for x, e in zip(xs, experts) for y in self._expert_ffn([x], [e])]
        e0 = experts[0]
        if not self._ffn_fusable(e0):
            return super()._expert_ffn(xs, experts)
        counts = [x.shape[0] for x in xs]
        batch = FFNBatch(counts, token_offsets(counts), e0.gate.in_features, e0.gate.out_features,
                         e0.gate.payload.in_pad, e0.down.payload.in_pad)
        y = self._ffn_batch(xs, experts, batch)  # [Σ T_i, H] float32, owned (not a view of device memory)
        return [y[a:b] for a, b in zip(batch.tok, batch.tok[1:])]

    @staticmethod
    def _ffn_kind(e: ExpertWeights) -> tuple:
        return e.gate.fmt, e.up.fmt, e.down.fmt, e.gate.out_features, e.gate.in_features

    def _ffn_fusable(self, e: ExpertWeights) -> bool:
        """Whether the fused kernels take this expert: their gate/up pass reads one format."""
        return e.gate.fmt == e.up.fmt

    def _ffn_batch(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights],
                   batch: FFNBatch) -> np.ndarray:
        """y [Σ T_i, H] float32: expert i's rows are down_i(SiLU(x_i·gate_iᵀ) · (x_i·up_iᵀ))."""
        raise NotImplementedError
