"""Device activations: the ops that keep a model's residual stream on one device across layers.

The trunk of a model (norms, attention projections, RoPE, attention over a KV cache, shared experts,
dense FFN layers, the LM head) runs on the device that the plan gives it. Its activations stay there
as :class:`DArray` handles; only what the host must see crosses (the normed hidden state of a MoE layer
for the router and the host experts, their summed output back, the logits at the end).

Every backend has these ops. :class:`DeviceOps` implements them with numpy on host arrays (the
reference, and what the host backends "numpy" and "cpu" use); a GPU backend overrides the ``_d_*``
hooks with its kernels and returns its own buffers inside the DArray. The public ``d_*`` methods check
shapes and dtypes once, here, so a backend's hooks are driver calls only.

All arrays are float32, C-contiguous, row-major. Shapes are given as ``[rows, cols]`` etc.; a DArray's
``shape`` is metadata, so :meth:`DeviceOps.d_view` reshapes for free.

Ops (``x``, ``a``, ``b``, ... are DArrays unless said otherwise):

| op | shapes | result |
|---|---|---|
| ``d_put(host)`` | any float32 | a device copy |
| ``d_get(a)`` | any | host float32 copy |
| ``d_zeros(shape)`` | any | zeros |
| ``d_view(a, shape)`` | same size | the same buffer, another shape |
| ``d_matmul(x, w)`` | x [T, in], w DeviceWeight [out, in] | x · Wᵀ [T, out] |
| ``d_matmul_many(x, [w1, ...])`` | x [T, in], w_i [out_i, in] | [x · W_iᵀ [T, out_i], ...] |
| ``d_rmsnorm(x, weight, eps)`` | x [N, d], weight [d] | x / sqrt(mean(x²) + eps) · weight |
| ``d_add(a, b)`` | a [N, d], b [N, d] or [d] | a + b (b broadcast over rows when 1-D) |
| ``d_silu_mul(g, u)`` | [N, d] each | SiLU(g) · u |
| ``d_scale_rows(a, s)`` | a [N, d], s host float32 [N] | a[i] · s[i] |
| ``d_rope(x, table, pos0, rd, interleave)`` | x [T, heads, d], table [P, rd/2, 2] | x rotated |
| ``d_write_rows(dst, row0, src)`` | dst [C, ...], src [T, ...] | dst[row0:row0+T] = src (in place) |
| ``d_write_rows(dst, row0, src, col0)`` | dst [C, D], src [T, W], col0 + W ≤ D | the block written |
| ``d_head_matmul(x, w)`` | x [T, B, K], w [B, N, K] (a DArray) | y[t, b] = w[b] · x[t, b], [T, B, N] |
| ``d_attention(q, k, v, n_keys, pos0, scale, window)`` | q [T, Hq, d], k/v [C, Hkv, d] | [T, Hq·d] |
| ``d_expert_ffn(x, experts, gates)`` | x [T, H], n ExpertWeights, host gates [n] | Σ_i g_i·FFN_i(x) [T, H] |

RoPE table (:func:`rope_table`): ``table[p, i] = (cos(p·f_i)·af, sin(p·f_i)·af)`` with ``f`` the inverse
frequencies and ``af`` YaRN's attention factor; position ``pos0 + t`` rotates row ``t``. rotate_half
layout pairs channel i with i + rotary_dim/2; interleaved pairs (2i, 2i+1) (DeepSeek layouts).
Channels ≥ rotary_dim pass unchanged.

Attention (GQA, causal): query row t sits at position ``pos0 + t`` and sees key rows j with
``lo ≤ j ≤ pos0 + t`` where ``lo = pos0 + t − window + 1`` for a sliding-window layer (``window`` > 0)
and 0 otherwise; only the first ``n_keys`` rows of k/v are valid. Query head h reads kv head
``h // (Hq / Hkv)``. ``out[t, h] = Σ_j softmax_j(scale · q[t, h]·k[j, kv(h)]) · v[j, kv(h)]``, float32
accumulation (the reference is float64, cast).

Routed experts (``d_expert_ffn``): ``FFN_i(x) = down_i(SiLU(x·gate_iᵀ) ⊙ x·up_iᵀ)`` of experts uploaded to
this backend (``upload_expert``), every row of x through every expert, weighted by the host float32
``gates`` and summed. The default hook is the host path (x down, ``expert_ffn``, the float32 sum in the
engine's order — ``0 + y_0·g_0 + y_1·g_1 ...`` —, the sum up), so every backend has it; a GPU backend
runs it on the device x (the decode case, T = 1, of a device trunk's experts in its own VRAM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_plan.errors import InputError

__all__ = ["DArray", "DeviceOps", "attention_ref", "rope_ref", "rope_table"]


@dataclass
class DArray:
    """A float32 activation on a backend's device.

    Attributes:
        shape: the logical shape (C-contiguous, row-major).
        buf: the backend's buffer (a numpy array for host backends, a CuPy array, an OpenCL buffer...).
        owner: ``id`` of the backend that made it (ops refuse another backend's arrays).
        offset: element offset of this view into ``buf`` (0 unless the backend makes sub-views).
    """

    shape: tuple[int, ...]
    buf: Any
    owner: int
    offset: int = 0

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return 4 * self.size


def rope_table(inv_freq: np.ndarray, positions: int, attention_factor: float = 1.0,
               scaling_factor: float = 1.0) -> np.ndarray:
    """float32 [positions, len(inv_freq), 2]: (cos, sin) of (p / scaling_factor) · f_i, times the
    attention factor (1 unless YaRN), for p = 0..positions-1 — what ``d_rope`` reads."""
    pos = np.arange(int(positions), dtype=np.float32) / np.float32(scaling_factor)
    freqs = pos[:, None] * np.asarray(inv_freq, np.float32)[None, :]  # [P, rd/2]
    af = np.float32(attention_factor)
    return np.ascontiguousarray(np.stack([np.cos(freqs) * af, np.sin(freqs) * af], axis=-1), np.float32)


def rope_ref(x: np.ndarray, table: np.ndarray, pos0: int, rotary_dim: int, interleave: bool) -> np.ndarray:
    """Reference of ``d_rope``: x float32 [T, heads, d] -> rotated copy (see the module docstring)."""
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


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_keys: int, pos0: int, scale: float,
                  window: int = 0) -> np.ndarray:
    """Reference of ``d_attention`` in float64, cast to float32: q [T, Hq, d], k/v [C, Hkv, d] ->
    [T, Hq·d] (see the module docstring for the mask)."""
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


class DeviceOps:
    """The device-activation half of the backend contract (mixed into :class:`Backend`).

    Public ``d_*`` methods check their arguments and raise :class:`~colibri_plan.errors.InputError`
    (wrong shape, dtype, another backend's DArray, a row range outside the buffer); the ``_d_*`` hooks
    below are the numpy reference, overridden by device backends.
    """

    # ---- public, checked -------------------------------------------------------------------------
    def d_put(self, host: np.ndarray) -> DArray:
        """Copy a host array (converted to float32, C-contiguous) to the device."""
        a = np.ascontiguousarray(host, dtype=np.float32)
        return DArray(tuple(a.shape), self._d_put(a), id(self))

    def d_get(self, a: DArray) -> np.ndarray:
        """Host float32 copy of ``a`` with its shape."""
        self._d_check(a)
        return np.asarray(self._d_get(a), dtype=np.float32).reshape(a.shape)

    def d_zeros(self, shape: tuple[int, ...]) -> DArray:
        """A zero-filled device array (KV cache pages are made with it)."""
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise InputError(f"d_zeros: negative dimension in {shape}")
        return DArray(shape, self._d_zeros(shape), id(self))

    def d_view(self, a: DArray, shape: tuple[int, ...]) -> DArray:
        """The same buffer seen with another shape of the same size."""
        self._d_check(a)
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != a.size:
            raise InputError(f"d_view: cannot view {a.shape} as {shape}")
        return DArray(shape, a.buf, a.owner, a.offset)

    def d_matmul(self, x: DArray, w) -> DArray:
        """x [T, in] · Wᵀ -> [T, out]; ``w`` a DeviceWeight uploaded to this backend."""
        self._d_check(x, ndim=2)
        self._check_weight(w)
        if x.shape[1] != w.in_features:
            raise InputError(f"d_matmul: x is {x.shape}, the weight wants [T, {w.in_features}]")
        return DArray((x.shape[0], w.out_features), self._d_matmul(x, w), id(self))

    def d_matmul_many(self, x: DArray, ws) -> list[DArray]:
        """[x [T, in] · W_iᵀ -> [T, out_i] for each DeviceWeight in ``ws``]: matrices that read the same
        x (q/k/v, gate/up), which a GPU backend runs in one launch; by default a loop of ``d_matmul``."""
        self._d_check(x, ndim=2)
        ws = list(ws)
        for w in ws:
            self._check_weight(w)
            if x.shape[1] != w.in_features:
                raise InputError(f"d_matmul_many: x is {x.shape}, a weight wants [T, {w.in_features}]")
        me = id(self)
        return [DArray((x.shape[0], w.out_features), y, me) for w, y in zip(ws, self._d_matmul_many(x, ws))]

    def d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> DArray:
        """Row-wise RMSNorm of x [N, d] with weight [d]."""
        self._d_check(x, ndim=2)
        self._d_check(weight, ndim=1)
        if weight.shape[0] != x.shape[1]:
            raise InputError(f"d_rmsnorm: x {x.shape} with weight {weight.shape}")
        return DArray(x.shape, self._d_rmsnorm(x, weight, float(eps)), id(self))

    def d_add(self, a: DArray, b: DArray) -> DArray:
        """a [N, d] + b ([N, d], or [d] broadcast over the rows)."""
        self._d_check(a, ndim=2)
        self._d_check(b)
        if b.shape != a.shape and b.shape != (a.shape[1],):
            raise InputError(f"d_add: {a.shape} + {b.shape}")
        return DArray(a.shape, self._d_add(a, b), id(self))

    def d_silu_mul(self, g: DArray, u: DArray) -> DArray:
        """SiLU(g) · u, g and u [N, d]."""
        self._d_check(g, ndim=2)
        self._d_check(u, ndim=2)
        if g.shape != u.shape:
            raise InputError(f"d_silu_mul: {g.shape} vs {u.shape}")
        return DArray(g.shape, self._d_silu_mul(g, u), id(self))

    def d_scale_rows(self, a: DArray, s: np.ndarray) -> DArray:
        """a [N, d] with row i multiplied by the host scalar s[i] (float32 [N])."""
        self._d_check(a, ndim=2)
        s = np.ascontiguousarray(s, dtype=np.float32).reshape(-1)
        if s.shape[0] != a.shape[0]:
            raise InputError(f"d_scale_rows: {s.shape[0]} scales for {a.shape[0]} rows")
        return DArray(a.shape, self._d_scale_rows(a, s), id(self))

    def d_rope(self, x: DArray, table: DArray, pos0: int, rotary_dim: int, interleave: bool) -> DArray:
        """RoPE of x [T, heads, d] at positions pos0..pos0+T-1 from ``table`` [P, rotary_dim/2, 2]."""
        self._d_check(x, ndim=3)
        self._d_check(table, ndim=3)
        rd = int(rotary_dim)
        if rd % 2 or rd > x.shape[2] or table.shape[1:] != (rd // 2, 2):
            raise InputError(f"d_rope: rotary_dim {rd} with x {x.shape} and table {table.shape}")
        if pos0 < 0 or pos0 + x.shape[0] > table.shape[0]:
            raise InputError(f"d_rope: positions {pos0}..{pos0 + x.shape[0] - 1} outside the table's "
                             f"{table.shape[0]} positions")
        return DArray(x.shape, self._d_rope(x, table, int(pos0), rd, bool(interleave)), id(self))

    def d_write_rows(self, dst: DArray, row0: int, src: DArray, col0: int = 0) -> None:
        """dst[row0 : row0 + T] = src, in place; dst [C, ...], src [T, ...] with the same trailing shape.
        With ``col0`` (or a narrower src), a block: dst [C, D] and src [T, W] 2-D, and
        dst[row0 : row0 + T, col0 : col0 + W] = src (an MLA cache row is [k_rope | latent])."""
        self._d_check(dst)
        self._d_check(src)
        t = src.shape[0] if src.shape else 0
        block = col0 != 0 or dst.shape[1:] != src.shape[1:]
        if block and (len(dst.shape) != 2 or len(src.shape) != 2 or col0 < 0
                      or col0 + src.shape[1] > dst.shape[1]):
            raise InputError(f"d_write_rows: rows {row0}..{row0 + t - 1}, columns {col0}.. of {src.shape} "
                             f"do not fit {dst.shape}")
        if row0 < 0 or row0 + t > dst.shape[0]:
            raise InputError(f"d_write_rows: rows {row0}..{row0 + t - 1} of {src.shape} do not fit "
                             f"{dst.shape}")
        if block:
            self._d_write_block(dst, int(row0), int(col0), src)
        else:
            self._d_write_rows(dst, int(row0), src)

    def d_head_matmul(self, x: DArray, w: DArray) -> DArray:
        """Per-head matrices: y[t, b] = w[b] · x[t, b] for x [T, B, K] and w [B, N, K] (a float32 DArray,
        e.g. MLA's absorbed key and value projections per head) -> [T, B, N].

        Raises:
            InputError: not 3-D DArrays of this backend, or B / K that differ.
        """
        self._d_check(x, ndim=3)
        self._d_check(w, ndim=3)
        if w.shape[0] != x.shape[1] or w.shape[2] != x.shape[2]:
            raise InputError(f"d_head_matmul: x {x.shape} with per-head weights {w.shape}; want x [T, B, K] "
                             "and w [B, N, K]")
        return DArray((x.shape[0], x.shape[1], w.shape[1]), self._d_head_matmul(x, w), id(self))

    def d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                    window: int = 0) -> DArray:
        """Causal GQA attention of q [T, Hq, d] over the first ``n_keys`` rows of k, v [C, Hkv, d]."""
        for a in (q, k, v):
            self._d_check(a, ndim=3)
        t, hq, d = q.shape
        if k.shape != v.shape or k.shape[2] != d or hq % k.shape[1]:
            raise InputError(f"d_attention: q {q.shape}, k {k.shape}, v {v.shape}")
        if not (0 < n_keys <= k.shape[0] and 0 <= pos0 and pos0 + t <= n_keys):
            raise InputError(f"d_attention: {n_keys} keys for queries at {pos0}..{pos0 + t - 1} "
                             f"(cache of {k.shape[0]} rows)")
        if not math.isfinite(scale):
            raise InputError(f"d_attention: scale must be finite, got {scale!r}")
        return DArray((t, hq * d), self._d_attention(q, k, v, int(n_keys), int(pos0), float(scale),
                                                     max(0, int(window))), id(self))

    def d_expert_ffn(self, x: DArray, experts, gates) -> DArray:
        """Σ_i gates[i] · down_i(SiLU(x·gate_iᵀ) ⊙ x·up_iᵀ) -> [T, H]: x [T, H] (decode: T = 1), ``experts``
        a sequence of n ExpertWeights uploaded to this backend (gate/up [I, H], down [H, I]), ``gates``
        host float32 [n]. n = 0 gives zeros.

        Raises:
            InputError: x not a 2-D DArray of this backend, a weight of another backend or freed, shapes
            that do not chain with x, ``len(gates) != n`` or a gate that is not finite.
        """
        self._d_check(x, ndim=2)
        experts = list(experts)
        g = np.ascontiguousarray(gates, dtype=np.float32).reshape(-1)
        if g.shape[0] != len(experts):
            raise InputError(f"d_expert_ffn: {g.shape[0]} gates for {len(experts)} experts")
        if not np.isfinite(g).all():
            raise InputError(f"d_expert_ffn: gates must be finite, got {g.tolist()}")
        self._d_check_experts("d_expert_ffn", x, experts)
        if not experts:
            return self.d_zeros(x.shape)
        return DArray(x.shape, self._d_expert_ffn(x, experts, g), id(self))

    def _d_check_experts(self, op: str, x: DArray, experts: list) -> None:
        """InputError unless every weight of ``experts`` is this backend's and each expert chains with x
        [T, H]: gate/up [I, H], down [H, I]."""
        hidden = x.shape[1]
        for e in experts:
            for w in e:
                self._check_weight(w)
            if not (e.gate.in_features == e.up.in_features == e.down.out_features == hidden
                    and e.gate.out_features == e.up.out_features == e.down.in_features):
                raise InputError(f"{op}: x is {x.shape}; an expert's gate/up must be [I, {hidden}] "
                                 f"and down [{hidden}, I]")

    def _d_check(self, a: DArray, ndim: int | None = None) -> None:
        if not isinstance(a, DArray) or a.owner != id(self):
            raise InputError(f"{getattr(self, 'name', 'backend')}: expected a DArray of this backend, got "
                             f"{type(a).__name__}")
        if ndim is not None and len(a.shape) != ndim:
            raise InputError(f"expected a {ndim}-D device array, got shape {a.shape}")

    # ---- hooks: numpy reference (host backends) ---------------------------------------------------
    def _d_put(self, a: np.ndarray) -> Any:
        return a.copy()

    def _d_get(self, a: DArray) -> np.ndarray:
        return a.buf.reshape(a.shape)

    def _d_zeros(self, shape: tuple[int, ...]) -> Any:
        return np.zeros(shape, np.float32)

    def _host(self, a: DArray) -> np.ndarray:
        return a.buf.reshape(a.shape)

    def _d_matmul(self, x: DArray, w) -> Any:
        return self._matmul(np.ascontiguousarray(self._host(x)), w)

    def _d_matmul_many(self, x: DArray, ws: list) -> list:
        return [self._d_matmul(x, w) for w in ws]

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
        # [B, T, K] · [B, K, N] -> [B, T, N], back to token-major [T, B, N]
        y = np.matmul(self._host(x).transpose(1, 0, 2), self._host(w).transpose(0, 2, 1))
        return np.ascontiguousarray(y.transpose(1, 0, 2), dtype=np.float32)

    def _d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                     window: int) -> Any:
        return attention_ref(self._host(q), self._host(k), self._host(v), n_keys, pos0, scale, window)

    def _d_expert_ffn(self, x: DArray, experts: list, gates: np.ndarray) -> Any:
        # the host path: x down once, every expert on it, then the engine's float32 sum in its order
        xh = self.d_get(x)  # [T, H]
        ys = self.expert_ffn([xh] * len(experts), experts)  # n x [T, H]
        out = np.zeros(x.shape, np.float32)
        for y, g in zip(ys, gates):
            out += y * g  # float32 [T, H] · float32 scalar, as the engine's y · gates[:, None]
        return self._d_put(out)
