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
CPU compute). Every byte is counted once: :meth:`ResidencyManager.resident_bytes`.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from colibri_plan.directio import aligned_buffer, drop_cache, open_for_read, read_full
from colibri_plan.engine.placement import Placement
from colibri_plan.errors import InputError, IntegrityError
from colibri_plan.formats.report import HIT_TIERS


@dataclass
class TierStats:
    """Counters and timers since the last :meth:`ResidencyManager.reset_stats` (seconds, bytes).

    ``uses`` counts expert computations served by each tier, keyed as a plan's ``hit_rate`` (vram,
    ram_pinned, lru, disk: a disk use is a miss, one read);
    ``disk_busy_s`` sums, per wave of concurrent reads, the time from the first submit to the last read's
    end (so ``disk_bytes / disk_busy_s`` is the disk throughput decode achieved);
    ``disk_wait_s`` is the time the CPU path waited for reads it had nothing else to do during;
    ``device_compute_s`` is per device key ("cuda:0"), wall time of its share of each layer
    (activation transfers included); ``layer_wall_s`` is the wall time inside :meth:`run`.
    """

    uses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_TIERS, 0))
    disk_bytes: int = 0
    disk_read_s: float = 0.0
    disk_busy_s: float = 0.0
    disk_wait_s: float = 0.0
    cpu_compute_s: float = 0.0
    device_compute_s: dict[str, float] = field(default_factory=dict)
    layer_wall_s: float = 0.0

    @property
    def expert_uses(self) -> int:
        return sum(self.uses.values())

    @property
    def misses(self) -> int:
        return self.uses["disk"]

    def hit_rates(self) -> dict[str, float]:
        """Share of expert computations served by each tier, keyed as a plan's ``hit_rate``."""
        n = max(1, self.expert_uses)
        return {tier: count / n for tier, count in self.uses.items()}

    def lru_hit_rate(self) -> float:
        """Hits among experts that are neither in VRAM nor pinned (the LRU cache's own hit rate)."""
        n = self.uses["lru"] + self.uses["disk"]
        return self.uses["lru"] / n if n else 0.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__, uses=dict(self.uses))
        d["hit_rate"] = self.hit_rates()
        d["lru_hit_rate"] = self.lru_hit_rate()
        return d


class _Slot:
    """A page-aligned buffer holding one expert block, and its parsed weights on the CPU backend."""

    __slots__ = ("buf", "key", "weights", "t_submit", "t_read_end")

    def __init__(self, nbytes: int):
        self.buf = aligned_buffer(nbytes)
        self.key: tuple[int, int] | None = None
        self.weights = None  # ExpertWeights on the CPU backend (zero-copy views of buf)
        self.t_submit = self.t_read_end = 0.0  # perf_counter stamps of the last streamed read


