"""Atomic file writes, versioned JSON documents and fingerprints.

Every plan, profile, heat, stats and pack index is written with :func:`atomic_write_bytes` (temp file in
the same folder, fsync, rename, fsync of the folder) so a crash never leaves a half-written file, and
read with :func:`read_document`, which checks the document kind and schema version before anything
else looks at it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from colibri_plan.errors import FormatError, InputError

#: the pipeline's own documents: an existing one is only ever replaced by a document of the same kind
PROTECTED_KINDS = ("plan", "profile", "heat", "coefficients", "verify-report", "model_spec", "pack")
ANY_KIND = "*"   # check_output_path: the kind is not known yet (checked again when the file is written)


def _document_kind(path: Path) -> str | None:
    """The "kind" of a small JSON document at ``path`` (None for anything else or unreadable)."""
    try:
        if path.stat().st_size > (16 << 20):
            return None
        doc = parse_json(path.read_bytes(), str(path), "JSON document")
    except (OSError, FormatError):
        return None
    kind = doc.get("kind") if isinstance(doc, dict) else None
    return kind if isinstance(kind, str) else None


def check_output_path(path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (),
                      kind: str | None = ANY_KIND) -> Path:
    """Check, before any work, that ``path`` can take an output file: its folder exists and the path is
    not a folder, a device or anything else that is not a regular file (a rename would replace it), not
    one of the command's ``inputs`` (files, or folders such as a pack, which it must not write into),
    not inside an expert pack folder, and not an existing pipeline document (:data:`PROTECTED_KINDS`) of
    another kind than ``kind`` (None: the output is not such a document; :data:`ANY_KIND`: not known).

    Raises:
        InputError: saying what is wrong with the path.
    """
    if not str(path).strip():   # Path("") is "."
        raise InputError("the output path is empty; give a file name")
    path = Path(path)
    out = path.resolve()
    for inp in inputs:
        if inp is None or not str(inp):
            continue
        src = Path(inp).resolve()
        if out == src or (src.is_dir() and src in out.parents):
            where = "is" if out == src else "is inside"
            raise InputError(f"cannot write {path}: it {where} the input {inp}; give another output path")
    if kind != ANY_KIND and out.is_file():
        old = _document_kind(out)
        if old in PROTECTED_KINDS and old != kind:
            new = f"a {kind!r} document" if kind else "another kind of file"
            raise InputError(f"cannot write {path}: it holds a {old!r} document and this would replace it "
                             f"with {new}; remove it yourself or choose another output path")
    if _document_kind(out.parent / "pack.json") == "pack":
        raise InputError(f"cannot write {path}: folder {path.parent} is an expert pack; write outputs "
                         "outside it")
    if path.exists() and not path.is_file():
        what = "a folder" if path.is_dir() else "not a regular file"
        raise InputError(f"cannot write {path}: it is {what}; give a file path")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise InputError(f"cannot write {path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise InputError(f"cannot write {path}: folder {folder} is not writable")
    check_free_space(folder, MIN_FREE_BYTES, str(path))   # a full disk fails here, before the work
    return path


#: check_output_path refuses a folder with less free space than this (a full disk fails before the work)
MIN_FREE_BYTES = 1 << 20


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 10**7 else f"{n:,} B"


def check_free_space(folder: str | os.PathLike, need_bytes: int, what: str) -> None:
    """Refuse to start writing ``need_bytes`` into ``folder`` when its filesystem has less free space
    (``what`` names the output in the message). A filesystem that cannot say is not refused.

    Raises:
        InputError: "cannot write <what>: <folder> has <free> free, it needs <need>; free space ...".
    """
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < need_bytes:
        raise InputError(f"cannot write {what}: the disk holding {folder} has {_gb(free)} free and this "
                         f"needs {_gb(int(need_bytes))}; free some space or write to another disk")


def write_failed(what: str, exc: OSError) -> InputError:
    """The one-line error of a write that failed part-way (a full disk, a quota, an I/O error); the
    caller has removed its temporary, so nothing was written."""
    why = exc.strerror or str(exc)
    hint = ("free some space or write to another disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
            else "check the disk and try again")
    return InputError(f"cannot write {what}: {why}; nothing was written; {hint}")


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists on this machine (one we may not signal counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale(folder: str | os.PathLike, prefix: str, suffix: str = "") -> list[Path]:
    """Remove the temporaries a killed process of ours left in ``folder``: entries named
    ``<prefix><pid>-<anything><suffix>`` whose ``pid`` is no longer alive (files, or folders such as a
    half-written pack). Entries of a live process, and anything else, stay. Returns what was removed;
    errors (a read-only folder) are ignored: cleaning is a courtesy, never a reason to fail.
    """
    pat = re.compile(re.escape(prefix) + r"(\d+)-.*" + re.escape(suffix) + "$", re.S)
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        m = pat.match(e.name)
        if not m or pid_alive(int(m.group(1))) or int(m.group(1)) == os.getpid():
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
            removed.append(Path(e.path))
        except OSError:
            pass
    return removed


def check_input_file(path: str | os.PathLike, what: str) -> Path:
    """Check that the input ``path`` is an existing regular file (it may be a link to one); ``what`` names
    it in the message ("plan file", "prompt file"). Returns the path.

    Raises:
        InputError: it does not exist, is a folder, or is something else (a device such as /dev/null, a
            pipe, a socket).
    """
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        raise InputError(f"{what} {path} is a folder, expected a file")
    if path.exists():
        raise InputError(f"{what} {path} is not a regular file (a device, pipe or socket); give a file")
    raise InputError(f"{what} {path} does not exist")


def atomic_write_bytes(path: str | os.PathLike, data: bytes, kind: str | None = None) -> Path:
    """Write ``data`` to ``path`` atomically; returns the path. The file gets the usual mode
    (0666 less the umask), like a plain ``open``. The temporary is ``.<name>.<pid>-<random>.tmp``; those
    of processes that died before their rename are removed first (:func:`clean_stale`).

    Raises:
        InputError: see :func:`check_output_path`; too little free space for ``data``, or the write
            failed (disk full, I/O error): one line, and the temporary is removed.
    """
    path = check_output_path(path, kind=kind)
    folder = path.parent if str(path.parent) else Path(".")
    clean_stale(folder, f".{path.name}.", ".tmp")
    check_free_space(folder, len(data) + 4096, str(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}-", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise write_failed(str(path), exc) from None
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600: the file is for other users/tools too
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise write_failed(str(path), exc) from None
        raise
    fsync_dir(folder)  # make the rename itself durable
    return path


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a folder so renames and new entries in it survive a crash; errors are ignored (some
    filesystems refuse fsync on folders)."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def atomic_write_text(path: str | os.PathLike, text: str, kind: str | None = None) -> Path:
    """Write UTF-8 ``text`` atomically (see :func:`atomic_write_bytes`)."""
    return atomic_write_bytes(path, text.encode("utf-8"), kind=kind)


def canonical_json(obj: Any) -> str:
    """JSON with sorted keys and no insignificant whitespace: the input of fingerprints."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def fingerprint(obj: Any) -> str:
    """sha256 hex digest (first 16 hex chars) of :func:`canonical_json` of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()[:16]


def write_document(path: str | os.PathLike, kind: str, schema_version: int, body: dict) -> Path:
    """Write a versioned JSON document ``{"kind", "schema_version", **body}`` atomically."""
    doc = {"kind": kind, "schema_version": int(schema_version), **body}
    return atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=False, allow_nan=False) + "\n",
                             kind=kind)


#: deepest nesting of lists/objects a document may have (ours nest at most 6 deep; config.json ~4)
MAX_JSON_DEPTH = 64
#: largest magnitude of a JSON integer (no field of any document comes near it; numpy holds int64)
MAX_JSON_INT = 2**63 - 1


def _json_int(text: str) -> int:
    v = int(text)
    if abs(v) > MAX_JSON_INT:
        raise ValueError(f"integer {text[:24]}{'...' if len(text) > 24 else ''} ({len(text)} digits) is "
                         "larger than any field can hold (2**63 - 1)")
    return v


def json_depth_ok(doc: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when ``doc`` nests lists/objects at most ``limit`` deep (checked without recursion)."""
    level = [doc] if isinstance(doc, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return False
        nxt: list = []
        for v in level:
            nxt.extend(c for c in (v.values() if isinstance(v, dict) else v) if isinstance(c, (dict, list)))
        level = nxt
    return True


def parse_json(text: str | bytes, where: str, what: str) -> Any:
    """Parse JSON text (or UTF-8 bytes) of a document read from ``where``; ``what`` names the expected
    file in messages. Deep nesting (more than :data:`MAX_JSON_DEPTH` levels, which would exhaust the
    interpreter's recursion) and integers beyond :data:`MAX_JSON_INT` are refused here, so no reader
    downstream meets them.

    Raises:
        FormatError: not UTF-8, not JSON, nested too deeply, or an integer too large.
    """
    try:
        doc = json.loads(text, parse_int=_json_int)
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels); is it a "
                          f"{what}? re-create it") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise FormatError(f"{where} is not valid JSON ({exc}); is it a {what}? re-create it") from None
    if not json_depth_ok(doc):
        raise FormatError(f"{where}: JSON nested too deeply (more than {MAX_JSON_DEPTH} levels); is it a "
                          f"{what}? re-create it")
    return doc


