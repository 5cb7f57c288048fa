"""Kernel instances and launch shapes of the CUDA backend (:class:`Launcher`, a part of
:class:`~colibri_plan.backends.cuda.backend.CUDABackend`), with the tuning tables they read.

The matmul kernels (``shaders/cuda/matmul.cu`` GEMV, ``prefill.cu`` tensor cores at T > 1,
``decode_imma.cu`` integer tensor cores at T = 1) are template instances compiled by NVRTC on first use,
one per (kernel, format, shape); a launch's grid, block and shared bytes are chosen once per call shape
and cached. Benchmarks and tests set the module-level tables below (read at call time) and clear the
backend's ``_launchers`` afterwards.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from colibri_plan.backends import programs
from colibri_plan.errors import UnsupportedError
from colibri_plan.quant import group_size

_GSHIFT = {32: 0, 64: 1, 128: 2}  # log2(G / 32): 16-byte words of int4 per group
_WARPS = 8  # warps per block
# (rows per warp tile R, 16-byte words per lane per step U): R·U (mm) or 2·R·U (gate_up) loads per lane in
# flight, twice over (bench/cuda_expert_ffn.py --tune; cp.async shared-memory staging: ~20% slower, H200)
_SHAPE = {"mm": (4, 1), "gate_up": (2, 1)}  # mm_args takes mm's (the same kernel, its table an argument)
# Per format family (int4 and int4-gG: "int4"; others their name) settings of the GEMV kernels, over _SHAPE
# and _WARPS: "gate_up"/"mm": (R, U) (mm also mm_args), "warps" per block, "max_regs" (NVRTC
# --maxrregcount: more resident blocks, 0 = none), "x_by_part" (matmul.cu COLIBRI_X_BY_PART: activations
# a 32-bit part at a time, fewer registers), "fit_wave" (the grid rounds the resident blocks of all
# matrices down, not up: with 3 resident per SM, 8 matrices take 49 blocks each, not 50, whose 400 blocks
# would leave 4 of them for a second wave on 132 SMs). Empty: the defaults. bench/cuda_expert_ffn.py
# --gemv-sweep times the alternatives (_SWEEP there); tests/test_backend_cuda_gemv_tune.py checks them.
# int8: two words per lane per step, activations by part, one wave (H200 sweep, bench/results/h200-cuda-ffn/
# gemv-sweep.json: 8-expert FFN kernels 79.3 vs 86.8 us, 0.94 vs 0.86 of copy); int4: no setting beat the
# defaults there (0.49-0.57 of copy: ~5 instructions per weight at 2 weights per byte bound it, not loads)
# f32 (routers: 32-256 rows): one row a warp tile and four words a step, so a 32-row router is 32 warps with
# 4 steps each, not 8 warps streaming 16 latency-bound steps (11 us a call on an H200,
# bench/cuda_step_profile.py); a lane reads the same words in the same order, so the sums are unchanged
# int8 mm_args (the dense trunk's GEMVs, a decode token's q/k/v, o and LM head): a row a warp, as the H200
# A/B ran fastest (bench/results/h200-step-profile-r4/mm-args-ab.txt: GPU busy 1571 against 1624 us a token)
_GEMV_TUNE: dict[str, dict] = {"int8": {"gate_up": (2, 2), "mm": (4, 2), "mm_args": (1, 2), "x_by_part": True,
                                        "fit_wave": True},
                               "f32": {"mm": (1, 4)}}
# T > 1: shaders/cuda/prefill.cu's tensor-core kernels (same tables) replace these; 16-row subtiles per
# warp tile, and the formats they take (codes exact in bf16, 4 columns per k-step in one 32-bit part; the
# float formats and int2 keep the GEMV kernels). Tokens per pass: 8 for T <= 8, else 16 (NT column tiles).
_TC = {"mm": "mm_tc", "mm_args": "mm_args_tc", "gate_up": "gate_up_tc"}
_TC_R16 = {"mm_tc": 2, "mm_args_tc": 2, "gate_up_tc": 2}  # bench/cuda_expert_ffn.py --tc-rows, H200
_TC_FORMATS = frozenset({"int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g32h"})
_TC_MIN_TOKENS = 2  # benchmarks set 1 to time the tensor-core kernels at decode
# warps per block of the tensor-core kernels, splitting the columns (2..8, prefill.cu TC_WARPS at most):
# None: enough for ~16 warps per SM over the grid (few blocks, e.g. one dense matrix: 8; the 8 experts of
# a layer: 2-4, which ran 1.4-1.9x faster than 8 on an H200); benchmarks may fix it
_TC_WARPS: int | None = None
# T = 1, per-row int4: decode_imma.cu's integer tensor-core kernels (same tables) replace the GEMV ones.
# They take int8 too, but its GEMV is faster (H200 8-expert FFN kernels, h200-cuda-ffn/decode-imma.json:
# int4 52.0 against 70.1 us, int8 91.7 against 79.2)
_IMMA = {"mm": "mm_imma", "mm_args": "mm_args_imma", "gate_up": "gate_up_imma"}
_IMMA_FORMATS = frozenset({"int4"})
_IMMA_OPS = frozenset({"mm", "mm_args", "gate_up"})  # the kernels that take them (benchmarks narrow it)
_IMMA_SHAPE = {"mm": (2, 8), "gate_up": (1, 8)}  # (16-row subtiles a tile, warps a block); mm_args: mm's
_IMMA_MIN_BLOCKS = 2  # resident 8-warp blocks per SM the registers must allow (IM_MIN_BLOCKS: launch bounds)
_IMMA_STAGES = 3  # steps of each warp's weight ring, 2 in flight (IM_STAGES; H200 49.6 us, 2: 51.1, 4: 55.9)
_IMMA_STATIC_SMEM = 4096  # decode_imma.cu's red array per 16-row subtile and matrix, bytes (+ 256: part)
_SOURCES = ("matmul.cu", "prefill.cu", "decode_imma.cu")  # one NVRTC source, in this order
_NVRTC_OPTIONS = ("--std=c++14",)  # benchmarks add -DCOLIBRI_READ_ONLY (loads without arithmetic)
_TOKENS_PER_PASS = 4  # T > 1: tokens summed per read of the weights (their activations in shared memory)


#: the kernels of shaders/cuda/trunk.cu (the device-activation ops'), compiled as one module
_TRUNK_KERNELS = ("tr_add", "tr_silu_mul", "tr_scale_rows", "tr_rope", "tr_pad_rows", "tr_expert_sum",
                  "tr_expert_scatter", "tr_rope_at", "tr_copy_rows_at", "tr_expert_table", "tr_qkv_prologue",
                  "tr_qkv_prologue_at")


#: NVRTC sources compiled after others, as one: route_fused.cu reuses matmul.cu's GEMV and route.cu's rule
_MODULES = {"route_fused.cu": ("matmul.cu", "route.cu", "route_fused.cu")}


def _family(fmt: str) -> str:
    return "int4" if fmt.startswith("int4") else fmt


def _gemv_shape(name: str, fmt: str) -> tuple[int, int, int, int, bool, bool]:
    """(R rows per warp tile, U words per lane per step, warps per block, max registers or 0, x by part,
    fit wave) of GEMV kernel ``name`` for ``fmt``: _GEMV_TUNE's family entry over _SHAPE and _WARPS."""
    # mm_args (the dense trunk's GEMVs) takes mm's shape unless the family sets an "mm_args" of its own (a
    # lane reads the same words in the same order whatever R and U: the sums keep their bits)
    t, key = _GEMV_TUNE.get(_family(fmt), {}), "mm" if name == "mm_args" else name
    r, u = t.get(name, t.get(key, _SHAPE[key]))
    return (int(r), int(u), int(t.get("warps", _WARPS)), int(t.get("max_regs", 0)), bool(t.get("x_by_part")),
            bool(t.get("fit_wave")))


