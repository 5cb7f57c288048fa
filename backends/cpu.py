"""The ``cpu`` backend: the engine's fast host path, numba kernels on all cores.

int8, int4 and int4-gG weights run integer kernels: :mod:`colibri_plan.backends.cpu_qkernels` (int8;
per-row int4 and int4-g128 of other lengths, blocked), :mod:`~colibri_plan.backends.cpu_q4t` (int4-g32,
transposed layout) and :mod:`~colibri_plan.backends.cpu_q4g` (int4-g64; per-row int4 of 512·n bytes a
row and int4-g128 of 16·n groups, transposed, each group's lanes summed in int32), both with explicit
AVX-512 VNNI code of :mod:`~colibri_plan.backends.cpu_vnni`: activations quantized to int16
once per call (one scale per token), int8/int4 × int16 products summed in int32 (``vpdpwssd`` on
AVX-512 VNNI), the packed bytes unpacked in registers, never dequantized to memory. Tiles of rows run
in parallel, every token of a batch per tile, so a GEMV streams each weight byte from RAM once and a
prefill batch of T tokens reads it once too (from L2 for tokens 2..T).
A matmul of at most ``serial_bytes`` (weight bytes × tokens, 2 MiB) runs a single-thread twin of its
kernel, chosen at upload with it (``HostWeight.kernel``/``serial``, same bits): waking the pool costs
more than such a matmul gains from a second core.
int2 and ``attention_absorb`` (MLA decode) run the float kernels of :mod:`~colibri_plan.backends.cpu_kernels`;
``d_attention`` (GQA over a KV cache) runs :mod:`~colibri_plan.backends.cpu_attention`. Float formats
(f32/f16/bf16) use the numpy reference path (float32 BLAS, f16/bf16 converted a block of rows at a
time). Weights stay in host memory, referenced, not copied (rows of odd length excepted: padded),
except the transposed int4 layouts: a copy, and the payload then holds no reference to the packed rows.

Routed experts: all experts of a layer run in one parallel call per projection, and a decode step's
weighted sum of them in one backend call (:mod:`~colibri_plan.backends.cpu_experts`).

Figures (``bench/cpu_gemv.py --repeats 7 --prefill 16``, ``bench/results/cpu-gemv.json``, a shared
2-core AVX-512 VNNI VM): GEMVs at trunk / GLM-5.2 expert shapes read weights at 0.97-1.05 (int8),
0.68-0.75 (int4), 0.81-0.83 (int4-g32), 0.72-0.77 (int4-g64), 0.60-0.64 (int4-g128) of the median RAM
read bandwidth measured between them (31.1 GB/s); the 1-2 MB matrices of the peer model 0.45-0.77,
where a call's fixed cost weighs more. The int4 / g64 / g128 figures are of the kernels before
``cpu_q4g``; docs/backends.md ("Figures") has both, and the per-call cost that now holds them back.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from typing import NamedTuple

import numpy as np

from colibri_plan.backends.base import DeviceInfo, DeviceWeight
from colibri_plan.backends.cpu_experts import CpuExperts
from colibri_plan.backends.numpy_ref import NumpyBackend, host_device, package_version
from colibri_plan.errors import BackendUnavailableError, InputError
from colibri_plan.quant import FORMATS, GROUP_FORMATS, QuantTensor, group_size

#: formats of the integer kernels; int2 has a float kernel, the rest go through the numpy path
INT4_FORMATS = ("int4",) + GROUP_FORMATS
INT_FORMATS = ("int8",) + INT4_FORMATS

# numba's "workqueue" threading layer (used when OpenMP and TBB are missing) must not be entered from
# two threads at once; one lock per process costs ~100 ns per call, and two concurrent GEMVs on the
# same cores would not be faster
_KERNEL_LOCK = threading.Lock()
_kernels = None


def _load_kernels():
    """Import (and on first use, compile or load from cache) the numba kernels: a namespace holding the
    functions of ``cpu_kernels`` (float), ``cpu_qkernels`` (integer, batched experts), ``cpu_q4t``
    (int4-g32/g64) and ``cpu_attention``."""
    global _kernels
    if _kernels is None:
        import types

        from colibri_plan.backends import (  # heavy: numba
            cpu_attention,
            cpu_kernels,
            cpu_q4g,
            cpu_q4t,
            cpu_qkernels,
        )

        ns = types.SimpleNamespace()
        for mod in (cpu_kernels, cpu_qkernels, cpu_q4g, cpu_q4t, cpu_attention):  # public names differ
            ns.__dict__.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
        _kernels = ns
    return _kernels


#: dynamic chunks of a transposed int4 matmul (cpu_q4t's / cpu_q4g's 128-row steps): 16, the count its
#: kernels were measured with; 64 chunks of 128 rows read RAM slower (8 weights of 8192x2048 from RAM,
#: one token: 25.5 vs 26.8 GB/s, best of 15, three interleaved rounds, shared 2-core host)
Q4T_CHUNKS = 16


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


class HostWeight(NamedTuple):
    """Payload of an uploaded weight: the packed QuantTensor (its rows a zero-stride stand-in for the
    transposed layouts, :func:`_without_rows`) plus the layout the integer kernels take
    (:func:`int_layout`) and those kernels (:func:`_layout_kernels`)."""

    qt: QuantTensor
    data3: np.ndarray | None = None  # blocked int8 / int4 [out, blocks, bb]; transposed int4 [out, C, J, L]
    # float32 [out, groups] (int8 / per-row int4: 1; int4-g32 transposed: per lane, groups·fold)
    scales2: np.ndarray | None = None
    cols: int = 0  # padded input columns the activations are quantized to
    group: int = 0  # int4: columns per zero-code group (per-row: ``cols``)
    fold: int = 0  # transposed int4: lanes each group (per-row: row) is split in; 0: blocked layout
    kernel: object = None  # the parallel matmul kernel of this layout (chosen once, at upload)
    serial: object = None  # its single-thread twin (same bits) for small matmuls; None: always parallel
    key: tuple | None = None  # (format, data3 shape, fold): one key, one batched call; None: float/int2
    experts: tuple | None = None  # the batched experts' (gate+up, down) kernels of this layout


def _without_rows(qt: QuantTensor) -> QuantTensor:
    """``qt`` with its data replaced by a read-only zero-stride view of its shape and dtype (no memory;
    ``nbytes`` unchanged): the payload of a weight whose kernels read a transposed copy, so that the
    packed rows are not held twice (an uploaded per-row int4 weight held its view of them, a
    transposed one would hold both)."""
    return QuantTensor(qt.fmt, qt.out_features, qt.in_features,
                       np.broadcast_to(np.zeros((), qt.data.dtype), qt.data.shape), qt.scales)


def _layout_kernels(k, hw: HostWeight) -> tuple:
    """(parallel matmul, its serial twin or None, batched experts' gate+up, down) kernels of ``hw``'s
    layout in the kernel namespace ``k``: cpu_qkernels (int8, blocked int4), cpu_q4t (int4-g32
    transposed) or cpu_q4g (per-row int4, int4-g64, int4-g128 transposed: groups summed in int32)."""
    fmt = hw.qt.fmt
    if fmt == "int8":
        return k.i8_matmul, k.i8_matmul_1, k.experts_gate_up, k.experts_matmul
    if hw.fold:
        if fmt == "int4-g32":
            return k.i4t_matmul, k.i4t_matmul_1, k.experts_gate_up_t, k.experts_matmul_t
        return k.i4g_matmul, k.i4g_matmul_1, k.experts_gate_up_g, k.experts_matmul_g
    if hw.group == hw.cols:  # per-row int4 blocks
        return k.i4r_matmul, k.i4r_matmul_1, k.experts_gate_up, k.experts_matmul
    # int4-g128 blocks: reassociating parallel kernel only (cpu_qkernels.i4r_matmul)
    return k.i4_matmul, None, k.experts_gate_up, k.experts_matmul


def _block(nbytes: int, sizes: tuple[int, ...]) -> tuple[int, int]:
    """(block bytes, padded row bytes): the largest size dividing the row, else the smallest, padded."""
    for bb in sizes:
        if nbytes % bb == 0:
            return bb, nbytes
    return sizes[-1], -(-nbytes // sizes[-1]) * sizes[-1]


def _padded(data: np.ndarray, nbytes: int, fill: int) -> np.ndarray:
    if data.shape[1] == nbytes:
        return data
    p = np.full((data.shape[0], nbytes), fill, data.dtype)  # a copy, only for rows of odd length
    p[:, : data.shape[1]] = data
    return p


#: per-row int4 rows of a multiple of this many bytes take the transposed layout of cpu_q4g (16 bytes
#: a lane when the row is a multiple of 1024 bytes, else 8: whole chunks of 64 lanes)
ROW_BYTES_T = 512


def int_layout(qt: QuantTensor, k) -> HostWeight:
    """The kernel layout of an int8 / int4 / int4-gG weight for the kernels of ``k``: blocked views
    (cpu_qkernels' ``BLOCKS8``/``BLOCKS4``: int8, per-row int4 of other lengths, int4-g128 of other
    group counts; no copy unless a row does not end on a whole block, then padded with the zero code;
    group scales of padding groups are 0.0 already) or transposed copies (``fold`` > 0: int4-g32 for
    cpu_q4t with per-lane scales; int4-g64, int4-g128 of 16·n groups, per-row int4 of 512·n bytes for
    cpu_q4g with the scales as stored)."""
    out, nb = qt.data.shape
    if qt.fmt == "int8":
        bb, pb = _block(nb, k.BLOCKS8)
        return HostWeight(qt, _padded(qt.data, pb, 0).reshape(out, -1, bb), qt.scales.reshape(out, 1), pb, pb)
    g = group_size(qt.fmt)
    scales = np.ascontiguousarray(qt.scales, dtype=np.float32)
    if g is None:
        if nb % ROW_BYTES_T == 0:  # per-row int4 transposed (cpu_q4g): one group of nb / J lanes
            J = 16 if nb % (2 * ROW_BYTES_T) == 0 else 8
            return HostWeight(qt, _lanes(qt.data, 1, nb // J, J), scales.reshape(out, 1), 2 * nb, 2 * nb,
                              nb // J)
        bb, pb = _block(nb, k.BLOCKS4)  # other rows: blocks of any size, one scale (cpu_qkernels)
        return HostWeight(qt, _padded(qt.data, pb, 0x88).reshape(out, -1, bb), scales.reshape(out, 1),
                          2 * pb, 2 * pb)
    groups, bg = scales.shape[1], g // 2
    data = _padded(qt.data, groups * bg, 0x88)
    if g == 128:
        if groups % 16 == 0:  # transposed, fold 4 (cpu_q4g): chunks of 64 lanes are 16 whole groups
            return HostWeight(qt, _lanes(data, groups, 4, 16), scales, groups * g, g, 4)
        return HostWeight(qt, data.reshape(out, groups, bg), scales, groups * g, g)  # blocks (cpu_qkernels)
    # g32/g64 transposed: wt[r, j, g·fold + s] = byte s·(bg/fold) + j of group g
    fold = _fold(groups, k.FOLDS[bg])
    if g == 64:  # cpu_q4g sums a group's lanes in int32: its own scales, [out, groups]
        return HostWeight(qt, _lanes(data, groups, fold, bg // fold), scales, groups * g, g, fold)
    lane_scales = np.repeat(scales, fold, axis=1) if fold > 1 else scales  # [out, groups·fold]
    return HostWeight(qt, _lanes(data, groups, fold, bg // fold), lane_scales, groups * g, g, fold)


def _fold(groups: int, folds: tuple[int, ...]) -> int:
    """Parts to split each group in: the fewest of ``folds`` making groups · parts a multiple of 64
    lanes (cpu_qkernels), else the most."""
    return next((f for f in folds if (groups * f) % 64 == 0), folds[-1])


def _lanes(a: np.ndarray, groups: int, fold: int, J: int) -> np.ndarray:
    """[N, groups·fold·J] (each group's bytes or activations in order) -> the transposed layout
    [N, C, J, L]: element j of part s of group g at lane g·fold + s, lanes in chunks of L = 64 (one
    chunk of every lane when their count is not a multiple of 64)."""
    n, K = a.shape[0], groups * fold
    L = 64 if K % 64 == 0 else K
    t = a.reshape(n, groups, fold, J).transpose(0, 3, 1, 2).reshape(n, J, K // L, L)  # [N, J, C, L]
    return np.ascontiguousarray(t.transpose(0, 2, 1, 3))


def int2_activations(x: np.ndarray, nbytes: int):
    """(x0, d1, d2, d3, xsum) for ``q2_matmul``: planes float32 [T, nbytes] and xsum float32 [T]."""
    T, n = x.shape
    xp = np.zeros((T, 4 * nbytes), np.float32)
    xp[:, :n] = x
    p = [xp[:, i::4] for i in range(4)]
    planes = [p[0]] + [p[i] - np.float32(4.0) * p[i - 1] for i in (1, 2, 3)]
    xsum = x.sum(axis=1, dtype=np.float64).astype(np.float32)
    return (*[np.ascontiguousarray(a) for a in planes], xsum)


class CpuBackend(CpuExperts, NumpyBackend):
    """numba kernels on every core of the host (see the module docstring).

    Args:
        device: the host DeviceInfo.
        capacity_bytes: optional cap on held weight bytes (tests); None = unbounded.
    """

    name = "cpu"
    formats = FORMATS
    #: weight bytes × tokens up to which an integer matmul runs serially (cpu_qkernels.SERIAL_BYTES;
    #: 0: always parallel, as bench/cpu_gemv.py --compare-parallel measures)
    serial_bytes: int = 2 << 20

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            if importlib.util.find_spec("numba") is None:
                return "numba is not installed (pip install numba)"
        except (ImportError, ValueError) as exc:
            return f"numba cannot be found: {exc}"
        return None

    @classmethod
    def list_devices(cls) -> list[DeviceInfo]:
        if cls.unavailable_reason() is not None:
            return []
        try:
            threads = os.environ.get("NUMBA_NUM_THREADS") or str(os.cpu_count() or 1)
            driver = (f"numba {package_version('numba')}, llvmlite {package_version('llvmlite')}, "
                      f"{threads} threads")
            return [host_device(cls.name, cls.formats, driver)]
        except Exception:  # noqa: BLE001 - discovery never raises
            return []

    def _open(self) -> None:
        try:
            self._k = _load_kernels()
            import numba

            self._numba = numba
            self._setchunk = _chunk_setter(numba)
            self._layouts: dict[tuple, tuple] = {}
            self.serial_bytes = self._k.SERIAL_BYTES
            # offsets of n experts of one token each (decode), padded to EXPERTS (read-only use)
            e = self._k.EXPERTS
            self._offs1 = [np.minimum(np.arange(e + 1, dtype=np.int64), n) for n in range(e + 1)]
        except Exception as exc:  # a broken numba/llvmlite install: say why, do not crash later
            raise BackendUnavailableError(f"cpu backend unavailable: numba failed to import: {exc}") from exc

    def _upload(self, qt: QuantTensor) -> HostWeight:
        qt = super()._upload(qt)
        if qt.fmt not in INT_FORMATS:
            return HostWeight(qt)
        hw = int_layout(qt, self._k)
        kernel, serial, gate_up, down = _layout_kernels(self._k, hw)
        key = (qt.fmt, hw.data3.shape, hw.fold)
        key = self._layouts.setdefault(key, key)  # one object per layout: batches compare keys by identity
        if hw.fold:  # the kernels read the transposed copy only: do not keep the packed rows alive too
            qt = _without_rows(qt)
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
                return NumpyBackend._matmul(self, x, DeviceWeight(qt.fmt, qt.out_features, qt.in_features,
                                                                  qt.nbytes, qt))
            y = np.empty((x.shape[0], qt.out_features), np.float32)  # [T, out]
            x0, d1, d2, d3, xsum = int2_activations(x, qt.data.shape[1])
            self._par(qt.out_features, self._k.q2_matmul, qt.data, qt.scales, x0, d1, d2, d3, xsum, y)
            return y
        y = np.empty((x.shape[0], qt.out_features), np.float32)  # [T, out]
        xa = self._xq(x, hw)
        if hw.serial is not None and qt.nbytes * x.shape[0] <= self.serial_bytes:
            hw.serial(hw.data3, hw.scales2, *xa, y)  # small: this thread, no pool wake-up, no lock
            return y
        self._par(-(-qt.out_features // self._step_rows(hw)), hw.kernel, hw.data3, hw.scales2, *xa, y,
                  chunks=Q4T_CHUNKS if hw.fold else 64)
        return y

    def _par(self, iterations: int, kernel, *args, chunks: int = 64) -> None:
        """``kernel(*args)`` under the process lock, its ``iterations`` prange steps scheduled dynamically
        in ``chunks`` chunks (64: one 32-row tile for a 2048-row weight): a core that is descheduled on a
        shared machine then stalls one chunk, not half the rows (measured 34 vs 29 GB/s with static
        halves on an idle 2-core host)."""
        _run_parallel(self._setchunk, max(1, iterations // chunks), kernel, *args)

    def rmsnorm_rows(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        """The engine's float32 RMSNorm (``engine/attention.rmsnorm``: x / sqrt(Σx²/H + eps) · weight,
        Σx² in numpy's pairwise order) of each row of x float32 [R, H] in one kernel call
        (``cpu_kernels.rms_norm``), bit for bit; weight float32 [H], [1, H] or [R, H]. Returns a new
        float32 [R, H].

        Raises:
            InputError: x not 2-D, or a weight that does not broadcast over its rows.
        """
        x = np.ascontiguousarray(x, dtype=np.float32)
        w = np.ascontiguousarray(weight, dtype=np.float32)
        w = w.reshape(1, -1) if w.ndim == 1 else w
        if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1] or w.shape[0] not in (1, x.shape[0]):
            raise InputError(f"rmsnorm_rows: x must be [R, H] and weight [H], [1, H] or [R, H]; got "
                             f"{np.shape(x)}, {np.shape(weight)}")
        out = np.empty_like(x)
        self._k.rms_norm(x, w, np.float32(eps), out)
        return out

    def _step_rows(self, hw: HostWeight) -> int:
        """Output rows one prange step of ``hw``'s kernels covers: cpu_q4t's TILE_ROWS (128) for the
        transposed int4 layouts (cpu_q4g's too), cpu_qkernels' ROW_TILE (32) for the blocked ones; the
        chunk count of :meth:`_par` holds only if its iterations are counted in the kernel's own steps."""
        return self._k.TILE_ROWS if hw.fold else self._k.ROW_TILE

    def _attention_absorb(self, q_abs, q_rope, latent, k_rope, scale) -> np.ndarray:
        out = np.empty_like(q_abs)  # [H, R], one head per parallel step
        self._par(64, self._k.attention_absorb, q_abs, q_rope, latent, k_rope, np.float32(scale), out)
        return out

    def _d_attention(self, q, k, v, n_keys: int, pos0: int, scale: float, window: int):
        qq, kk, vv = self._host(q), self._host(k), self._host(v)  # [T, Hq, d], [C, Hkv, d] x2
        out = np.empty((qq.shape[0], qq.shape[1] * qq.shape[2]), np.float32)  # [T, Hq·d]
        self._par(qq.shape[0] * qq.shape[1], self._k.gqa_attention, qq, kk, vv, n_keys, pos0,
                  np.float32(scale), window, out)
        return out


BACKEND = CpuBackend
