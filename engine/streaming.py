"""Streamed experts of the residency manager: page-aligned slots, O_DIRECT reads in waves, the LRU admit.

:class:`StreamedExperts` is a mixin of :class:`~colibri_plan.engine.residency.ResidencyManager` (it uses
the manager's ``pack``, ``fd``, ``o_direct``, ``verify``, ``cpu``, ``tc``, ``stats``, ``placement``,
``_pool``, ``_free``, ``_lru`` and ``_garbage``). A miss takes a :class:`Slot` from the free pool, is
read with one O_DIRECT read of its whole 4096-aligned block (all misses of a wave in flight together on
the reader pool; buffered reads when the plan chose them, the page cache kept within its bytes
by :meth:`StreamedExperts._after_buffered_read`), checked against its crc32, computed as soon as its
read completes, then admitted to its layer's LRU list (evicted slots return to the pool; no copies).
"""

from __future__ import annotations

import time

from colibri_plan.directio import aligned_buffer, drop_cache, read_full
from colibri_plan.errors import IntegrityError


class Slot:
    """A page-aligned buffer holding one expert block, and its parsed weights on the CPU backend."""

    __slots__ = ("buf", "key", "weights", "qts", "dev", "t_submit", "t_read_end")

    def __init__(self, nbytes: int):
        self.buf = aligned_buffer(nbytes)
        self.key: tuple[int, int] | None = None
        self.weights = None  # ExpertWeights on the CPU backend (zero-copy views of buf)
        self.qts = None      # the parsed QuantTensors (views of buf), what a device upload takes
        self.dev: tuple[str, object] | None = None  # (device key, its upload) on a unified device
        self.t_submit = self.t_read_end = 0.0  # perf_counter stamps of the last streamed read


class StreamedExperts:
    """Reads, slot moves and LRU admission of streamed experts (mixin of ``ResidencyManager``)."""

    def _read_block(self, slot: Slot, layer: int, e: int) -> float:
        """Read one expert block into ``slot.buf`` and parse it; returns seconds spent reading.

        Raises:
            IntegrityError: the read failed, came back short, or the block fails its checksum.
        """
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
            self._after_buffered_read(layer, e, off, nbytes)
        slot.t_read_end = time.perf_counter()
        seconds = slot.t_read_end - t0
        slot.weights = self.pack.expert_from_bytes(slot.buf, layer, e, check=self.verify)  # views of buf
        slot.qts = slot.weights
        slot.key = (layer, e)
        return seconds

    def _after_buffered_read(self, layer: int, e: int, off: int, nbytes: int) -> None:
        """After a buffered read: without a plan's page cache (start-up, or O_DIRECT refused) drop the
        pages, so the page cache cannot hide the next read; with one, keep the last
        ``_page_cache_cap`` streamed experts' pages (one LRU over all layers, as the cost model prices
        it) and drop the least recent beyond that, so the cache stays within the plan's bytes."""
        pc = self._page_cache
        if pc is None:
            drop_cache(self.fd, off, nbytes)
            return
        with self._page_cache_lock:   # reader threads call this concurrently
            key = (int(layer), int(e))
            self.stats.page_cache_hits += key in pc
            pc[key] = (off, nbytes)
            pc.move_to_end(key)
            evicted = [pc.popitem(last=False)[1] for _ in range(len(pc) - self._page_cache_cap)]
        for ev_off, ev_nbytes in evicted:
            drop_cache(self.fd, ev_off, ev_nbytes)

    def _on_device(self, slot: Slot, key: str):
        """The upload of ``slot``'s expert on device ``key`` (made now if the slot has none there)."""
        if slot.dev is None or slot.dev[0] != key:
            self._drop_dev(slot)
            slot.dev = (key, self.tc.upload(key, slot.qts))
        return slot.dev[1]

    def _drop_dev(self, slot: Slot) -> None:
        if slot.dev is not None:
            self._garbage.append(slot.dev)
            slot.dev = None

    def _take_slot(self) -> Slot:
        slot = self._free.pop()
        if slot.weights is not None:  # it held an evicted expert: release its CPU-backend views
            for w in slot.weights:
                self.cpu.free(w)
            slot.weights, slot.key = None, None
        self._drop_dev(slot)
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
        done: list[Slot] = []
        for n, (i, slot, _) in enumerate(pending):
            self._await_read(layer, expert_ids, pending, n, done)
            t0 = time.perf_counter()
            slot.weights = self.cpu.upload_expert(*slot.weights)  # zero-copy on host backends
            dev = self.tc.device("disk")
            if dev is None:
                out[i] = self.cpu.expert_ffn([xs[i]], [slot.weights])[0]
                st.cpu_compute_s += time.perf_counter() - t0
            else:   # unified device: one upload per slot fill (a memcpy on unified memory), then compute
                out[i] = self.tc.call(dev, [xs[i]], [self._on_device(slot, dev)])[0][0]
                self._add_device_s(dev, time.perf_counter() - t0)
            done.append(slot)
        self._admit_wave(layer, done)

    def _await_read(self, layer: int, expert_ids, pending: list, n: int, done: list) -> None:
        """Wait for the wave's read ``n`` and count it (a disk use, its bytes, read and wait seconds); a
        failed read returns the wave's buffers (``pending[n:]`` and ``done``) to the pool and re-raises."""
        st = self.stats
        i, _, fut = pending[n]
        t0 = time.perf_counter()
        try:
            st.disk_read_s += fut.result()
        except BaseException:
            self._abort_reads(pending[n:], done)
            raise
        st.disk_wait_s += time.perf_counter() - t0
        st.uses["disk"] += 1
        st.disk_bytes += self.pack.expert_location(layer, int(expert_ids[i]))[1]

    def _admit_wave(self, layer: int, done: list) -> None:
        """Charge the wave's disk time and admit its slots to the layer's LRU."""
        if done:  # the wave's reads were in flight together: its wall time is what the disk delivered in
            self.stats.disk_busy_s += max(s.t_read_end for s in done) - min(s.t_submit for s in done)
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
            self._drop_dev(slot)
            self._free.append(slot)

    def _admit(self, layer: int, slot: Slot) -> None:
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
