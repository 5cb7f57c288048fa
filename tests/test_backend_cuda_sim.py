"""The CUDA backend's host logic on a simulated GPU, so CI without a GPU checks it end to end.

A stand-in ``cupy`` module provides device memory (a byte heap addressed by fake pointers), pinned host
buffers (real host memory), ``memcpyAsync``, streams with graph capture (captured work is recorded and
replayed), events and a module whose kernels read the pointer tables from the heap and compute with
:func:`colibri_plan.quant.dequantize` on the padded layout. What runs for real is ``backends/cuda.py``:
pointer tables, padding, offsets, batching, staging, graph keys, out-of-memory handling. The kernels'
own arithmetic is covered by ``test_backend_cuda.py`` (host-compiled decoding) and, on a GPU, the oracle.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import re
import sys
import types

import numpy as np
import pytest

from colibri_plan import quant
from colibri_plan.backends.base import silu_mul_ref
from colibri_plan.errors import DeviceOutOfMemoryError

BASE, HEAP = 1 << 20, 1 << 26  # fake device addresses start at BASE; 64 MiB of device memory
MM_ARGS_MAX = 4  # matmul.cu: table entries an mm_args launch carries as its argument
FMTS = {0: "f32", 1: "f16", 2: "bf16", 3: "int8", 4: "int4", 5: "int2"}


class Sim:
    def __init__(self):
        self.heap = np.full(HEAP, 0xFF, np.uint8)  # NaN garbage
        self.top = 0
        self.pinned: list[np.ndarray] = []  # pinned host buffers (views), in allocation order
        self.capturing: list | None = None
        self.launches = 0
        self.functions: dict = {}  # CUfunction "address" -> kernel (driver launches)
        self.stream_ptr, self.current_stream = 7, 0  # the backend's stream; the thread's current one

    def alloc(self, n: int) -> int:
        n = -(-n // 256) * 256
        if self.top + n > HEAP:
            raise CUDARuntimeError(2)
        self.top += n
        return BASE + self.top - n

    def mem(self, ptr: int, n: int) -> np.ndarray:
        if not BASE <= ptr < BASE + HEAP:  # unified addressing: a pinned host buffer reads in place
            for a in self.pinned:
                p0 = a.ctypes.data
                if p0 <= ptr and ptr + n <= p0 + a.size:
                    return a[ptr - p0:ptr - p0 + n]
        assert BASE <= ptr and ptr + n <= BASE + self.top, "device access out of bounds"
        return self.heap[ptr - BASE:ptr - BASE + n]

    def alloc_pinned(self, n: int) -> bytearray:
        """Pinned host memory (NaN garbage, like fresh memory), readable by the kernels at its address."""
        buf = bytearray(b"\xff" * n)
        self.pinned.append(np.frombuffer(buf, np.uint8))
        return buf

    def run(self, op):
        if self.capturing is not None:
            self.capturing.append(op)
        else:
            op()


class CUDARuntimeError(RuntimeError):
    def __init__(self, status):
        super().__init__(f"cudaError {status}")
        self.status = status


def _kernel_op(sim, name, grid, args):
    """What mm / mm_args / gate_up compute, read from their tables (device memory; mm_args: its argument)."""
    n_mats = grid[1]
    if name.startswith("mm_args"):
        table = sim.last_table = np.asarray(args[0]).reshape(-1, 8)[:n_mats]
        rows, in_pad, stride, gshift = (int(a) for a in args[1:])
    else:
        table_ptr, rows, in_pad, stride, gshift = (int(a) for a in args)
        table = sim.mem(table_ptr, 64 * n_mats).view(np.uint64).reshape(n_mats, 8)
    fid = int(name.split("<")[1].split(",")[0])
    fmt = FMTS.get(fid) or f"int4-g{32 << gshift}"
    row_bytes = in_pad * quant.bits(fmt) // 8

    def weight(wp, sp, rows):
        scale_n = None if fmt in quant.FLOAT_FORMATS else (rows * in_pad // quant.group_size(fmt)
                                                          if quant.group_size(fmt) else rows)
        dtype = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "int8": np.int8}.get(fmt, np.uint8)
        data = sim.mem(int(wp), rows * row_bytes).view(dtype).reshape(rows, -1)
        s = None
        if scale_n is not None:
            s = sim.mem(int(sp), 4 * scale_n).view(np.float32)
            s = s.reshape(rows, -1) if quant.group_size(fmt) else s
        return quant.dequantize(quant.QuantTensor(fmt, rows, in_pad, data, s)).astype(np.float64)

    for e in table:
        if name.startswith("mm"):
            r, st = int(e[5]) or rows, int(e[6]) or stride  # an entry's own height and y stride, when set
            W, xp, yp, T = weight(e[0], e[1], r), int(e[2]), int(e[3]), int(e[4])
            x = sim.mem(xp, 4 * T * in_pad).view(np.float32).reshape(T, in_pad).astype(np.float64)
            y = sim.mem(yp, 4 * ((T - 1) * st + r)).view(np.float32)
            for t in range(T):
                y[t * st:t * st + r] = x[t] @ W.T
        else:
            G, U = weight(e[0], e[1], rows), weight(e[2], e[3], rows)
            xp, hp, T, ip = int(e[4]), int(e[5]), int(e[6]), int(e[7])
            idx = sim.mem(ip, 4 * T).view(np.int32) if ip else np.arange(T)  # routed rows of x (prefill)
            n = int(idx.max()) + 1
            x = sim.mem(xp, 4 * n * in_pad).view(np.float32).reshape(n, in_pad)[idx].astype(np.float64)
            h = sim.mem(hp, 4 * T * stride).view(np.float32).reshape(T, stride)
            h[:] = np.nan  # padding must be written (0) by the kernel: the down matmul reads it
            h[:, :rows] = silu_mul_ref(x @ G.T, x @ U.T)
            h[:, rows:] = 0.0


def record_compiles(be, monkeypatch) -> list:
    """Every NVRTC compile of the simulated backend ``be`` from now on, as (name expressions, options)."""
    seen = []
    base = be.cp.RawModule

    class Recorder(base):
        def __init__(self, code, options, name_expressions=()):
            seen.append((tuple(name_expressions), tuple(options)))
            super().__init__(code, options, name_expressions)

    monkeypatch.setattr(be.cp, "RawModule", Recorder)
    return seen


def param_kinds(code: str, name: str) -> str:
    """Parameter kinds of kernel ``name`` (a template instance ``mm_args<3,4,1,1>`` too) read from its CUDA
    signature: p pointer, q 64-bit integer, i int, f float, t matmul.cu's MMArgs."""
    head = r"__global__\s+void\s+(?:IM_BOUNDS\s+)?"  # decode_imma.cu's launch bounds macro
    m = re.search(head + re.escape(name.split("<")[0]) + r"\s*\(([^)]*)\)", code)
    assert m, f"no kernel {name} in the source"
    kinds = ""
    for par in m.group(1).split(","):
        words = par.replace("*", " * ").split()
        kinds += ("p" if "*" in words else "t" if "MMArgs" in words else "q" if "u64" in words
                  or "tr_u64" in words else "i" if "int" in words else "f" if "float" in words else "?")
    assert "?" not in kinds, m.group(1)
    return kinds


