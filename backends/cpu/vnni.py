"""AVX-512 VNNI code for the ``cpu`` backend's numba kernels: llvmlite helpers of the intrinsics that write
``vpdpwssd`` (16 lanes of two int16 products each) where LLVM's vectorisation of numba loops gets one
product per 32-bit lane (the codes zero-extended) and does not form the pairs (interleaved loads come
out as shifts and ``vpmulld``). Imported by ``q4t`` only when the backend is opened.

Numba's disk cache keys a kernel by the contents of its own file: a change here must come with
q4t.VNNI_SOURCE set to this file's new hash (tests/test_backend_cpu_kernels.py checks), or its
kernels keep the old code. ``VNNI`` is a compile-time constant of the kernels:
False leaves the intrinsic branches dead (never selected on hosts without the instructions).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


#: the one-token loop shape prefetches the weight bytes this far ahead (4 rows of 2048 columns): 8
#: int4-g32 experts' decode from RAM 24.7 against 21.3 GB/s gate+up, 20.5 against 19.0 down (best of
#: 30, interleaved, shared 2-core host; 2048 and 8192 bytes measured alike)
PREFETCH_BYTES = 4096


def prefetch(builder, ptr):
    """Software prefetch of the cache line at ptr into all cache levels (a read; never faults)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]),
                                        "llvm.prefetch.p0")
    read, all_levels, data = ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)
    builder.call(fn, [builder.bitcast(ptr, i8p), read, all_levels, data])


def plus(builder, value, n: int):
    return builder.add(value, ir.Constant(value.type, n)) if n else value


# ---- AVX-512 VNNI: the lane dots as explicit vpdpwssd (two int16 products per 32-bit lane) ---------
# LLVM vectorises the loops above with one useful product per 32-bit lane (the codes zero-extended to
# 32 bits) and does not form full int16 pairs from numba code (interleaved loads come out as
# shifts and vpmulld), so these intrinsics write the vector code: 16 lanes at a time, the weights as
# (low, high) nibble pairs in each 32-bit lane against the activation pairs x2 = xe | xo << 16.
# Measured from L1 on one core: 66 GMAC/s against 32 for the loop above.

_I32, _V16, _W32, _B16 = I32, V16, W32, B16
_at, _load, _store, _splat, _vpdpwssd, _c = at, load, store, splat, vpdpwssd, plus


def _void9(codegen):
    """A numba intrinsic of nine arguments that returns nothing, its code written by ``codegen``."""

    @intrinsic
    def op(typingctx, a0, a1, a2, a3, a4, a5, a6, a7, a8):
        return types.void(a0, a1, a2, a3, a4, a5, a6, a7, a8), codegen

    return op


def _packed_dots(J: int, CH: int):
    """Intrinsic ``(ai, ao, w, wo, x2, xo, step, xsl, so)``: 16·CH lanes of ``ai[ao:] = Σ_j code·x −
    8·xsl`` from the packed bytes w[wo + j·step] (uint8, unpacked in registers) and the pairs
    x2[xo + j·step] (int32), xsl[so:] int32: the one-token loop shape (CH independent sums)."""

    def codegen(context, builder, sig, args):
        ai_, ao_, w_, wo_, x_, xo_, step_, s_, so_ = args
        pw, px = _at(context, builder, sig.args[2], w_, wo_), _at(context, builder, sig.args[4], x_, xo_)
        acc = [_splat(0)] * CH
        for j in range(J):
            line = builder.mul(step_, ir.Constant(step_.type, j))
            prefetch(builder, builder.gep(pw, [_c(builder, line, PREFETCH_BYTES)]))
            for ch in range(CH):
                off = _c(builder, line, 16 * ch)
                pair = nibble_pairs(builder, builder.gep(pw, [off]))
                acc[ch] = _vpdpwssd(builder, acc[ch], pair, _load(builder, builder.gep(px, [off]), _V16))
        ps, pa = _at(context, builder, sig.args[7], s_, so_), _at(context, builder, sig.args[0], ai_, ao_)
        for ch in range(CH):
            xs = _load(builder, builder.gep(ps, [ir.Constant(so_.type, 16 * ch)]), _V16)
            dst = builder.gep(pa, [ir.Constant(ao_.type, 16 * ch)])
            _store(builder, builder.sub(acc[ch], builder.shl(xs, _splat(3))), dst)  # − 8·Σ xq
        return context.get_dummy_value()

    return _void9(codegen)


