"""A pack's tokenizer files: copied from the checkpoint and checked by `model pack`, checked again when read.

`model pack` copies the checkpoint's text files (:data:`~colibri_plan.text.codec.TEXT_FILES`) into the
pack folder beside ``pack.json`` after reading them as a run will (:class:`~colibri_plan.text.codec.
TextCodec`: the tokenizer parses, its ids fit the model's vocabulary, the JSON files and the chat template
parse) and records them in the index's ``tokenizer`` section::

    "tokenizer": {"files": [[name, bytes, crc32], ...], "vocab_size": int, "stop_ids": [int, ...],
                  "chat_template": bool}

A pack without that section (a fixture, a checkpoint without ``tokenizer.json``, a pack of an older
version) opens and runs on token ids as before; :func:`text_status` says so.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from colibri_plan.errors import FormatError, InputError, IntegrityError
from colibri_plan.formats.pack_verify import file_crc32
from colibri_plan.text.codec import TEXT_FILES, TOKENIZER_FILE, TextCodec, has_tokenizer

__all__ = ["copy_tokenizer", "open_text", "text_status", "no_tokenizer_reason", "pack_text_line",
           "encode_prompt"]


def no_tokenizer_reason(folder) -> str:
    """Why a checkpoint folder gives no text: what it has instead of ``tokenizer.json``, if anything."""
    folder = Path(folder)
    if (folder / "tokenizer.model").is_file():
        return (f"{folder} has tokenizer.model (SentencePiece) but no {TOKENIZER_FILE}; save the tokenizer "
                "with transformers (AutoTokenizer.from_pretrained(folder).save_pretrained(folder)) and pack "
                "again to run on text")
    return f"{folder} has no {TOKENIZER_FILE}"


def copy_tokenizer(src, dst, model_vocab_size: int) -> dict | None:
    """Check the text files of checkpoint folder ``src`` and copy them into (temporary) pack folder
    ``dst``; returns the index's ``tokenizer`` section, or None when ``src`` has no ``tokenizer.json``.

    Raises:
        FormatError: a file that does not parse or a tokenizer of another vocabulary (the message names
            the file; fix or remove it to pack without text).
        InputError: a file cannot be copied.
    """
    src, dst = Path(src), Path(dst)
    if not has_tokenizer(src):
        return None
    codec = TextCodec.from_folder(src, model_vocab_size)
    files = []
    for name in TEXT_FILES:
        if not (src / name).is_file():
            continue
        try:
            shutil.copyfile(src / name, dst / name)
            with open(dst / name, "rb") as f:
                os.fsync(f.fileno())
        except OSError as exc:
            raise InputError(f"cannot copy {src / name} into the pack: {exc.strerror}") from exc
        files.append([name, (dst / name).stat().st_size, file_crc32(dst / name)])
    return {"files": files, "vocab_size": codec.vocab_size, "stop_ids": sorted(codec.stop_ids),
            "chat_template": codec.chat is not None}


def _section(pack) -> dict | None:
    sec = getattr(pack, "index", {}).get("tokenizer")
    if sec is None:
        return None
    where = f"{pack.path}/pack.json"
    files = sec.get("files") if isinstance(sec, dict) else None
    if not isinstance(files, list) or not all(
            isinstance(r, list) and len(r) == 3 and r[0] in TEXT_FILES and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in r[1:]) for r in files):
        raise FormatError(f"{where}: tokenizer.files must be a list of [name, bytes, crc32] rows of "
                          f"{', '.join(TEXT_FILES)}; re-create the pack")
    if TOKENIZER_FILE not in [r[0] for r in files]:
        raise FormatError(f"{where}: tokenizer.files does not list {TOKENIZER_FILE}; re-create the pack")
    return sec


def open_text(weights) -> TextCodec | None:
    """The text side of an open pack (its copied files, each checked against the index's size and
    crc32 first) or of a checkpoint folder (its own files); None when there is none.

    Raises:
        IntegrityError: a copied file is missing or changed since packing.
        FormatError: a malformed ``tokenizer`` section, or files that do not parse.
    """
    if hasattr(weights, "index"):   # a pack
        sec = _section(weights)
        if sec is None:
            return None
        for name, nbytes, crc in sec["files"]:
            p = Path(weights.path) / name
            if not p.is_file() or p.stat().st_size != nbytes or file_crc32(p) != crc:
                raise IntegrityError(f"pack {weights.path}: {name} is missing or differs from the one packed "
                                     "(size or crc32); re-create the pack")
        return TextCodec.from_folder(weights.path, weights.arch.vocab_size)
    folder = getattr(weights, "folder", None)
    if folder is None or not has_tokenizer(folder):
        return None
    return TextCodec.from_folder(folder, weights.arch.vocab_size)


def text_status(weights) -> str:
    """One line: the text side (:meth:`TextCodec.describe`), or why the model runs on token ids only."""
    try:
        codec = open_text(weights)
    except (FormatError, IntegrityError) as exc:
        return f"text: unusable ({exc})"
    if codec is not None:
        return f"text: {codec.describe()}"
    where = getattr(weights, "folder", None)
    why = no_tokenizer_reason(where) if where is not None else (
        f"pack {getattr(weights, 'path', '?')} was made without tokenizer files (a fixture, or a checkpoint "
        f"without {TOKENIZER_FILE})")
    return f"text: none, runs on token ids only: {why}"


def pack_text_line(pack_path, checkpoint) -> str:
    """What `model pack` says about the text side of the pack it wrote from ``checkpoint``."""
    from colibri_plan.formats.pack_index import read_index

    sec = read_index(pack_path).get("tokenizer")
    if not sec:
        return f"text: none, the pack runs on token ids only ({no_tokenizer_reason(checkpoint)})"
    stops = ", ".join(str(i) for i in sec.get("stop_ids", [])) or "none"
    return (f"text: copied {', '.join(r[0] for r in sec['files'])} ({sec['vocab_size']} tokens, stop ids "
            f"{stops}, chat template {'yes' if sec.get('chat_template') else 'none'})")


def encode_prompt(weights, text: str, chat: bool = False) -> tuple[list[int], TextCodec]:
    """Token ids of a text prompt (with ``chat``: one user message through the chat template, ready for
    the assistant's reply) and the model's codec (`run --prompt`).

    Raises:
        InputError: the model has no tokenizer (:func:`text_status` says why), or no chat template with
            ``chat``, or the prompt has no tokens.
        IntegrityError / FormatError: as :func:`open_text`.
    """
    codec = open_text(weights)
    if codec is None:
        raise InputError(f"a text prompt needs the model's tokenizer; {text_status(weights)}; give "
                         "--prompt-ids instead, or pack the model from a checkpoint that has tokenizer.json")
    ids = codec.encode_chat([{"role": "user", "content": text}]) if chat else codec.encode(text)
    if not ids:
        raise InputError("the prompt is empty (no tokens); give some text")
    return ids, codec
