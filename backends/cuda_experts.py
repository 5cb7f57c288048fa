"""Routed experts on the CUDA backend's device activations: ``_d_expert_ffn`` of
:mod:`colibri_plan.backends.device_ops`, mixed into :class:`colibri_plan.backends.cuda.CUDABackend`.

A device trunk's decode step hands the experts it holds in this GPU's VRAM the normed hidden state x
that is already there; they run on the backend's stream with no host staging of x and no host wait:

1. one small host-to-device copy (through ``d_put``'s pinned ring, asynchronous) of the launch table —
   the host path's layout (:meth:`CUDABackend._ffn_batch`): per expert a gate/up entry (gate W, S, up W,
   S, x, h_i, T) then per expert a down entry (W, S, h_i, y_i, T) — followed by the float32 gates;
2. ``gate_up`` of ``shaders/cuda/matmul.cu`` over all experts (h_i = SiLU(x·gate_iᵀ) ⊙ x·up_iᵀ, [T, I_pad]
   each, zero in the padding), then ``mm`` (y_i = h_i·down_iᵀ, [T, H] each): the host path's kernel
   instances and launch shapes (``_launcher``), launched directly (``cuLaunchKernel``);
3. ``tr_expert_sum`` of ``shaders/cuda/trunk.cu``: y = Σ_i gates[i]·y_i into a fresh [T, H] array, in the
   host's order and float32 roundings.

x reads in place when its rows are ``H_pad`` floats at a 16-byte aligned address (every common hidden
size), else it is padded first (``_d_padded``). h and the y_i live in grow-only work buffers of the
stream (reused in stream order). Experts of mixed formats or shapes, or whose gate and up formats
differ, take the contract's host path. Not thread-safe, like the other device ops.

A prefill (T > 1) routes each token to its own experts: :meth:`CUDAExpertOps.d_expert_ffn_rows` runs
expert i on its rows ``rows[i]`` of the device x only. gate_up's entries carry those row indices (its
8th slot), so x is never gathered; the down outputs of all experts are consecutive rows, and
``tr_expert_scatter`` adds each token's gated rows in expert order. With T > 1 the launcher picks the
tensor-core kernels of ``shaders/cuda/prefill.cu`` (each weight read once per 16 tokens).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri_plan.backends.device_ops import DArray
from colibri_plan.errors import InputError


class CUDAExpertOps:
    """``_d_expert_ffn`` on the device (module docstring). Needs the device ops of
    :class:`~colibri_plan.backends.cuda_device.CUDADeviceOps` and the backend's ``_launcher``,
    ``_ffn_kind`` and ``_ffn_fusable``."""

    def _d_expert_ffn(self, x: DArray, experts: list, gates: np.ndarray) -> Any:
        e0 = experts[0]
        kind = self._ffn_kind(e0)
        if not self._ffn_fusable(e0) or any(self._ffn_kind(e) != kind for e in experts[1:]):
            return super()._d_expert_ffn(x, experts, gates)  # the contract's host path
        T, H = x.shape
        n, I, Hp, Ip = len(experts), e0.gate.out_features, e0.gate.payload.in_pad, e0.down.payload.in_pad
        self._d_go()
        st = self._dstate
        xp = self._d_padded(self._ptr(x), T, H, Hp)  # [T, Hp]
        h = self._d_work("ex_h", 4 * n * T * Ip)  # h_i [T, Ip] at h + 4·i·T·Ip
        y = self._d_work("ex_y", 4 * n * T * H)  # y_i [T, H] at y + 4·i·T·H: tr_expert_sum reads [n, T·H]
        gu, dn = [], []  # 8 u64 per entry; a down entry's rows / y stride 0: the launch's
        for i, e in enumerate(experts):
            g, u, d = e.gate.payload, e.up.payload, e.down.payload
            hi = h + 4 * i * T * Ip
            gu += (g.data, g.scales, u.data, u.scales, xp, hi, T, 0)
            dn += (d.data, d.scales, hi, y + 4 * i * T * H, T, 0, 0, 0)
        # [gate/up entries | down entries | gates (n float32)], one copy up; pool memory, reused only by
        # work queued after ours
        args = self._d_put(np.concatenate((np.array(gu + dn, np.uint64).view(np.float32), gates)))
        ap, sptr = args.data.ptr, st["sptr"]
        launches = ((self._launcher("gate_up", e0.gate.fmt, n, Ip, I, Hp, Ip, T), "gate_up", 0),
                    (self._launcher("mm", e0.down.fmt, n, H, H, Ip, H, T), "mm", 64 * n))
        for (fn, (blocks, _), (block,), smem, scalars), name, off in launches:
            k = st["launches"].get(id(fn)) or self._d_kernel(name, fn)
            k(blocks, n, 1, block, smem, sptr, ap + off, *scalars)  # grid (blocks, n experts)
        n_out = T * H
        return self._d_launch("tr_expert_sum", n_out, self._blocks(n_out), 2, y, ap + 128 * n, n_out, n)

    def d_expert_ffn_rows(self, x: DArray, experts, rows, gates) -> DArray:
        """Routed experts of a prefill on the device x: y [T, H] with y[t] = Σ_i gates[i][k] ·
        down_i(SiLU(x[t]·gate_iᵀ) ⊙ x[t]·up_iᵀ) over the experts i (in order) whose ``rows[i]`` holds t at
        position k. x a float32 [T, H] DArray of this backend; ``experts`` n ExpertWeights of this
        backend; ``rows`` n int arrays of distinct token indices in [0, T); ``gates`` n float32 arrays
        of the same lengths. Queued on the stream (no host wait); experts of mixed kinds run through
        the host (``expert_ffn`` on their gathered rows).

        Raises:
            InputError: x not a 2-D DArray of this backend, counts or lengths that do not match, a row
            outside [0, T), a gate that is not finite, or weights that do not chain with x.
        """
        self._d_check(x, ndim=2)
        experts, T, H = list(experts), x.shape[0], x.shape[1]
        rows = [np.asarray(r, np.int64).reshape(-1) for r in rows]
        gates = [np.asarray(g, np.float32).reshape(-1) for g in gates]
        if not len(experts) == len(rows) == len(gates):
            raise InputError(f"d_expert_ffn_rows: {len(experts)} experts, {len(rows)} row lists and "
                             f"{len(gates)} gate lists; give one of each per expert")
        for r, g in zip(rows, gates):
            if r.shape != g.shape or (r.size and (r.min() < 0 or r.max() >= T)) or not np.isfinite(g).all():
                raise InputError(f"d_expert_ffn_rows: rows {r.tolist()[:8]} with gates {g.tolist()[:8]}: "
                                 f"each row in [0, {T}), one finite gate per row")
        self._d_check_experts("d_expert_ffn_rows", x, experts)
        keep = [i for i, r in enumerate(rows) if r.size]
        if not keep:
            return self.d_zeros((T, H))
        experts, rows, gates = [experts[i] for i in keep], [rows[i] for i in keep], [gates[i] for i in keep]
        kind = self._ffn_kind(experts[0])
        if not self._ffn_fusable(experts[0]) or any(self._ffn_kind(e) != kind for e in experts[1:]):
            xh = self.d_get(x)  # mixed kinds: the host path on each expert's rows, summed in order
            out = np.zeros((T, H), np.float32)
            for r, g, y in zip(rows, gates, self.expert_ffn([xh[r] for r in rows], experts)):
                out[r] += y * g[:, None]
            return self.d_put(out)
        return DArray((T, H), self._d_expert_rows(x, experts, rows, gates), id(self))

    def _d_expert_rows(self, x: DArray, experts: list, rows: list, gates: list) -> Any:
        T, H = x.shape
        e0 = experts[0]
        n, I, Hp, Ip = len(experts), e0.gate.out_features, e0.gate.payload.in_pad, e0.down.payload.in_pad
        counts = [len(r) for r in rows]
        offs = np.concatenate(([0], np.cumsum(counts)))  # expert i's rows of h / ys start at offs[i]
        pos = np.full((n, T), -1, np.int32)  # [n, T]: token t's row in ys for expert i, or -1
        gmat = np.zeros((n, T), np.float32)
        for i, (r, g) in enumerate(zip(rows, gates)):
            pos[i, r] = offs[i] + np.arange(len(r))
            gmat[i, r] = g
        self._d_go()
        st = self._dstate
        # [idx (all experts' rows, int32) | pos | gates], one copy up; the table refers to idx by address
        routing = self._d_put(np.concatenate((np.concatenate(rows).astype(np.int32).view(np.float32),
                                              pos.reshape(-1).view(np.float32), gmat.reshape(-1))))
        rp = routing.data.ptr
        xp = self._d_padded(self._ptr(x), T, H, Hp)  # [T, Hp]
        h = self._d_work("ex_h", 4 * int(offs[-1]) * Ip)  # expert i's h [T_i, Ip] at row offs[i]
        y = self._d_work("ex_y", 4 * int(offs[-1]) * H)  # expert i's y [T_i, H] at row offs[i]
        gu, dn = [], []
        for i, e in enumerate(experts):
            g, u, d = e.gate.payload, e.up.payload, e.down.payload
            hi, o = h + 4 * int(offs[i]) * Ip, int(offs[i])
            gu += (g.data, g.scales, u.data, u.scales, xp, hi, counts[i], rp + 4 * o)
            dn += (d.data, d.scales, hi, y + 4 * o * H, counts[i], 0, 0, 0)
        args = self._d_put(np.array(gu + dn, np.uint64).view(np.float32))
        ap, sptr, Tm = args.data.ptr, st["sptr"], max(counts)
        launches = ((self._launcher("gate_up", e0.gate.fmt, n, Ip, I, Hp, Ip, Tm), "gate_up", 0),
                    (self._launcher("mm", e0.down.fmt, n, H, H, Ip, H, Tm), "mm", 64 * n))
        for (fn, (blocks, _), (block,), smem, scalars), name, off in launches:
            k = st["launches"].get(id(fn)) or self._d_kernel(name, fn)
            k(blocks, n, 1, block, smem, sptr, ap + off, *scalars)  # grid (blocks, n experts)
        total = int(offs[-1])
        n_out = T * H
        out = self._d_launch("tr_expert_scatter", n_out, self._blocks(n_out), 3, y,
                             rp + 4 * total, rp + 4 * (total + n * T), n_out, H, n)
        del routing, args  # pool memory: reused only by work queued after these launches
        return out