def _scratch_dots(J: int, NT: int, CH: int):
    """Intrinsic ``(ai, ao, astep, ws, wo, x2, xo, xstep, step)``: 16·CH lanes of NT tokens,
    ``ai[ao + u·astep:] = Σ_j ws·x2`` over the unpacked signed pairs ws[wo + j·step] and token u's pairs
    x2[xo + u·xstep + j·step] (int32 each): the prefill loop shape, one weight load for NT tokens
    (NT·CH independent sums: 64 lanes at once were 1.3-1.4x as fast as 16 at 4 and 16 tokens)."""

    def codegen(context, builder, sig, args):
        ai_, ao_, astep_, w_, wo_, x_, xo_, xstep_, step_ = args
        pw, px = _at(context, builder, sig.args[3], w_, wo_), _at(context, builder, sig.args[5], x_, xo_)
        pa = _at(context, builder, sig.args[0], ai_, ao_)
        acc = [[_splat(0)] * NT for _ in range(CH)]
        for j in range(J):
            for ch in range(CH):
                off = _c(builder, builder.mul(step_, ir.Constant(step_.type, j)), 16 * ch)
                wv = _load(builder, builder.gep(pw, [off]), _V16)
                for u in range(NT):
                    xoff = builder.add(off, builder.mul(xstep_, ir.Constant(xstep_.type, u)))
                    acc[ch][u] = _vpdpwssd(builder, acc[ch][u], wv,
                                           _load(builder, builder.gep(px, [xoff]), _V16))
        for ch in range(CH):
            for u in range(NT):
                dst = _c(builder, builder.mul(astep_, ir.Constant(astep_.type, u)), 16 * ch)
                _store(builder, acc[ch][u], builder.gep(pa, [dst]))
        return context.get_dummy_value()

    return _void9(codegen)


#: the intrinsics by (J, tokens), each over a whole chunk of L = 64 lanes (4 vectors: 1.3-1.4x as fast
#: as one vector a call at 4 and 16 tokens, and as a loop over 16-lane calls)
_pk16, _pk8, _pk4 = (_packed_dots(J, 4) for J in (16, 8, 4))
_s16x4, _s8x4, _s4x4 = (_scratch_dots(J, 4, 4) for J in (16, 8, 4))
_s16x2, _s8x2, _s4x2 = (_scratch_dots(J, 2, 4) for J in (16, 8, 4))
_s16x1, _s8x1, _s4x1 = (_scratch_dots(J, 1, 4) for J in (16, 8, 4))
@intrinsic
def _unpack16(typingctx, ws, so, w, wo):
    """16 lanes of ``ws[so:] = pair(low − 8, high − 8)`` of the bytes w[wo:] (int32 ← uint8): vector
    stores, so the loads that follow are forwarded (scalar stores under a 64-byte load cost ~400 ns a
    row)."""
    sig = types.void(ws, so, w, wo)

    def codegen(context, builder, sig, args):
        ws_, so_, w_, wo_ = args
        pair = builder.bitcast(nibble_pairs(builder, _at(context, builder, sig.args[2], w_, wo_)), _W32)
        signed = builder.bitcast(builder.sub(pair, _splat(8, _W32)), _V16)  # int16 lanes: no borrow
        _store(builder, signed, _at(context, builder, sig.args[0], ws_, so_))
        return context.get_dummy_value()

    return sig, codegen


def _fsum_chunks(context, builder, sig, args, tokens):
    # the fused multiply-add chains of _vsum (one per token u: ai at ao + u·astep): [<16 x float>]
    sl_, so_, ai_, ao_, astep_, n_ = args[:6]
    vf = ir.VectorType(ir.FloatType(), 16)
    ps, pa = _at(context, builder, sig.args[0], sl_, so_), _at(context, builder, sig.args[2], ai_, ao_)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v16f32")
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [ir.Constant(ir.FloatType(), 0.0)] * 16))
            for _ in range(tokens)]
    with cgutils.for_range(builder, builder.udiv(n_, ir.Constant(n_.type, 16))) as loop:
        off = builder.mul(loop.index, ir.Constant(n_.type, 16))
        w = _load(builder, builder.gep(ps, [off]), vf)
        for u, acc in enumerate(accs):
            uo = builder.add(off, builder.mul(astep_, ir.Constant(astep_.type, u)))
            a = builder.sitofp(_load(builder, builder.gep(pa, [uo]), _V16), vf)
            builder.store(builder.call(fma, [w, a, builder.load(acc)]), acc)
    return [builder.load(acc) for acc in accs]


