"""AVX-512 VNNI code of the ``cpu`` backend's int8 kernels (qkernels): several rows of a blocked int8
weight [out, blocks, bb] times one token of int16 activations, with software prefetch.

Why: the one-row block dot (``vnni._dot8_vnni``) ran a 2 MB GEMV at 38-48 GB/s in L2 but read RAM at
only 9.3 GB/s on one core (16.8 on two), where the RAM probe reads 18 / 36 GB/s: one dependent
``vpdpwssd`` chain and a horizontal sum per 256-byte block, no loads in flight ahead of the row. Here
R rows run at once (2 in qkernels' tiles): R·2 independent chains, each activation vector loaded once for
R rows, each row prefetching ``PREFETCH8_BYTES`` ahead into L2, and the R block sums reduced together
(one shuffle tree for R rows instead of R).

Bits: the int32 block sums are exact (the same integers as the one-row dot, in any order of addition),
and each row's float32 sum runs over its blocks in order, ``acc = acc + float32(block)`` in a lane of an
<R x float> vector (IEEE adds, no fast-math flags): the float sum of ``qkernels._row8``, bit for bit.

Numba's disk cache keys a kernel by the contents of its own file: qkernels names this file's hash
(``qkernels.VNNI8_SOURCE``; tests/test_backend_cpu_kernels.py checks).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from colibri_plan.backends.cpu.vnni import B32, I32, I64, V16, W32, at, load, prefetch, splat, vpdpwssd

#: each row's prefetch distance (bytes ahead of the bytes being multiplied, into L2 as vnni's; a row's end
#: prefetches the next rows'). Scratch sweep, one thread, 128 int8 matrices of 1024x2048 (4 KiB pages)
#: from RAM: none 8.2, 1024 9.5, 4096 9.5, 8192 12.9, 16384 12.9 GB/s at 4 rows (2 rows alike, 1 row
#: 10.3 at best; the one-row dot 7.3; numpy's int64 sum of the same arrays 11.0); locality 3 (L1) 11.2.
#: Views of one huge-page array: 4 rows 16.4, 2 rows 17.7 (12288 ahead 18.3; numpy ~17): the tiles run 2
PREFETCH8_BYTES = 12288


def _tree(builder, vs: list) -> ir.Value:
    """<R x i32> of the lane sums of R vectors <16 x i32> (R a power of two ≤ 16), in order: pairs of
    vectors are halved into one (each item's first and second half lanes added), then the lanes of each
    item halved until one is left. Integer adds: exact in any order."""
    w = 16  # lanes per item
    while len(vs) > 1:
        g = 16 // w  # items per vector
        lo = [k * w + i for k in range(g) for i in range(w // 2)]
        first = ir.Constant(ir.VectorType(I32, 16), lo + [16 + j for j in lo])
        second = ir.Constant(ir.VectorType(I32, 16), [j + w // 2 for j in lo] + [16 + j + w // 2 for j in lo])
        vs = [builder.add(builder.shuffle_vector(a, b, first), builder.shuffle_vector(a, b, second))
              for a, b in zip(vs[0::2], vs[1::2])]
        w //= 2
    (v,) = vs
    n = 16
    while w > 1:
        lo = [k * w + i for k in range(n // w) for i in range(w // 2)]
        m = ir.VectorType(I32, n // 2)
        v = builder.add(builder.shuffle_vector(v, v, ir.Constant(m, lo)),
                        builder.shuffle_vector(v, v, ir.Constant(m, [j + w // 2 for j in lo])))
        n //= 2
        w //= 2
    return v


def rows8(R: int):
    """Intrinsic ``(w, wo, rstep, x, xo, nb, bb)`` -> UniTuple(float32, R): for rows i < R at w[wo + i·rstep]
    (int8, C order, offsets flat in elements) and the token at x[xo] (int16), ``Σ_b float32(Σ_j
    w·x over block b)`` over nb blocks of bb bytes (bb a multiple of 64), blocks summed in order."""
    vf = ir.VectorType(ir.FloatType(), R)

    @intrinsic
    def _rows8(typingctx, w, wo, rstep, x, xo, nb, bb):
        if getattr(w, "layout", "") != "C" or getattr(x, "layout", "") != "C":
            return None  # flat offsets need C order
        sig = types.UniTuple(types.float32, R)(w, wo, rstep, x, xo, nb, bb)

        def codegen(context, builder, sig, args):
            wo_, rstep_, xo_, nb_, bb_ = (context.cast(builder, args[i], sig.args[i], types.int64)
                                          for i in (1, 2, 4, 5, 6))
            pw0 = at(context, builder, sig.args[0], args[0], wo_)
            px0 = at(context, builder, sig.args[3], args[3], xo_)
            rows = [builder.gep(pw0, [builder.mul(rstep_, ir.Constant(I64, i))]) for i in range(R)]
            facc = cgutils.alloca_once_value(builder, ir.Constant(vf, [ir.Constant(ir.FloatType(), 0.0)] * R))
            steps = builder.udiv(bb_, ir.Constant(I64, 64))

            def ptr(p, off, n):  # p + off + n (elements)
                return builder.gep(p, [builder.add(off, ir.Constant(I64, n))])

            with cgutils.for_range(builder, nb_) as blk:
                boff = builder.mul(blk.index, bb_)
                accs = [cgutils.alloca_once_value(builder, splat(0)) for _ in range(2 * R)]  # [row][half]
                with cgutils.for_range(builder, steps) as st:
                    off = builder.add(boff, builder.mul(st.index, ir.Constant(I64, 64)))  # 64 bytes a step
                    xs = [load(builder, ptr(px0, off, 32 * h), W32) for h in range(2)]  # one load, R rows
                    for i, pr in enumerate(rows):
                        prefetch(builder, ptr(pr, off, PREFETCH8_BYTES))
                        for h in range(2):
                            wv = builder.sext(load(builder, ptr(pr, off, 32 * h), B32), W32)  # vpmovsxbw
                            a = accs[2 * i + h]
                            builder.store(vpdpwssd(builder, builder.load(a), wv, xs[h]), a)
                sums = [builder.add(builder.load(accs[2 * i]), builder.load(accs[2 * i + 1]))
                        for i in range(R)]  # exact int32 block sums, <16 x i32> each
                if R == 1:
                    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [V16]),
                                                        "llvm.vector.reduce.add.v16i32")
                    s = builder.insert_element(ir.Constant(ir.VectorType(I32, 1), None),
                                               builder.call(fn, sums), ir.Constant(I32, 0))
                else:
                    s = _tree(builder, sums)
                builder.store(builder.fadd(builder.load(facc), builder.sitofp(s, vf)), facc)  # in block order
            v = builder.load(facc)
            vals = [builder.extract_element(v, ir.Constant(I32, i)) for i in range(R)]
            return context.make_tuple(builder, sig.return_type, vals)

        return sig, codegen

    return _rows8


#: the multi-row int8 dots by rows: 2 (the tiles' body), 4 (tests), 1 (a tile's odd last row)
_rows8x2, _rows8x4, _rows8x1 = rows8(2), rows8(4), rows8(1)
