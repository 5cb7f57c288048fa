"""The KV cache on the device that runs attention (the host backends' too): per layer K and V as device
arrays, in whole pages.

Layout (what ``d_attention`` reads): per layer ``k[layer]`` and ``v[layer]`` are float32 DArrays
[capacity, n_kv_heads, head_dim], token-major (row t holds token t's keys of every kv head, after RoPE).
``capacity`` is a whole number of ``page_tokens`` pages (64, as colibrì and the plan's
``trunk.kv.page_tokens``). The cache reserves the planned context at open — the bytes the plan's
``trunk.kv.bytes`` charged: ``ceil(context / 64) · 64 · 2 · n_layers · n_kv_heads · head_dim · 4`` — and
grows by whole pages when a run passes it (new arrays, the old rows copied with ``d_write_rows``).

MLA (:class:`DeviceLatentCache`): one array per layer, [capacity, 1, qk_rope_head_dim + kv_lora_rank],
row t = [k_rope(t) | latent(t)] (the rotated rope key, then the normed kv latent). ``d_attention`` reads it
as keys *and* values of one kv head shared by every query head, which is the weight-absorbed MLA core
(docs/engine.md, "MLA on the device"); the cache holds no separate V, so it reserves
``ceil(context / 64) · 64 · n_layers · (rope + rank) · 4`` bytes, the latent cache the planner prices.
"""

from __future__ import annotations

import math

from colibri_plan.backends import DArray
from colibri_plan.errors import InputError
from colibri_plan.formats.plan_trunk import DEVICE_KV_BYTES_PER_VALUE, PAGE_TOKENS

__all__ = ["DeviceKVCache", "DeviceLatentCache", "device_kv_bytes", "latent_kv_bytes"]

#: bytes per cached value: the planner prices the same constant (K and V are float32 DArrays)
_B = DEVICE_KV_BYTES_PER_VALUE


def device_kv_bytes(n_layers: int, n_kv_heads: int, head_dim: int, context_tokens: int,
                    page_tokens: int = PAGE_TOKENS) -> int:
    """Bytes a :class:`DeviceKVCache` reserves for ``context_tokens`` (whole pages, float32 K and V)."""
    pages = max(1, math.ceil(max(0, int(context_tokens)) / int(page_tokens)))
    return pages * int(page_tokens) * 2 * int(n_layers) * int(n_kv_heads) * int(head_dim) * _B


def latent_kv_bytes(n_layers: int, rope_dim: int, rank: int, context_tokens: int,
                    page_tokens: int = PAGE_TOKENS) -> int:
    """Bytes a :class:`DeviceLatentCache` reserves for ``context_tokens`` (whole pages, float32 rows of
    rope_dim + rank values, no separate V)."""
    return device_kv_bytes(n_layers, 1, int(rope_dim) + int(rank), context_tokens, page_tokens) // 2


