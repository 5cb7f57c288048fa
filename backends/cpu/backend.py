"""The ``cpu`` backend: the engine's fast host path, numba kernels on all cores.

int8, int4 and int4-gG weights run integer kernels: :mod:`colibri_plan.backends.cpu.qkernels` (int8;
per-row int4 and int4-g128 of other lengths, blocked), :mod:`~colibri_plan.backends.cpu.q4t` (int4-g32,
transposed layout) and :mod:`~colibri_plan.backends.cpu.q4g` (int4-g64; per-row int4 of 512·n bytes a
row and int4-g128 of 16·n groups, transposed, each group's lanes summed in int32), both with explicit
AVX-512 VNNI code of :mod:`~colibri_plan.backends.cpu.vnni`: activations quantized to int16
once per call (one scale per token), int8/int4 × int16 products summed in int32 (``vpdpwssd`` on
AVX-512 VNNI), the packed bytes unpacked in registers, never dequantized to memory. Tiles of rows run
in parallel, every token of a batch per tile, so a GEMV streams each weight byte from RAM once and a
prefill batch of T tokens reads it once too (from L2 for tokens 2..T).
A matmul of at most ``serial_bytes`` (weight bytes × tokens, 2 MiB; int8 128 KiB, int4-g32 256 KiB:
:meth:`CpuBackend.serial_limit`) runs a single-thread twin of its kernel, chosen at upload with it
(``HostWeight.kernel``/``serial``, same bits): waking the pool costs more than such a matmul gains from a
second core. int8 tiles run two rows at a time with software prefetch (:mod:`~.vnni8`).
int2 runs the float kernel of :mod:`~.kernels`; ``d_attention`` (GQA over a KV cache, MLA over its
latent cache) runs :mod:`~.attention`. Float formats
(f32/f16/bf16) use the numpy reference path (float32 BLAS, f16/bf16 converted a block of rows at a
time). Weights stay in host memory, referenced, not copied (rows of odd length excepted: padded),
except the transposed int4 layouts: a copy, and the payload then holds no reference to the packed rows.

Routed experts: all experts of a layer run in one parallel call per projection, and a decode step's
weighted sum of them in one backend call (:mod:`~colibri_plan.backends.cpu.experts`).

Figures (``bench/cpu_gemv.py --repeats 7 --prefill 16``, ``bench/results/cpu-gemv.json``, a shared
2-core AVX-512 VNNI VM): GEMVs at trunk / GLM-5.2 expert shapes read weights at 0.97-1.05 (int8),
0.68-0.75 (int4), 0.81-0.83 (int4-g32), 0.72-0.77 (int4-g64), 0.60-0.64 (int4-g128) of the median RAM
read bandwidth measured between them (31.1 GB/s); the 1-2 MB matrices of the peer model 0.45-0.77,
where a call's fixed cost weighs more. The int4 / g64 / g128 figures are of the kernels before
``q4g``; docs/backends.md ("Figures") has both, and the per-call cost that now holds them back.
"""

from __future__ import annotations

import importlib.util
import os
import threading

import numpy as np

from colibri_plan.backends.base import Backend, DeviceInfo, DeviceWeight
from colibri_plan.backends.cpu.experts import CpuExperts
from colibri_plan.backends.cpu.layout import (
    INT_FORMATS,
    HostWeight,
    int2_activations,
    int_layout,
    layout_kernels,
    without_rows,
)
from colibri_plan.backends.cpu.prologue import CpuPrologue
from colibri_plan.backends.numpy_ref import host_device, host_tensor, matmul_blocks, package_version
from colibri_plan.backends.reference import HostArrays
from colibri_plan.errors import BackendUnavailableError
from colibri_plan.quant import FORMATS, QuantTensor

# numba's "workqueue" threading layer (used when OpenMP and TBB are missing) must not be entered from
# two threads at once; one lock per process costs ~100 ns per call, and two concurrent GEMVs on the
# same cores would not be faster
_KERNEL_LOCK = threading.Lock()
_kernels = None


def _load_kernels():
    """Import (and on first use, compile or load from cache) the numba kernels: a namespace holding the
    functions of ``kernels`` (float), ``qkernels`` (integer, batched experts), ``qact`` (activation
    quantizers), ``q4t`` (int4-g32), ``q4g`` (int4-g64/g128, per-row int4 transposed) and ``attention``."""
    global _kernels
    if _kernels is None:
        import types

        from colibri_plan.backends.cpu import attention, kernels, q4g, q4t, qact, qkernels  # heavy: numba

        ns = types.SimpleNamespace()
        for mod in (kernels, qkernels, qact, q4g, q4t, attention):  # public names differ
            ns.__dict__.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
        _kernels = ns
    return _kernels