def read_json_object(path: str | os.PathLike, what: str) -> dict:
    """Parse ``path`` as UTF-8 JSON holding one object.

    Raises:
        InputError: the file cannot be read.
        FormatError: not UTF-8 / not valid JSON, or not an object; ``what`` names the expected file.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path} is not valid JSON ({exc}); is it a {what}? re-create it") from exc
    doc = parse_json(text, str(path), what)
    if not isinstance(doc, dict):
        raise FormatError(f"{path} must hold a JSON object (a {what})")
    return doc


def read_document(path: str | os.PathLike, kind: str, schema_version: int) -> dict:
    """Read a JSON document written by :func:`write_document` and check its kind and version.

    Returns:
        The parsed document (a dict, including ``kind`` and ``schema_version``).

    Raises:
        InputError: the file does not exist, is a folder or is not a regular file (see
            :func:`check_input_file`), or cannot be read.
        FormatError: not JSON, not an object, another kind, or another schema version.
    """
    path = check_input_file(path, f"{kind} file")
    doc = read_json_object(path, f"{kind} file")
    if doc.get("kind") != kind:
        if "kind" not in doc:  # not one of ours at all (or hand-written): say what it lacks
            raise FormatError(f"{path} is not a colibri-plan {kind} file: it has no \"kind\" field (a {kind} "
                              f"file says \"kind\": {kind!r}); give the file `colibri-plan` wrote")
        raise FormatError(f"{path} is a {doc.get('kind')!r} file, expected {kind!r}")
    if doc.get("schema_version") != schema_version:
        raise FormatError(
            f"{path} has {kind} schema_version {doc.get('schema_version')!r}; this colibri-plan reads "
            f"version {schema_version}; re-create the file with this version")
    return doc
