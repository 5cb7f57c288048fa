"""What the GPU backends share about kernels and compiled programs: the ``FMT`` code every kernel source
switches on, the kernel files of ``shaders/`` (package data), the discovery check of a driver package, and
the checksummed cache files of compiled programs (OpenCL binaries, the Vulkan pipeline cache).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.resources
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from colibri_plan.errors import ColibriError
from colibri_plan.fileio import atomic_write_bytes
from colibri_plan.quant import group_size

#: the ``FMT`` every kernel source switches on (.cl, .cu, .metal, .comp); see :func:`kernel_format`
KERNEL_FORMAT = {"f32": 0, "f16": 1, "bf16": 2, "int8": 3, "int4": 4, "int2": 5}


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