#: dynamic chunks of a transposed int4 matmul (q4t's / q4g's 128-row steps): 16, the count its
#: kernels were measured with; 64 chunks of 128 rows read RAM slower (8 weights of 8192x2048 from RAM,
#: one token: 25.5 vs 26.8 GB/s, best of 15, three interleaved rounds, shared 2-core host)
Q4T_CHUNKS = 16
#: dynamic chunks of an int8 matmul (32-row tiles): 8, fewer and longer runs of rows per thread than 64
#: (its prefetches run on into the next rows of the same chunk): a 1024x2048 GEMV from RAM, 2 threads,
#: shared 2-core Xeon, two passes: 64 chunks 92.6 / 81.1 µs, 16 87.6 / 79.6, 8 85.1 / 79.5, 2 (static
#: halves) 80.0 / 75.2; 8 keeps a descheduled core's stall to 1/8 of the rows (scratch runs, not kept)
I8_CHUNKS = 8


def _chunk_setter(numba):
    """numba's parallel chunk-size setter (returns the previous size): its C entry point once the thread
    pool runs (0.2 µs a call; ``numba.set_parallel_chunksize`` checks the pool and its argument first,
    ~3 µs, twice per kernel call), else the checked function."""
    numba.get_parallel_chunksize()  # starts the pool (what the first parallel kernel would do)
    try:
        from numba.np.ufunc import parallel
        return parallel._set_parallel_chunksize
    except (ImportError, AttributeError):  # another numba layout: the public function
        return numba.set_parallel_chunksize


def _run_parallel(setchunk, chunk: int, kernel, *args) -> None:
    """``kernel(*args)`` under the kernel lock with numba's parallel chunk size ``chunk`` (restored after)."""
    with _KERNEL_LOCK:
        old = setchunk(chunk)
        try:
            kernel(*args)
        finally:
            setchunk(old)


