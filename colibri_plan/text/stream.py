"""Text as it is generated: turn token ids into text one token at a time, and cut at stop strings.

:class:`StreamDecoder` returns, for each new id, the text that id completes. One token may hold part of a
UTF-8 character (byte-level BPE) and a decoder may change the text before it (a SentencePiece word start),
so each step decodes a short window of recent ids and returns what it adds to the window's earlier text,
holding back text that ends in an incomplete character (U+FFFD). The pieces joined equal the decode of all
ids. :class:`StopStrings` holds back text that may begin a stop string and ends the text before the first
one found. :class:`IdText` is the text of a model without a tokenizer: its ids, space-separated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from colibri_plan.errors import InputError

__all__ = ["StreamDecoder", "StopStrings", "IdText", "MAX_STOP_STRINGS"]

#: stop strings one request may give (OpenAI's limit)
MAX_STOP_STRINGS = 4

_INCOMPLETE = "\ufffd"


class StreamDecoder:
    """Incremental detokenizer over ``decode(ids) -> str``.

    Usage::

        s = codec.stream()
        for tok in ids:
            print(s.push(tok), end="")
        print(s.flush())      # what is left (an incomplete character at the very end)
    """

    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self._start = 0    # first id of the window decoded each step
        self._done = 0     # ids whose text has been returned

    def push(self, tok: int) -> str:
        """Add one id; returns the new text it completes ("" while a character or word is incomplete)."""
        self.ids.append(int(tok))
        before = self._decode(self.ids[self._start:self._done])
        now = self._decode(self.ids[self._start:])
        if len(now) <= len(before) or now.endswith(_INCOMPLETE):
            return ""
        self._start, self._done = self._done, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        """The text of the ids not yet returned, complete or not (call once, at the end)."""
        before = self._decode(self.ids[self._start:self._done])
        now = self._decode(self.ids[self._start:])
        self._start = self._done = len(self.ids)
        return now[len(before):] if len(now) > len(before) else ""


class IdText:
    """The text of a model packed without a tokenizer: each id as a decimal number, space-separated."""

    def __init__(self):
        self.ids: list[int] = []

    def push(self, tok: int) -> str:
        self.ids.append(int(tok))
        return f"{' ' if len(self.ids) > 1 else ''}{int(tok)}"

    def flush(self) -> str:
        return ""


class StopStrings:
    """Cut generated text at the first of a few stop strings.

    Args:
        stops: up to :data:`MAX_STOP_STRINGS` non-empty strings.

    Raises:
        InputError: too many, or an empty or non-string one.
    """

    def __init__(self, stops: Sequence[str] = ()):
        stops = list(stops)
        if len(stops) > MAX_STOP_STRINGS:
            raise InputError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise InputError(f"each stop string must be non-empty text, got {s!r}")
        self.stops = stops
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """Add new text; returns what can be shown now. After a stop string, :attr:`stopped` is True and
        the text returned ends before it (the stop string itself is never shown)."""
        if self.stopped:
            return ""
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held, self.stopped = "", True
            return buf[:cut]
        keep = 0   # the longest end of buf that could still grow into a stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """Text held back at the end of a generation that no stop string completed."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out
