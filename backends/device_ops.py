"""The checked device-activation half of the contract (:class:`DeviceOps`, the base of ``Backend``).

A device trunk keeps a model's residual stream on one device across layers as :class:`DArray` handles;
only what the host must see crosses. Each public ``d_*`` method checks shapes, dtypes and ownership once,
here, and calls a ``_d_*`` hook that a backend binds at open from its parts (driver calls only;
``reference.HostArrays`` on host arrays). Ops, shapes and dtypes: :mod:`colibri_plan.backends.contract`.
Two hooks have generic defaults: ``_d_matmul_many`` (a loop of ``_d_matmul``) and ``_d_expert_ffn`` (the
host path: x down once, ``expert_ffn``, the engine's float32 sum, the sum up), so every backend has them.

``DArray``, ``rope_table``, ``rope_ref`` and ``attention_ref`` are re-exported for existing importers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.reference import attention_ref, rope_ref, rope_table
from colibri_plan.errors import InputError, UnsupportedError

__all__ = ["DArray", "DeviceOps", "attention_ref", "rope_ref", "rope_table"]


class DeviceOps:
    """The checked ``d_*`` ops (base of :class:`~colibri_plan.backends.base.Backend`): each raises
    :class:`~colibri_plan.errors.InputError` on a wrong shape, dtype, another backend's DArray or a row
    range outside the buffer, then calls its ``_d_*`` hook."""

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

    def d_add_rmsnorm(self, a: DArray, b: DArray, weight: DArray, eps: float) -> tuple[DArray, DArray]:
        """The residual add and the next RMSNorm, a and b [N, d], weight [d]: (h = a + b, rmsnorm(h)), the
        bits of :meth:`d_add` then :meth:`d_rmsnorm`; one launch where the backend binds an
        ``_d_add_rmsnorm`` hook (CUDA), else those two ops."""
        fused = getattr(self, "_d_add_rmsnorm", None)
        if fused is None:
            h = self.d_add(a, b)
            return h, self.d_rmsnorm(h, weight, eps)
        self._d_check(a, ndim=2)
        self._d_check(b, ndim=2)
        self._d_check(weight, ndim=1)
        if b.shape != a.shape or weight.shape[0] != a.shape[1]:
            raise InputError(f"d_add_rmsnorm: {a.shape} + {b.shape} with weight {weight.shape}")
        h, y = fused(a, b, weight, float(eps))
        me = id(self)
        return DArray(a.shape, h, me), DArray(a.shape, y, me)

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

    def d_router_topk(self, x: DArray, w_router, bias: DArray | None, rule) -> tuple[DArray, DArray]:
        """The router GEMV and top-k rule of one MoE layer on the device (optional op: see ``supports``):
        x [T, H], ``w_router`` a DeviceWeight [E, H], ``bias`` a DArray [E] (e_score_correction_bias) or
        None, ``rule`` a :class:`~colibri_plan.backends.routing.RouteRule` -> (ids [T, K], weights [T, K]),
        both left on the device: ids' 4-byte elements are int32 expert ids in descending choice order
        (:meth:`d_get_ids` reads them), weights float32. The host rule is ``routing.route_ref``. Where the
        backend binds an ``_d_route_fused`` hook (CUDA, a decode token), GEMV and rule are one launch.

        Raises:
            InputError: wrong shapes, another backend's arrays, a rule that cannot choose K of E.
            UnsupportedError: the backend has no kernel, or the router is wider than its kernel takes.
        """
        ints, floats = self._d_router_check(x, w_router, bias, rule)
        fused = getattr(self, "_d_route_fused", None)
        got = None if fused is None else fused(x, w_router, bias, ints, floats)  # None: not this call
        if got is None:
            logits = DArray((x.shape[0], ints[0]), self._d_matmul(x, w_router), id(self))  # [T, E]
            # the hook's buffers; a GPU may pack both in one ([ids | weights], w_offset = T·K) for one copy
            got = self._d_route(logits, bias, rule, ints, floats)
        ids, weights, w_offset = got
        shape, me = (x.shape[0], rule.top_k), id(self)
        return DArray(shape, ids, me), DArray(shape, weights, me, w_offset)

    def _d_router_check(self, x: DArray, w_router, bias: DArray | None, rule) -> tuple[tuple, tuple]:
        """:meth:`d_router_topk`'s checks (its Raises); the kernels' scalars ``routing.kernel_params``."""
        from colibri_plan.backends.routing import kernel_params

        self._d_check(x, ndim=2)
        self._check_weight(w_router)
        e = w_router.out_features
        if x.shape[1] != w_router.in_features:
            raise InputError(f"d_router_topk: x is {x.shape}, the router wants [T, {w_router.in_features}]")
        if bias is not None:
            self._d_check(bias, ndim=1)
            if bias.shape[0] != e:
                raise InputError(f"d_router_topk: bias {bias.shape} for a router of {e} experts")
        rule.check(e)
        if not self.supports("d_router_topk"):
            raise UnsupportedError(f"{self.name}: d_router_topk has no kernel here (route on the host)")
        return kernel_params(rule, e, bias is not None)

    def d_get_ids(self, ids: DArray) -> np.ndarray:
        """Host int32 copy of a device ids array (``d_router_topk``'s first result), with its shape."""
        return self.d_get(ids).view(np.int32)

    def d_get_routing(self, ids: DArray, weights: DArray) -> tuple[np.ndarray, np.ndarray]:
        """``d_router_topk``'s (ids, weights) on the host: (int32 [T, K], float32 [T, K]), in one copy when
        the backend packed them back to back in one buffer (CUDA, OpenCL), else two."""
        self._d_check(ids, ndim=2)
        self._d_check(weights, ndim=2)
        if weights.buf is ids.buf and weights.offset == ids.offset + ids.size and ids.shape == weights.shape:
            both = self.d_get(DArray((2, *ids.shape), ids.buf, ids.owner, ids.offset))  # [2, T, K]
            return both[0].view(np.int32), both[1]
        return self.d_get_ids(ids), self.d_get(weights)

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

    # ---- generic hooks ----------------------------------------------------------------------------
    def _d_matmul_many(self, x: DArray, ws: list) -> list:
        return [self._d_matmul(x, w) for w in ws]

    def _d_expert_ffn(self, x: DArray, experts: list, gates: np.ndarray) -> Any:
        # the host path: x down once, every expert on it, then the engine's float32 sum in its order
        xh = self.d_get(x)  # [T, H]
        ys = self.expert_ffn([xh] * len(experts), experts)  # n x [T, H]
        out = np.zeros(x.shape, np.float32)
        for y, g in zip(ys, gates):
            out += y * g  # float32 [T, H] · float32 scalar, as the engine's y · gates[:, None]
        return self._d_put(out)