class ResidencyManager:
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

    def __init__(self, pack, placement: Placement, cpu_backend, devices: dict | None = None,
                 read_threads: int = 8, working_buffers: int | None = None, verify_checksums: bool = True):
        self.pack, self.placement, self.cpu = pack, placement, cpu_backend
        self.devices = dict(devices or {})
        self.verify = verify_checksums
        arch = pack.arch
        placement.validate(arch.moe_layers, arch.n_experts)
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
                pack.experts_path)
        self.stats = TierStats()
        self._vram: dict[tuple[int, int], tuple[str, object]] = {}
        self._pinned: dict[tuple[int, int], _Slot] = {}
        self._lru: dict[int, OrderedDict] = {l: OrderedDict() for l in arch.moe_layers}
        self._pool = ThreadPoolExecutor(max(1, int(read_threads)), thread_name_prefix="expert-read")
        self._dev_pool = ThreadPoolExecutor(max(1, len(self.devices)), thread_name_prefix="device")
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._load_vram()
            self._load_pinned()
            n_work = 1 if self.in_memory else int(working_buffers or arch.top_k)   # never used in memory
            total = n_work + sum(placement.layer(l).lru_slots for l in arch.moe_layers)
            self._free = [_Slot(self.block_bytes) for _ in range(total)]
            self.working_buffers = n_work
        except BaseException:
            self.close()
            raise

    # ---- start-up ------------------------------------------------------------------------------
    def _read_block(self, slot: _Slot, layer: int, e: int) -> float:
        """Read one expert block into ``slot.buf`` and parse it; returns seconds spent reading."""
        off, nbytes, _ = self.pack.expert_location(layer, e)
        t0 = time.perf_counter()
        try:
            got = read_full(self.fd, slot.buf, off, nbytes)
        except OSError as exc:
            raise IntegrityError(f"reading expert (layer {layer}, expert {e}) from "
                                 f"{self.pack.experts_path} failed: {exc}; check the disk and re-run "
                                 "`colibri-plan model verify`") from exc
        if got != nbytes:
            raise IntegrityError(f"expert (layer {layer}, expert {e}): short read ({got} of {nbytes} B): "
                                 f"{self.pack.experts_path} was truncated; re-create the pack")
        if not self.o_direct:
            drop_cache(self.fd, off, nbytes)  # keep the page cache from hiding the next read
        slot.t_read_end = time.perf_counter()
        seconds = slot.t_read_end - t0
        slot.weights = self.pack.expert_from_bytes(slot.buf, layer, e, check=self.verify)  # views of buf
        slot.key = (layer, e)
        return seconds

    def _load_vram(self) -> None:
        for layer in self.pack.arch.moe_layers:
            for key, ids in self.placement.layer(layer).vram.items():
                backend = self.devices[key]
                for e in ids:
                    if self.in_memory:
                        self._vram[(layer, e)] = (key, backend.upload_expert(*self.pack.expert(layer, e)))
                        continue
                    # a fresh buffer per expert, dropped after the upload: a GPU keeps the only copy
                    scratch = _Slot(self.block_bytes)
                    self._read_block(scratch, layer, e)
                    self._vram[(layer, e)] = (key, backend.upload_expert(*scratch.weights))

    def _load_pinned(self) -> None:
        for layer in self.pack.arch.moe_layers:
            for e in self.placement.layer(layer).ram_pinned:
                slot = _Slot(self.block_bytes)
                if self.in_memory:   # the checkpoint's arrays are already in RAM: no read, no copy
                    slot.weights = self.cpu.upload_expert(*self.pack.expert(layer, e))
                    self._pinned[(layer, e)] = slot
                    continue
                self._read_block(slot, layer, e)
                slot.weights = self.cpu.upload_expert(*slot.weights)
                self._pinned[(layer, e)] = slot

    # ---- the ExpertProvider call ---------------------------------------------------------------
    def run(self, layer: int, expert_ids: Sequence[int], xs: Sequence[np.ndarray],
            gates: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Weighted outputs of the chosen experts of ``layer`` (see ExpertProvider.run)."""
        if self._closed:
            raise InputError("residency manager is closed")
        t_layer = time.perf_counter()
        st = self.stats
        out: list[np.ndarray | None] = [None] * len(expert_ids)
        by_dev: dict[str, list[int]] = {}
        cpu_hits: list[tuple[int, object]] = []
        misses: list[int] = []
        lru = self._lru[layer]
        for i, e in enumerate(expert_ids):
            key = (layer, int(e))
            if key in self._vram:
                by_dev.setdefault(self._vram[key][0], []).append(i)
            elif key in self._pinned:
                cpu_hits.append((i, self._pinned[key].weights))
                st.uses["ram_pinned"] += 1
            elif key in lru:
                lru.move_to_end(key)
                cpu_hits.append((i, lru[key].weights))
                st.uses["lru"] += 1
            else:
                misses.append(i)
        # devices first: they run in their own threads while the CPU works
        dev_jobs = {k: self._dev_pool.submit(self._device_call, k, layer, [expert_ids[i] for i in idx],
                                             [xs[i] for i in idx]) for k, idx in by_dev.items()}
        st.uses["vram"] += sum(len(v) for v in by_dev.values())
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
            for i, y in zip(by_dev[k], job.result()):
                out[i] = y
        st.layer_wall_s += time.perf_counter() - t_layer
        return [y * g[:, None] for y, g in zip(out, gates)]  # [T_i, H] · gates [T_i, 1]

    def _device_call(self, key: str, layer: int, ids: list[int], xs: list[np.ndarray]) -> list[np.ndarray]:
        t0 = time.perf_counter()
        backend = self.devices[key]
        ys = backend.expert_ffn(xs, [self._vram[(layer, int(e))][1] for e in ids])
        with self._lock:
            d = self.stats.device_compute_s
            d[key] = d.get(key, 0.0) + time.perf_counter() - t0
        return ys

    def _take_slot(self) -> _Slot:
        slot = self._free.pop()
        if slot.weights is not None:  # it held an evicted expert: release its CPU-backend views
            for w in slot.weights:
                self.cpu.free(w)
            slot.weights, slot.key = None, None
        return slot

    def _submit_wave(self, layer: int, expert_ids, wave: list[int]) -> list:
        """Start the O_DIRECT reads of up to ``working_buffers`` misses; all are in flight together."""
        pending = []
        for i in wave:
            slot = self._take_slot()
            slot.t_submit = time.perf_counter()
            pending.append((i, slot, self._pool.submit(self._read_block, slot, layer, int(expert_ids[i]))))
        return pending

    def _complete_wave(self, layer: int, expert_ids, xs, pending: list, out) -> None:
        """Compute each streamed expert as soon as its read completes, then admit it to the LRU."""
        st = self.stats
        done: list[_Slot] = []
        for n, (i, slot, fut) in enumerate(pending):
            t0 = time.perf_counter()
            try:
                st.disk_read_s += fut.result()
            except BaseException:
                self._abort_reads(pending[n:], done)
                raise
            st.disk_wait_s += time.perf_counter() - t0
            st.uses["disk"] += 1
            st.disk_bytes += self.pack.expert_location(layer, int(expert_ids[i]))[1]
            t0 = time.perf_counter()
            slot.weights = self.cpu.upload_expert(*slot.weights)  # zero-copy on host backends
            out[i] = self.cpu.expert_ffn([xs[i]], [slot.weights])[0]
            st.cpu_compute_s += time.perf_counter() - t0
            done.append(slot)
        if done:  # the wave's reads were in flight together: its wall time is what the disk delivered in
            st.disk_busy_s += max(s.t_read_end for s in done) - min(s.t_submit for s in done)
        for slot in done:
            self._admit(layer, slot)

    def _abort_reads(self, pending, done: list) -> None:
        """A read failed: wait for the wave's other reads and return every buffer to the pool."""
        for _, slot, fut in pending:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the first failure is the one re-raised
                pass
            slot.weights, slot.key = None, None
            self._free.append(slot)
        for slot in done:
            for w in slot.weights:
                self.cpu.free(w)
            slot.weights, slot.key = None, None
            self._free.append(slot)

    def _admit(self, layer: int, slot: _Slot) -> None:
        """Make ``slot`` the layer's most recent LRU entry; evicted slots go back to the free pool."""
        lru = self._lru[layer]
        cap = self.placement.layer(layer).lru_slots
        if cap <= 0:
            self._free.append(slot)
            return
        lru[slot.key] = slot
        lru.move_to_end(slot.key)
        while len(lru) > cap:
            _, old = lru.popitem(last=False)
            self._free.append(old)

    # ---- accounting ----------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Bytes held per tier: each device key, "ram_pinned", "ram_buffers" (LRU slots + working)."""
        d: dict[str, int] = {k: b.memory_used() for k, b in self.devices.items()}
        d["ram_pinned"] = len(self._pinned) * self.block_bytes
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
        for key, ew in getattr(self, "_vram", {}).values():
            for w in ew:
                self.devices[key].free(w)
        self._vram = {}
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None
