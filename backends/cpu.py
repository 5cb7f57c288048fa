"""The ``cpu`` backend: the engine's fast host path, numba kernels on all cores.

int8, int4 and int4-gG weights run the integer kernels of :mod:`colibri_plan.backends.cpu_qkernels`:
activations quantized to int16 once per call (one scale per token), int8/int4 × int16 products summed
in int32 (``vpdpwssd`` on AVX-512 VNNI), the packed bytes unpacked in registers, never dequantized to
memory. Tiles of rows run in parallel, every token of a batch per tile, so a GEMV streams each weight
byte from RAM once and a prefill batch of T tokens reads it once too (from L2 for tokens 2..T).
A matmul of at most ``serial_bytes`` (weight bytes × tokens, 2 MiB) runs a single-thread twin of its
kernel, chosen at upload with it (``HostWeight.kernel``/``serial``, same bits): waking the pool costs
more than such a matmul gains from a second core.
int2 and ``attention_absorb`` (MLA decode) run the float kernels of :mod:`~colibri_plan.backends.cpu_kernels`;
``d_attention`` (GQA over a KV cache) runs :mod:`~colibri_plan.backends.cpu_attention`. Float formats
(f32/f16/bf16) use the numpy reference path (float32 BLAS, f16/bf16 converted a block of rows at a
time). Weights stay in host memory, referenced, not copied (rows of odd length excepted: padded).

Routed experts: all experts of a layer run in one parallel call per projection (``_experts_batch``).

Figures (``bench/cpu_gemv.py``, ``bench/results/cpu-gemv.json``, a shared 2-core AVX-512 VM): GEMVs
at trunk / GLM-5.2 expert shapes read weights at 0.72-0.96 (int8), 0.66-0.81 (int4), 0.63-0.76
(int4-g32) of the RAM read bandwidth measured beside them; 1-2 MB matrices are bound by the ~70 µs
cost of a call.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from colibri_plan.backends.base import DeviceInfo, DeviceWeight, ExpertWeights
from colibri_plan.backends.numpy_ref import NumpyBackend, host_device, package_version
from colibri_plan.errors import BackendUnavailableError
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

        from colibri_plan.backends import cpu_attention, cpu_kernels, cpu_q4t, cpu_qkernels  # heavy: numba

        ns = types.SimpleNamespace()
        for mod in (cpu_kernels, cpu_qkernels, cpu_q4t, cpu_attention):
            ns.__dict__.update({k: v for k, v in vars(mod).items() if not k.startswith("__")})
        ns.ROW_TILE = cpu_qkernels.ROW_TILE
        _kernels = ns
    return _kernels


class _Parallel:
    """Holds the kernel lock and sets numba's parallel chunk size for one call (restored after)."""

    def __init__(self, numba, chunk: int):
        self.numba, self.chunk, self.old = numba, chunk, 0

    def __enter__(self):
        _KERNEL_LOCK.acquire()
        try:
            self.old = self.numba.set_parallel_chunksize(self.chunk)
        except BaseException:
            _KERNEL_LOCK.release()
            raise

    def __exit__(self, *exc):
        self.numba.set_parallel_chunksize(self.old)
        _KERNEL_LOCK.release()


class HostWeight(NamedTuple):
    """Payload of an uploaded weight: the packed QuantTensor plus the blocked views the integer kernels
    take (``cpu_qkernels``)."""

    qt: QuantTensor
    data3: np.ndarray | None = None  # int8 / int4 [out, blocks, bb]; int4-g32/g64 [out, C, J, L]
    scales2: np.ndarray | None = None  # float32 [out, groups] (int8/per-row int4: 1; transposed: per lane)
    cols: int = 0  # padded input columns the activations are quantized to
    group: int = 0  # int4: columns per zero-code group (per-row: ``cols``)
    fold: int = 0  # int4-g32/g64: parts each group is split in (transposed layout); 0: blocked layout
    kernel: object = None  # the parallel matmul kernel of this layout (chosen once, at upload)
    serial: object = None  # its single-thread twin (same bits) for small matmuls; None: always parallel


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


