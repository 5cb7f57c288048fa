"""Routed experts on the Vulkan backend's device activations: :class:`VulkanExperts`, the part whose
``_d_expert_ffn`` hook (:mod:`colibri_plan.backends.device_ops`)
:class:`~colibri_plan.backends.vulkan.backend.VulkanBackend` binds at open.

A device trunk's decode step hands the experts it holds on this device the normed hidden state x that
is already there; they run inside the open batch (``batch.Batch``: recorded into its command buffer,
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

from colibri_plan.backends.batched import ffn_kind
from colibri_plan.backends.device_ops import DeviceOps
from colibri_plan.backends.handles import DArray
from colibri_plan.backends.vulkan import util as vu
from colibri_plan.backends.vulkan.device import EW_GATED_SUM, EW_PAD


def ffn_steps(d, ps: list, tok: list, nt: int, xstride: int, I: int, H: int, Ip: int) -> tuple[list, list]:
    """The matmul.comp dispatches of a batch of experts of one kind on Device ``d``, as lists of (pipeline,
    A buffers, B buffers, push constants, groups x, groups y), MAXE experts each: the gate/up ones
    (h_i = SiLU(x·gate_iᵀ) ⊙ x·up_iᵀ, MODE 1), then the down ones (y_i = h_i·down_iᵀ, MODE 0). ``ps``:
    the experts' (gate, up, down) payloads; expert i owns rows tok[i] .. tok[i+1]-1 of x, h and y; x rows
    ``xstride`` vec4s apart (0: one row for all)."""
    g0, d0 = ps[0][0], ps[0][2]
    gate_up = d.pipeline("matmul", (vu.WG, g0.code, g0.group, nt, vu.ROWS, 1))
    down = d.pipeline("matmul", (vu.WG, d0.code, d0.group, nt, vu.ROWS, 0))
    first, second = [], []
    for c in range(0, len(ps), vu.MAXE):  # one dispatch per MAXE experts (the shader's descriptor arrays)
        sub, t = ps[c:c + vu.MAXE], tok[c:c + vu.MAXE + 1]
        t = t + [t[-1]] * (vu.MAXE + 1 - len(t))
        pc = [g0.nchunk, I, xstride, Ip, 0, g0.parts[0].soff, g0.nscale, *t]
        first.append((gate_up, [p[0].parts[0].b for p in sub], [p[1].parts[0].b for p in sub], pc,
                      -(-I // vu.ROWS), len(sub)))
        downs = [p[2].parts[0].b for p in sub]
        second.append((down, downs, downs, [d0.nchunk, H, Ip // 4, H, 0, d0.parts[0].soff, d0.nscale, *t],
                       -(-H // vu.ROWS), len(sub)))
    return first, second


class VulkanExperts:
    """``_d_expert_ffn`` on the device (module docstring).

    Args:
        backend: the open Vulkan backend; dops: its :class:`~.device.VulkanDeviceOps` (batch, ``_ew``).
    """

    HOOKS = ("_d_expert_ffn",)

    def __init__(self, backend, dops):
        self.be, self.d, self.batch, self._fusable = backend, dops, dops.batch, backend._ffn_fusable

    def _d_expert_ffn(self, x: DArray, experts: list, gates: np.ndarray) -> Any:
        e0 = experts[0]
        kind = ffn_kind(e0)
        if any(ffn_kind(e) != kind or not self._fusable(e) for e in experts):
            return DeviceOps._d_expert_ffn(self.be, x, experts, gates)  # the contract's host path
        (T, H), n, batch = x.shape, len(experts), self.batch
        I, Hp, Ip = e0.gate.out_features, e0.gate.payload.in_pad, e0.down.payload.in_pad
        xh = x.buf if H == Hp else self.d._ew(EW_PAD, [x.buf], T * Hp, Hp, H)  # [T, Hp]
        xstride = 0  # decode: every expert reads x's one row
        if T > 1:  # one copy command, a region per expert: n copies of x [T, Hp], one after another
            nb = 4 * T * Hp
            xh, src, xstride = batch.take(n * nb), xh, Hp // 4  # [n·T, Hp]
            batch.copy(src, xh, [(0, i * nb, nb) for i in range(n)])
        hb = batch.take(4 * n * T * Ip)  # h_i [T, Ip] at row i·T
        if Ip != I:  # down reads all Ip columns: the padding must be zeros, not a pooled buffer's floats
            self.be.vk.lib.vkCmdFillBuffer(batch.cb(hb), hb.b.buf, 0, hb.b.size, 0)
            batch.op_done()
        yb = batch.take(4 * n * T * H)  # y_i [T, H] at row i·T: the gated sum reads [n, T·H]
        ps = [(e.gate.payload, e.up.payload, e.down.payload) for e in experts]
        # the host path's pipelines (the same sums); expert i owns rows i·T .. i·T + T-1 of h and y
        gate_up, down = ffn_steps(self.be._d, ps, [i * T for i in range(n + 1)], self.be._nt([T]), xstride,
                                  I, H, Ip)
        for pipe, a, b, pc, gx, gy in gate_up:
            batch.dispatch(pipe, a, hb, pc, gx, gy, x=xh, b=b)
        for pipe, a, b, pc, gx, gy in down:
            batch.dispatch(pipe, a, yb, pc, gx, gy, x=hb, b=b)
        gb = self.d._d_put(np.ascontiguousarray(gates, np.float32))  # [n], recorded into the batch
        return self.d._ew(EW_GATED_SUM, [yb, gb], T * H, H, n)  # [T, H]