class CpuBackend(Backend):
    """numba kernels on every core of the host (see the module docstring); device activations are host
    arrays (``reference.HostArrays``, with this backend's matmul and attention kernels).

    Args:
        device: the host DeviceInfo.
        capacity_bytes: optional cap on held weight bytes (tests); None = unbounded.
    """

    name = "cpu"
    formats = FORMATS
    optional_ops = frozenset({"d_router_topk", "expert_ffn_sum", "d_attention_prologue"})
    #: weight bytes × tokens up to which an integer matmul runs serially (qkernels.SERIAL_BYTES;
    #: 0: always parallel, as bench/cpu_gemv.py --compare-parallel measures)
    serial_bytes: int = 2 << 20
    #: the same bound for the int4-g32 / int4-g32h kernels (q4t, ``q4t.SERIAL_BYTES``: lower, their
    #: parallel GEMV is faster from 0.3 MB on); the smaller of the two applies
    serial_bytes_t: int = 256 << 10
    #: the same for int8 (``qkernels.SERIAL_BYTES_8``: its parallel GEMV from RAM is faster from 128 KiB on)
    serial_bytes_8: int = 128 << 10

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            if importlib.util.find_spec("numba") is None:
                return "numba is not installed (pip install numba)"
        except (ImportError, ValueError) as exc:
            return f"numba cannot be found: {exc}"
        return None

    @classmethod
    def _devices(cls) -> list[DeviceInfo]:
        threads = os.environ.get("NUMBA_NUM_THREADS") or str(os.cpu_count() or 1)
        versions = f"numba {package_version('numba')}, llvmlite {package_version('llvmlite')}"
        driver = f"{versions}, {threads} threads"
        return [host_device(cls.name, cls.formats, driver)]

    def __init__(self, device: DeviceInfo, capacity_bytes: int | None = None):
        self._capacity_bytes = capacity_bytes
        super().__init__(device)

    def _open(self) -> None:
        try:
            self._k = _load_kernels()
            import numba

            self._numba = numba
            self._setchunk = _chunk_setter(numba)
            self._layouts: dict[tuple, tuple] = {}
            self.serial_bytes = self._k.SERIAL_BYTES
            self.serial_bytes_t = self._k.SERIAL_BYTES_T
            self.serial_bytes_8 = self._k.SERIAL_BYTES_8
        except Exception as exc:  # a broken numba/llvmlite install: say why, do not crash later
            raise BackendUnavailableError(f"cpu backend unavailable: numba failed to import: {exc}") from exc
        # parts: host arrays as device activations (this backend's matmul; attention and RMSNorm are its
        # kernels, below), the batched routed experts (expert_ffn's hook and the one-call decode sum)
        self.bind(HostArrays(self), [h for h in HostArrays.HOOKS
                                     if h not in ("_d_attention", "_d_rmsnorm", "_d_rope")])
        self.bind(CpuExperts(self), ("_expert_ffn", "expert_ffn_sum"))
        self.bind(CpuPrologue(self))  # a GQA layer's q/k norms, RoPE and cache append: one numba call

    def capacity_bytes(self) -> int | None:
        return self._capacity_bytes

    def _upload(self, qt: QuantTensor) -> HostWeight:
        qt = host_tensor(qt)
        if qt.fmt not in INT_FORMATS:
            return HostWeight(qt)
        hw = int_layout(qt, self._k)
        kernel, serial, gate_up, down = layout_kernels(self._k, hw)
        key = (qt.fmt, hw.data3.shape, hw.fold)
        key = self._layouts.setdefault(key, key)  # one object per layout: batches compare keys by identity
        if hw.fold:  # the kernels read the transposed copy only: do not keep the packed rows alive too
            qt = without_rows(qt)
        return hw._replace(qt=qt, kernel=kernel, serial=serial, key=key, experts=(gate_up, down))

    def _xq(self, x: np.ndarray, hw: HostWeight):
        """Activations of x float32 [T, in] for ``hw``'s kernel: int8 (xq3 [T, blocks, bb], sx [T]);
        int4 blocked (xe3, xo3 [T, blocks, bb], sx [T], xsum int32 [T, groups]) or transposed (xe4, xo4
        [T, C, J, L], sx [T], Σ xq per lane int32 [T, C·L])."""
        T = x.shape[0]
        blocks, bb = hw.data3.shape[1], hw.data3.shape[-1]
        sx = np.empty(T, np.float32)
        if hw.qt.fmt == "int8":
            xq = np.empty((T, hw.cols), np.int16)
            self._k.quant_x8(x, xq, sx)
            return xq.reshape(T, blocks, bb), sx
        if hw.fold:  # activations in the weight's lanes [T, C, J, L], with Σ xq per lane [T, C·L]
            xe4 = np.empty((T, *hw.data3.shape[1:]), np.int16)
            xo4 = np.empty_like(xe4)
            xsl = np.empty((T, hw.data3.shape[1] * hw.data3.shape[3]), np.int32)
            self._k.quant_x4t(x, hw.cols // hw.group, hw.fold, xe4, xo4, sx, xsl)
            return xe4, xo4, sx, xsl
        xe = np.empty((T, hw.cols // 2), np.int16)
        xo = np.empty((T, hw.cols // 2), np.int16)
        xsum = np.empty((T, hw.cols // hw.group), np.int32)
        self._k.quant_x4(x, hw.group, xe, xo, sx, xsum)
        return xe.reshape(T, blocks, bb), xo.reshape(T, blocks, bb), sx, xsum

    def _matmul(self, x: np.ndarray, w: DeviceWeight) -> np.ndarray:
        hw: HostWeight = w.payload
        qt = hw.qt
        if hw.kernel is None:  # float formats, int2
            if qt.fmt != "int2":
                return matmul_blocks(x, qt)  # the numpy backend's float32 BLAS path
            y = np.empty((x.shape[0], qt.out_features), np.float32)  # [T, out]
            x0, d1, d2, d3, xsum = int2_activations(x, qt.data.shape[1])
            self._par(qt.out_features, self._k.q2_matmul, qt.data, qt.scales, x0, d1, d2, d3, xsum, y)
            return y
        return self._matmul_q(self._xq(x, hw), x.shape[0], hw)

    def _matmul_q(self, xa: tuple, tokens: int, hw: HostWeight) -> np.ndarray:
        """y float32 [tokens, out] of an integer weight ``hw`` on activations ``xa`` already quantized
        for its layout (:meth:`_xq`)."""
        qt = hw.qt
        y = np.empty((tokens, qt.out_features), np.float32)  # [T, out]
        if hw.serial is not None and qt.nbytes * tokens <= self.serial_limit(hw):
            hw.serial(hw.data3, hw.scales2, *xa, y)  # small: this thread, no pool wake-up, no lock
            return y
        chunks = Q4T_CHUNKS if hw.fold else (I8_CHUNKS if hw.kernel is self._k.i8_matmul else 64)
        self._par(-(-qt.out_features // self._step_rows(hw)), hw.kernel, hw.data3, hw.scales2, *xa, y,
                  chunks=chunks)
        return y

    def serial_limit(self, hw: HostWeight) -> int:
        """Weight bytes × tokens up to which a matmul of ``hw`` runs its serial kernel: ``serial_bytes``, or
        the smaller ``serial_bytes_t`` (int4-g32 / g32h) / ``serial_bytes_8`` (int8) where it applies."""
        if hw.kernel is self._k.i4t_matmul:  # int4-g32 / g32h: their own, lower bound
            return min(self.serial_bytes, self.serial_bytes_t)
        if hw.kernel is self._k.i8_matmul:
            return min(self.serial_bytes, self.serial_bytes_8)
        return self.serial_bytes

    def _d_matmul_many(self, x, ws) -> list:
        """x [T, in] (a host DArray) · W_iᵀ for each weight of ``ws``: weights whose activations are
        quantized alike (:func:`_act_key`: q/k/v, gate/up of one format) share one quantization of x
        (the same numbers each would make: the same bits), the others run :meth:`_matmul`."""
        xh = np.ascontiguousarray(HostArrays._host(x))  # [T, in] float32
        shared: dict = {}
        out = []
        for w in ws:
            hw: HostWeight = w.payload
            key = _act_key(hw)
            if key is None:
                out.append(self._matmul(xh, w))
                continue
            xa = shared.get(key)
            if xa is None:
                xa = shared[key] = self._xq(xh, hw)
            out.append(self._matmul_q(xa, xh.shape[0], hw))
        return out

    def _d_add_rmsnorm(self, a, b, weight, eps: float) -> tuple:
        # h = a + b and its RMSNorm in one kernel call: the bits of _d_add then _d_rmsnorm
        aa, bb = HostArrays._host(a), HostArrays._host(b)  # [N, d] each
        h, out = np.empty(aa.shape, np.float32), np.empty(aa.shape, np.float32)
        self._k.add_rms_norm(aa, bb, HostArrays._host(weight).reshape(1, -1), np.float32(eps), h, out)
        return h, out

    def _d_rope(self, x, table, pos0: int, rotary_dim: int, interleave: bool):
        # one kernel call for reference.rope_ref's eight numpy ops (its bits)
        xx = HostArrays._host(x)  # [T, heads, d]
        out = np.empty(xx.shape, np.float32)
        self._k.rope(xx, HostArrays._host(table), int(pos0), int(rotary_dim), bool(interleave), out)
        return out

    def _par(self, iterations: int, kernel, *args, chunks: int = 64) -> None:
        """``kernel(*args)`` under the process lock, its ``iterations`` prange steps scheduled dynamically
        in ``chunks`` chunks (64: one 32-row tile for a 2048-row weight): a core that is descheduled on a
        shared machine then stalls one chunk, not half the rows (measured 34 vs 29 GB/s with static
        halves on an idle 2-core host)."""
        _run_parallel(self._setchunk, max(1, iterations // chunks), kernel, *args)

    def _step_rows(self, hw: HostWeight) -> int:
        """Output rows one prange step of ``hw``'s kernels covers: q4t's TILE_ROWS (128) for the
        transposed int4 layouts (q4g's too), qkernels' ROW_TILE (32) for the blocked ones; the
        chunk count of :meth:`_par` holds only if its iterations are counted in the kernel's own steps."""
        return self._k.TILE_ROWS if hw.fold else self._k.ROW_TILE

    def _d_rmsnorm(self, x, weight, eps: float):
        # one kernel call for every row, the numpy formula's bits
        out = np.empty(x.shape, np.float32)  # [N, d]
        self._k.rms_norm(HostArrays._host(x), HostArrays._host(weight).reshape(1, -1), np.float32(eps), out)
        return out

    def _d_attention(self, q, k, v, n_keys: int, pos0: int, scale: float, window: int):
        qq, kk, vv = (HostArrays._host(a) for a in (q, k, v))  # [T, Hq, d], [C, Hkv, d] x2
        out = np.empty((qq.shape[0], qq.shape[1] * qq.shape[2]), np.float32)  # [T, Hq·d]
        self._par(qq.shape[0] * qq.shape[1], self._k.gqa_attention, qq, kk, vv, n_keys, pos0,
                  np.float32(scale), window, out)
        return out


def _act_key(hw: HostWeight) -> tuple | None:
    """What :meth:`CpuBackend._xq` reads of ``hw`` (format, padded columns, group, fold, activation
    block shape): weights of one key take the same quantized activations; None for the float / int2
    path (not quantized per call)."""
    if hw.kernel is None:
        return None
    return hw.qt.fmt, hw.cols, hw.group, hw.fold, hw.data3.shape[1:]


BACKEND = CpuBackend
