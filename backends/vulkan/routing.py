"""The Vulkan backend's ``d_router_topk`` hook (``_d_route``): ``shaders/vulkan/route.comp``, one token row
per invocation, on the router logits that ``d_matmul`` left in device memory; one dispatch writes the ids
(at the x binding) and the weights (at y), both fresh arrays that stay on the device."""

from __future__ import annotations

import numpy as np

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.routing import check_kernel_limits
from colibri_plan.backends.vulkan.batch import VkArray

ROUTE_WG = 64  # invocations per workgroup (token rows)


class VulkanRouting:
    """The ``_d_route`` hook (:meth:`colibri_plan.backends.device_ops.DeviceOps.d_router_topk`).

    Args:
        backend: the open Vulkan backend; batch: its :class:`~.batch.Batch`.
    """

    HOOKS = ("_d_route",)

    def __init__(self, backend, batch):
        self._d, self.batch = backend._d, batch

    def _d_route(self, logits: DArray, bias: DArray | None, rule, ints: tuple, floats: tuple
                 ) -> tuple[VkArray, VkArray, int]:
        check_kernel_limits(ints)
        T = logits.shape[0]
        e, k, softmax, has_bias, g, tg, gmax, norm = ints
        ids, w = self.batch.take(4 * T * k), self.batch.take(4 * T * k)  # [T, K] each
        if T:
            bits = [int(np.float32(f).view(np.uint32)) for f in floats]  # eps, scale as their bits
            pc = [T, e, k, softmax, has_bias, g, tg, gmax, norm, *bits]
            ins = [logits.buf, logits.buf if bias is None else bias.buf]  # no bias: never read
            self.batch.dispatch(self._d.pipeline("route", (ROUTE_WG,)), ins, w, pc, -(-T // ROUTE_WG), x=ids)
        return ids, w, 0  # two arrays: Vulkan's ops read every DArray from offset 0
