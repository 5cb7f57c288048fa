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
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri_plan.backends.device_ops import DArray


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
