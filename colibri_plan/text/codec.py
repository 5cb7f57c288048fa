"""Text in, text out: a checkpoint's tokenizer files read through the ``tokenizers`` library.

The files (those of a Hugging Face checkpoint; a pack keeps copies, engine/pack_text.py):

- ``tokenizer.json`` (needed): the tokenizer, its special tokens and post-processor (which adds a BOS
  where the model wants one);
- ``tokenizer_config.json``: the special tokens by name (``bos_token``, ``eos_token``, ...; a string or
  an ``{"content": ...}`` object) and often the ``chat_template``;
- ``chat_template.jinja`` (or ``chat_template.json``): the chat template, as newer checkpoints store it;
- ``generation_config.json``: ``eos_token_id`` (an id or a list), the ids that end a generation.

Encoding a plain prompt adds the post-processor's special tokens; a rendered chat prompt already holds
them (the template writes them), so it is encoded without, as transformers does.
"""

from __future__ import annotations

import json
from pathlib import Path

from colibri_plan.errors import FormatError, InputError

__all__ = ["TOKENIZER_FILE", "TEXT_FILES", "TextCodec", "has_tokenizer"]

#: the file without which there is no text
TOKENIZER_FILE = "tokenizer.json"
#: every file of a checkpoint's text side that is read (and copied into a pack)
TEXT_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "chat_template.jinja", "chat_template.json")
#: the special-token names passed to a chat template
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def has_tokenizer(folder) -> bool:
    """True when ``folder`` holds a ``tokenizer.json``."""
    return (Path(folder) / TOKENIZER_FILE).is_file()


