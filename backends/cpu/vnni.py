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


#: the one-token loop shapes prefetch the weight bytes this far ahead (4 rows of 2048 columns): 8
#: int4-g32 experts' decode from RAM (the vpdpwssd pairs before the byte kernels) 24.7 against 21.3 GB/s
#: gate+up, 20.5 against 19.0 down (best of
#: 30, interleaved, shared 2-core host; 2048 and 8192 bytes measured alike, again with the byte kernels)
PREFETCH_BYTES = 4096
#: llvm.prefetch locality of those prefetches: 2 (prefetcht1: into L2, not L1), where 3 (prefetcht0)
#: held an L1 miss buffer per line until it came from RAM: a decode step's 8 int4-g32h experts a layer
#: (8 layers, peer shapes, from RAM) 9.78 against 10.0 ms (medians of 4 interleaved fresh processes, shared
#: 2-core Xeon; locality 1 slower, none 11.8 ms; scratch runs of bench/cpu_expert_step.py, not kept)
PREFETCH_LOCALITY = 2


def prefetch(builder, ptr):
    """Software prefetch of the cache line at ptr into L2 (``PREFETCH_LOCALITY``; a read, never faults)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]),
                                        "llvm.prefetch.p0")
    read, locality, data = ir.Constant(I32, 0), ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)
    builder.call(fn, [builder.bitcast(ptr, i8p), read, locality, data])


def plus(builder, value, n: int):
    return builder.add(value, ir.Constant(value.type, n)) if n else value


_I32, _V16 = I32, V16
_at, _load, _store = at, load, store


def _lane_scales(builder, ps, off, fold: int, half: bool):
    """<16 x float> scales of 16 lanes from their 16 / fold group scales at ps + off (elements: float32,
    or float16 bits as uint16 when ``half``, widened exactly), each repeated ``fold`` times (lane k's
    scale is group k // fold's)."""
    n = 16 // fold
    if half:
        v = _load(builder, builder.gep(ps, [off]), ir.VectorType(ir.IntType(16), n))
        v = builder.bitcast(v, ir.VectorType(ir.HalfType(), n))
        v = builder.fpext(v, ir.VectorType(ir.FloatType(), n))  # exact: vcvtph2ps
    else:
        v = _load(builder, builder.gep(ps, [off]), ir.VectorType(ir.FloatType(), n))
    if fold > 1:
        v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), [k // fold for k in range(16)]))
    return v


def _fsum_chunks(context, builder, sig, args, tokens, fold=1):
    # the fused multiply-add chains of _vsum (one per token u: ai at ao + u·astep): [<16 x float>]; the
    # scales sl at so: one per lane (fold 1) or one per group of ``fold`` lanes, float32 or float16 bits
    sl_, so_, ai_, ao_, astep_, n_ = args[:6]
    vf = ir.VectorType(ir.FloatType(), 16)
    half = sig.args[0].dtype == types.uint16
    ps, pa = _at(context, builder, sig.args[0], sl_, so_), _at(context, builder, sig.args[2], ai_, ao_)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vf, vf]), "llvm.fma.v16f32")
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vf, [ir.Constant(ir.FloatType(), 0.0)] * 16))
            for _ in range(tokens)]
    with cgutils.for_range(builder, builder.udiv(n_, ir.Constant(n_.type, 16))) as loop:
        off = builder.mul(loop.index, ir.Constant(n_.type, 16))
        w = _lane_scales(builder, ps, builder.mul(loop.index, ir.Constant(n_.type, 16 // fold)), fold, half)
        for u, acc in enumerate(accs):
            uo = builder.add(off, builder.mul(astep_, ir.Constant(astep_.type, u)))
            a = builder.sitofp(_load(builder, builder.gep(pa, [uo]), _V16), vf)
            builder.store(builder.call(fma, [w, a, builder.load(acc)]), acc)
    return [builder.load(acc) for acc in accs]


def _halves(builder, a, b, first, second):
    mask = ir.VectorType(_I32, len(first))
    return builder.fadd(builder.shuffle_vector(a, b, ir.Constant(mask, first)),
                        builder.shuffle_vector(a, b, ir.Constant(mask, second)))


def vsum(fold: int):
    """Intrinsic ``(sl, so, ai, ao, astep, n)``: float32 ``Σ_k sl[so + k // fold]·float32(ai[ao + k])``
    over n lanes, n a multiple of 16 (sl flat float32, or float16 bits as uint16, widened exactly: one
    scale per lane at fold 1, per group of ``fold`` lanes else; ai flat int32; ``astep`` unused,
    :func:`vsum4`'s token step): one fused multiply-add per 16 lanes in lane order, then halves added
    (16 → 8 → 4 → 2 → 1). Written out, not left to LLVM's reassociation, so every loop shape gets the
    same bits, and every fold and scale type the same bits for the same lane scale values."""

    @intrinsic
    def _vsum(typingctx, sl, so, ai, ao, astep, n):
        sig = types.float32(sl, so, ai, ao, astep, n)

        def codegen(context, builder, sig, args):
            (v,) = _fsum_chunks(context, builder, sig, args, 1, fold)
            width = 16
            while width > 1:  # add the upper half onto the lower half
                width //= 2
                v = _halves(builder, v, v, list(range(width)), list(range(width, 2 * width)))
            return builder.extract_element(v, ir.Constant(_I32, 0))

        return sig, codegen

    return _vsum


def vsum4(fold: int):
    """Intrinsic ``(sl, so, ai, ao, astep, n, out)``: :func:`vsum` of 4 tokens (ai at ao + u·astep) into
    out[0:4] float32, sharing the scale loads and the halving steps (two tokens' halves in one vector):
    the same additions, so the same bits."""

    @intrinsic
    def _vsum4(typingctx, sl, so, ai, ao, astep, n, out):
        sig = types.void(sl, so, ai, ao, astep, n, out)

        def codegen(context, builder, sig, args):
            a, b, c, d = _fsum_chunks(context, builder, sig, args, 4, fold)
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

    return _vsum4


#: the float sums by fold: one scale per lane (_vsum, _vsum4: q4g, and q4t's lane scales) or per group
#: of 2 / 4 lanes (q4t's int4-g32 rows of 32 / 16 groups folded to 64 lanes, scales as stored)
_vsum, _vsum_2, _vsum_4 = (vsum(f) for f in (1, 2, 4))
_vsum4, _vsum4_2, _vsum4_4 = (vsum4(f) for f in (1, 2, 4))


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


# ---- int4-g32 by bytes: vpdpbusd on the int16 activations split in bytes ----------------------
# The transposed int4-g32 layout of the one-token shape above unpacks 16 bytes into 16 int16 pairs for
# one vpdpwssd (32 products, 5 instructions of unpacking). Here each 32-bit lane holds 4 bytes of one
# lane (group part) instead, and ``vpdpbusd`` (u8 x s8, 4 products a 32-bit lane, 64 an instruction)
# multiplies the codes with the activations' bytes: xq = 256·xh + xl (xh the signed high byte, xl the
# unsigned low byte), so Σ code·xq = 256·Σ code·xh + Σ xl·code, exact in int32 (|Σ code·xh| ≤
# 32·15·128): the same integers a_k as the pairs give, from 2 instructions of unpacking per 128
# products. Layout of a chunk of L lanes, L a multiple of 16 (J bytes each; ``layout.bytes_layout``): for
# quarter q (lanes 16q..16q + 15), dword d (bytes 4d..4d + 3 of each lane), 64 bytes: lane 16q + i's 4
# bytes at 4i; a row of C chunks is C·L / 16 quarters one after the other. The
# activations of a token (``q4t._xbytes``): for each (q, d) 4 x 64 bytes: xl of the even columns, xh
# of the even, xl of the odd, xh of the odd, in the same byte order.

B64 = ir.VectorType(ir.IntType(8), 64)


def vpdpbusd(builder, acc, u, s):
    """acc + Σ of the four u8·s8 products in each 32-bit lane of u (unsigned) and s (signed)."""
    fnty = ir.FunctionType(V16, [V16, B64, B64])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [acc, u, s])


def _quarters(builder, nq, body):
    """``body(q)`` for q = 0 .. nq − 1, the quarters of one chunk (L / 16 of a chunk of L lanes): a chunk
    of 64 lanes written out as one block of code with constant offsets (the 4 quarters; measured a
    runtime loop 5-15% slower there), other chunks a runtime loop."""
    with builder.if_else(builder.icmp_unsigned("==", nq, ir.Constant(nq.type, 4))) as (four, other):
        with four:
            for k in range(4):
                body(_c64(k))
        with other:
            with cgutils.for_range(builder, nq) as loop:
                body(loop.index)


def byte_dots(J: int, NT: int):
    """Intrinsic ``(ai, ao, astep, w, wo, xb, xo, xstep, xsl, so, sstep, nq)``: the 16·nq lanes of nq
    quarters (J·16 bytes each of w uint8 at wo, the layout above; a chunk of L lanes is L / 16 of them,
    any number) times NT tokens' activation bytes (xb uint8, token u at xo + u·xstep, 4·J·16 bytes a
    quarter), ``ai[ao + u·astep + k] = Σ code·xq − 8·xsl[so + u·sstep + k]`` (int32, exact: the integers
    of the int16 pairs), one weight load and unpacking for NT tokens."""
    D = J // 4

    @intrinsic
    def dots(typingctx, ai, ao, astep, w, wo, xb, xo, xstep, xsl, so, sstep, nq):
        sig = types.void(ai, ao, astep, w, wo, xb, xo, xstep, xsl, so, sstep, nq)

        def codegen(context, builder, sig, args):
            ai_, ao_, astep_, w_, wo_, xb_, xo_, xstep_, xs_, so_, sstep_, nq_ = args
            pw0 = at(context, builder, sig.args[3], w_, wo_)
            px0 = at(context, builder, sig.args[5], xb_, xo_)
            px0 = [builder.gep(px0, [builder.mul(xstep_, ir.Constant(xstep_.type, u))]) for u in range(NT)]
            pa0 = at(context, builder, sig.args[0], ai_, ao_)
            ps0 = at(context, builder, sig.args[8], xs_, so_)
            m15 = splat(15, B64)
            four = splat(4, B64)

            def quarter(q):
                q = builder.sext(q, I64) if q.type != I64 else q
                pw = builder.gep(pw0, [builder.mul(q, _c64(64 * D))])
                px = [builder.gep(p, [builder.mul(q, _c64(256 * D))]) for p in px0]
                acc_h = [splat(0)] * NT
                acc_l = [splat(0)] * NT
                for d in range(D):
                    line = 64 * d
                    if NT == 1:
                        prefetch(builder, builder.gep(pw, [_c64(line + PREFETCH_BYTES)]))
                    wv = load(builder, builder.gep(pw, [_c64(line)]), B64)
                    lo = builder.and_(wv, m15)
                    hi = builder.lshr(wv, four)
                    for u in range(NT):
                        xl_e, xh_e, xl_o, xh_o = (load(builder, builder.gep(px[u], [_c64(4 * line + 64 * i)]),
                                                       B64) for i in range(4))
                        acc_l[u] = vpdpbusd(builder, vpdpbusd(builder, acc_l[u], xl_e, lo), xl_o, hi)
                        acc_h[u] = vpdpbusd(builder, vpdpbusd(builder, acc_h[u], lo, xh_e), hi, xh_o)
                q16 = builder.mul(q, _c64(16))
                for u in range(NT):
                    so = builder.add(builder.mul(sstep_, ir.Constant(sstep_.type, u)), q16)
                    xs = load(builder, builder.gep(ps0, [so]), V16)
                    a = builder.add(builder.shl(acc_h[u], splat(8)), acc_l[u])
                    a = builder.sub(a, builder.shl(xs, splat(3)))  # − 8·Σ xq
                    dst = builder.add(builder.mul(astep_, ir.Constant(astep_.type, u)), q16)
                    store(builder, a, builder.gep(pa0, [dst]))

            _quarters(builder, nq_, quarter)
            return context.get_dummy_value()

        return sig, codegen

    return dots


#: the byte intrinsics by J (16, 8, 4 bytes a lane) and tokens (1, 2, 4)
_b16x1, _b16x2, _b16x4 = (byte_dots(16, n) for n in (1, 2, 4))
_b8x1, _b8x2, _b8x4 = (byte_dots(8, n) for n in (1, 2, 4))
_b4x1, _b4x2, _b4x4 = (byte_dots(4, n) for n in (1, 2, 4))


def byte_dots2(J: int):
    """Intrinsic ``(ai, ao, bo, w, wo, v, vo, xb, xo, xsl, so, nq)``: :func:`byte_dots` of one token for two
    rows at once over nq quarters, w at wo (into ai[ao:]) and v at vo (into ai[bo:]), sharing the
    activation loads (a gate and an up row, or two rows of one weight): the same integers as two calls."""
    D = J // 4

    @intrinsic
    def dots(typingctx, ai, ao, bo, w, wo, v, vo, xb, xo, xsl, so, nq):
        sig = types.void(ai, ao, bo, w, wo, v, vo, xb, xo, xsl, so, nq)

        def codegen(context, builder, sig, args):
            ai_, ao_, bo_, w_, wo_, v_, vo_, xb_, xo_, xs_, so_, nq_ = args
            pws0 = [at(context, builder, sig.args[3], w_, wo_), at(context, builder, sig.args[5], v_, vo_)]
            px0 = at(context, builder, sig.args[7], xb_, xo_)
            pas0 = [at(context, builder, sig.args[0], ai_, ao_), at(context, builder, sig.args[0], ai_, bo_)]
            ps0 = at(context, builder, sig.args[9], xs_, so_)
            m15, four = splat(15, B64), splat(4, B64)

            def quarter(q):
                q = builder.sext(q, I64) if q.type != I64 else q
                pws = [builder.gep(p, [builder.mul(q, _c64(64 * D))]) for p in pws0]
                px = builder.gep(px0, [builder.mul(q, _c64(256 * D))])
                q16 = builder.mul(q, _c64(16))
                acc_h, acc_l = [splat(0)] * 2, [splat(0)] * 2
                for d in range(D):
                    line = 64 * d
                    xl_e, xh_e, xl_o, xh_o = (load(builder, builder.gep(px, [_c64(4 * line + 64 * i)]), B64)
                                              for i in range(4))
                    for r, pw in enumerate(pws):
                        prefetch(builder, builder.gep(pw, [_c64(line + PREFETCH_BYTES)]))
                        wv = load(builder, builder.gep(pw, [_c64(line)]), B64)
                        lo, hi = builder.and_(wv, m15), builder.lshr(wv, four)
                        acc_l[r] = vpdpbusd(builder, vpdpbusd(builder, acc_l[r], xl_e, lo), xl_o, hi)
                        acc_h[r] = vpdpbusd(builder, vpdpbusd(builder, acc_h[r], lo, xh_e), hi, xh_o)
                xs = builder.shl(load(builder, builder.gep(ps0, [q16]), V16), splat(3))  # 8·Σ xq
                for r, pa in enumerate(pas0):
                    a = builder.sub(builder.add(builder.shl(acc_h[r], splat(8)), acc_l[r]), xs)
                    store(builder, a, builder.gep(pa, [q16]))

            _quarters(builder, nq_, quarter)
            return context.get_dummy_value()

        return sig, codegen

    return dots


#: two rows, one token, by J
_b16r2, _b8r2, _b4r2 = (byte_dots2(J) for J in (16, 8, 4))


# ---- int8 blocks (qkernels): int8 weights sign-extended to int16, paired with the int16 activations ----
# LLVM vectorises qkernels' int8 block dot with both operands widened to int32 and one product a lane;
# vpmovsxbw + vpdpwssd take 32 products an instruction pair. Integer sums: exact, the same int32 as the
# loop's, so the kernels' float results keep their bits.


def dot8():
    """Intrinsic ``(w, wo, x, xo, n)``: int32 ``Σ_j int32(w[wo + j])·int32(x[xo + j])`` over j < n, n a
    multiple of 32 (w int8, x int16, both C-contiguous, offsets flat in elements)."""

    @intrinsic
    def _dot8(typingctx, w, wo, x, xo, n):
        if getattr(w, "layout", "") != "C" or getattr(x, "layout", "") != "C":
            return None  # flat offsets need C order: the caller keeps its loop
        sig = types.int32(w, wo, x, xo, n)

        def codegen(context, builder, sig, args):
            w_, wo_, x_, xo_, n_ = args
            pw, px = at(context, builder, sig.args[0], w_, wo_), at(context, builder, sig.args[2], x_, xo_)
            acc = cgutils.alloca_once_value(builder, splat(0))
            with cgutils.for_range(builder, builder.udiv(n_, ir.Constant(n_.type, 32))) as loop:
                off = builder.mul(loop.index, ir.Constant(n_.type, 32))
                wv = builder.sext(load(builder, builder.gep(pw, [off]), B32), W16)  # vpmovsxbw
                xv = load(builder, builder.gep(px, [off]), W16)
                builder.store(vpdpwssd(builder, builder.load(acc), wv, xv), acc)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(I32, [V16]),
                                                "llvm.vector.reduce.add.v16i32")
            return builder.call(fn, [builder.load(acc)])

        return sig, codegen

    return _dot8


_dot8_vnni = dot8()
