"""Buffer pools shared by the GPU backends: :class:`WorkBuffers`, named grow-only buffers (activations in,
FFN intermediate, results, pinned staging), and :class:`Replays`, recorded work per call shape (CUDA
graphs, Vulkan command buffers) replayed instead of recorded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


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
