"""Routed experts on the Vulkan backend's device activations: ``_d_expert_ffn`` of
:mod:`colibri_plan.backends.device_ops`, mixed into :class:`colibri_plan.backends.vulkan.VulkanBackend`.

A device trunk's decode step hands the experts it holds on this device the normed hidden state x that
is already there; they run inside the open batch (``vulkan_device``: recorded into its command buffer,
no submission and no fence wait of their own):

1. x as ``matmul.comp`` reads it: rows of ``H_pad`` floats (op 5 of ``elementwise.comp`` pads it when
   H is not a multiple of 128). Decode (T = 1): every expert reads that one row (activation stride 0);
   a prefill (T > 1): one copy command with a region per expert repeats x [T, H_pad] n times, since the
   shader gives expert i the rows ``tok[i] .. tok[i+1]-1`` of x and of its output alike;
2. the host path's pipelines (``VulkanBackend._ffn_batch``): ``matmul.comp`` MODE 1 over up to MAXE
   experts per dispatch (h_i = SiLU(x·gate_iᵀ) ⊙ x·up_iᵀ, [T, I_pad] each, zero in the padding), then
   MODE 0 (y_i = h_i·down_iᵀ, [T, H] each), with the same specialisation constants, so each y_i is the
   host path's bit for bit;
3. op 6 of ``elementwise.comp``: y = 0 + g_0·y_0 + g_1·y_1 + ... into a fresh [T, H] array, float32
   products and sums in the host combine's order (``precise``: never fused); the gates ride in the
   command buffer as ``d_put`` sends small host data.

Experts of mixed formats or shapes, or that the fused pipelines cannot take (a weight split over
several buffers, gate and up formats that differ), take the contract's host path.

``d_matmul_many`` stays the contract's loop of ``d_matmul`` (one recorded dispatch each, no submission):
``matmul.comp``'s table of matrices shares one format, one row count and one output buffer whose rows
are the x rows, while q/k/v differ in height (and may in format) and each result must be its own
buffer, so one dispatch would cost a copy per result, more than the dispatches it saves.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri_plan.backends import vulkan_util as vu
from colibri_plan.backends.device_ops import DArray
from colibri_plan.backends.vulkan_device import EW_GATED_SUM, EW_PAD, VkArray


class VulkanExpertOps:
    """``_d_expert_ffn`` on the device (module docstring). Needs the batch of
    :class:`~colibri_plan.backends.vulkan_device.VulkanDeviceOps` (``_cb``, ``_take``, ``_ew``,
    ``_op_done``, ``_d_put``) and the backend's ``_ffn_kind``, ``_ffn_fusable`` and ``_nt``."""

    def _d_expert_ffn(self, x: DArray, experts: list, gates: np.ndarray) -> Any:
        e0 = experts[0]
        kind = self._ffn_kind(e0)
        if any(self._ffn_kind(e) != kind or not self._ffn_fusable(e) for e in experts):
            return super()._d_expert_ffn(x, experts, gates)  # the contract's host path
        (T, H), n = x.shape, len(experts)
        g0, d0 = e0.gate.payload, e0.down.payload
        I, Hp, Ip = e0.gate.out_features, g0.in_pad, d0.in_pad
        xh = x.buf if H == Hp else self._ew(EW_PAD, [x.buf], T * Hp, Hp, H)  # [T, Hp]
        xstride = 0  # decode: every expert reads x's one row
        if T > 1:
            xh, xstride = self._repeat_rows(xh, n, 4 * T * Hp), Hp // 4  # [n·T, Hp]
        tok = [i * T for i in range(n + 1)]  # expert i owns rows i·T .. i·T + T-1 of h and y
        hb = self._take(4 * n * T * Ip)  # h_i [T, Ip] at row i·T
        if Ip != I:  # down reads all Ip columns: the padding must be zeros, not a pooled buffer's floats
            self.vk.lib.vkCmdFillBuffer(self._cb(hb), hb.b.buf, 0, hb.b.size, 0)
            self._op_done()
        yb = self._take(4 * n * T * H)  # y_i [T, H] at row i·T: the gated sum reads [n, T·H]
        nt = self._nt([T])  # the host path's pipelines: the same sums
        gate_up = self._d.pipeline("matmul", (vu.WG, g0.code, g0.group, nt, vu.ROWS, 1))
        down = self._d.pipeline("matmul", (vu.WG, d0.code, d0.group, nt, vu.ROWS, 0))
        for c in range(0, n, vu.MAXE):  # one dispatch per MAXE experts (the shader's descriptor arrays)
            sub, t = experts[c:c + vu.MAXE], tok[c:c + vu.MAXE + 1]
            t = t + [t[-1]] * (vu.MAXE + 1 - len(t))
            pc = [g0.nchunk, I, xstride, Ip, 0, g0.parts[0].soff, g0.nscale, *t]
            self._dispatch_ab(gate_up, [e.gate.payload.parts[0].b for e in sub],
                              [e.up.payload.parts[0].b for e in sub], xh, hb, pc, -(-I // vu.ROWS), len(sub))
        for c in range(0, n, vu.MAXE):
            sub, t = experts[c:c + vu.MAXE], tok[c:c + vu.MAXE + 1]
            t = t + [t[-1]] * (vu.MAXE + 1 - len(t))
            downs = [e.down.payload.parts[0].b for e in sub]
            pc = [d0.nchunk, H, Ip // 4, H, 0, d0.parts[0].soff, d0.nscale, *t]
            self._dispatch_ab(down, downs, downs, hb, yb, pc, -(-H // vu.ROWS), len(sub))
        gb = self._d_put(np.ascontiguousarray(gates, np.float32))  # [n], recorded into the batch
        return self._ew(EW_GATED_SUM, [yb, gb], T * H, H, n)  # [T, H]

    def _repeat_rows(self, src: VkArray, n: int, nbytes: int) -> VkArray:
        """A new array holding ``n`` copies of the first ``nbytes`` of ``src``, one after another: one
        copy command with n regions, recorded into the batch."""
        out = self._take(n * nbytes)
        regions = self.vk.ffi.new("VkBufferCopy[]", [(0, i * nbytes, nbytes) for i in range(n)])
        cb = self._cb(src, out)
        self._d.barrier(cb)  # src's writes (d_put's update, the padded copy) -> this copy
        self.vk.lib.vkCmdCopyBuffer(cb, src.b.buf, out.b.buf, n, regions)
        self._op_done()
        return out

    def _dispatch_ab(self, pipe, a: list, b: list, x: VkArray, out: VkArray, pc: list[int], gx: int,
                     gy: int) -> None:
        """Record a barrier and one ``matmul.comp`` dispatch: weight buffer records ``a`` (binding 0) and
        ``b`` (binding 1; ``b is a`` for MODE 0), ``x`` at binding 2, ``out`` at binding 3."""
        cb, d = self._cb(x, out), self._d
        same = b is a
        a = a + [a[0]] * (d.maxe - len(a))  # spare slots repeat the first
        b = a if same else b + [b[0]] * (d.maxe - len(b))
        d.barrier(cb)  # earlier ops' writes -> this dispatch's reads
        d.dispatch(cb, pipe, a, b, x.b, out.b, pc, (gx, gy, 1), self._batch.sets, self._cmds.drop)
        self._op_done()
