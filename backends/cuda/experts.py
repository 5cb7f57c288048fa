"""Routed experts on the CUDA backend's device activations: :class:`CudaExperts`, the part whose hooks
``_d_expert_ffn`` (:mod:`colibri_plan.backends.device_ops`) and ``_d_expert_rows`` (the optional op
``CUDABackend.d_expert_ffn_rows``) :class:`~colibri_plan.backends.cuda.backend.CUDABackend` binds at open.

A device trunk's decode step hands the experts it holds in this GPU's VRAM the normed hidden state x
that is already there; they run on the backend's stream with no host staging of x and no host wait:

1. one small host-to-device copy (through ``d_put``'s pinned ring, asynchronous) of the launch table —
   the host path's layout (``CUDABackend._ffn_batch``): per expert a gate/up entry (gate W, S, up W,
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

A prefill (T > 1) routes each token to its own experts: ``d_expert_ffn_rows`` runs expert i on its rows
``rows[i]`` of the device x only (:func:`expert_rows_args` checks its arguments). gate_up's entries carry
those row indices (its 8th slot), so x is never gathered; an expert in mapped host memory with more
than 16 tokens is first copied to a VRAM work buffer (:meth:`CudaExperts._staged`); the down outputs of
all experts are consecutive rows, and ``tr_expert_scatter`` adds each token's gated rows in expert
order. With T > 1 the launcher picks the tensor-core kernels of ``shaders/cuda/prefill.cu`` (each
weight read once per 16 tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from colibri_plan.backends.batched import ffn_fusable, ffn_kind
from colibri_plan.backends.device_ops import DeviceOps
from colibri_plan.backends.handles import DArray, ExpertWeights
from colibri_plan.backends.staging import PaddedWeight
from colibri_plan.errors import InputError

#: a prefill expert in mapped host memory with more tokens than this is copied to VRAM first (its
#: weights would otherwise cross PCIe once per 16-token tile of the prefill kernels)
STAGE_MIN_TOKENS = 16
#: VRAM one call's copies may take (the rest read in place)
STAGE_MAX_BYTES = 256 << 20


def _one_kind(experts: list) -> bool:
    """Whether the fused kernels take every expert in one launch pair: one kind, gate and up alike."""
    kind = ffn_kind(experts[0])
    return ffn_fusable(experts[0]) and all(ffn_kind(e) == kind for e in experts[1:])


def _bad(rows: np.ndarray, gates: np.ndarray, T: int) -> bool:
    """Whether some row is outside [0, T) or some gate is not finite."""
    return bool(rows.size and (rows.min() < 0 or rows.max() >= T)) or not np.isfinite(gates).all()


def expert_rows_args(be, x: DArray, experts, rows, gates) -> tuple[list, list, list, bool]:
    """The checked arguments of ``d_expert_ffn_rows``: (the experts with rows, their rows int64, their
    gates float32, whether they run fused); raises its InputErrors (see there)."""
    be._d_check(x, ndim=2)
    experts, T = list(experts), x.shape[0]
    rows = [np.asarray(r, np.int64).reshape(-1) for r in rows]
    gates = [np.asarray(g, np.float32).reshape(-1) for g in gates]
    if not len(experts) == len(rows) == len(gates):
        raise InputError(f"d_expert_ffn_rows: {len(experts)} experts, {len(rows)} row lists and "
                         f"{len(gates)} gate lists; give one of each per expert")
    # checked on the concatenation first, not per expert: the prefill's hot path (32 experts a layer)
    if any(r.shape != g.shape for r, g in zip(rows, gates)) or rows and _bad(np.concatenate(rows),
                                                                              np.concatenate(gates), T):
        r, g = next((r, g) for r, g in zip(rows, gates) if r.shape != g.shape or _bad(r, g, T))
        raise InputError(f"d_expert_ffn_rows: rows {r.tolist()[:8]} with gates {g.tolist()[:8]}: "
                         f"each row in [0, {T}), one finite gate per row")
    be._d_check_experts("d_expert_ffn_rows", x, experts)
    keep = [i for i, r in enumerate(rows) if r.size]
    experts, rows, gates = [experts[i] for i in keep], [rows[i] for i in keep], [gates[i] for i in keep]
    return experts, rows, gates, bool(experts) and _one_kind(experts)


def ffn_table(experts: list, counts: list, starts: list, xs: list, h: int, y: int, idx: int = 0) -> list[int]:
    """matmul.cu's launch table of a batch of experts, 8 u64 per entry: per expert a gate/up entry (gate W,
    S, up W, S, x, h_i, T_i, its routed rows), then per expert a down entry (W, S, h_i, y_i, T_i). Expert
    i has ``counts[i]`` tokens whose rows of h (I_pad floats) and y (H floats) start at row ``starts[i]``
    of the buffers at ``h`` and ``y``; its x at address ``xs[i]``, all of it (``idx`` 0) or the int32 row
    indices at ``idx + 4·starts[i]`` (a prefill's routing)."""
    gu, dn = [], []
    for e, T, r, xp in zip(experts, counts, starts, xs):
        g, u, d = e.gate.payload, e.up.payload, e.down.payload
        hi = h + 4 * r * d.in_pad
        gu += (g.data, g.scales, u.data, u.scales, xp, hi, T, idx + 4 * r if idx else 0)
        dn += (d.data, d.scales, hi, y + 4 * r * e.down.out_features, T, 0, 0, 0)
    return gu + dn


class CudaExperts:
    """``_d_expert_ffn`` and ``_d_expert_rows`` on the device (module docstring).

    Args:
        backend: the open CUDA backend; dops: its :class:`~colibri_plan.backends.cuda.device.CudaDeviceOps`.
    """

    HOOKS = ("_d_expert_ffn", "_d_expert_rows")

    def __init__(self, backend, dops):
        self.be, self.d, self._launcher = backend, dops, backend._launcher

    def _d_expert_ffn(self, x: DArray, experts: list, gates: np.ndarray) -> Any:
        if not _one_kind(experts):
            return DeviceOps._d_expert_ffn(self.be, x, experts, gates)  # the contract's host path
        ops, (T, H), n = self.d, x.shape, len(experts)
        ops._d_go()
        xp, h, y = self._buffers(x, experts, n * T)  # h_i, y_i at rows i·T
        table = ffn_table(experts, [T] * n, [i * T for i in range(n)], [xp] * n, h, y)
        # [gate/up entries | down entries | gates (n float32)], one copy up; pool memory, reused only by
        # work queued after ours
        args = ops._d_put(np.concatenate((np.array(table, np.uint64).view(np.float32), gates)))
        self._launch(experts, args.data.ptr, T, H)
        n_out = T * H
        return ops._d_launch("tr_expert_sum", n_out, ops._blocks(n_out), 2, y, args.data.ptr + 128 * n, n_out,
                             n)

    def _d_expert_rows(self, x: DArray, experts: list, rows: list, gates: list) -> Any:
        ops, (T, H), n = self.d, x.shape, len(experts)
        counts = [len(r) for r in rows]
        offs = [0, *np.cumsum(counts).tolist()]  # expert i's rows of h / ys start at offs[i]
        total, cat = offs[-1], np.concatenate(rows)  # [sum T_i] all experts' token rows, expert by expert
        of = np.repeat(np.arange(n), counts)  # [sum T_i] the expert of each
        # [idx (int32) | pos [n, T] (token t's row in ys for expert i, or -1) | gates [n, T]], one copy up
        # (whole-array numpy: a prefill layer's 32 experts cost ~0.3 ms of Python a loop each)
        buf = np.zeros(total + 2 * n * T, np.float32)
        buf[:total].view(np.int32)[:] = cat
        pos = buf[total: total + n * T].view(np.int32).reshape(n, T)
        pos[:] = -1
        pos[of, cat] = np.arange(total, dtype=np.int32)
        buf[total + n * T:].reshape(n, T)[of, cat] = np.concatenate(gates)
        ops._d_go()
        routing = ops._d_put(buf)  # the table refers to idx by address
        rp = routing.data.ptr
        experts = self._staged(experts, counts)  # mapped experts read many times: a VRAM copy first
        xp, h, y = self._buffers(x, experts, total)  # expert i's h [T_i, Ip] and y [T_i, H] at row offs[i]
        args = ops._d_put(np.array(ffn_table(experts, counts, offs, [xp] * n, h, y, rp), np.uint64)
                          .view(np.float32))
        self._launch(experts, args.data.ptr, max(counts), H)
        n_out = T * H
        out = ops._d_launch("tr_expert_scatter", n_out, ops._blocks(n_out), 3, y,
                            rp + 4 * total, rp + 4 * (total + n * T), n_out, H, n)
        del routing, args  # pool memory: reused only by work queued after these launches
        return out

    def _staged(self, experts: list, counts: list) -> list:
        """``experts`` with each one held in mapped host memory (``upload_expert_mapped``) and more than
        :data:`STAGE_MIN_TOKENS` tokens replaced by a copy in a grow-only VRAM work buffer, copied on the
        stream (PCIe, asynchronous; up to :data:`STAGE_MAX_BYTES` a call, the rest read in place). The
        prefill kernels read an expert's weights once per 16 tokens: over PCIe that is many reads of
        what one copy brings up."""
        big = [i for i, (e, T) in enumerate(zip(experts, counts))
               if T > STAGE_MIN_TOKENS and e.gate.host_mapped and e.up.host_mapped and e.down.host_mapped]
        sizes = [sum(-(-w.payload.mem.size // 256) * 256 for w in experts[i]) for i in big]
        while big and sum(sizes) > STAGE_MAX_BYTES:
            big.pop(), sizes.pop()
        if not big:
            return experts
        be, out = self.be, list(experts)
        at = self.d._d_work("ex_stage", sum(sizes))
        for i in big:
            ws = []
            for w in experts[i]:
                pw, n = w.payload, w.payload.mem.size
                be.rt.memcpyAsync(at, pw.data, n, be.rt.memcpyHostToDevice, be.stream.ptr)
                copy = PaddedWeight(at, at + pw.scales - pw.data, pw.in_pad)  # the scales' offset kept
                ws.append(dataclasses.replace(w, payload=copy, host_mapped=False))
                at += -(-n // 256) * 256
            out[i] = ExpertWeights(*ws)
        return out

    def _buffers(self, x: DArray, experts: list, rows: int) -> tuple[int, int, int]:
        """Device addresses of x as rows of H_pad floats, and of grow-only h [rows, I_pad] and y [rows, H]
        work buffers of the stream (reused in stream order)."""
        ops, (T, H), e0 = self.d, x.shape, experts[0]
        Ip = e0.down.payload.in_pad
        xp = ops._d_padded(ops._ptr(x), T, H, e0.gate.payload.in_pad)  # [T, Hp]
        return xp, ops._d_work("ex_h", 4 * rows * Ip), ops._d_work("ex_y", 4 * rows * H)

    def _launch(self, experts: list, ap: int, T: int, H: int) -> None:
        """gate_up over every expert (the table at ``ap``), then mm over them (at ``ap + 64·n``): the host
        path's kernel instances and launch shapes for ``T`` tokens, grid (blocks, n experts)."""
        ops, e0, n = self.d, experts[0], len(experts)
        I, Hp, Ip = e0.gate.out_features, e0.gate.payload.in_pad, e0.down.payload.in_pad
        st = ops._dstate
        for (fn, (blocks, _), (block,), smem, scalars), name, off in (
                (self._launcher("gate_up", e0.gate.fmt, n, Ip, I, Hp, Ip, T), "gate_up", 0),
                (self._launcher("mm", e0.down.fmt, n, H, H, Ip, H, T), "mm", 64 * n)):
            k = st["launches"].get(id(fn)) or ops._d_kernel(name, fn)
            k(blocks, n, 1, block, smem, st["sptr"], ap + off, *scalars)
