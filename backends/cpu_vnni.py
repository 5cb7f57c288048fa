"""AVX-512 VNNI code for the ``cpu`` backend's numba kernels: llvmlite helpers of the intrinsics that write
``vpdpwssd`` (16 lanes of two int16 products each) where LLVM's vectorisation of numba loops gets one
product per 32-bit lane (the codes zero-extended) and does not form the pairs (interleaved loads come
out as shifts and ``vpmulld``). Imported by ``cpu_q4t`` only when the backend is opened.

Numba's disk cache keys a kernel by its own file: a change here needs cpu_q4t touched (or the cache
cleared) for its kernels to pick it up. ``VNNI`` is a compile-time constant of the kernels:
False leaves the intrinsic branches dead (never selected on hosts without the instructions).
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

I32 = ir.IntType(32)
V16 = ir.VectorType(I32, 16)  # 16 lanes
W32 = ir.VectorType(ir.IntType(16), 32)  # the same bits as 32 int16
B16 = ir.VectorType(ir.IntType(8), 16)


def _host_has_vnni() -> bool:
    from llvmlite import binding

    features = binding.get_host_cpu_features()
    return all(features.get(f, False) for f in ("avx512f", "avx512bw", "avx512vnni"))


#: the vpdpwssd kernels are compiled in
VNNI = _host_has_vnni()


def at(context, builder, aty, arr, off):
    """Pointer to element ``off`` (flat, in elements) of array ``arr`` of numba type ``aty``."""
    return builder.gep(context.make_array(aty)(context, builder, arr).data, [off])


def load(builder, ptr, vty):
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def store(builder, v, ptr):
    builder.store(v, builder.bitcast(ptr, v.type.as_pointer()), align=1)


def splat(v: int, vty=V16):
    return ir.Constant(vty, [ir.Constant(vty.element, v)] * vty.count)


def vpdpwssd(builder, acc, w, x):
    """acc + Σ of the two int16 products in each 32-bit lane of w and x (<16 x i32> each)."""
    fnty = ir.FunctionType(V16, [V16, W32, W32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpwssd.512")
    return builder.call(fn, [acc, builder.bitcast(w, W32), builder.bitcast(x, W32)])


def nibble_pairs(builder, ptr):
    """16 packed bytes at ptr -> <16 x i32>: (low nibble, high nibble) as an int16 pair per lane."""
    d = builder.zext(load(builder, ptr, B16), V16)
    hi = builder.shl(builder.and_(d, splat(0xF0)), splat(12))  # high nibble to bit 16
    return builder.or_(builder.and_(d, splat(15)), hi)


def plus(builder, value, n: int):
    return builder.add(value, ir.Constant(value.type, n)) if n else value
