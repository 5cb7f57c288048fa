"""A decode step captured once and replayed (issue 25, Builds 2 and 3): :class:`CudaStepGraphs`, the part
whose ops ``d_capture_step``, ``d_expert_table``, ``d_router_indexed`` and ``d_expert_ffn_indexed``
(optional op ``d_capture_step``) :class:`~colibri_plan.backends.cuda.backend.CUDABackend` binds at open.

A decode step of the device trunk is ~15 launches a layer, each a few µs of Python: at 24 layers the host,
not the GPU, sets the pace. Here the trunk's own code runs once under CUDA stream capture (CuPy's
``Stream.begin_capture``) and the graph is replayed: one driver call a token. What a replay needs from the
host goes through pinned buffers copied inside the graph: the token's embedding row, its position and
the addresses of the cache's arrays in, the logits and every MoE layer's routing out. While
``CudaDeviceOps.graph`` is set, position-dependent ops (RoPE, the KV cache append, attention) read the
position from device memory and the cache ops read their arrays' addresses there ("slots"), so one graph
serves every step of every cache until attention's key slices change (the caller's key).

The routed experts stay on the device too (llama.cpp's ``mul_mat_id`` idea): ``d_expert_ffn_indexed``
builds matmul.cu's launch table from the router's ids in device memory and the layer's expert table
(``d_expert_table``: each expert's weight and scale addresses), then runs the host path's ``gate_up`` and
``mm`` kernels and ``tr_expert_sum`` — the same kernels, launch shapes and summation order (experts by
ascending id) as ``d_expert_ffn``, so a replayed step gives the eager step's bits. ``d_router_indexed``
routes the token and writes that launch table in the same launch (routing.py's ``route_fused``: router
GEMV, top-k rule, table) and hands it to ``d_expert_ffn_indexed``, which then skips ``tr_expert_table``: a
captured MoE layer is four launches, not six.

Memory: everything the capture allocates comes from a memory pool of the graph's own (PyTorch's private
pool idea), kept with the graph, so no later allocation can take a block a replay writes; the work
buffers and arrays it reads from outside (cache, weights) are held by the caller and by the graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from colibri_plan.backends.batched import ffn_fusable, ffn_kind
from colibri_plan.backends.handles import DArray
from colibri_plan.errors import InputError, UnsupportedError

MAX_TOP_K = 32  # trunk.cu tr_expert_table's id array


@dataclass
class ExpertTable:
    """One MoE layer's experts on the device: ``dev`` a CuPy uint64 [E, 6] array (gate W, S, up W, S,
    down W, S addresses; bit 0 of gate W set on an absent expert's row); ``first`` an ExpertWeights
    (format and shapes of all); ``experts`` the ExpertWeights held, so that their memory outlives the
    table; ``absent`` how many of the E live off this GPU; ``rows`` the host's copy of ``dev``."""

    dev: Any
    first: Any
    experts: list = field(repr=False)
    absent: int = 0  # experts that live off this GPU (gate 0 on the device)
    rows: Any = field(default=None, repr=False)  # the host's copy of dev, numpy uint64 [E, 6]


@dataclass
class IndexedRoute:
    """The launch table ``route_fused`` wrote for one decode token's experts (``d_router_indexed``), for
    ``d_expert_ffn_indexed`` to run instead of ``tr_expert_table``: ``args`` the CuPy float32 array it lies
    in ([K gate/up | K down entries] of 8 u64, then K gates); ``ids``, ``x``, ``h``, ``y`` the device
    addresses of the ids it was made from, of the token's x (read in place: rows of the experts' in_pad)
    and of the work buffers it names; ``table`` the layer's ExpertTable."""

    args: Any
    ids: int
    x: int
    h: int
    y: int
    table: ExpertTable