def launch_kernel(sim, f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
    """cuLaunchKernel: the arguments read back from ``void *params[]`` by the kernel's declared types."""
    kernel = sim.functions[f]
    assert (by, bz, extra) == (1, 1, 0) and stream == sim.stream_ptr
    args = []
    for i, kind in enumerate(kernel.kinds):
        at = ctypes.c_void_p.from_address(params + 8 * i).value
        args.append(np.uint64(ctypes.c_uint64.from_address(at).value) if kind in "pq" else
                    np.int32(ctypes.c_int32.from_address(at).value) if kind == "i" else
                    np.float32(ctypes.c_float.from_address(at).value) if kind == "f" else
                    np.frombuffer(ctypes.string_at(at, 8 * MM_ARGS_MAX * 8), np.uint64).copy())
    kernel((gx, gy, gz), (bx,), tuple(args), shared_mem=smem)


def fake_cupy(sim: Sim):
    cp = types.ModuleType("cupy")
    cp.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    cuda = types.SimpleNamespace()
    cp.cuda = cuda
    cuda.is_available = lambda: True

    class Memory:
        def __init__(self, size):
            self.size, self.ptr = size, sim.alloc(size)

    class Device:
        def __init__(self, i=0):
            self.attributes = {"MultiProcessorCount": 4, "MaxSharedMemoryPerBlockOptin": 227 * 1024}

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def use(self):
            pass

    class Stream:
        ptr = 7

        def __init__(self, non_blocking=False):
            pass

        __enter__ = Device.__enter__
        __exit__ = Device.__exit__

        def use(self):
            sim.current_stream = self.ptr

        def synchronize(self):
            assert sim.capturing is None, "synchronize inside a capture"

        def begin_capture(self):
            sim.capturing = []

        def end_capture(self):
            ops, sim.capturing = sim.capturing, None
            return types.SimpleNamespace(launch=lambda stream=None: [op() for op in ops])

    class Event:
        def record(self, stream=None):
            pass

    def memcpy(dst, src, n, kind, stream):
        def op():
            if kind == 1:
                sim.mem(dst, n)[:] = np.frombuffer(ctypes.string_at(src, n), np.uint8)
            else:
                ctypes.memmove(dst, sim.mem(src, n).ctypes.data, n)
        sim.run(op)

    class Kernel:
        def __init__(self, name, kinds):
            # decode_imma.cu's static arrays (red: 4 KiB per 16-row subtile and matrix, part); the default
            # dynamic limit is what 48 KiB leaves, more needs the opt-in attribute
            r16 = int(name.split(",")[1].rstrip(">")) if "imma<" in name else 0
            self.shared_size_bytes = 4096 * r16 * (2 if name.startswith("gate_up") else 1) + 160 if r16 else 0
            self.__name__, self.kinds = name, kinds
            self.max_dynamic_shared_size_bytes = 48 * 1024 - self.shared_size_bytes
            self.kernel = types.SimpleNamespace(ptr=id(self))
            sim.functions[id(self)] = self

        def __call__(self, grid, block, args, shared_mem=0):
            assert shared_mem <= self.max_dynamic_shared_size_bytes
            assert shared_mem + self.shared_size_bytes <= 227 * 1024
            sim.launches += 1
            sim.run(lambda: _kernel_op(sim, self.__name__, grid, args))

    class RawModule:
        def __init__(self, code, options, name_expressions=()):
            self.names, self.code = set(name_expressions), code

        def get_function(self, name):
            assert name in self.names or f"void {name}(" in self.code, name
            return Kernel(name, param_kinds(self.code, name))

    class Arr:
        def __init__(self, a):
            self.a = np.array(a)

    rt = types.SimpleNamespace(
        memGetInfo=lambda: (HEAP, HEAP), getDeviceCount=lambda: 1, driverGetVersion=lambda: 12040,
        runtimeGetVersion=lambda: 12040, getDevice=lambda: 0, memcpyAsync=memcpy,
        memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDefault=4, errorMemoryAllocation=2,
        CUDARuntimeError=CUDARuntimeError,
        getDeviceProperties=lambda i: {"name": b"Simulated GPU", "major": 9, "minor": 0, "integrated": 0})
    cuda.runtime = rt
    cuda.memory = types.SimpleNamespace(Memory=Memory, OutOfMemoryError=MemoryError)
    cuda.driver = types.SimpleNamespace(occupancyMaxActiveBlocksPerMultiprocessor=lambda f, b, s: 2,
                                        launchKernel=lambda *a: launch_kernel(sim, *a))
    cuda.stream = types.SimpleNamespace(get_current_stream_ptr=lambda: sim.current_stream)
    cuda.Device, cuda.Stream, cuda.Event = Device, Stream, Event
    cuda.alloc_pinned_memory = sim.alloc_pinned
    cuda.get_elapsed_time = lambda a, b: 0.05
    cp.RawModule = RawModule
    cp.asarray = Arr
    cp.empty_like = lambda a: Arr(np.empty_like(a.a))
    cp.empty, cp.float32 = lambda shape, dtype: Arr(np.full(shape, np.nan, dtype)), np.float32
    cp.asnumpy = lambda a, stream=None: a.a.copy()
    return cp


@pytest.fixture
def be(monkeypatch):
    sim = Sim()
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(sim))
    from colibri_plan.backends import get_backend

    cls = get_backend("cuda")
    assert cls.unavailable_reason() is None
    b = cls.open(0)
    b.sim = sim
    yield b
    b.close()