def int_layout(qt: QuantTensor, k) -> HostWeight:
    """The blocked views of an int8 / int4 / int4-gG weight for the kernels of ``k`` (cpu_qkernels'
    ``BLOCKS8``/``BLOCKS4``): no copy unless a row does not end on a whole block (then padded with the
    zero code; group scales of padding groups are 0.0 already)."""
    out, nb = qt.data.shape
    if qt.fmt == "int8":
        bb, pb = _block(nb, k.BLOCKS8)
        return HostWeight(qt, _padded(qt.data, pb, 0).reshape(out, -1, bb), qt.scales.reshape(out, 1), pb, pb)
    g = group_size(qt.fmt)
    if g is None:  # per-row int4: blocks of any size, one scale
        bb, pb = _block(nb, k.BLOCKS4)
        return HostWeight(qt, _padded(qt.data, pb, 0x88).reshape(out, -1, bb), qt.scales.reshape(out, 1),
                          2 * pb, 2 * pb)
    groups, bg = qt.scales.shape[1], g // 2
    data = _padded(qt.data, groups * bg, 0x88)
    if g == 128:  # 64-byte groups vectorise as blocks
        return HostWeight(qt, data.reshape(out, groups, bg), qt.scales, groups * g, g)
    # g32/g64 transposed: wt[r, j, g·fold + s] = byte s·(bg/fold) + j of group g
    fold = _fold(groups, k.FOLDS[bg])
    lane_scales = np.repeat(qt.scales, fold, axis=1) if fold > 1 else qt.scales  # [out, groups·fold]
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


