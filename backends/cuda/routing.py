"""The CUDA backend's ``d_router_topk`` hooks: ``_d_route``, ``shaders/cuda/route.cu``'s ``route_topk``, one
token row per warp (a block of ``ROUTE_THREADS``: one warp, one row), its lanes sharing the row's experts,
on the router logits that ``d_matmul`` left in device memory; and, for a decode token (T = 1) of an f32
router, ``_d_route_fused``: ``shaders/cuda/route_fused.cu``'s ``route_fused``, GEMV and rule in one launch
(logits, ids and weights with the bits of the two launches: the same GEMV and rule code), which in a
captured step also writes the expert kernels' launch table (``backends/cuda/graph.py``
``d_router_indexed``: the layer's routing is one launch, not mm_args, route_topk and tr_expert_table).
ids and weights are fresh pool arrays of the stream. One direct ``cuLaunchKernel`` (the device ops'
:class:`_Launch`) each, no host wait. ``COLIBRI_CUDA_FUSED_ROUTE=0`` (or :data:`FUSED` False) keeps the
separate launches (the before/after of a benchmark)."""

from __future__ import annotations

import os
from typing import Any

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.routing import check_kernel_limits

ROUTE_THREADS = 32  # threads per block: one warp, one token row (route.cu: a multiple of 32, at most
# 32 * ROUTE_WARPS); a thread per row made a decode step's top-k 28 us of serial latency on an H200
# (bench/cuda_step_profile.py), a block with lane-0 reductions 14.5 us (bench/results/h200-step-profile)
ROUTE_MAX_BLOCKS = 65535  # rows beyond are grid-strided

#: route_fused for decode tokens (read at call time; benchmarks and tests set it)
FUSED = os.environ.get("COLIBRI_CUDA_FUSED_ROUTE", "1").strip() != "0"
# route_fused's blocks: 8 warps as the f32 GEMV's (launch.py _WARPS), sized for FUSED_ROWS_PER_WARP router
# rows a warp, so a 128-row router streams on 16 SMs as mm_args does (one block would be bound by one SM's
# ~64 bytes a clock: 1 MB in ~8 us)
FUSED_THREADS = 256
FUSED_ROWS_PER_WARP = 1
# x [in_pad] floats in dynamic shared memory: with route_fused's 6.6 KB of static arrays, under the 48 KiB a
# block gets without opting in (wider routers take the two launches)
FUSED_MAX_IN = 10240
FUSED_MAX_K_TABLE = 32  # trunk.cu tr_expert_table's (route_fused writes the table a lane a choice)


def fused_blocks(n_experts: int) -> int:
    """Blocks of a ``route_fused`` launch for a router of ``n_experts`` rows."""
    return max(1, min(-(-n_experts // (FUSED_THREADS // 32 * FUSED_ROWS_PER_WARP)), ROUTE_MAX_BLOCKS))


def _route_buffer(d, n: int):
    """n floats for a routing's [ids | weights]: inside a captured step (graph.py) cut from the step's
    route region, back to back with the other layers' (one copy down), else a pool array."""
    cap = d.graph
    buf = cap.take(n) if cap is not None and hasattr(cap, "take") else None
    return buf or d._d_empty(n)


class CudaRouting:
    """The ``_d_route`` and ``_d_route_fused`` hooks (:meth:`colibri_plan.backends.device_ops.DeviceOps.
    d_router_topk`).

    Args:
        dops: the backend's :class:`~colibri_plan.backends.cuda.device.CudaDeviceOps` (stream, pool,
            launches).
    """

    HOOKS = ("_d_route", "_d_route_fused")

    def __init__(self, dops):
        self.d = dops
        self._count = None  # route_fused's count of finished blocks (int32 0 between launches)

    def _d_route(self, logits: DArray, bias: DArray | None, rule, ints: tuple, floats: tuple
                 ) -> tuple[Any, Any, int]:
        check_kernel_limits(ints)
        d, T = self.d, logits.shape[0]
        e, k, softmax, _, g, tg, gmax, norm = ints  # a null bias pointer says "no bias"
        d._d_go()
        st = d._dstate
        # [ids | weights], [T, K] each: one copy brings both down
        buf = _route_buffer(d, 2 * T * k)
        if T:
            launch = st["launches"].get("route_topk") or d._d_kernel("route_topk")
            launch(min(T, ROUTE_MAX_BLOCKS), 1, 1, ROUTE_THREADS, 0, st["sptr"], d._ptr(logits),
                   0 if bias is None else d._ptr(bias), buf.data.ptr, buf.data.ptr + 4 * T * k, T, e, k,
                   softmax, g, tg, gmax, norm, *floats)
        return buf, buf, T * k

    def _d_route_fused(self, x: DArray, w, bias: DArray | None, ints: tuple, floats: tuple,
                       table: tuple | None = None) -> tuple[Any, Any, int] | None:
        """GEMV and rule of one decode token x [1, H] (checked by ``d_router_topk``) in one launch:
        ``_d_route``'s (buffer [ids | weights], the same buffer, K; the logits in a buffer apart), or None
        when route_fused does not take this call (:data:`FUSED` off, T != 1, a router not f32 or wider than
        :data:`FUSED_MAX_IN`). ``table``: (experts, out, xe, h, y, h_row_bytes, y_row_bytes), device
        addresses and byte strides of tr_expert_table's arguments: the launch table is written too."""
        if not FUSED or x.shape[0] != 1 or w.fmt != "f32" or w.payload.in_pad > FUSED_MAX_IN:
            return None
        check_kernel_limits(ints)
        d, H, in_pad = self.d, x.shape[1], w.payload.in_pad
        e, k, softmax, _, g, tg, gmax, norm = ints
        if table is not None and k > FUSED_MAX_K_TABLE:
            return None
        d._d_go()
        st = d._dstate
        count = self._count
        if count is None:  # int32 0; inside a capture a memset of the graph's own, not kept (its pool's)
            count = d._d_zeros((1,))
            if d.graph is None:
                self._count = count
        # [ids | weights] as _d_route's, the logits [E] apart
        buf, logits = _route_buffer(d, 2 * k), d._d_empty(e)
        bp = buf.data.ptr
        launch = st["launches"].get("route_fused") or d._d_kernel("route_fused")
        launch(fused_blocks(e), 1, 1, FUSED_THREADS, 4 * in_pad, st["sptr"], w.payload.data, d._ptr(x),
               0 if bias is None else d._ptr(bias), logits.data.ptr, count.data.ptr, bp, bp + 4 * k,
               *(table or (0,) * 7), e, H, in_pad, k, softmax, g, tg, gmax, norm, *floats)
        return buf, buf, k
