"""The arguments of the optional ``d_attention_prologue`` op (backends/contract.py), checked once for every
backend that declares it (CUDA's ``tr_qkv_prologue``, the CPU's numba kernel): shapes that chain, rows
inside the cache, positions inside the RoPE table."""

from __future__ import annotations

from colibri_plan.errors import InputError

__all__ = ["check_prologue_args"]


def check_prologue_args(be, q, k, v, norms, rope, k_cache, v_cache, row0: int) -> tuple[int, int, int, int]:
    """(T, Hq, Hkv, d) of valid ``d_attention_prologue`` arguments: q [T, Hq, d], k and v [T, Hkv, d],
    caches [C, Hkv, d], ``norms`` None or two [d] weights, ``rope`` None or (table [P, rd/2, 2], rd,
    interleave), rows row0..row0+T-1.

    Raises:
        InputError: arrays of another backend or of shapes that do not fit, rows past the cache or
        positions past the table.
    """
    for a in (q, k, v, k_cache, v_cache):
        be._d_check(a, ndim=3)
    T, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != d:
        raise InputError(f"d_attention_prologue: q {q.shape}, k {k.shape}, v {v.shape}")
    if k_cache.shape != v_cache.shape or k_cache.shape[1:] != (hkv, d):
        raise InputError(f"d_attention_prologue: caches {k_cache.shape} / {v_cache.shape} for k {k.shape}")
    if row0 < 0 or row0 + T > k_cache.shape[0]:
        raise InputError(f"d_attention_prologue: rows {row0}..{row0 + T - 1} do not fit the cache's "
                         f"{k_cache.shape[0]}")
    if norms is not None:
        for w in norms:
            be._d_check(w, ndim=1)
            if w.shape[0] != d:
                raise InputError(f"d_attention_prologue: a norm weight {w.shape} for heads of {d}")
    if rope is not None:
        table, rd = rope[0], int(rope[1])
        be._d_check(table, ndim=3)
        if rd % 2 or not 0 <= rd <= d or table.shape[1:] != (rd // 2, 2):
            raise InputError(f"d_attention_prologue: rotary_dim {rd} with heads of {d} and table "
                             f"{table.shape}")
        if row0 + T > table.shape[0]:
            raise InputError(f"d_attention_prologue: positions {row0}..{row0 + T - 1} outside the "
                             f"table's {table.shape[0]}")
    return T, hq, hkv, d