def _q(fmt, shape, seed):
    return quant.quantize(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), fmt)


def test_device_listing(be):
    (d,) = type(be).list_devices()
    assert d.name == "Simulated GPU" and d.kind == "gpu" and d.total_memory_bytes == HEAP
    assert "sm_90" in d.driver


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_matmul_tables_and_padding(be, fmt):
    qt = _q(fmt, (37, 203), 1)
    x = np.random.default_rng(2).standard_normal((3, 203), dtype=np.float32)
    be.timing = True
    y = be.matmul(x, be.upload(qt))
    assert y.shape == (3, 37) and y.dtype == np.float32
    np.testing.assert_allclose(y, quant.matmul_ref(x, qt), rtol=1e-4, atol=1e-4)
    assert be.last_device_seconds == pytest.approx(5e-5)


def test_batched_expert_ffn_one_launch_pair_and_graph_replay(be):
    H, I = 200, 72
    qts = [tuple(_q("int4-g64", s, 10 * j + k) for k, s in enumerate(((I, H), (I, H), (H, I))))
           for j in range(4)]
    experts = [be.upload_expert(*q) for q in qts]
    rng = np.random.default_rng(3)
    for rep in range(4):  # call 1 runs plainly, call 2 is captured, later calls replay the graph
        xs = [rng.standard_normal((T, H), dtype=np.float32) for T in (1, 3, 2, 1)]
        before = be.sim.launches
        ys = be.expert_ffn(xs, experts)
        assert be.sim.launches - before == (2 if rep < 2 else 0)  # replays launch no kernels one by one
        for (g, u, d), x, y in zip(qts, xs, ys):
            ref = quant.matmul_ref(silu_mul_ref(quant.matmul_ref(x, g), quant.matmul_ref(x, u)), d)
            np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert len(be._graphs) >= 1


