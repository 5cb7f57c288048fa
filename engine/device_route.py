"""Routing on the trunk's device (issue 25, Build 1): each MoE layer's router GEMV and top-k rule run as the
backend's ``d_router_topk`` on the device x, so a decode step no longer brings x down for the host's
router; only the ids and weights come down ([T, K] each: one small copy on CUDA and OpenCL, which pack
them in one buffer, two on Vulkan), and x only when some chosen experts live off this device (the host
part then runs as before).

Used by :class:`~colibri_plan.engine.trunk.Trunk` on a GPU backend that declares the op, with a residency
manager holding experts on that backend; off with ``COLIBRI_DEVICE_ROUTING=0`` (the host rule then runs,
as before), and never on the host backends (there the host rule is the same code without copies).

The routers go up as f32 matrices and their biases as device vectors: E·H·4 bytes per MoE layer
(:attr:`DeviceRouter.nbytes`, not counted in the trunk's ``dense_bytes``, which the planner prices).
Token-exactness: the device's logits and float32 sums round in another order than the host's, so a
routing can differ only where two choice scores are within float32 rounding of each other.
"""

from __future__ import annotations

import os

import numpy as np

from colibri_plan.backends import HOST_BACKENDS
from colibri_plan.backends.routing import MAX_EXPERTS, MAX_GROUPS, MAX_TOP_K, RouteRule
from colibri_plan.errors import ColibriError
from colibri_plan.quant import quantize

#: environment switch: "0" keeps routing on the host (the before/after of bench/h200_gpuroute.sh)
ENV = "COLIBRI_DEVICE_ROUTING"


def device_routing_off_reason(backend, arch) -> str | None:
    """Why the trunk on ``backend`` routes on the host, or None when it routes on the device."""
    if os.environ.get(ENV, "1").strip() == "0":
        return f"{ENV}=0"
    name = getattr(backend, "name", "")
    if name in HOST_BACKENDS:
        return f"{name} is a host backend: the host rule runs there without copies"
    if not backend.supports("d_router_topk"):
        return f"{name} declares no d_router_topk kernel"
    if arch.n_experts > MAX_EXPERTS or arch.n_group > MAX_GROUPS or arch.top_k > MAX_TOP_K:
        return (f"{arch.n_experts} experts / {arch.n_group} groups / top-{arch.top_k} exceed the device "
                f"kernels' {MAX_EXPERTS} / {MAX_GROUPS} / {MAX_TOP_K}")
    return None


class DeviceRouter:
    """Every MoE layer's router on one backend.

    Args:
        backend: the trunk's open backend (declaring ``d_router_topk``).
        arch: the model's ArchConfig (its rule: :meth:`RouteRule.from_arch`).
        dense: the model's dense tensors: ``layers.{i}.router`` float [E, H], ``layers.{i}.router_bias``
            float [E] where the family has one.

    Attributes:
        nbytes: bytes uploaded (routers and biases).

    Raises:
        DeviceOutOfMemoryError: from the uploads (nothing stays uploaded).
    """

    def __init__(self, backend, arch, dense: dict):
        self.be, self.rule, self.nbytes = backend, RouteRule.from_arch(arch), 0
        self._w: dict[int, object] = {}
        self._bias: dict[int, object] = {}
        try:
            for i in arch.moe_layers:
                p = f"layers.{i}."
                qt = quantize(np.asarray(dense[p + "router"], np.float32), "f32")  # [E, H]
                self._w[i] = backend.upload(qt)
                self.nbytes += qt.nbytes
                if p + "router_bias" in dense:
                    self._bias[i] = backend.d_put(np.asarray(dense[p + "router_bias"], np.float32))  # [E]
                    self.nbytes += self._bias[i].nbytes
        except BaseException:
            self.close()
            raise

    def on_device(self, x, layer: int):
        """The routing of the device x [T, H] (post-norm) of MoE layer ``layer`` left on the device: (ids,
        weights) DArrays [T, K] as ``d_router_topk`` returns them (a captured step reads them there)."""
        return self.be.d_router_topk(x, self._w[layer], self._bias.get(layer), self.rule)  # [T, K] each

    def on_device_indexed(self, x, layer: int, table):
        """Inside a captured decode step (a backend declaring ``d_capture_step``): the routing of the device
        x [1, H] of MoE layer ``layer`` with its experts' launch table written from ``table`` (the layer's
        ``d_expert_table``, or None) where the backend can, in the same launch: (ids, weights [1, K] left on
        the device, the prepared table for ``d_expert_ffn_indexed``, or None)."""
        return self.be.d_router_indexed(x, self._w[layer], self._bias.get(layer), self.rule, table)

    def route(self, x, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The routing of the device x [T, H] (post-norm) of MoE layer ``layer``, brought down: (ids int64
        [T, K] in descending choice order, weights float32 [T, K]), as ``engine.moe.route`` returns them."""
        ids_h, w_h = self.be.d_get_routing(*self.on_device(x, layer))  # one copy down where packed
        return ids_h.astype(np.int64), w_h

    def close(self) -> None:
        """Free the uploaded routers (the backend stays open)."""
        for w in self._w.values():
            try:
                if not getattr(self.be, "closed", False):
                    self.be.free(w)
            except ColibriError:
                pass
        self._w, self._bias = {}, {}
