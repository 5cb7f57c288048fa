"""A decode step captured as segments between host hand-offs (issue 25, Build 4): :class:`CudaSegments`,
whose op ``d_capture_segments`` :class:`~colibri_plan.backends.cuda.backend.CUDABackend` binds at open
(part of the optional op ``d_capture_step``).

When some experts of a MoE layer live on the host, a decode step cannot be one graph: the host must see
the router's choice before it knows whether it has work. The trunk's code then runs once under capture
as in :mod:`.graph`, but ``cut(outs, n_next)`` (handed to the body) ends the graph being captured, its last
nodes copying ``outs`` down into pinned memory, and starts the next one, whose first node copies
``n_next`` floats up from pinned memory (the host's partial sum). A replay (:meth:`CapturedSegments.run`)
launches the segments back to back on the stream; before a segment that takes host input it waits on the
event recorded after the last segment with outputs (not on the stream: a segment launched in between, the
device's own experts of that layer, keeps running while the host computes), asks the caller for the
input and writes it to that segment's pinned slot. Layers without host experts are not cut: they sync
nowhere.

The position, the cache's address slots and the private memory pool work as in
:meth:`.graph.CudaStepGraphs.d_capture_step`; every segment reads them (the pool is shared by all segments
of a step: they run in capture order on one stream, so a block freed in one and reused by a later one is
stream-ordered).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri_plan.backends.cuda.graph import _slot0
from colibri_plan.backends.handles import DArray
from colibri_plan.errors import InputError, UnsupportedError


@dataclass
class Segment:
    """One captured graph of a step: ``n_in`` floats the host gives before its launch at ``in_off`` of the
    step's pinned cut inputs; ``sizes`` its outputs' float counts at ``out_off`` of the pinned outputs;
    ``event`` recorded after its launch when it has outputs."""

    graph: Any
    n_in: int
    in_off: int
    sizes: list
    out_off: int
    event: Any = None


@dataclass
class CapturedSegments:
    """A decode step captured as segments (module docstring); :meth:`run` replays it.

    Attributes:
        waits: host waits of the last :meth:`run` (one per segment that takes host input).
    """

    segments: list
    stream: Any
    n_in: int
    inp_host: np.ndarray  # pinned float32: step inputs [n_in], position (int32), pad, slots (u64)
    cut_host: np.ndarray  # pinned float32: every cut's host input, one after another
    out_host: np.ndarray  # pinned float32: every segment's outputs, one after another
    keep: list = field(repr=False)
    waits: int = 0

    def _outs(self, s: Segment) -> list[np.ndarray]:
        out, off = [], s.out_off
        for n in s.sizes:
            out.append(self.out_host[off: off + n].copy())
            off += n
        return out

    def run(self, inputs: np.ndarray, pos: int, slots: list[int], give) -> list[np.ndarray]:
        """Replay with ``inputs`` float32 [n_in] at position ``pos`` and the cache's ``slots``; ``give(j,
        outs)`` returns the float32 [n] input of the j-th segment that takes one, from ``outs`` (copies of
        the outputs of the last segment with outputs before it). Returns the last segment's outputs."""
        n = self.n_in
        self.inp_host[:n] = inputs
        self.inp_host[n: n + 1].view(np.int32)[0] = pos
        s0 = _slot0(n)
        self.inp_host[s0: s0 + 2 * len(slots)].view(np.uint64)[:] = slots
        last, j, self.waits = None, 0, 0
        for k, s in enumerate(self.segments):
            if k and s.n_in:
                last.event.synchronize()  # that segment's copies down are done; later ones keep running
                self.waits += 1
                self.cut_host[s.in_off: s.in_off + s.n_in] = give(j, self._outs(last))
                j += 1
            s.graph.launch(stream=self.stream)
            if s.sizes:
                s.event.record(self.stream)
                last = s
        self.stream.synchronize()
        return self._outs(self.segments[-1])


