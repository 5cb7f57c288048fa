"""A prefill's host-held experts computed on the trunk's GPU (issue 25: llama.cpp's "op offload").

A long prompt touches most experts of every layer, each with many token rows. The host CPU computing those
rows is what made a hybrid plan's prefill slow (a 512-token prompt of the 24-layer Qwen3-30B-A3B fixture
with 8 of 32 experts a layer in RAM: ~5 s of host compute). For a prefill of at least
:data:`~colibri_plan.formats.plan.PREFILL_OFFLOAD_TOKENS` tokens on a trunk whose backend has
``d_expert_ffn_rows`` (CUDA), :meth:`PrefillOffload.offload_experts` instead copies each touched expert that
the CPU would compute to the trunk's device (an int8 expert of the fixture is 4.7 MB: ~0.2 ms over PCIe)
and the trunk runs it there with the device's own experts in one ``d_expert_ffn_rows`` call; the uploads
are freed after the layer (:meth:`Offload.release`). Decode (one token) is unchanged.

Where each expert's bytes come from, so the tiers' accounting and checks hold as on the host path:

- pinned (computed by the CPU): the slot's parsed QuantTensors (``Slot.qts``, views of its buffer), a
  "ram_pinned" use;
- an LRU hit (the LRU tier on the CPU): its slot's QuantTensors, made most recent, an "lru" use;
- a miss (the disk tier on the CPU): read as :meth:`StreamedExperts._complete_wave` reads one (a slot from
  the pool, one O_DIRECT read, crc32 in the reader thread, waves of ``working_buffers``), uploaded as soon
  as its read lands, then admitted to the layer's LRU: a "disk" use with its bytes and read seconds.

Experts another device holds (a second GPU's VRAM) or that a unified device computes (the plan's
``compute`` map) stay on the host path (:meth:`ResidencyManager.run`), and so do those beyond the device's
free capacity (``capacity_bytes`` less what it holds: the uploads never fail for room). The upload seconds
are the trunk device's expert time (``device_compute_s``) and the layer's wall time, and are counted apart in
``offload_h2d_s`` / ``offload_h2d_bytes`` / ``offloaded`` of the stats (the run report's
``prefill_terms``). ``COLIBRI_PREFILL_OFFLOAD=0`` turns the offload off (the host computes them, as before).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from colibri_plan.backends import HOST_BACKENDS
from colibri_plan.errors import InputError
from colibri_plan.formats.plan import PREFILL_OFFLOAD_TOKENS
from colibri_plan.quant import QuantTensor

__all__ = ["OFFLOAD_ENV", "PREFILL_OFFLOAD_TOKENS", "Offload", "PrefillOffload", "offload_enabled"]

#: "0" turns the prefill offload off (the host computes its experts' rows, as before issue 25)
OFFLOAD_ENV = "COLIBRI_PREFILL_OFFLOAD"


def offload_enabled() -> bool:
    """Whether the prefill offload is on (the default; ``COLIBRI_PREFILL_OFFLOAD=0`` turns it off)."""
    return os.environ.get(OFFLOAD_ENV, "1").strip() not in ("0", "off", "false", "no")


class Offload:
    """The host experts of one MoE layer uploaded to the trunk's device for one prefill call.

    Attributes:
        key: the trunk device's key in the manager's devices (its seconds are charged there).
        taken: [(position in the layer's expert ids, ExpertWeights on the device)], ascending.
        left: positions that stay on the host path (another device's, or a unified device's tier).
    """

    def __init__(self, backend, key: str, copy: bool):
        self.be, self.key, self.copy = backend, key, copy
        self.taken: list[tuple[int, object]] = []
        self.left: list[int] = []
        self.nbytes, self.seconds = 0, 0.0

    def upload(self, qts: Sequence[QuantTensor]):
        """Upload one expert's (gate, up, down) QuantTensors; returns its ExpertWeights on the device. A host
        backend's upload may alias the host bytes (numpy's does), and a streamed slot is refilled by the next
        wave: such a backend gets copies."""
        t0 = time.perf_counter()
        if self.copy:
            qts = [QuantTensor(q.fmt, q.out_features, q.in_features, q.data.copy(),
                               None if q.scales is None else q.scales.copy()) for q in qts]
        ew = self.be.upload_expert(*qts)
        self.seconds += time.perf_counter() - t0
        self.nbytes += sum(q.nbytes for q in qts)
        return ew

    def release(self) -> None:
        """Free the uploads (after the layer's device work is queued: a CUDA free waits for it)."""
        taken, self.taken = self.taken, []
        for _, ew in taken:
            for w in ew:
                self.be.free(w)


class PrefillOffload:
    """:meth:`offload_experts` (mixin of ``ResidencyManager``; uses its tiers, reads and stats)."""

    def offload_experts(self, layer: int, expert_ids: Sequence[int], positions: Sequence[int],
                        backend) -> Offload:
        """Upload the experts at ``positions`` of ``expert_ids`` (MoE ``layer``) that the CPU would compute
        to ``backend`` (the trunk's device, one of the manager's devices), counted in their tiers' uses as
        :meth:`run` counts them (the routing was observed by :meth:`local_experts`); the module docstring
        says where each one's bytes come from.

        Returns:
            an :class:`Offload`; the caller computes ``taken`` on the device, then calls ``release``.

        Raises:
            InputError: the manager is closed, or ``backend`` is none of its devices. IntegrityError: a read
            fails its checksum (every upload made is freed). DeviceOutOfMemoryError: from an upload (the
            same).
        """
        if self._closed:
            raise InputError("residency manager is closed")
        key = next((k for k, d in self.devices.items() if d is backend), None)
        if key is None:
            raise InputError("offload_experts: the trunk's backend is none of the residency manager's "
                             "devices")
        t_layer = time.perf_counter()
        st, lru, tc = self.stats, self._lru[layer], self.tc
        off = Offload(backend, key, getattr(backend, "name", "") in HOST_BACKENDS)
        misses: list[int] = []
        cap = backend.capacity_bytes()
        room = float("inf") if cap is None else cap - backend.memory_used()  # bytes the uploads may take

        def fits(nbytes: int) -> bool:  # what does not fit stays on the host path (no upload fails for room)
            nonlocal room
            room -= nbytes
            return room >= 0
        try:
            for i in positions:
                k = (layer, int(expert_ids[i]))
                if k in self._pinned:   # pinned and computed by the CPU (a unified device's: _pinned_dev)
                    qts = self._pinned[k].qts
                    qts = qts if qts is not None else self.pack.expert(*k)
                    if not fits(sum(q.nbytes for q in qts)):
                        off.left.append(i)
                        continue
                    off.taken.append((i, off.upload(qts)))
                    st.uses["ram_pinned"] += 1
                elif k in lru and tc.device("lru") is None and fits(sum(q.nbytes for q in lru[k].qts)):
                    lru.move_to_end(k)
                    off.taken.append((i, off.upload(lru[k].qts)))
                    st.uses["lru"] += 1
                elif (k not in lru and k not in self._vram and k not in self._pinned_dev
                      and tc.device("disk") is None and not self.in_memory
                      and fits(self.pack.expert_location(*k)[1])):
                    misses.append(i)
                else:
                    off.left.append(i)
            w = self.working_buffers
            for w0 in range(0, len(misses), w):
                self._upload_wave(layer, expert_ids, self._submit_wave(layer, expert_ids, misses[w0:w0 + w]),
                                  off)
        except BaseException:
            off.release()
            raise
        off.taken.sort(key=lambda t: t[0])
        st.offloaded += len(off.taken)
        st.offload_h2d_bytes += off.nbytes
        st.offload_h2d_s += off.seconds
        self._add_device_s(key, off.seconds)
        st.layer_wall_s += time.perf_counter() - t_layer
        return off

    def _upload_wave(self, layer: int, expert_ids, pending: list, off: Offload) -> None:
        """:meth:`_complete_wave` with the compute replaced by an upload: each miss goes up as soon as its
        read completes, then joins the LRU (its CPU weights made, for a later hit on the host)."""
        done: list = []
        for n, (i, slot, _) in enumerate(pending):
            self._await_read(layer, expert_ids, pending, n, done)
            slot.weights = self.cpu.upload_expert(*slot.weights)  # zero-copy on host backends
            done.append(slot)
            try:
                off.taken.append((i, off.upload(slot.qts)))
            except BaseException:
                self._abort_reads(pending[n + 1:], done)
                raise
        self._admit_wave(layer, done)