@dataclass
class CapturedStep:
    """A captured decode step: :meth:`run` fills its inputs, replays it and returns its outputs.

    Attributes:
        n_in: float32 inputs before the int32 position; sizes: element counts of the outputs in order.
    """

    graph: Any
    stream: Any
    n_in: int
    sizes: list
    inp_host: np.ndarray  # pinned float32: the inputs [n_in], the position (int32), a pad, the slots (u64)
    out_host: np.ndarray  # pinned float32 [sum(sizes)]
    keep: list = field(repr=False)  # the private pool, device input, outputs and buffers the graph reads

    def run(self, inputs: np.ndarray, pos: int, slots: list[int]) -> list[np.ndarray]:
        """Replay with ``inputs`` float32 [n_in] at position ``pos``, the slots holding the device addresses
        ``slots`` (in :meth:`CudaStepGraphs.d_capture_step`'s order); copies of the outputs (float32)."""
        n = self.n_in
        self.inp_host[:n] = inputs
        self.inp_host[n: n + 1].view(np.int32)[0] = pos
        s0 = _slot0(n)
        self.inp_host[s0: s0 + 2 * len(slots)].view(np.uint64)[:] = slots
        self.graph.launch(stream=self.stream)
        self.stream.synchronize()
        got = self.out_host[:sum(self.sizes)].copy()  # one copy; the outputs are views of it
        out, off = [], 0
        for n in self.sizes:
            out.append(got[off: off + n])
            off += n
        return out


class _RouteCut:
    """``size`` floats at float offset ``off`` of a captured step's route region (a CuPy array): what a
    device array is to the device ops (``data.ptr``), the region kept alive with it. Routings cut back to
    back from one region come down in one copy, not one per MoE layer."""

    def __init__(self, region, off: int, size: int):
        from types import SimpleNamespace as NS

        self.region, self.size, self.data = region, size, NS(ptr=region.data.ptr + 4 * off)