class DeviceKVCache:
    """Keys and values of past tokens on one backend's device (see the module docstring).

    Args:
        backend: an open backend (its ``d_*`` ops hold the arrays).
        n_layers, n_kv_heads, head_dim: the model's attention geometry.
        context_tokens: tokens to reserve at open (rounded up to whole pages; at least one page).
        page_tokens: tokens per page (64).

    Attributes:
        length: tokens cached so far (the position of the next token).
        capacity: rows reserved per layer (a multiple of ``page_tokens``).
        k, v: per layer DArray [capacity, n_kv_heads, head_dim]; rows < length are valid.
        grown_pages: pages added after open (0 while the run stays within the reserved context).

    Raises:
        InputError: a non-positive page size or geometry.
        DeviceOutOfMemoryError / the backend's allocation error: the pages do not fit the device.
    """

    def __init__(self, backend, n_layers: int, n_kv_heads: int, head_dim: int, context_tokens: int,
                 page_tokens: int = PAGE_TOKENS):
        if min(int(n_layers), int(n_kv_heads), int(head_dim), int(page_tokens)) < 1:
            raise InputError(f"device KV cache: layers {n_layers}, kv heads {n_kv_heads}, head_dim "
                             f"{head_dim} and page_tokens {page_tokens} must all be >= 1")
        self.backend = backend
        self.n_layers, self.n_kv_heads, self.head_dim = int(n_layers), int(n_kv_heads), int(head_dim)
        self.page_tokens = int(page_tokens)
        self.length = 0
        self.grown_pages = 0
        self.capacity = self._pages_for(context_tokens) * self.page_tokens
        shape = (self.capacity, self.n_kv_heads, self.head_dim)
        self.k: list[DArray] = [backend.d_zeros(shape) for _ in range(self.n_layers)]
        self.v: list[DArray] = self._values(shape)

    #: arrays per layer: K and V (a latent cache: one, read as both)
    _arrays = 2

    def _values(self, shape: tuple[int, ...]) -> list[DArray]:
        return [self.backend.d_zeros(shape) for _ in range(self.n_layers)]

    def _pages_for(self, tokens: int) -> int:
        return max(1, math.ceil(max(0, int(tokens)) / self.page_tokens))

    @property
    def reserved_bytes(self) -> int:
        """Device bytes held by K and V of every layer (all reserved rows, valid or not)."""
        return self._arrays * self.n_layers * self.capacity * self.n_kv_heads * self.head_dim * _B

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` rows per layer: grow every layer by whole pages when it passes the
        capacity (new zeroed arrays; the old rows copied on the device). No-op when they fit."""
        if tokens <= self.capacity:
            return
        pages = self._pages_for(tokens)
        new_cap = pages * self.page_tokens
        be = self.backend
        shape = (new_cap, self.n_kv_heads, self.head_dim)
        for store in (self.k, self.v)[: self._arrays]:
            for layer, old in enumerate(store):
                grown = be.d_zeros(shape)
                be.d_write_rows(grown, 0, old)  # the whole old array: rows past length are zeros anyway
                store[layer] = grown
        if self._arrays == 1:
            self.v = self.k
        self.grown_pages += pages - self.capacity // self.page_tokens
        self.capacity = new_cap

    def append(self, layer: int, k: DArray, v: DArray) -> tuple[DArray, DArray]:
        """Store k, v [T, n_kv_heads, head_dim] at rows length..length+T-1 of ``layer``; return the
        layer's whole K and V arrays (the first length + T rows valid). ``length`` advances in
        :meth:`advance` once every layer has appended.

        Raises:
            InputError: the rows pass the capacity (call :meth:`reserve` first) or shapes differ.
        """
        self._check_rows(k.shape[0])
        self.backend.d_write_rows(self.k[layer], self.length, k)
        self.backend.d_write_rows(self.v[layer], self.length, v)
        return self.k[layer], self.v[layer]

    def rows(self, layer: int, t: int) -> tuple[DArray, DArray]:
        """The layer's whole K and V arrays, once rows length..length+T-1 are checked to fit: where a fused
        append (the backend's ``d_attention_prologue``) writes this call's rows itself.

        Raises:
            InputError: the rows pass the capacity (call :meth:`reserve` first).
        """
        self._check_rows(t)
        return self.k[layer], self.v[layer]

    def _check_rows(self, t: int) -> None:
        end = self.length + t
        if end > self.capacity:
            raise InputError(f"device KV cache: rows {self.length}..{end - 1} pass its {self.capacity} "
                             "reserved rows; reserve() first")

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as cached (called by the trunk after all layers ran)."""
        self.length += int(n)

    def nbytes(self) -> int:
        """Bytes held by the valid rows of every layer."""
        return self._arrays * self.n_layers * self.length * self.n_kv_heads * self.head_dim * _B

    def close(self) -> None:
        """Drop the device arrays (their memory returns to the backend's allocator)."""
        self.k, self.v = [], []


class DeviceLatentCache(DeviceKVCache):
    """The MLA cache on a device: per layer one DArray [capacity, 1, rope_dim + rank], row t =
    [k_rope(t) | latent(t)], read by ``d_attention`` as keys and values of one kv head (module docstring).

    Args:
        backend, n_layers, context_tokens, page_tokens: as :class:`DeviceKVCache`.
        rope_dim: qk_rope_head_dim. rank: kv_lora_rank.

    Attributes:
        rope_dim, rank; k (and v, the same list): per layer DArray [capacity, 1, rope_dim + rank].
    """

    _arrays = 1

    def __init__(self, backend, n_layers: int, rope_dim: int, rank: int, context_tokens: int,
                 page_tokens: int = PAGE_TOKENS):
        self.rope_dim, self.rank = int(rope_dim), int(rank)
        super().__init__(backend, n_layers, 1, self.rope_dim + self.rank, context_tokens, page_tokens)

    def _values(self, shape: tuple[int, ...]) -> list[DArray]:
        return self.k

    def append(self, layer: int, k_rope: DArray, latent: DArray) -> tuple[DArray, DArray]:
        """Store k_rope [T, rope_dim] and latent [T, rank] as rows length..length+T-1 of ``layer``; return
        the layer's array twice (keys and values; the first length + T rows valid).

        Raises:
            InputError: the rows pass the capacity (call :meth:`reserve` first) or shapes differ.
        """
        self._check_rows(latent.shape[0])
        be, rows = self.backend, self.k[layer]
        flat = be.d_view(rows, (self.capacity, self.head_dim))  # [C, rope | rank]
        be.d_write_rows(flat, self.length, k_rope, 0)
        be.d_write_rows(flat, self.length, latent, self.rope_dim)
        return rows, rows

