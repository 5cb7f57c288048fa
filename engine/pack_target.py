"""Where a pack may be written: a new folder, or (with ``--force``) an existing pack folder only.

Checked before any work and again just before the commit replaces the old folder, so ``--force`` can
never delete a folder or file that is not a pack (``engine/pack.py``'s writer calls it).
"""

from __future__ import annotations

import os
from pathlib import Path

from colibri_plan.errors import InputError
from colibri_plan.formats.pack_index import INDEX_NAME, PACK_KIND


def _holds_pack_index(folder: Path) -> bool:
    """True when ``folder/pack.json`` is a JSON object of kind "pack" (any schema version: an older pack
    may be replaced too)."""
    from colibri_plan.errors import ColibriError
    from colibri_plan.fileio import read_json_object

    index = folder / INDEX_NAME
    if not index.is_file():
        return False
    try:
        return read_json_object(index, "pack index").get("kind") == PACK_KIND
    except (ColibriError, OSError):
        return False


def check_pack_output(out_dir, overwrite: bool = False, inputs=()) -> Path:
    """Check, before any work, that a pack can be written to ``out_dir``: the path names a new folder in
    an existing one, or (with ``overwrite``) an existing pack folder, which the commit then replaces.
    Anything else is refused, so ``--force`` can never delete a folder or file that is not a pack.

    Args:
        inputs: the command's input paths (e.g. the checkpoint folder); the output may not be one of
            them, lie inside one, or contain one (replacing it would delete the input).

    Returns:
        ``out_dir`` as a Path.

    Raises:
        InputError: empty name, ".", "..", "/", the current folder or one above it; a folder inside an
            existing pack; an existing path
            without ``overwrite``; with ``overwrite`` a file, a symbolic link, a mount point or a folder
            that is not a pack; one of ``inputs``; a parent folder that is missing or not writable.
    """
    if not str(out_dir).strip():
        raise InputError("the output pack path is empty; give a new folder name")
    out = Path(out_dir)
    full = Path(os.path.abspath(out))
    real = out.resolve()
    cwd = Path.cwd().resolve()
    if out.name in ("", ".", "..") or full == full.parent or real == cwd or real in cwd.parents:
        raise InputError(f"cannot write pack {out_dir}: it is '.', '..', '/', the current folder or a folder "
                         "above it; give a new folder name such as packs/mymodel")
    for inp in inputs:
        if inp is None or not str(inp):
            continue
        src = Path(inp).resolve()
        if real == src or src in real.parents or real in src.parents:
            where = "is" if real == src else "is inside" if src in real.parents else "contains"
            raise InputError(f"cannot write pack {out_dir}: it {where} the input {inp}; "
                             "give another output folder")
    for folder in full.parents:   # a pack inside a pack: the outer pack's folder is not for outputs
        if _holds_pack_index(folder):
            raise InputError(f"cannot write pack {out_dir}: folder {folder} is an expert pack; write outputs "
                             "outside it")
    if out.is_symlink() or out.exists():
        if not overwrite:
            raise InputError(f"{out} already exists; remove it, choose another output folder, or pass "
                             "--force to replace an existing pack")
        if out.is_symlink():
            why = "a symbolic link"
        elif not out.is_dir():
            why = "a file, not a pack folder"
        elif os.path.ismount(full):
            why = "a mount point"
        elif not _holds_pack_index(out):
            why = f"a folder that is not an expert pack (no {INDEX_NAME} of kind {PACK_KIND!r})"
        else:
            why = None
        if why is not None:
            raise InputError(f"cannot replace {out}: it is {why}; --force only replaces an existing pack; "
                             "remove it yourself or choose another output folder")
    parent = out.parent
    if not parent.is_dir():
        raise InputError(f"cannot write pack {out}: folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise InputError(f"cannot write pack {out}: folder {parent} is not writable")
    return out


def temp_folder(out: Path) -> Path:
    """The hidden temp folder a pack is written into, ``.<OUT>.tmp-<pid>-<random>`` next to ``out``,
    after removing those a killed ``model pack`` / ``model fixture`` left (their pid is gone:
    :func:`colibri_plan.fileio.clean_stale`). Not created here."""
    import uuid

    from colibri_plan.fileio import clean_stale

    clean_stale(out.parent, f".{out.name}.tmp-")
    return out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def check_pack_space(out: Path, expert_bytes: int, dense_bytes: int) -> None:
    """Refuse, before any expert is written, a pack that cannot fit the free space of ``out``'s disk:
    ``expert_bytes`` (experts.bin) + ``dense_bytes`` (dense.safetensors, float32) + 1 MiB for the rest.

    Raises:
        InputError: with the free and needed bytes.
    """
    from colibri_plan.fileio import check_free_space

    check_free_space(out.parent, int(expert_bytes) + int(dense_bytes) + (1 << 20), f"pack {out}")


def replace_pack(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished temp folder ``tmp`` to ``out`` (checked again: it may have changed during the
    writing); with ``overwrite`` the old pack is moved aside first and deleted after the rename (put
    back if the rename fails).

    Raises:
        InputError: ``out`` refused by :func:`check_pack_output`, or a rename failed.
    """
    import shutil
    import uuid

    from colibri_plan.fileio import fsync_dir

    check_pack_output(out, overwrite)
    old = None
    try:
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
        os.replace(tmp, out)
    except OSError as exc:
        if old is not None and old.exists():
            os.replace(old, out)
        raise InputError(f"cannot write pack {out}: {exc.strerror}") from exc
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