def _halves(builder, a, b, first, second):
    mask = ir.VectorType(_I32, len(first))
    return builder.fadd(builder.shuffle_vector(a, b, ir.Constant(mask, first)),
                        builder.shuffle_vector(a, b, ir.Constant(mask, second)))


@intrinsic
def _vsum(typingctx, sl, so, ai, ao, astep, n):
    """float32 ``Σ_k sl[so + k]·float32(ai[ao + k])`` over n lanes, n a multiple of 16 (sl flat float32,
    ai flat int32; ``astep`` unused, :func:`_vsum4`'s token step): one fused multiply-add per 16 lanes
    in lane order, then halves added (16 → 8 → 4 → 2 → 1). Written out, not left to LLVM's
    reassociation, so every loop shape gets the same bits."""
    sig = types.float32(sl, so, ai, ao, astep, n)

    def codegen(context, builder, sig, args):
        (v,) = _fsum_chunks(context, builder, sig, args, 1)
        width = 16
        while width > 1:  # add the upper half onto the lower half
            width //= 2
            v = _halves(builder, v, v, list(range(width)), list(range(width, 2 * width)))
        return builder.extract_element(v, ir.Constant(_I32, 0))

    return sig, codegen


@intrinsic
def _vsum4(typingctx, sl, so, ai, ao, astep, n, out):
    """:func:`_vsum` of 4 tokens (ai at ao + u·astep) into out[0:4] float32, sharing the scale loads and
    the halving steps (two tokens' halves in one vector): the same additions, so the same bits."""
    sig = types.void(sl, so, ai, ao, astep, n, out)

    def codegen(context, builder, sig, args):
        a, b, c, d = _fsum_chunks(context, builder, sig, args, 4)
        r8, r4 = list(range(8)), list(range(4))
        ab = _halves(builder, a, b, r8 + [16 + i for i in r8], [8 + i for i in r8] + [24 + i for i in r8])
        cd = _halves(builder, c, d, r8 + [16 + i for i in r8], [8 + i for i in r8] + [24 + i for i in r8])
        v = _halves(builder, ab, cd, [o + i for o in (0, 8, 16, 24) for i in r4],
                    [o + 4 + i for o in (0, 8, 16, 24) for i in r4])  # 4 tokens x 4
        v = _halves(builder, v, v, [o + i for o in (0, 4, 8, 12) for i in (0, 1)],
                    [o + 2 + i for o in (0, 4, 8, 12) for i in (0, 1)])  # 4 x 2
        v = _halves(builder, v, v, [0, 2, 4, 6], [1, 3, 5, 7])  # 4 x 1
        _store(builder, v, _at(context, builder, sig.args[6], args[6], ir.Constant(ir.IntType(64), 0)))
        return context.get_dummy_value()

    return sig, codegen


# ---- grouped int4 (q4g): adjacent lanes of one group summed in int32 ------------------------
# Per-row int4, int4-g64 and int4-g128 split each group over 2 or 4 adjacent lanes of the transposed
# layout, so two neighbouring lanes may share a 32-bit sum: 32 bytes of one byte row (lanes k..k+31)
# zero-extend to 32 int16 codes whose low nibbles pair with xe and high nibbles with xo as they lie
# (``vpdpwssd`` adds lanes 2i and 2i + 1 into 32-bit lane i), 3 instructions of unpacking per 64
# products where the int4-g32 pairs take 5 per 32. No activation pairs (x2) and no per-lane scales.

W16 = W32  # <32 x i16>
B32 = ir.VectorType(ir.IntType(8), 32)
I64 = ir.IntType(64)


def _c64(n: int):
    return ir.Constant(I64, n)


