"""Tiered expert residency: VRAM, pinned RAM, a RAM LRU cache and O_DIRECT streaming, driven by a plan.

A :class:`ResidencyManager` is an :class:`~colibri_plan.engine.moe.ExpertProvider`. At start-up it
uploads every VRAM expert to its device (so capacity failures happen before inference; no host copy
is kept) and reads every pinned expert into RAM. Everything else is *streamed*: a miss is read from
``experts.bin`` with one O_DIRECT read of the whole 4096-aligned block into a page-aligned buffer,
checked against its crc32 and computed on the CPU backend straight from that buffer. Each MoE layer
keeps the last ``lru_slots`` streamed experts (least recently used evicted). Buffers move between a
free pool and the layers' LRU lists without copies; the pool always keeps ``working_buffers`` free so
the misses of one layer (up to top-k at decode) are read concurrently by a thread pool.

Within one MoE layer, device-resident experts run on their devices in their own threads while the CPU
computes pinned and cached experts, then each streamed expert as its read completes (disk reads overlap
CPU compute; the slots, reads and LRU admission are :mod:`colibri_plan.engine.streaming`). Every byte is
counted once: :meth:`ResidencyManager.resident_bytes`.

At decode (one token) :meth:`ResidencyManager.run_sum` computes a layer whose chosen experts are all in RAM
on the CPU backend in one ``expert_ffn_sum`` call (same bits as :meth:`ResidencyManager.run` then
``scatter_sum``).

A device trunk's long prefill may compute the host tiers' experts on its GPU instead
(:meth:`ResidencyManager.offload_experts`, :mod:`colibri_plan.engine.offload`).

A placement's ``compute`` map may hand the host tiers (pinned, LRU, disk) to a unified-memory device
(:mod:`colibri_plan.engine.unified`): those experts are uploaded to it (pinned once at start-up, streamed
once per slot fill) and computed there, beside the CPU path. It may hand the pinned tier alone to a
discrete GPU that maps host memory: those experts live in mapped page-locked RAM and a device trunk on
that GPU computes them with its VRAM experts, zero-copy over PCIe.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from colibri_plan.directio import open_for_read
from colibri_plan.engine.moe import scatter_sum
from colibri_plan.engine.offload import PrefillOffload
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.repin import Repinner
from colibri_plan.engine.residency_device import DeviceTiers
from colibri_plan.engine.streaming import Slot, StreamedExperts
from colibri_plan.engine.tierstats import TierStats
from colibri_plan.engine.unified import TierCompute
from colibri_plan.errors import InputError


class ResidencyManager(StreamedExperts, PrefillOffload, DeviceTiers):
    """Serve a pack's experts from VRAM / pinned RAM / LRU / disk as a :class:`Placement` says.

    Args:
        pack: an open :class:`~colibri_plan.engine.pack.PackedModel`.
        placement: where every (layer, expert) lives (:class:`Placement`; validated against the pack).
        cpu_backend: open backend for CPU-resident and streamed experts (its ``upload`` must be
            zero-copy host memory: "cpu" or "numpy").
        devices: open backends by device key ("cuda:0", "vulkan:0"), for the placement's VRAM tiers.
        read_threads: concurrent O_DIRECT reads (queue depth).
        working_buffers: buffers kept free for in-flight misses (default: top-k).
        verify_checksums: crc32-check every expert read from disk (in the reader threads).

    Raises:
        InputError: the placement names a device not in ``devices`` or does not fit the pack.
        DeviceOutOfMemoryError: VRAM experts do not fit (raised here, before inference; nothing stays
            uploaded).
        IntegrityError: an expert read at start-up fails its checksum.
    """

    slot_type = Slot   # the buffer type (engine.repin reads newcomers into one)

    def __init__(self, pack, placement: Placement, cpu_backend, devices: dict | None = None,
                 read_threads: int = 8, working_buffers: int | None = None, verify_checksums: bool = True):
        repin = getattr(placement, "repin", None)
        if repin is not None and repin.enabled:   # re-pinning edits the tiers: work on an own copy
            placement = copy.deepcopy(placement)
            for layer in pack.arch.moe_layers:
                placement.layers.setdefault(int(layer), LayerPlacement())
        self.pack, self.placement, self.cpu = pack, placement, cpu_backend
        # the cpu backend's one-call decode sum, where the backend declares it
        self._fused = cpu_backend.expert_ffn_sum if cpu_backend.supports("expert_ffn_sum") else None
        self.repinner = Repinner(self, repin) if repin is not None and repin.enabled else None
        # fn(layer, expert ids, selections each or None: one token) after each routing served (promote.py)
        self.observers: list = []
        # the prefills served before any observer came (a prompt's, before the first decode step makes the
        # promoter): (layer, ids, counts), the latest few per layer, for it to count first
        self.early_routing: deque = deque(maxlen=8 * max(1, len(pack.arch.moe_layers)))
        self.devices = dict(devices or {})
        self.verify = verify_checksums
        arch = pack.arch
        placement.validate(arch.moe_layers, arch.n_experts)
        self.tc = TierCompute(getattr(placement, "compute", None), self.devices)
        missing = sorted(set(placement.device_keys()) - set(self.devices))
        if missing:
            raise InputError(f"the placement puts experts on {', '.join(missing)}, "
                             "but no such device is open")
        # weights held in memory (a checkpoint folder) have no experts.bin: every expert must be resident
        self.in_memory = not hasattr(pack, "expert_location")
        if self.in_memory:
            streamed = [l for l in arch.moe_layers if len(placement.layer(l).resident()) < arch.n_experts]
            if streamed:
                raise InputError(f"the placement streams experts of layer {streamed[0]} from disk, which "
                                 "needs an expert pack (colibri-plan model pack); a checkpoint folder runs "
                                 "with every expert resident")
            self.block_bytes, self.fd, self.o_direct, self.page_cache_method, self.io_warning = (
                0, None, None, None, None)
        else:
            self.block_bytes = max(pack.expert_location(l, 0)[1] for l in arch.moe_layers)
            self.fd, self.o_direct, self.page_cache_method, self.io_warning = open_for_read(
                pack.experts_path, buffered=placement.page_cache_experts is not None)
        self.stats = TierStats()
        self._vram: dict[tuple[int, int], tuple[str, object]] = {}
        self._pinned: dict[tuple[int, int], Slot] = {}
        self._pinned_dev: dict[tuple[int, int], tuple[str, object]] = {}   # pinned, computed on a device
        self._garbage: list[tuple[str, object]] = []   # device uploads of evicted slots, freed after run
        self._lru: dict[int, OrderedDict] = {l: OrderedDict() for l in arch.moe_layers}
        self._pool = ThreadPoolExecutor(max(1, int(read_threads)), thread_name_prefix="expert-read")
        self._dev_pool = ThreadPoolExecutor(max(1, len(self.devices)), thread_name_prefix="device")
        self._lock = threading.Lock()
        # buffered reads (a plan's choice): the streamed experts the page cache keeps, least recent first
        self._page_cache: OrderedDict | None = None
        self._page_cache_cap = int(placement.page_cache_experts or 0)
        self._page_cache_lock = threading.Lock()
        self._closed = False
        try:
            self._load_vram()
            self._load_pinned()
            if placement.page_cache_experts is not None and not self.in_memory:
                self._page_cache = OrderedDict()   # start-up reads were dropped: decode starts cold
            n_work = 1 if self.in_memory else int(working_buffers or arch.top_k)   # never used in memory
            total = n_work + sum(placement.layer(l).lru_slots for l in arch.moe_layers)
            self._free = [Slot(self.block_bytes) for _ in range(total)]
            self.working_buffers = n_work
        except BaseException:
            self.close()
            raise

    # ---- start-up ------------------------------------------------------------------------------
    def _load_vram(self) -> None:
        for layer in self.pack.arch.moe_layers:
            for key, ids in self.placement.layer(layer).vram.items():
                backend = self.devices[key]
                for e in ids:
                    if self.in_memory:
                        self._vram[(layer, e)] = (key, backend.upload_expert(*self.pack.expert(layer, e)))
                        continue
                    # a fresh buffer per expert, dropped after the upload: a GPU keeps the only copy
                    scratch = Slot(self.block_bytes)
                    self._read_block(scratch, layer, e)
                    self._vram[(layer, e)] = (key, backend.upload_expert(*scratch.weights))

    def _load_pinned(self) -> None:
        dev = self.tc.device("ram_pinned")
        for layer in self.pack.arch.moe_layers:
            for e in self.placement.layer(layer).ram_pinned:
                if dev is not None:   # unified device or mapped RAM: its upload is the only copy (as VRAM)
                    if self.in_memory:
                        self._pinned_dev[(layer, e)] = (dev, self.tc.upload(dev, self.pack.expert(layer, e)))
                        continue
                    scratch = Slot(self.block_bytes)
                    self._read_block(scratch, layer, e)
                    self._pinned_dev[(layer, e)] = (dev, self.tc.upload(dev, scratch.weights))
                    continue
                slot = Slot(self.block_bytes)
                if self.in_memory:   # the checkpoint's arrays are already in RAM: no read, no copy
                    slot.weights = self.cpu.upload_expert(*self.pack.expert(layer, e))
                    self._pinned[(layer, e)] = slot
                    continue
                self._read_block(slot, layer, e)
                slot.weights = self.cpu.upload_expert(*slot.weights)
                self._pinned[(layer, e)] = slot

    # ---- the ExpertProvider call ---------------------------------------------------------------
    def local_experts(self, layer: int, expert_ids: Sequence[int], xs: Sequence[np.ndarray], backend
                      ) -> tuple[list[tuple[int, str, object]], list[int]]:
        """Split a layer's chosen experts for a device trunk on ``backend``: the ones that backend holds
        (in VRAM, or pinned in host memory it maps) run on the trunk's device x (``d_expert_ffn``), the
        rest through :meth:`run` with ``observed=True``. Counts the routing of all (re-pinning, which may
        swap tiers, runs first) and a "vram" or "ram_pinned" use per local one; their seconds come back
        through :meth:`add_local_seconds`. ``xs[i]``: expert i's token rows, or any sequence of their
        length (only the row counts are read here).

        Returns:
            ([(position in expert_ids, device key, ExpertWeights)] of the local ones, [positions of the
            others]), both ascending.
        """
        if self._closed:
            raise InputError("residency manager is closed")
        if self.repinner is not None:
            self.repinner.observe(layer, expert_ids, xs)
        if self.observers or self._pinned_dev:
            counts = [len(x) for x in xs]
            for fn in self.observers:
                fn(layer, expert_ids, counts)
            if not self.observers and self._pinned_dev and max(counts, default=0) > 1:  # a prefill's
                self.early_routing.append((layer, list(expert_ids), counts))
        local, rest = [], []
        for i, e in enumerate(expert_ids):
            tier, held = self._on(backend, layer, int(e))
            if held is not None:
                local.append((i, *held))
                self.stats.uses[tier] += 1
            else:
                rest.append(i)
        return local, rest

    def add_local_seconds(self, key: str, seconds: float) -> None:
        """Charge ``seconds`` of local experts (:meth:`local_experts`) on device ``key`` to its expert
        compute time and to the experts' layer wall time."""
        self._add_device_s(key, seconds)
        self.stats.layer_wall_s += seconds

    def run(self, layer: int, expert_ids: Sequence[int], xs: Sequence[np.ndarray],
            gates: Sequence[np.ndarray], observed: bool = False) -> list[np.ndarray]:
        """Weighted outputs of the chosen experts of ``layer`` (see ExpertProvider.run); ``observed``: the
        routing was already counted by :meth:`local_experts`."""
        if self._closed:
            raise InputError("residency manager is closed")
        if self.repinner is not None and not observed:   # count the routing; between tokens, maybe re-pin
            self.repinner.observe(layer, expert_ids, xs)
        t_layer = time.perf_counter()
        out = self._compute(layer, expert_ids, xs, self._sort(layer, expert_ids), t_layer)
        return [y * g[:, None] for y, g in zip(out, gates)]  # [T_i, H] · gates [T_i, 1]

    def _sort(self, layer: int, expert_ids: Sequence[int]) -> tuple[dict, list, list[int]]:
        """Where each chosen expert of ``layer`` runs, counted in the tier uses (LRU hits made most recent,
        ascending): (device key -> [(position, its weights)], CPU hits [(position, CPU weights)], the
        positions of misses to stream)."""
        st = self.stats
        by_dev: dict[str, list[tuple[int, object]]] = {}   # device key -> [(position, its weights)]
        cpu_hits: list[tuple[int, object]] = []
        misses: list[int] = []
        lru, lru_dev = self._lru[layer], self.tc.device("lru")
        for i, e in enumerate(expert_ids):
            key = (layer, int(e))
            if key in self._vram:
                by_dev.setdefault(self._vram[key][0], []).append((i, self._vram[key][1]))
                st.uses["vram"] += 1
            elif key in self._pinned_dev:
                by_dev.setdefault(self._pinned_dev[key][0], []).append((i, self._pinned_dev[key][1]))
                st.uses["ram_pinned"] += 1
            elif key in self._pinned:
                cpu_hits.append((i, self._pinned[key].weights))
                st.uses["ram_pinned"] += 1
            elif key in lru:
                lru.move_to_end(key)
                if lru_dev is None:
                    cpu_hits.append((i, lru[key].weights))
                else:
                    by_dev.setdefault(lru_dev, []).append((i, self._on_device(lru[key], lru_dev)))
                st.uses["lru"] += 1
            else:
                misses.append(i)
        return by_dev, cpu_hits, misses

    def _compute(self, layer: int, expert_ids: Sequence[int], xs: Sequence[np.ndarray],
                 sorted_: tuple[dict, list, list[int]], t_layer: float) -> list[np.ndarray]:
        """The unweighted outputs [T_i, H] of the chosen experts, as :meth:`_sort` placed them; adds the
        layer's wall time since ``t_layer`` (a perf_counter stamp)."""
        st = self.stats
        by_dev, cpu_hits, misses = sorted_
        out: list[np.ndarray | None] = [None] * len(expert_ids)
        # devices first: they run in their own threads while the CPU works
        dev_jobs = {k: self._dev_pool.submit(self._device_call, k, [xs[i] for i, _ in jobs],
                                             [w for _, w in jobs]) for k, jobs in by_dev.items()}
        w = self.working_buffers
        first = self._submit_wave(layer, expert_ids, misses[:w])  # reads overlap the CPU hits below
        if cpu_hits:
            t0 = time.perf_counter()
            ys = self.cpu.expert_ffn([xs[i] for i, _ in cpu_hits], [w for _, w in cpu_hits])
            for (i, _), y in zip(cpu_hits, ys):
                out[i] = y
            st.cpu_compute_s += time.perf_counter() - t0
        self._complete_wave(layer, expert_ids, xs, first, out)
        for w0 in range(w, len(misses), w):  # more misses than buffers (long prefill): further waves
            wave = self._submit_wave(layer, expert_ids, misses[w0:w0 + w])
            self._complete_wave(layer, expert_ids, xs, wave, out)
        for k, job in dev_jobs.items():
            for (i, _), y in zip(by_dev[k], job.result()):
                out[i] = y
        while self._garbage:   # uploads of slots evicted during this layer: no device job uses them now
            self.tc.free(*self._garbage.pop())
        st.layer_wall_s += time.perf_counter() - t_layer
        return out

    def run_sum(self, layer: int, expert_ids: Sequence[int], x: np.ndarray, gates: np.ndarray) -> np.ndarray:
        """Σ_i gates[i] · expert_i(x) of MoE layer ``layer`` at decode: x float32 [T, H] routed to every
        expert (T = 1), expert_ids distinct ascending [n], gates float32 [n]; returns float32 [T, H], the
        sum of :meth:`run`'s outputs in ``scatter_sum``'s order, bit for bit.

        When every chosen expert is computed by the CPU backend from RAM (pinned, or an LRU hit with the
        LRU tier on the CPU) and that backend has ``expert_ffn_sum``, the step is one backend call, with
        the tier counts, LRU order and timers :meth:`run` keeps. Otherwise (a device expert, a unified
        device's tier, a miss to stream) it is :meth:`run` then ``scatter_sum``: a miss keeps the reads
        overlapping the CPU hits' compute, which one call after every read would serialize.

        Raises:
            InputError: the manager is closed; as :meth:`run`.
        """
        if self._closed:
            raise InputError("residency manager is closed")
        n = len(expert_ids)
        if self.repinner is not None:   # count the routing first: a re-pinning round may swap tiers
            self.repinner.observe(layer, expert_ids, [x] * n)
        t_layer = time.perf_counter()
        sorted_ = self._sort(layer, expert_ids)
        by_dev, cpu_hits, misses = sorted_
        if by_dev or misses or self._fused is None:
            out = self._compute(layer, expert_ids, [x] * n, sorted_, t_layer)
            ys = [y * gates[i: i + 1, None] for i, y in enumerate(out)]  # [T, H] · gate, as run() weighs
            return scatter_sum(x, [np.arange(x.shape[0])] * n, ys)
        t0 = time.perf_counter()
        out = self._fused(x, [w for _, w in cpu_hits], gates)  # [T, H]: one batched call, one weighted sum
        t1 = time.perf_counter()
        st = self.stats
        st.cpu_compute_s += t1 - t0
        st.layer_wall_s += t1 - t_layer   # lookups + the call, as run() times its layer
        return out

    def _device_call(self, key: str, xs: list[np.ndarray], weights: list) -> list[np.ndarray]:
        ys, seconds = self.tc.call(key, xs, weights)
        self._add_device_s(key, seconds)
        return ys

    def _add_device_s(self, key: str, seconds: float) -> None:
        with self._lock:
            self.stats.device_compute_s[key] = self.stats.device_compute_s.get(key, 0.0) + seconds

    # ---- accounting ----------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Bytes held per tier: each device key, "ram_pinned", "ram_buffers" (LRU slots + working)."""
        d: dict[str, int] = {k: b.memory_used() for k, b in self.devices.items()}
        d["ram_pinned"] = len(self._pinned) * self.block_bytes   # pinned on a unified device: its key
        mapped = {k for k in self.devices if getattr(self.devices[k], "mapped_bytes", 0)}
        for k in mapped:   # a discrete GPU's mapped pinned experts are host memory, not its VRAM
            d["ram_pinned"] += self.devices[k].mapped_bytes
        d["ram_buffers"] = (len(self._free) + sum(len(v) for v in self._lru.values())) * self.block_bytes
        return d

    def reset_stats(self) -> TierStats:
        """Return the current stats and start new ones."""
        old, self.stats = self.stats, TierStats()
        return old

    def close(self) -> None:
        """Free device uploads, buffers and the file descriptor. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for pool in (getattr(self, "_pool", None), getattr(self, "_dev_pool", None)):
            if pool is not None:
                pool.shutdown(wait=True)
        slots = getattr(self, "_free", []) + [s for v in getattr(self, "_lru", {}).values()
                                              for s in v.values()]
        for slot in slots:
            self._drop_dev(slot)
        for key, ew in [*getattr(self, "_vram", {}).values(), *getattr(self, "_pinned_dev", {}).values(),
                        *getattr(self, "_garbage", [])]:
            for w in ew:
                self.devices[key].free(w)
        self._vram, self._pinned_dev, self._garbage = {}, {}, []
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