class CudaSegments:
    """``d_capture_segments`` (module docstring). Args: backend, its CudaDeviceOps."""

    HOOKS = ("d_capture_segments",)

    def __init__(self, backend, dops):
        self.be, self.d = backend, dops
        self.cp, self.rt = backend.cp, backend.rt

    def d_capture_segments(self, n_in: int, n_out: int, n_cut: int, body, pos: int, slots: list[int]
                           ) -> CapturedSegments:
        """Capture ``body(inp, cut)`` as a chain of CUDA graphs. ``inp`` a DArray [n_in] of the step's inputs;
        ``cut(outs, n_next)`` ends the segment being captured with ``outs`` (DArrays) copied down and starts
        the next, returning a DArray [n_next] of its host input (None when n_next is 0); ``body`` returns
        the last segment's outputs. At most ``n_out`` output floats and ``n_cut`` cut-input floats in all.
        Position and slots: as :meth:`.graph.CudaStepGraphs.d_capture_step`.

        Raises:
            UnsupportedError: the body did something a replay cannot repeat, or the driver refused the
            capture; nothing is left captured.
        """
        from types import SimpleNamespace as NS

        cp, rt, ops, s = self.cp, self.rt, self.d, self.be.stream
        ops._d_go()
        for name in ("tr_rope_at", "tr_copy_rows_at", "tr_expert_table", "attention_gqa_at", "tr_expert_sum",
                     "tr_add", "tr_qkv_prologue_at"):
            ops._d_kernel(name)  # compiled and loaded before the capture, not inside it
        n_inp = _slot0(n_in) + 2 * len(slots)
        inp, cin = ops._d_empty(n_inp), ops._d_empty(max(1, n_cut))
        pinned = cp.cuda.alloc_pinned_memory
        inp_host = np.frombuffer(pinned(4 * n_inp), np.float32, n_inp)
        cut_host = np.frombuffer(pinned(4 * max(1, n_cut)), np.float32, max(1, n_cut))
        out_host = np.frombuffer(pinned(4 * max(1, n_out)), np.float32, max(1, n_out))
        base = inp.data.ptr + 4 * _slot0(n_in)
        where = {int(p): base + 8 * i for i, p in enumerate(slots)}

        def slot(ptr: int) -> int:
            if ptr not in where:
                raise UnsupportedError("cuda: a cache op on an array the captured step was not given")
            return where[ptr]

        segs: list[Segment] = []
        st = NS(n_in=0, in_off=0, out_off=0, cut_used=0, capturing=False)
        mode = getattr(rt, "streamCaptureModeRelaxed", None)

        def begin(n_next: int):
            s.begin_capture() if mode is None else s.begin_capture(mode)
            st.capturing, st.n_in, st.in_off = True, n_next, st.cut_used
            if n_next:
                if st.cut_used + n_next > n_cut:
                    raise InputError(f"d_capture_segments: over {n_cut} cut-input floats")
                dst = cin.data.ptr + 4 * st.cut_used
                rt.memcpyAsync(dst, cut_host.ctypes.data + 4 * st.cut_used, 4 * n_next, rt.memcpyHostToDevice,
                               s.ptr)
                st.cut_used += n_next
                return DArray((n_next,), cin, id(self.be), st.in_off)
            return None

        def end(outs: list):
            sizes, off = [o.size for o in outs], st.out_off
            if off + sum(sizes) > n_out:
                raise InputError(f"d_capture_segments: over {n_out} output floats")
            for o in outs:
                rt.memcpyAsync(out_host.ctypes.data + 4 * off, ops._ptr(o), o.nbytes, rt.memcpyDeviceToHost,
                               s.ptr)
                off += o.size
            st.capturing = False
            graph = s.end_capture()
            ev = cp.cuda.Event(disable_timing=True) if sizes else None
            segs.append(Segment(graph, st.n_in, st.in_off, sizes, st.out_off, ev))
            st.out_off = off

        def cut(outs: list, n_next: int):
            end(list(outs))
            return begin(int(n_next))

        pool = cp.cuda.MemoryPool()  # the capture's allocations: never handed out to anything else
        ops.graph = NS(posp=inp.data.ptr + 4 * n_in, pos=int(pos), slot=slot)
        try:
            with cp.cuda.using_allocator(pool.malloc):
                try:
                    s.begin_capture() if mode is None else s.begin_capture(mode)
                    st.capturing = True
                    rt.memcpyAsync(inp.data.ptr, inp_host.ctypes.data, 4 * n_inp, rt.memcpyHostToDevice,
                                   s.ptr)
                    end(body(DArray((n_in,), inp, id(self.be)), cut))
                finally:
                    ops.graph = None
                    if st.capturing:
                        s.end_capture()
        except (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as exc:
            raise UnsupportedError(f"cuda: the decode step could not be captured: {exc}") from None
        work = list(ops._dstate["work"]._bufs.values())  # buffers the graphs read, held past a regrowth
        return CapturedSegments(segs, s, n_in, inp_host, cut_host, out_host, [pool, inp, cin, work])