def group_dots(J: int, R: int, NT: int):
    """Intrinsic ``(ai, ao, astep, w, wo, xe, xo, xoff, xstep, xg, go, gstep)``: the 64 lanes of one chunk
    of J byte rows (w uint8 at wo + j·64 + k, lanes k; xe/xo int16 of token u at xoff + u·xstep + j·64 + k)
    summed in int32 over groups of R adjacent lanes (R = 2: 32 sums, R = 4: 16), minus 8·xg (the groups'
    Σ xq, xg int32 of token u at go + u·gstep), stored as ai[ao + u·astep + e] for NT tokens: exact
    ``Σ (code − 8)·xq`` per group, the same integers for every NT. One token keeps 4 independent
    sums (low and high nibbles apart) so the ``vpdpwssd`` chains overlap."""

    @intrinsic
    def dots(typingctx, ai, ao, astep, w, wo, xe, xo, xoff, xstep, xg, go, gstep):
        sig = types.void(ai, ao, astep, w, wo, xe, xo, xoff, xstep, xg, go, gstep)

        def codegen(context, builder, sig, args):
            ai_, ao_, astep_, w_, wo_, xe_, xo_, xoff_, xstep_, xg_, go_, gstep_ = args
            pw = at(context, builder, sig.args[3], w_, wo_)
            pe0, po0 = (at(context, builder, sig.args[i], args[i], xoff_) for i in (5, 6))
            tok = [builder.mul(xstep_, ir.Constant(xstep_.type, u)) for u in range(NT)]
            pe = [builder.gep(pe0, [t]) for t in tok]
            po = [builder.gep(po0, [t]) for t in tok]
            chains = 2 if NT == 1 else 1
            acc = [[[splat(0)] * chains for _ in range(2)] for _ in range(NT)]  # [token][half][chain]
            for j in range(J):
                prefetch(builder, builder.gep(pw, [_c64(64 * j + PREFETCH_BYTES)]))
                for h in range(2):  # lanes 32h .. 32h + 31
                    off = _c64(64 * j + 32 * h)
                    codes = builder.zext(load(builder, builder.gep(pw, [off]), B32), W16)
                    lo = builder.and_(codes, splat(15, W16))
                    hi = builder.lshr(codes, splat(4, W16))
                    for u in range(NT):
                        e = load(builder, builder.gep(pe[u], [off]), W16)
                        o = load(builder, builder.gep(po[u], [off]), W16)
                        if chains == 2:
                            acc[u][h] = [vpdpwssd(builder, acc[u][h][0], lo, e),
                                         vpdpwssd(builder, acc[u][h][1], hi, o)]
                        else:
                            acc[u][h] = [vpdpwssd(builder, vpdpwssd(builder, acc[u][h][0], lo, e), hi, o)]
            pa, pg = at(context, builder, sig.args[0], ai_, ao_), at(context, builder, sig.args[9], xg_, go_)
            even = ir.Constant(V16, [ir.Constant(I32, 2 * i) for i in range(16)])
            odd = ir.Constant(V16, [ir.Constant(I32, 2 * i + 1) for i in range(16)])
            for u in range(NT):
                a = [builder.add(*acc[u][h]) if chains == 2 else acc[u][h][0] for h in range(2)]
                if R == 4:  # lane pairs (2i, 2i + 1) of both halves: groups of 4 lanes, in order
                    a = [builder.add(builder.shuffle_vector(a[0], a[1], even),
                                     builder.shuffle_vector(a[0], a[1], odd))]
                ou = builder.mul(astep_, ir.Constant(astep_.type, u))
                gu = builder.mul(gstep_, ir.Constant(gstep_.type, u))
                for q, v in enumerate(a):
                    xs = load(builder, builder.gep(pg, [plus(builder, gu, 16 * q)]), V16)
                    store(builder, builder.sub(v, builder.shl(xs, splat(3))),  # − 8·Σ xq
                          builder.gep(pa, [plus(builder, ou, 16 * q)]))
            return context.get_dummy_value()

        return sig, codegen

    return dots


#: the grouped intrinsics by (J, R) and tokens: (16, 2) int4-g64 at fold 2; (16, 4) int4-g128 and
#: per-row rows of 1024·n bytes; (8, 4) int4-g64 at fold 4 and per-row rows of 512·(2n + 1) bytes
_g16r2x1, _g16r2x2, _g16r2x4 = (group_dots(16, 2, n) for n in (1, 2, 4))
_g16r4x1, _g16r4x2, _g16r4x4 = (group_dots(16, 4, n) for n in (1, 2, 4))
_g8r4x1, _g8r4x2, _g8r4x4 = (group_dots(8, 4, n) for n in (1, 2, 4))