def _imma_shape(name: str) -> tuple[int, int]:
    """(16-row subtiles per tile, warps per block) of decode_imma.cu kernel ``name``."""
    r16, warps = _IMMA_SHAPE["gate_up" if name.startswith("gate_up") else "mm"]
    return int(r16), int(warps)


class Launcher:
    """NVRTC-compiled kernel instances and cached launch shapes on one device.

    Args:
        cp: the ``cupy`` module; dev: the ``cupy.cuda.Device``; sms: its multiprocessor count.

    Attributes (cleared by :meth:`clear`): ``fns`` compiled functions and modules, ``occupancy`` resident
    blocks per kernel, ``opted_in`` dynamic shared bytes a kernel was allowed past 48 KiB, ``launchers``
    launch shapes per call shape.
    """

    def __init__(self, cp, dev, sms: int):
        self.cp, self.dev, self.sms = cp, dev, sms
        # prefill.cu and decode_imma.cu use matmul.cu's formats and decoders: one NVRTC source
        self.src = "".join(programs.kernel_source("cuda", f) for f in _SOURCES)
        self.fns: dict[str, Any] = {}
        self.occupancy: dict[tuple, int] = {}
        self.opted_in: dict[str, int] = {}  # kernel -> dynamic shared bytes it was allowed (above 48 KiB)
        self.launchers: dict[tuple, tuple] = {}

    def clear(self) -> None:
        for cache in (self.fns, self.occupancy, self.opted_in, self.launchers):
            cache.clear()

    def smem_limit(self) -> int:
        return int(self.dev.attributes.get("MaxSharedMemoryPerBlockOptin", 48 * 1024))

    def fn(self, name: str, fmt: str, tc: int, smem: int):
        """The kernel instance ``name<format, R, U, tc>`` (prefill.cu's ``name<format, R16, NT>``, tc = NT;
        decode_imma.cu's ``name<format, R16>``), compiled by NVRTC on first use (one module each: only the
        formats a model uses are compiled; CuPy caches the binaries on disk), allowed ``smem`` bytes of
        dynamic shared memory. Raises UnsupportedError when those and its static bytes pass the device's."""
        options = _NVRTC_OPTIONS
        if name in _TC_R16:
            params = (_TC_R16[name], tc)
        elif name in _IMMA.values():
            params = (_imma_shape(name)[0],)
            options += (f"-DIM_MIN_BLOCKS={_IMMA_MIN_BLOCKS}", f"-DIM_STAGES={_IMMA_STAGES}")
        else:
            r, u, _, max_regs, by_part, _ = _gemv_shape(name, fmt)
            params = (r, u, tc)
            options += ((f"--maxrregcount={max_regs}",) if max_regs else ()) + (
                ("-DCOLIBRI_X_BY_PART",) if by_part else ())
        key = f"{name}<{programs.kernel_format(fmt)},{','.join(map(str, params))}>"
        fkey = f"{key} {' '.join(options)}"  # the options too: benchmarks change _NVRTC_OPTIONS (read-only)
        fn = self.fns.get(fkey)
        # CuPy keeps functions per device, picked by the calling thread's current device (engine threads: 0)
        with self.dev:
            if fn is None:
                mod = self.cp.RawModule(code=self.src, options=options, name_expressions=[key])
                fn = self.fns[fkey] = mod.get_function(key)
            # past 48 KiB of static (decode_imma.cu's) and dynamic shared memory together a block must opt in
            static = int(getattr(fn, "shared_size_bytes", 0) or 0)
            # set by us, and only ever raised: a cached launch of the same function may need more than this
            # one (the attribute's default, 48 KiB less the static bytes or not, differs between stacks)
            if smem + static > 48 * 1024 and self.opted_in.get(fkey, 0) < smem:
                limit = self.smem_limit()
                if smem + static > limit:
                    raise UnsupportedError(f"cuda: {name} needs {smem + static} B of shared memory, "
                                           f"{limit} B allowed")
                fn.max_dynamic_shared_size_bytes = self.opted_in[fkey] = smem
        return fn

    def resident(self, fn, smem: int, warps: int = _WARPS) -> int:
        """Blocks of ``fn`` (``warps`` per block) that fit on one SM at once (CUDA occupancy calculator);
        2 if unknown."""
        key = (fn.__name__, id(fn), smem, warps)  # compiled variants of one name differ in registers
        if key not in self.occupancy:
            try:
                with self.dev:
                    n = self.cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                        fn.kernel.ptr, 32 * warps, smem)
            except Exception:  # noqa: BLE001 - older CuPy without the binding
                n = 2
            self.occupancy[key] = max(1, int(n))
        return self.occupancy[key]

    def config(self, name: str, fmt: str, n_mats: int, rows_grid: int, rows: int, in_pad: int,
               stride: int, T: int):
        """(kernel, grid, block, shared bytes, scalar args) of one launch, cached: calls stay cheap."""
        key = (name, fmt, n_mats, rows_grid, rows, in_pad, stride, T)
        hit = self.launchers.get(key)
        if hit is None:
            scalars = tuple(np.int32(v) for v in (rows, in_pad, stride, _GSHIFT.get(group_size(fmt), 0)))
            if T >= _TC_MIN_TOKENS and fmt in _TC_FORMATS:  # prefill: tensor cores, each weight once per pass
                name = _TC[name]
                nt = 1 if T <= 8 else 2  # mma column tiles of 8 tokens per pass
                fn = self.fn(name, fmt, nt, 0)
                # a block per (row tile, token pass), its warps splitting the columns
                items = -(-rows_grid // (16 * _TC_R16[name])) * -(-T // (8 * nt))
                warps = _TC_WARPS or min(8, max(2, round(16 * self.sms / (items * n_mats))))
                hit = self.launchers[key] = (fn, (items, n_mats), (32 * warps,), 0, scalars)
                return hit
            r16, warps = _imma_shape(_IMMA[name])
            # decode_imma.cu: x as fixed-point limbs (4 bytes a column), then each warp's ring of weight steps
            # (a step: rows g and g + 8 of each subtile and matrix, a 16-byte word of each of 32 lanes)
            nm = 2 if name == "gate_up" else 1
            smem = in_pad * 4 + warps * _IMMA_STAGES * nm * r16 * 2 * 512
            static = _IMMA_STATIC_SMEM * nm * r16 + 256
            if T == 1 and fmt in _IMMA_FORMATS and name in _IMMA_OPS and smem + static <= self.smem_limit():
                name = _IMMA[name]
                fn = self.fn(name, fmt, 1, smem)
                tiles, slots = -(-rows_grid // (16 * r16)), self.resident(fn, smem, warps) * self.sms
                # one resident wave over all matrices, then as few blocks as give each the same tile count
                per = -(-tiles // max(1, min(tiles, slots // n_mats)))
                hit = self.launchers[key] = (fn, (-(-tiles // per), n_mats), (32 * warps,), smem, scalars)
                return hit
            # tokens per pass: 1 for decode; _TOKENS_PER_PASS for T > 1 when they fit in shared memory
            tc = _TOKENS_PER_PASS if T > 1 and _TOKENS_PER_PASS * in_pad * 4 <= self.smem_limit() else 1
            smem = tc * in_pad * 4
            fn = self.fn(name, fmt, tc, smem)
            r, _, warps, _, _, fit_wave = _gemv_shape(name, fmt)
            warp_tiles, slots = -(-rows_grid // r), self.resident(fn, smem, warps) * self.sms
            # one wave of resident blocks over all matrices; each warp streams its row tiles
            wave = slots // n_mats if fit_wave else -(-slots // n_mats)
            blocks = max(1, min(-(-warp_tiles // warps), wave))
            hit = self.launchers[key] = (fn, (blocks, n_mats), (32 * warps,), smem, scalars)
        return hit

    def module_fn(self, name: str):
        """Kernel ``name`` of trunk.cu / attention.cu / route.cu / route_fused.cu (after matmul.cu and
        route.cu: _MODULES) / matmul.cu (rmsnorm: d_rmsnorm's), a CuPy RawKernel, compiled by NVRTC once per
        source file on first use (CuPy caches the binaries)."""
        fn = self.fns.get(name)
        if fn is None:
            source = ("trunk.cu" if name in _TRUNK_KERNELS else "matmul.cu" if name == "rmsnorm"
                      else "route.cu" if name == "route_topk" else "route_fused.cu" if name == "route_fused"
                      else "attention.cu")
            with self.dev:
                mod = self.fns.get(source)
                if mod is None:
                    code = "".join(programs.kernel_source("cuda", f) for f in _MODULES.get(source, (source,)))
                    mod = self.fns[source] = self.cp.RawModule(code=code,
                                                                options=("--std=c++14",))  # cuda.py's
                fn = self.fns[name] = mod.get_function(name)
        return fn