class CpuBackend(NumpyBackend):
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
            self.serial_bytes = self._k.SERIAL_BYTES
        except Exception as exc:  # a broken numba/llvmlite install: say why, do not crash later
            raise BackendUnavailableError(f"cpu backend unavailable: numba failed to import: {exc}") from exc

    def _upload(self, qt: QuantTensor) -> HostWeight:
        qt = super()._upload(qt)
        if qt.fmt not in INT_FORMATS:
            return HostWeight(qt)
        hw, k = int_layout(qt, self._k), self._k
        if qt.fmt == "int8":
            pair = (k.i8_matmul, k.i8_matmul_1)
        elif hw.fold:
            pair = (k.i4t_matmul, k.i4t_matmul_1)
        elif hw.group == hw.cols:  # per-row int4
            pair = (k.i4r_matmul, k.i4r_matmul_1)
        else:  # int4-g128: reassociating parallel kernel only (cpu_qkernels.i4r_matmul)
            pair = (k.i4_matmul, None)
        return hw._replace(kernel=pair[0], serial=pair[1])

    def _xq(self, x: np.ndarray, hw: HostWeight):
        """Activations of x float32 [T, in] for ``hw``'s kernel: int8 (xq3 [T, blocks, bb], sx [T]);
        int4 (xe3, xo3 [T, blocks, bb] or, transposed, [T, C, J, L], sx [T], xsum [T, groups])."""
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
        if qt.fmt not in INT_FORMATS + ("int2",):
            return NumpyBackend._matmul(self, x, DeviceWeight(qt.fmt, qt.out_features, qt.in_features,
                                                              qt.nbytes, qt))
        y = np.empty((x.shape[0], qt.out_features), np.float32)  # [T, out]
        if qt.fmt == "int2":
            x0, d1, d2, d3, xsum = int2_activations(x, qt.data.shape[1])
            with self._parallel(qt.out_features):
                self._k.q2_matmul(qt.data, qt.scales, x0, d1, d2, d3, xsum, y)
            return y
        xa = self._xq(x, hw)
        if hw.serial is not None and qt.nbytes * x.shape[0] <= self.serial_bytes:
            hw.serial(hw.data3, hw.scales2, *xa, y)  # small: this thread, no pool wake-up, no lock
            return y
        with self._parallel(self._tiles(qt.out_features)):
            hw.kernel(hw.data3, hw.scales2, *xa, y)
        return y

    def _parallel(self, iterations: int):
        """Context for a kernel call: the process lock and dynamic scheduling of the kernel's prange
        steps in chunks of ~1/64 of the matrix (one 32-row tile for a 2048-row weight): a core that is
        descheduled on a shared machine then stalls one chunk, not half the rows (measured 34 vs 29
        GB/s with static halves on an idle 2-core host)."""
        return _Parallel(self._numba, max(1, iterations // 64))

    def _tiles(self, rows: int) -> int:
        return -(-rows // self._k.ROW_TILE)

    def _attention_absorb(self, q_abs, q_rope, latent, k_rope, scale) -> np.ndarray:
        out = np.empty_like(q_abs)  # [H, R], one head per parallel step
        with self._parallel(64):
            self._k.attention_absorb(q_abs, q_rope, latent, k_rope, np.float32(scale), out)
        return out

    def _d_attention(self, q, k, v, n_keys: int, pos0: int, scale: float, window: int):
        qq, kk, vv = self._host(q), self._host(k), self._host(v)  # [T, Hq, d], [C, Hkv, d] x2
        out = np.empty((qq.shape[0], qq.shape[1] * qq.shape[2]), np.float32)  # [T, Hq·d]
        with self._parallel(qq.shape[0] * qq.shape[1]):
            self._k.gqa_attention(qq, kk, vv, n_keys, pos0, np.float32(scale), window, out)
        return out

    def _expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        if not all(_batchable(e, experts[0]) for e in experts):  # mixed formats: one expert at a time
            return [NumpyBackend._expert_ffn(self, [x], [e])[0] for x, e in zip(xs, experts)]
        n = self._k.EXPERTS
        out: list[np.ndarray] = []
        for c in range(0, len(xs), n):  # all experts of a layer in one call per projection (cpu_qkernels)
            out.extend(self._experts_batch(xs[c:c + n], experts[c:c + n]))
        return out

    def _experts_batch(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]:
        """Up to EXPERTS experts of one layout: gate+up (SiLU·mul fused) then down, one call each."""
        n, k = len(xs), self._k
        offs = np.zeros(k.EXPERTS + 1, np.int64)
        offs[1: n + 1] = np.cumsum([x.shape[0] for x in xs])
        offs[n + 1:] = offs[n]  # padding experts own no tokens
        x = np.concatenate(xs) if n > 1 else xs[0]  # [ΣT, H]
        g0, d0 = experts[0].gate.payload, experts[0].down.payload
        h = np.empty((x.shape[0], g0.qt.out_features), np.float32)  # [ΣT, I]
        gw, gs, uw, us, dw, ds = ([getattr(getattr(e, m).payload, a) for e in experts]
                                  for m in ("gate", "up", "down") for a in ("data3", "scales2"))
        pad = k.EXPERTS - n
        with self._parallel(k.EXPERTS * self._tiles(h.shape[1])):
            gate_up = k.experts_gate_up_t if g0.fold else k.experts_gate_up
            gate_up(_kind(g0), *(tuple(v + v[:1] * pad) for v in (gw, gs, uw, us)), *self._xq_any(x, g0),
                    offs, h)
        y = np.empty((x.shape[0], d0.qt.out_features), np.float32)  # [ΣT, H]
        with self._parallel(k.EXPERTS * self._tiles(y.shape[1])):
            down = k.experts_matmul_t if d0.fold else k.experts_matmul
            down(_kind(d0), tuple(dw + dw[:1] * pad), tuple(ds + ds[:1] * pad), *self._xq_any(h, d0), offs, y)
        return [y[offs[i]: offs[i + 1]] for i in range(n)]

    def _xq_any(self, x: np.ndarray, hw: HostWeight):
        """(xa3, xb3, sx, xsum) for the batched kernels; int8 fills the unused slots."""
        a = self._xq(x, hw)
        return a if len(a) == 4 else (a[0], a[0], a[1], _NO_SUMS)


_NO_SUMS = np.zeros((1, 1), np.int32)


def _kind(hw: HostWeight) -> int:
    """Row kernel of a weight in the batched expert kernels: 0 int8, 1 int4 blocks, 2 transposed."""
    return 0 if hw.qt.fmt == "int8" else (2 if hw.fold else 1)


def _batchable(e: ExpertWeights, first: ExpertWeights) -> bool:
    """True when expert ``e`` runs in the same batched call as ``first``: integer formats, the same
    layout for each projection, gate and up alike."""
    g, u, d = (w.payload for w in e)
    g0, d0 = first.gate.payload, first.down.payload
    return (g.qt.fmt in INT_FORMATS and g.qt.fmt == u.qt.fmt == g0.qt.fmt and d.qt.fmt == d0.qt.fmt
            and d.qt.fmt in INT_FORMATS and g.data3.shape == u.data3.shape == g0.data3.shape
            and g.fold == u.fold == g0.fold and d.data3.shape == d0.data3.shape and d.fold == d0.fold)


BACKEND = CpuBackend