def _slot0(n_in: int) -> int:
    """Float index of the first slot in a step's inputs: after n_in floats and the position, 8-aligned."""
    return -(-(n_in + 1) // 2) * 2


class CudaStepGraphs:
    """``d_capture_step``, ``d_expert_table``, ``d_expert_ffn_indexed`` (module docstring).

    Args:
        backend: the open CUDA backend; dops: its CudaDeviceOps; experts: its CudaExperts.
    """

    HOOKS = ("d_capture_step", "d_expert_table", "d_router_indexed", "d_expert_ffn_indexed",
             "d_attention_splits", "d_expert_exchange")

    def __init__(self, backend, dops, experts):
        self.be, self.d, self.ex = backend, dops, experts
        self.cp, self.rt = backend.cp, backend.rt

    def d_attention_splits(self, T: int, hq: int, hkv: int, keys: int) -> int:
        """Key slices ``d_attention`` launches for T query rows over ``keys`` keys (part of a captured
        step's identity: a replay keeps the count it was captured with)."""
        return self.d.attention_splits(T, hq, hkv, keys, captured=True)

    def d_expert_table(self, experts: list) -> ExpertTable:
        """The device table of one layer's E experts (ExpertWeights of this backend, in expert id order; None
        for an expert that lives off this GPU: its row holds another expert's addresses with bit 0 of the
        gate weight's set, and ``tr_expert_table`` gives it gate 0, so it adds nothing to the device's sum).

        Raises:
            InputError: no expert on this backend, or one of another backend. UnsupportedError: experts of
            mixed formats or shapes, or whose gate and up formats differ (the fused kernels take one kind
            per launch).
        """
        held = [e for e in experts if e is not None]
        if not held:
            raise InputError("d_expert_table: no experts")
        kind = ffn_kind(held[0])
        if not ffn_fusable(held[0]) or any(ffn_kind(e) != kind for e in held[1:]):
            raise UnsupportedError("cuda: a layer's experts differ in format or shape; the indexed kernels "
                                   "take one kind per layer")
        rows = []
        for e in held:
            for w in e:
                self.be._check_weight(w)
            rows.append([e.gate.payload.data, e.gate.payload.scales, e.up.payload.data, e.up.payload.scales,
                         e.down.payload.data, e.down.payload.scales])
        if any(r[0] & 1 for r in rows):
            raise UnsupportedError("cuda: an expert's gate weight at an odd address (the table's absent bit)")
        it = iter(rows)
        rows = [next(it) if e is not None else [rows[0][0] | 1, *rows[0][1:]] for e in experts]
        host = np.array(rows, np.uint64)  # [E, 6]
        dev = self.d._d_put(host.view(np.float32).reshape(-1))  # [E, 6] u64
        return ExpertTable(dev, held[0], list(held), len(experts) - len(held), host)

    def d_expert_exchange(self, table: ExpertTable, a: int, b: int, ew_a, ew_b) -> None:
        """Exchange experts ``a`` and ``b`` of ``table``'s layer between the buffers that hold them: ew_a
        (a's ExpertWeights) gets b's bytes, ew_b a's, and rows a and b of the table swap, so every id still
        reads its own weights (engine/promote.py moves a hot expert from mapped host memory into VRAM this
        way, a cold one out). Stream-ordered: launches after it, a replayed step's too, read the new
        places; the bytes cross the bus twice (2 x the expert's bytes). One of the two must live in mapped
        host memory (``upload_expert_mapped``: its host array gives each matrix's padded bytes).

        Raises:
            InputError: an id out of range, a == b, or ew_a / ew_b not the table's rows a / b.
            UnsupportedError: neither expert in mapped host memory, or their matrices' layouts differ.
        """
        rows = table.rows  # [E, 6] addresses, as dev holds them
        E = rows.shape[0]
        if not (0 <= a < E and 0 <= b < E) or a == b:
            raise InputError(f"d_expert_exchange: experts {a} and {b} of a layer of {E}")
        for i, ew in ((a, ew_a), (b, ew_b)):
            if int(rows[i, 0]) != ew.gate.payload.data or int(rows[i, 4]) != ew.down.payload.data:
                raise InputError(f"d_expert_exchange: the weights given for expert {i} are not its row")
        rt, s = self.rt, self.be.stream.ptr
        self.d._d_go()  # this device and stream current: the work buffer is pool memory of the stream
        for wa, wb in zip(ew_a, ew_b):
            pa, pb = wa.payload, wb.payload
            if pa.scales - pa.data != pb.scales - pb.data or (wa.fmt, wa.out_features, wa.in_features) != (
                    wb.fmt, wb.out_features, wb.in_features):
                raise UnsupportedError("d_expert_exchange: the two experts' matrices differ in layout")
            host = pa.mem if wa.host_mapped else pb.mem if wb.host_mapped else None
            if host is None:
                raise UnsupportedError("d_expert_exchange: neither expert lives in mapped host memory")
            n = int(host.nbytes)  # data rows + scales, as upload_expert_mapped laid them out
            tmp = self.d._d_work("exchange", n)
            rt.memcpyAsync(tmp, pa.data, n, rt.memcpyDefault, s)  # a's bytes aside (unified addresses)
            rt.memcpyAsync(pa.data, pb.data, n, rt.memcpyDefault, s)
            rt.memcpyAsync(pb.data, tmp, n, rt.memcpyDefault, s)
        rows[[a, b]] = rows[[b, a]]
        rt.memcpyAsync(table.dev.data.ptr, rows.ctypes.data, rows.nbytes, rt.memcpyHostToDevice, s)
        self.be.stream.synchronize()  # the copy from pageable rows is done before they change again

    def d_router_indexed(self, x: DArray, w_router, bias: DArray | None, rule, table: ExpertTable | None
                         ) -> tuple[DArray, DArray, IndexedRoute | None]:
        """``d_router_topk`` of one decode token x [1, H] that also writes its experts' launch table from
        ``table`` (the layer's :meth:`d_expert_table`; None: routing alone), all in one ``route_fused``
        launch: (ids [1, K], weights [1, K] as d_router_topk leaves them, the :class:`IndexedRoute` to hand
        to :meth:`d_expert_ffn_indexed`, or None where the table is not written here: no table, K > 32,
        x not already rows of the experts' in_pad, or the fused kernel off; d_expert_ffn_indexed then
        builds it). Raises as ``d_router_topk``."""
        be, ops = self.be, self.d
        ints, floats = be._d_router_check(x, w_router, bias, rule)
        K, e0 = rule.top_k, None if table is None else table.first
        fits = (e0 is not None and x.shape == (1, e0.gate.in_features) and K <= MAX_TOP_K
                and e0.gate.payload.in_pad == x.shape[1] and ops._ptr(x) % 16 == 0)
        if not fits:
            return (*be.d_router_topk(x, w_router, bias, rule), None)
        ops._d_go()
        xp, h, y = self.ex._buffers(x, [e0], K)  # x in place (fits), h_j [Ip] and y_j [H] at rows j
        args = ops._d_empty(32 * K + K)  # [K gate/up entries | K down entries] of 8 u64, then K gates
        got = be._d_route_fused(x, w_router, bias, ints, floats, (
            table.dev.data.ptr, args.data.ptr, xp, h, y, 4 * e0.down.payload.in_pad, 4 * x.shape[1]))
        if got is None:
            return (*be.d_router_topk(x, w_router, bias, rule), None)
        buf, _, w_offset = got
        me = id(be)
        return (DArray((1, K), buf, me), DArray((1, K), buf, me, w_offset),
                IndexedRoute(args, buf.data.ptr, ops._ptr(x), h, y, table))

    def d_expert_ffn_indexed(self, x: DArray, ids: DArray, weights: DArray, table: ExpertTable,
                             routed: IndexedRoute | None = None) -> DArray:
        """Σ_j weights[j] · expert_{ids[j]}(x) of one decode token on the device: x float32 [1, H];
        ids [1, K] int32 and weights [1, K] float32 as ``d_router_topk`` leaves them; ``table`` the
        layer's :meth:`d_expert_table`; ``routed`` the :meth:`d_router_indexed` that made ids and weights
        with the launch table (``tr_expert_table`` is then not launched). -> [1, H], summed over the
        experts by ascending id (the host's order). No host wait, nothing staged: it may run inside a
        captured step.

        Raises:
            InputError: x not [1, H] of this backend, or ids/weights not [1, K] with K <= 32.
        """
        ops = self.d
        self.be._d_check(x, ndim=2)
        K = ids.shape[-1]
        if x.shape[0] != 1 or ids.shape != (1, K) or weights.shape != (1, K) or not 0 < K <= MAX_TOP_K:
            raise InputError(f"d_expert_ffn_indexed: x {x.shape}, ids {ids.shape}, weights {weights.shape}: "
                             f"one token [1, H] and [1, K] with K <= {MAX_TOP_K}")
        e0, H = table.first, x.shape[1]
        if e0.gate.in_features != H:
            raise InputError(f"d_expert_ffn_indexed: x is {x.shape}; the experts want "
                             f"[1, {e0.gate.in_features}]")
        ops._d_go()
        xp, h, y = self.ex._buffers(x, [e0], K)  # h_j [Ip], y_j [H] at rows j
        if (routed is not None and routed.table is table and routed.x == xp == ops._ptr(x)
                and (routed.ids, routed.h, routed.y) == (ops._ptr(ids), h, y) and routed.args.size == 33 * K):
            args = routed.args  # route_fused wrote it for these buffers
        else:
            args = ops._d_empty(32 * K + K)  # [K gate/up entries | K down entries] of 8 u64, then K gates
            ops._d_kernel("tr_expert_table")(1, 1, 1, 32, 0, ops._dstate["sptr"], ops._ptr(ids),
                                             ops._ptr(weights), table.dev.data.ptr, args.data.ptr, K, xp, h,
                                             y, 4 * e0.down.payload.in_pad, 4 * H)
        ap = args.data.ptr
        self.ex._launch([e0] * K, ap, 1, H)  # gate_up, then mm, K experts
        out = ops._d_launch("tr_expert_sum", H, ops._blocks(H), 2, y, ap + 128 * K, H, K)
        return DArray((1, H), out, id(self.be))

    def d_capture_step(self, n_in: int, n_out: int, body, pos: int, slots: list[int]) -> CapturedStep:
        """Capture ``body(inp)`` as a CUDA graph: ``inp`` a DArray [n_in] of the step's inputs (filled by
        each :meth:`CapturedStep.run`); ``body`` returns the DArrays to bring back, at most ``n_out``
        floats in all. Inside, position-dependent ops read the position from device memory (``pos``: the
        one this capture runs at) and the cache ops read the address of each array they touch from its
        slot: ``slots`` the device addresses of those arrays now (each replay gives the ones it wants).
        Nothing runs until the first :meth:`CapturedStep.run`.

        Raises:
            UnsupportedError: the body did something a replay cannot repeat (a host upload or read, an
            MLA block write, a cache op on an array outside ``slots``), or the driver refused the
            capture; nothing is left captured.
        """
        from types import SimpleNamespace as NS

        cp, rt, ops, s = self.cp, self.rt, self.d, self.be.stream
        ops._d_go()
        for name in ("tr_rope_at", "tr_copy_rows_at", "tr_expert_table", "attention_gqa_at", "tr_expert_sum",
                     "tr_qkv_prologue_at"):
            ops._d_kernel(name)  # compiled and loaded before the capture, not inside it
        n_inp = _slot0(n_in) + 2 * len(slots)  # [inputs | position | pad | slots]: inp_host's device copy
        inp = ops._d_empty(n_inp)
        inp_host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * n_inp), np.float32, n_inp)
        base = inp.data.ptr + 4 * _slot0(n_in)
        where = {int(p): base + 8 * i for i, p in enumerate(slots)}

        def slot(ptr: int) -> int:
            if ptr not in where:
                raise UnsupportedError("cuda: a cache op on an array the captured step was not given")
            return where[ptr]

        out_host = np.frombuffer(cp.cuda.alloc_pinned_memory(4 * max(1, n_out)), np.float32, max(1, n_out))
        pool = cp.cuda.MemoryPool()  # the capture's allocations: never handed out to anything else
        mode = getattr(rt, "streamCaptureModeRelaxed", None)  # the pool may cudaMalloc while capturing
        # the routings (route_topk's [ids | weights]) are cut from one region, in layer order
        region, cut = ops._d_empty(max(1, n_out)), [0]

        def take(n: int):
            if cut[0] + n > region.size:
                return None
            cut[0] += n
            return _RouteCut(region, cut[0] - n, n)

        ops.graph = NS(posp=inp.data.ptr + 4 * n_in, pos=int(pos), slot=slot, take=take)
        try:
            s.begin_capture() if mode is None else s.begin_capture(mode)
            try:
                with cp.cuda.using_allocator(pool.malloc):
                    rt.memcpyAsync(inp.data.ptr, inp_host.ctypes.data, 4 * n_inp, rt.memcpyHostToDevice,
                                   s.ptr)
                    outs = body(DArray((n_in,), inp, id(self.be)))
                    sizes, off = [o.size for o in outs], 0
                    if sum(sizes) > n_out:
                        raise InputError(f"d_capture_step: {sum(sizes)} output floats, {n_out} reserved")
                    for src, n in _runs([(ops._ptr(o), o.nbytes) for o in outs]):  # adjacent: one copy
                        rt.memcpyAsync(out_host.ctypes.data + off, src, n, rt.memcpyDeviceToHost, s.ptr)
                        off += n
            finally:
                ops.graph = None
                graph = s.end_capture()
        except (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError) as exc:
            raise UnsupportedError(f"cuda: the decode step could not be captured: {exc}") from None
        work = list(ops._dstate["work"]._bufs.values())  # buffers the graph reads, held past a regrowth
        return CapturedStep(graph, s, n_in, sizes, inp_host, out_host, [pool, inp, outs, work, region])


def _runs(parts: list) -> list:
    """(address, bytes) parts -> the same bytes as fewer parts: each part that starts where the one before
    it ends joins it."""
    runs: list = []
    for ptr, n in parts:
        if runs and runs[-1][0] + runs[-1][1] == ptr:
            runs[-1][1] += n
        elif n:
            runs.append([ptr, n])
    return [tuple(r) for r in runs]
