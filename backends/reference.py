"""The numpy reference of the contract's ops, and :class:`HostArrays`, the device-activation hooks on host
arrays that the host backends (``numpy``, ``cpu``) and Metal (shared memory) bind.

The functions here are what every kernel is compared with (the cross-backend oracles); attention (GQA,
and MLA's on its latent cache: one kv head) computes in float64 and casts. Shapes and the mask rules are
those of :mod:`colibri_plan.backends.contract`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.routing import ids_as_float32, route_ref

__all__ = ["HostArrays", "attention_ref", "rope_ref", "rope_table", "silu_mul_ref"]


def silu_mul_ref(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SiLU(g) · u in float32, the activation of SwiGLU experts."""
    g = g.astype(np.float32)
    with np.errstate(over="ignore"):  # exp(-g) overflows to inf for g < -88: SiLU is then -0, as it should be
        return (g / (1.0 + np.exp(-g))) * u


def rope_table(inv_freq: np.ndarray, positions: int, attention_factor: float = 1.0,
               scaling_factor: float = 1.0) -> np.ndarray:
    """float32 [positions, len(inv_freq), 2]: (cos, sin) of (p / scaling_factor) · f_i, times the
    attention factor (1 unless YaRN), for p = 0..positions-1 — what ``d_rope`` reads."""
    pos = np.arange(int(positions), dtype=np.float32) / np.float32(scaling_factor)
    freqs = pos[:, None] * np.asarray(inv_freq, np.float32)[None, :]  # [P, rd/2]
    af = np.float32(attention_factor)
    return np.ascontiguousarray(np.stack([np.cos(freqs) * af, np.sin(freqs) * af], axis=-1), np.float32)


def rope_ref(x: np.ndarray, table: np.ndarray, pos0: int, rotary_dim: int, interleave: bool) -> np.ndarray:
    """``d_rope``: x float32 [T, heads, d] -> a rotated copy; rotate_half pairs channel i with
    i + rotary_dim/2, interleaved pairs (2i, 2i+1); channels ≥ rotary_dim pass unchanged."""
    t, rd = x.shape[0], int(rotary_dim)
    if rd == 0:
        return x.copy()
    cs = table[pos0: pos0 + t]  # [T, rd/2, 2]
    cos, sin = cs[:, None, :, 0], cs[:, None, :, 1]  # [T, 1, rd/2]
    out = x.copy()
    if interleave:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = a * cos - b * sin
        out[..., 1:rd:2] = b * cos + a * sin
    else:
        half = rd // 2
        a, b = x[..., :half], x[..., half:rd]
        out[..., :half] = a * cos - b * sin
        out[..., half:rd] = b * cos + a * sin
    return out


