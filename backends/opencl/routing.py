"""The OpenCL backend's ``d_router_topk`` hook (``_d_route``): ``shaders/opencl/route.cl``, one token row per
work-item, on the router logits that ``d_matmul`` left in device memory; ids and weights stay there."""

from __future__ import annotations

from typing import Any

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.routing import check_kernel_limits


class OpenCLRouting:
    """The ``_d_route`` hook (:meth:`colibri_plan.backends.device_ops.DeviceOps.d_router_topk`).

    Args:
        backend: the open OpenCL backend; dops: its ``OpenCLDeviceOps`` (allocations from its pool).
    """

    HOOKS = ("_d_route",)

    def __init__(self, backend, dops):
        self.be, self._alloc = backend, dops._alloc

    def _d_route(self, logits: DArray, bias: DArray | None, rule, ints: tuple, floats: tuple
                 ) -> tuple[Any, Any, int]:
        check_kernel_limits(ints)
        T = logits.shape[0]
        e, k, softmax, has_bias, g, tg, gmax, norm = ints
        buf = self._alloc(8 * T * k)  # [ids | weights], [T, K] each: one copy brings both down
        if T:
            b = logits if bias is None else bias  # any buffer where there is no bias: never read
            self.be._kernel("route_topk", None)(self.be.queue, (T,), None, logits.buf, logits.offset, b.buf,
                                                b.offset, buf, buf, T * k, T, e, k, softmax, has_bias, g,
                                                tg, gmax, norm, *floats)
        return buf, buf, T * k