def test_mixed_formats_fall_back_per_expert(be):
    H, I = 64, 40
    qa = (_q("int4", (I, H), 1), _q("int4", (I, H), 2), _q("int8", (H, I), 3))
    qb = (_q("f16", (I, H), 4), _q("bf16", (I, H), 5), _q("f32", (H, I), 6))
    xs = [np.ones((2, H), np.float32), np.full((1, H), 0.5, np.float32)]
    ys = be.expert_ffn(xs, [be.upload_expert(*qa), be.upload_expert(*qb)])
    for (g, u, d), x, y in zip((qa, qb), xs, ys):
        ref = quant.matmul_ref(silu_mul_ref(quant.matmul_ref(x, g), quant.matmul_ref(x, u)), d)
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_out_of_memory_is_typed_and_holds_nothing(be):
    small = be.upload(_q("int4", (16, 16), 0))
    held = be.memory_used()
    big = quant.QuantTensor("int8", 8192, 8192, np.zeros((8192, 8192), np.int8), np.ones(8192, np.float32))
    be.capacity_bytes = lambda: None  # let it reach the (simulated) driver: cudaErrorMemoryAllocation
    with pytest.raises(DeviceOutOfMemoryError) as info:
        be.upload(big)
    assert info.value.held_bytes == held and info.value.requested_bytes >= big.nbytes
    assert be.memory_used() == held
    be.free(small)