#: bytes of float64 scores one attention_ref tile may hold: a long prompt's [Hkv, g, T, S] scores for the
#: whole prompt took 5.96 GiB at 20,000 tokens; tiles of query rows keep it near this
ATTENTION_TILE_BYTES = 64 << 20


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_keys: int, pos0: int, scale: float,
                  window: int = 0) -> np.ndarray:
    """``d_attention`` in float64, cast to float32: q [T, Hq, d], k/v [C, Hkv, d] -> [T, Hq·d]; query row t
    at position pos0 + t sees keys lo..pos0+t (lo = pos0 + t − window + 1 when window > 0, else 0).

    Query rows are taken in tiles whose scores [Hkv, g, rows, keys] stay within
    :data:`ATTENTION_TILE_BYTES` (each row's softmax is its own: the same numbers as one pass); a tile
    sees only the keys its last row may (causal), so early tiles are cheaper too."""
    t, hq = q.shape[0], q.shape[1]
    rows = max(1, ATTENTION_TILE_BYTES // (8 * hq * max(1, n_keys)))
    if t <= rows:
        return _attention_tile(q, k, v, n_keys, pos0, scale, window)
    out = np.empty((t, hq * q.shape[2]), np.float32)
    for r0 in range(0, t, rows):
        r1 = min(t, r0 + rows)
        out[r0:r1] = _attention_tile(q[r0:r1], k, v, pos0 + r1, pos0 + r0, scale, window)  # [rows, Hq·d]
    return out


def _attention_tile(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_keys: int, pos0: int, scale: float,
                    window: int) -> np.ndarray:
    """:func:`attention_ref` of one tile of query rows, all at once."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    kk = np.asarray(k[:n_keys], np.float64).transpose(1, 0, 2)  # [Hkv, S, d]
    vv = np.asarray(v[:n_keys], np.float64).transpose(1, 0, 2)
    qq = np.asarray(q, np.float64).transpose(1, 0, 2).reshape(hkv, g, t, d)  # head h -> kv head h // g
    s = scale * np.matmul(qq, kk[:, None].transpose(0, 1, 3, 2))  # [Hkv, g, T, S]
    qpos = pos0 + np.arange(t)[:, None]
    kpos = np.arange(n_keys)[None, :]
    allowed = kpos <= qpos
    if window > 0:
        allowed &= kpos > qpos - window
    s = np.where(allowed, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p, vv[:, None])  # [Hkv, g, T, d]
    return out.reshape(hq, t, d).transpose(1, 0, 2).reshape(t, hq * d).astype(np.float32)


class HostArrays:
    """The ``_d_*`` hooks of :class:`~colibri_plan.backends.device_ops.DeviceOps` on host numpy arrays: a
    DArray's ``buf`` is a float32 array, ``d_matmul`` runs the backend's own host ``_matmul`` (numba kernels
    on ``cpu``, the GPU on Metal). Bound by a backend at open (:meth:`Backend.bind`)."""

    HOOKS = ("_d_put", "_d_get", "_d_zeros", "_d_matmul", "_d_rmsnorm", "_d_add", "_d_silu_mul",
             "_d_scale_rows", "_d_rope", "_d_write_rows", "_d_write_block", "_d_head_matmul", "_d_attention",
             "_d_route")

    def __init__(self, backend):
        self._matmul = backend._matmul

    @staticmethod
    def _host(a: DArray) -> np.ndarray:
        return a.buf.reshape(a.shape)

    def _d_put(self, a: np.ndarray) -> Any:
        return a.copy()

    def _d_get(self, a: DArray) -> np.ndarray:
        return self._host(a)

    def _d_zeros(self, shape: tuple[int, ...]) -> Any:
        return np.zeros(shape, np.float32)

    def _d_matmul(self, x: DArray, w) -> Any:
        return self._matmul(np.ascontiguousarray(self._host(x)), w)

    def _d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> Any:
        xx = self._host(x)
        var = np.mean(xx * xx, axis=-1, keepdims=True, dtype=np.float32)
        return (xx / np.sqrt(var + np.float32(eps))) * self._host(weight)

    def _d_add(self, a: DArray, b: DArray) -> Any:
        return self._host(a) + self._host(b)

    def _d_silu_mul(self, g: DArray, u: DArray) -> Any:
        gg = self._host(g)
        return (gg / (np.float32(1.0) + np.exp(-gg))) * self._host(u)

    def _d_scale_rows(self, a: DArray, s: np.ndarray) -> Any:
        return self._host(a) * s[:, None]

    def _d_rope(self, x: DArray, table: DArray, pos0: int, rotary_dim: int, interleave: bool) -> Any:
        return rope_ref(self._host(x), self._host(table), pos0, rotary_dim, interleave)

    def _d_write_rows(self, dst: DArray, row0: int, src: DArray) -> None:
        self._host(dst)[row0: row0 + src.shape[0]] = self._host(src)

    def _d_write_block(self, dst: DArray, row0: int, col0: int, src: DArray) -> None:
        self._host(dst)[row0: row0 + src.shape[0], col0: col0 + src.shape[1]] = self._host(src)

    def _d_head_matmul(self, x: DArray, w: DArray) -> Any:
        # [B, T, K] · [B, K, N] -> [B, T, N] (batched BLAS), back to token-major [T, B, N]
        y = np.matmul(self._host(x).transpose(1, 0, 2), self._host(w).transpose(0, 2, 1))
        return np.ascontiguousarray(y.transpose(1, 0, 2), dtype=np.float32)

    def _d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                     window: int) -> Any:
        return attention_ref(self._host(q), self._host(k), self._host(v), n_keys, pos0, scale, window)

    def _d_route(self, logits: DArray, bias: DArray | None, rule, ints: tuple, floats: tuple) -> tuple:
        # the host rule itself on the logits (ids kept as their int32 bits in a float32 array)
        ids, w = route_ref(self._host(logits), None if bias is None else self._host(bias), rule)
        return ids_as_float32(ids), w, 0
