"""Which processor computes each host tier: the CPU backend, or a unified-memory device (issue #16).

A plan's ``compute`` section maps the three host tiers — ``ram_pinned`` (experts loaded at start-up),
``lru`` (cached streamed experts) and ``disk`` (misses, computed straight after their read) — to
``"cpu"`` or to a device key ``"<backend>:<index>"`` whose device has unified memory (an integrated GPU,
Apple silicon, or lavapipe, a CPU Vulkan device: its "device memory" is host memory). Such a device reads
the same RAM pool the CPU does, so computing a host tier there costs no PCIe transfer.

How the bytes get there (the honest part): no backend here can alias an arbitrary page-aligned host
buffer (Vulkan would need ``VK_EXT_external_memory_host``, which lavapipe and the ``vulkan`` bindings do
not give us cleanly), so a tier computed on a device is **uploaded into device-visible memory**: a
pinned expert once at start-up (its host read buffer is then dropped, as for VRAM: each byte is held
once), a streamed expert once per slot fill (the slot's host buffer stays, so a cached expert is held
twice: host slot + device copy; on unified memory the upload is a memcpy at RAM speed, priced by the
planner as one extra read of the expert at RAM GB/s). An LRU hit on a device-computed tier reuses the
upload made when its slot was filled.

A discrete GPU that declares ``upload_expert_mapped`` (CUDA) may compute the **pinned** tier too, zero-copy:
its pinned experts are written once at start-up into mapped page-locked host memory in the GPU's weight
layout (the only copy, as for VRAM) and its kernels read them over PCIe. A device trunk on that GPU runs
them like its VRAM experts (``ResidencyManager.local_experts`` / ``held_on``: the same indexed kernels in
a captured step, no hand-off to the host); any other caller computes them through :meth:`TierCompute.call`.
The LRU and disk tiers stay on unified devices and the CPU: a streamed slot is refilled per miss, and a
mapped copy of it would be a second host copy per fill.

Backends are not thread-safe: every call into one device goes through that device's lock
(:meth:`TierCompute.call`), whether it comes from the device thread (VRAM experts) or the CPU path
(streamed experts).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.formats.plan import COMPUTE_TIERS

#: the host tiers whose processor a plan chooses, in the plan's ``hit_rate`` vocabulary
HOST_TIERS = COMPUTE_TIERS
#: the CPU backend's name in a ``compute`` map
CPU = "cpu"


def check_compute(compute: dict | None) -> dict[str, str]:
    """A complete ``{tier: "cpu" | "<backend>:<index>"}`` map (missing tiers -> "cpu").

    Raises:
        InputError: an unknown tier, or a processor that is neither "cpu" nor a device key.
    """
    out = dict.fromkeys(HOST_TIERS, CPU)
    for tier, who in (compute or {}).items():
        if tier not in HOST_TIERS:
            raise InputError(f"compute: unknown tier {tier!r} (tiers: {', '.join(HOST_TIERS)})")
        if not isinstance(who, str) or (who != CPU and not who.partition(":")[2].isdigit()):
            raise InputError(f"compute.{tier} must be 'cpu' or '<backend>:<index>', got {who!r}")
        out[tier] = who
    return out


class TierCompute:
    """The processor of each host tier and a lock per open device.

    Args:
        compute: ``{tier: "cpu" | device key}`` (:func:`check_compute`).
        devices: open backends by device key; each device named in ``compute`` must be among them and
            have unified memory (``DeviceInfo.unified_memory``).

    Raises:
        InputError: a device is not open, or is a discrete GPU for the LRU or disk tier, or for the pinned
            tier without ``upload_expert_mapped`` (its tier would need PCIe copies per use).
    """

    def __init__(self, compute: dict | None, devices: dict):
        self.compute = check_compute(compute)
        self.devices = devices
        self.locks = {k: threading.Lock() for k in devices}
        for tier, who in self.compute.items():
            if who == CPU:
                continue
            if who not in devices:
                raise InputError(f"compute.{tier} names {who}, but no such device is open")
            if not self.mapped(who):
                continue
            maps = getattr(devices[who], "supports", lambda op: False)("upload_expert_mapped")
            if tier != "ram_pinned" or not maps:
                info = devices[who].device
                raise InputError(f"compute.{tier}: {who} ({info.name}) has no unified memory; host tiers "
                                 "run on the CPU or on a unified-memory device (a discrete GPU that maps "
                                 "pinned host memory may compute the pinned tier alone)")

    def mapped(self, key: str) -> bool:
        """Whether device ``key`` is a discrete GPU: the tier it computes lives in mapped host memory."""
        info = getattr(self.devices[key], "device", None)
        return info is not None and not info.unified_memory

    def device(self, tier: str) -> str | None:
        """The device key computing ``tier``, or None for the CPU backend."""
        who = self.compute[tier]
        return None if who == CPU else who

    def keys(self) -> list[str]:
        """Device keys computing any host tier."""
        return sorted({w for w in self.compute.values() if w != CPU})

    def call(self, key: str, xs: Sequence[np.ndarray], weights: Sequence) -> tuple[list[np.ndarray], float]:
        """``expert_ffn`` on device ``key`` under its lock; returns (outputs, seconds)."""
        with self.locks[key]:
            t0 = time.perf_counter()
            ys = self.devices[key].expert_ffn(list(xs), list(weights))
            return ys, time.perf_counter() - t0

    def upload(self, key: str, weights) -> object:
        """Upload host expert weights (gate, up, down) to device ``key`` under its lock: into mapped host
        memory on a discrete GPU (:meth:`mapped`), else into its device-visible memory."""
        with self.locks[key]:
            be = self.devices[key]
            return (be.upload_expert_mapped if self.mapped(key) else be.upload_expert)(*weights)

    def free(self, key: str, weights) -> None:
        """Free an expert uploaded with :meth:`upload`."""
        with self.locks[key]:
            for w in weights:
                self.devices[key].free(w)
