"""The CUDA backend's ``d_router_topk`` hook (``_d_route``): ``shaders/cuda/route.cu``'s ``route_topk``, one
token row per warp (a block of ``ROUTE_THREADS``: one warp, one row), its lanes sharing the row's experts,
on the router logits that ``d_matmul`` left in device memory; ids and weights are fresh pool arrays of the
stream. One direct ``cuLaunchKernel`` (the device ops' :class:`_Launch`), no host wait: a decode step's
routing is two launches (the router GEMV, this) and nothing comes down."""

from __future__ import annotations

from typing import Any

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.routing import check_kernel_limits

ROUTE_THREADS = 32  # threads per block: one warp, one token row (route.cu: a multiple of 32, at most
# 32 * ROUTE_WARPS); a thread per row made a decode step's top-k 28 us of serial latency on an H200
# (bench/cuda_step_profile.py), a block with lane-0 reductions 14.5 us (bench/results/h200-step-profile)
ROUTE_MAX_BLOCKS = 65535  # rows beyond are grid-strided


class CudaRouting:
    """The ``_d_route`` hook (:meth:`colibri_plan.backends.device_ops.DeviceOps.d_router_topk`).

    Args:
        dops: the backend's :class:`~colibri_plan.backends.cuda.device.CudaDeviceOps` (stream, pool,
            launches).
    """

    HOOKS = ("_d_route",)

    def __init__(self, dops):
        self.d = dops

    def _d_route(self, logits: DArray, bias: DArray | None, rule, ints: tuple, floats: tuple
                 ) -> tuple[Any, Any, int]:
        check_kernel_limits(ints)
        d, T = self.d, logits.shape[0]
        e, k, softmax, _, g, tg, gmax, norm = ints  # a null bias pointer says "no bias"
        d._d_go()
        st = d._dstate
        # [ids | weights], [T, K] each: one copy brings both down (a captured step's: all layers' in one)
        cap = d.graph
        buf = cap.take(2 * T * k) if cap is not None and hasattr(cap, "take") else None
        buf = buf or d._d_empty(2 * T * k)
        if T:
            launch = st["launches"].get("route_topk") or d._d_kernel("route_topk")
            launch(min(T, ROUTE_MAX_BLOCKS), 1, 1, ROUTE_THREADS, 0, st["sptr"], d._ptr(logits),
                   0 if bias is None else d._ptr(bias), buf.data.ptr, buf.data.ptr + 4 * T * k, T, e, k,
                   softmax, g, tg, gmax, norm, *floats)
        return buf, buf, T * k