def _json_object(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: not valid JSON ({exc}); fix or remove the file") from None
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: must hold a JSON object, got {type(doc).__name__}")
    return doc


def _token_name(v) -> str | None:
    """A special token as tokenizer_config writes it: a string, or ``{"content": str, ...}``."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _ids(v, where: str) -> list[int]:
    """``eos_token_id``: an int, a list of ints, or absent."""
    if v is None:
        return []
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in vals):
        raise FormatError(f"{where}: eos_token_id must be a token id or a list of them, got {v!r}")
    return [int(i) for i in vals]


def _chat_source(folder: Path, config: dict) -> tuple[str | None, str]:
    """The chat template text and the file it came from (``chat_template.jinja`` first, then
    ``chat_template.json``, then tokenizer_config.json; a list of named templates gives ``default``)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8"), str(jinja)
        except UnicodeDecodeError:
            raise FormatError(f"{jinja}: not UTF-8 text") from None
    where = folder / "chat_template.json"
    src = _json_object(where).get("chat_template")
    if src is None:
        where, src = folder / "tokenizer_config.json", config.get("chat_template")
    if isinstance(src, list):   # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in src if isinstance(t, dict)}
        src = named.get("default", next(iter(named.values()), None))
    if src is not None and not isinstance(src, str):
        raise FormatError(f"{where}: chat_template must be a string, got {type(src).__name__}")
    return src, str(where)


class TextCodec:
    """A model's tokenizer, special tokens, chat template and stop ids.

    Use :meth:`from_folder`. Attributes:
        vocab_size: ids the tokenizer produces (its vocabulary with added tokens), <= the model's.
        stop_ids: frozenset of ids that end a generation (generation_config's ``eos_token_id`` and the
            tokenizer's ``eos_token``).
        special_tokens: ``{"bos_token": str, ...}`` of the names the files define.
        chat: a :class:`~colibri_plan.text.chat.ChatTemplate`, or None without a template.
        where: the folder the files were read from.
    """

    def __init__(self, tokenizer, special_tokens: dict, stop_ids, chat, where: str):
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.special_tokens, self.stop_ids = special_tokens, frozenset(stop_ids)
        self.chat, self.where = chat, where

    @classmethod
    def from_folder(cls, folder, model_vocab_size: int | None = None) -> TextCodec:
        """Read and check the text files of ``folder`` (module docstring).

        Args:
            model_vocab_size: the model's vocabulary (embedding rows); the tokenizer's ids must fit in it.

        Raises:
            InputError: no ``tokenizer.json`` in ``folder``.
            FormatError: a file that does not parse (tokenizer, JSON, chat template syntax), a tokenizer
                whose ids pass the model's vocabulary, or an EOS id outside it; each names the file.
        """
        from tokenizers import Tokenizer

        from colibri_plan.text.chat import ChatTemplate

        folder = Path(folder)
        path = folder / TOKENIZER_FILE
        if not path.is_file():
            raise InputError(f"{folder} has no {TOKENIZER_FILE}: without a tokenizer the model runs on token "
                             "ids only (--prompt-ids)")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the Rust side raises plain Exception
            raise FormatError(f"{path}: the tokenizers library cannot read it ({exc}); fix or remove the "
                              "file") from None
        config = _json_object(folder / "tokenizer_config.json")
        special_map = _json_object(folder / "special_tokens_map.json")
        special = {k: n for k in SPECIAL_NAMES
                   if (n := _token_name(config.get(k, special_map.get(k)))) is not None}
        gen_where = str(folder / "generation_config.json")
        stop = _ids(_json_object(folder / "generation_config.json").get("eos_token_id"), gen_where)
        if "eos_token" in special:
            eos = tok.token_to_id(special["eos_token"])
            if eos is None:
                raise FormatError(f"{folder / 'tokenizer_config.json'}: eos_token {special['eos_token']!r} "
                                  f"is not a token of {TOKENIZER_FILE}")
            stop.append(int(eos))
        src, src_where = _chat_source(folder, config)
        codec = cls(tok, special, stop, None if src is None else ChatTemplate(src, special, src_where),
                    str(folder))
        if model_vocab_size is not None:
            codec.check_vocab(int(model_vocab_size))
        return codec

    def check_vocab(self, model_vocab_size: int) -> None:
        """Refuse a tokenizer whose ids (or stop ids) the model's embedding of ``model_vocab_size`` rows
        cannot hold (a model's vocabulary may be padded past the tokenizer's, never the reverse).

        Raises:
            FormatError: naming both sizes.
        """
        if self.vocab_size > model_vocab_size:
            raise FormatError(f"{self.where}/{TOKENIZER_FILE} has {self.vocab_size} tokens but the model's "
                              f"vocabulary has {model_vocab_size}: the tokenizer belongs to another model")
        bad = sorted(i for i in self.stop_ids if i >= model_vocab_size)
        if bad:
            raise FormatError(f"{self.where}: EOS id {bad[0]} is outside the model's vocabulary "
                              f"0..{model_vocab_size - 1}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the post-processor's BOS etc. when ``add_special_tokens``).

        Raises:
            InputError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise InputError(f"a prompt must be text, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (special tokens such as EOS left out unless ``skip_special_tokens`` is
        False)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation through the chat template.

        Raises:
            InputError: the model has no chat template, or the template refused the messages.
        """
        if self.chat is None:
            raise InputError(f"{self.where} has no chat template (tokenizer_config.json's chat_template or "
                             "chat_template.jinja): send a plain prompt instead (run --prompt without "
                             "--chat, or /v1/completions)")
        return self.chat.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation ready for the assistant's reply (:meth:`render_chat`, encoded
        without adding special tokens: the template wrote them)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def stream(self):
        """A fresh :class:`~colibri_plan.text.stream.StreamDecoder` over this codec."""
        from colibri_plan.text.stream import StreamDecoder

        return StreamDecoder(self.decode)

    def describe(self) -> str:
        """One line for people: vocabulary, stop ids, chat template or none."""
        stops = ", ".join(str(i) for i in sorted(self.stop_ids)) or "none"
        return (f"tokenizer {self.vocab_size} tokens, stop ids {stops}, "
                f"chat template {'yes' if self.chat is not None else 'none'}")
