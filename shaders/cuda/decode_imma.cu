// Decode (T = 1) matmul and fused gate/up of the per-row int4 and int8 formats on integer tensor cores,
// appended to matmul.cu by backends/cuda.py (it uses matmul.cu's u64, F_*, Cols and MMArgs). Same tables,
// entries and outputs as matmul.cu's mm / mm_args / gate_up, so the launcher swaps one for the other.
//
// Why: the GEMV kernels spend ~5 instructions on each int4 weight (byte permute, subtract, FMA, ...); at
// two weights per byte that bounds them near half of an H200's bandwidth. Here 16 rows x 32 columns of
// codes are one mma.sync m16n8k32 A operand, with one mask per 4 int4 codes and none for int8.
//
// Exact integer sums: each block turns x into 32-bit fixed point X = rint(x 2^-e), e from the largest
// |x| (|X| < 2^30: every x within 2^-7 of the largest is exact, smaller ones are rounded at 2^e), and
// splits X into four signed base-256 digits (limbs) X = b3 2^24 + b2 2^16 + b1 2^8 + b0, each in
// [-128, 127]. One mma (s8 in, int32 accumulate, exact) takes the codes as A and the limbs as the columns
// of B (32 x 8: column l is limb l, columns 4..7 are zero), so it sums all four limbs of 16 rows x 32
// columns at once. int4 A holds the nibbles n (0..15); the -8 of the codes is one exact integer per limb,
// SB_l = sum of b_l over the columns. The warps of a block add their int32 sums (order-free, so
// deterministic), and the row's result is, in double,
//   y[r] = s[r] 2^e sum_l 2^(8 l) (C_l[r] - 8 SB_l)   (int8: C_l[r] alone)
//
// Work shape: a block owns row tiles of 16 R16 rows (blocks stride over the tiles, one resident wave);
// its warps split each tile's 64-byte row segments (lane g = lane / 4, t = lane % 4 loads 16 bytes of
// rows g and g + 8 of each 16-row subtile: word 4 seg + t) and load the next segment, of this tile or the
// next, while summing the current one. A k-step j of a segment takes from each lane 8 columns of one
// row: int4 part j of its word (a0 / a2 = even / odd nibbles), int8 parts 2j, 2j + 1 (a0 / a2). Limb l of
// those columns is B column l: lane (l, t) holds (P_l, Q_l) = (b0, b1), 8 bytes of the 32-byte shared entry
// of (segment, k-step, t), so the 16 lanes l < 4 of a k-step read 128 consecutive bytes.

#define IM_WARPS 8  // warps per block at most (backends/cuda.py _IMMA_SHAPE)
#ifndef IM_MIN_BLOCKS  // resident blocks of IM_WARPS warps per SM the registers must allow (128 each at 2)
#define IM_MIN_BLOCKS 2
#endif
#define IM_BOUNDS __launch_bounds__(32 * IM_WARPS, IM_MIN_BLOCKS)
#ifndef IM_STAGES  // steps of weights per warp ring: IM_STAGES - 1 in flight (backends/cuda.py _IMMA_STAGES)
#define IM_STAGES 3
#endif

#ifndef COLIBRI_HOST_MMA
// c (16 x 8, int32; c0 / c1 row g, columns 2t / 2t + 1, c2 / c3 row g + 8) += A (16 x 32 s8: a0 / a2 row g
// at k 4t.. / 16 + 4t.., a1 / a3 row g + 8) . B (32 x 8 s8: b0 k 4t.., b1 k 16 + 4t.. at column g); byte i
// of a register is k + i
__device__ __forceinline__ void mma_i8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared, asynchronous (L2 only: the weights are read once); groups of them are
// committed and waited for in issue order
__device__ __forceinline__ void im_cp16(uint4 *dst, const uint4 *src) {
    unsigned d;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(d) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void im_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void im_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(IM_STAGES - 1) : "memory"); }
__device__ __forceinline__ void im_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ unsigned im_max_u32(unsigned v) {  // over the warp
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

__device__ __forceinline__ int im_sum_i32(int v) {  // over the warp
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}
#endif

// byte l of each of a, b, c, d -> one word (a's byte lowest)
__device__ __forceinline__ unsigned im_limb(unsigned a, unsigned b, unsigned c, unsigned d, int l) {
    const unsigned s = (unsigned)l | ((unsigned)(l + 4) << 4);
    return __byte_perm(__byte_perm(a, b, s), __byte_perm(c, d, s), 0x5410);
}

// the 8 columns c0 .. c0 + 7 of limb entry i ((segment, k-step j, t) = ((i / 4) / KS, (i / 4) % KS, i % 4))
template <int FMT>
__device__ __forceinline__ int im_col0(int i) {
    constexpr int KS = Cols<FMT>::n / 8;
    return Cols<FMT>::n * (4 * ((i >> 2) / KS) + (i & 3)) + 8 * ((i >> 2) % KS);
}

// entry i's 8 activations (u, v) -> its limbs: xq[4 i + l] = (P_l, Q_l); adds the limbs to s
template <int FMT>
__device__ __forceinline__ void im_entry(uint2 *xq, int i, float4 u, float4 v, float f1, float f2, bool bad,
                                         int (&s)[4]) {
    const float f[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
    unsigned X[8];  // the four signed digits of each, one per byte
#pragma unroll
    for (int k = 0; k < 8; k++) {
        int r = bad ? 0 : __float2int_rn(f[k] * f1 * f2);
        unsigned packed = 0;
#pragma unroll
        for (int l = 0; l < 4; l++) {  // r = d + 256 r', d the low byte read as signed (exact: |X| < 2^30)
            const int d = l < 3 ? (int)(r << 24) >> 24 : r;
            s[l] += d;
            packed |= ((unsigned)d & 0xFFu) << (8 * l);
            r = (r - d) >> 8;
        }
        X[k] = packed;
    }
    // int4: P the even columns (a0, low nibbles), Q the odd; int8: P columns 0..3 (a0), Q 4..7 (a2)
    constexpr bool I4 = FMT == F_INT4;
    constexpr int p0 = 0, p1 = I4 ? 2 : 1, p2 = I4 ? 4 : 2, p3 = I4 ? 6 : 3, q0 = I4 ? 1 : 4, q1 = I4 ? 3 : 5,
                  q2 = I4 ? 5 : 6, q3 = 7;
#pragma unroll
    for (int l = 0; l < 4; l++)
        xq[4 * i + l] = make_uint2(im_limb(X[p0], X[p1], X[p2], X[p3], l), im_limb(X[q0], X[q1], X[q2], X[q3], l));
}

__device__ __forceinline__ unsigned im_abs_max(unsigned m, float4 v) {  // |x| bits: ordered as the values
    return max(max(m, max(__float_as_uint(fabsf(v.x)), __float_as_uint(fabsf(v.y)))),
               max(__float_as_uint(fabsf(v.z)), __float_as_uint(fabsf(v.w))));
}

#define IM_KEEP 3  // limb entries a thread keeps in registers between the two staging passes

// x (in_pad floats, 16-byte aligned) -> the limb entries of every (segment, k-step, t); returns e (X =
// rint(x 2^-e)) and sets sb[l] = SB_l (int4) and bad (x holds an inf or NaN). Ends with a block barrier:
// xq is ready. The first pass keeps up to IM_KEEP entries a thread in registers, so the second reads x
// again only for wider rows; then() runs once the first pass's loads are issued.
template <int FMT, class Then>
__device__ __forceinline__ int im_stage(uint2 *xq, const float *x, int in_pad, int (*part)[5], int (&sb)[4],
                                        bool &bad, Then then) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, warps = blockDim.x >> 5, n = in_pad / 8;
    const float4 *x4 = reinterpret_cast<const float4 *>(x);
    float4 keep[IM_KEEP][2];
    unsigned m = 0;  // |x| as bits: for non-negative floats (inf, NaN too) the integer order is the order
#pragma unroll
    for (int a = 0; a < IM_KEEP; a++) {
        const int i = threadIdx.x + a * (int)blockDim.x;
        if (i < n) {
            const int c0 = im_col0<FMT>(i);
            keep[a][0] = x4[c0 / 4];
            keep[a][1] = x4[c0 / 4 + 1];
            m = im_abs_max(im_abs_max(m, keep[a][0]), keep[a][1]);
        }
    }
    then();  // x's loads are on their way: now the caller's (the weights' first steps queue behind them)
    for (int i = threadIdx.x + IM_KEEP * (int)blockDim.x; i < n; i += blockDim.x) {
        const int c0 = im_col0<FMT>(i);
        m = im_abs_max(im_abs_max(m, x4[c0 / 4]), x4[c0 / 4 + 1]);
    }
    m = im_max_u32(m);
    if (lane == 0) part[w][0] = (int)m;
    __syncthreads();
    for (int k = 0; k < warps; k++) m = max(m, (unsigned)part[k][0]);
    bad = m >= 0x7F800000u;
    // |x| < 2^E with E = biased exponent - 126 (subnormals: 2^-126); X = x 2^(30 - E), |X| < 2^30
    const int e = bad || m == 0 ? 0 : (int)(m >> 23) - 126 - 30;
    // 2^-e as two factors, each a normal float (-e is in [-98, 156]): the products are exact
    const float f1 = __int_as_float((127 + (-e >> 1)) << 23), f2 = __int_as_float((127 + (-e - (-e >> 1))) << 23);
    int s[4] = {0, 0, 0, 0};
#pragma unroll
    for (int a = 0; a < IM_KEEP; a++) {
        const int i = threadIdx.x + a * (int)blockDim.x;
        if (i < n) im_entry<FMT>(xq, i, keep[a][0], keep[a][1], f1, f2, bad, s);
    }
    for (int i = threadIdx.x + IM_KEEP * (int)blockDim.x; i < n; i += blockDim.x) {
        const int c0 = im_col0<FMT>(i);
        im_entry<FMT>(xq, i, x4[c0 / 4], x4[c0 / 4 + 1], f1, f2, bad, s);
    }
#pragma unroll
    for (int l = 0; l < 4; l++) {
        s[l] = im_sum_i32(s[l]);
        if (lane == 0) part[w][1 + l] = s[l];
    }
    __syncthreads();
    sb[0] = sb[1] = sb[2] = sb[3] = 0;
    for (int k = 0; k < warps; k++)
        for (int l = 0; l < 4; l++) sb[l] += part[k][1 + l];
    return e;
}

// One block's row tiles (16 R16 rows of NM matrices; gate and up share x) against one token x: emit(row,
// v[NM]) gets each row's finished value (row scale applied) for rows row0 .. row0 + 16 R16 - 1 (rows past
// `rows` read the last row: valid memory, emit decides). words: 16-byte words per row (in_pad / Cols).
//
// A warp's work is one stream of steps (tile k of the block, its segment w + s warps), IM_STAGES - 1 steps
// of weights in flight ahead of the one being summed: cp.async copies each lane's 16-byte words into the
// warp's ring in shared memory, and the lane reads back only its own words (no warp barrier). The sums
// take few instructions, so a step lasts about one memory latency: bytes in flight, not arithmetic, set
// the rate (with one step ahead in registers the kernels ran at half the GEMV kernels' rate on an H200).
template <int FMT, int R16, int NM, class Emit>
__device__ __forceinline__ void imma_rows(const uint4 *const *W, const float *const *S, int rows, int ntiles,
                                          int words, const float *x, int in_pad, Emit emit) {
    constexpr int KS = Cols<FMT>::n / 8, WS = NM * R16 * 2;  // k-steps per segment; words a lane per step
    extern __shared__ uint4 dyn[];  // the limb entries (in_pad * 4 bytes), then the warps' rings
    __shared__ int red[2][IM_WARPS][NM * R16 * 64];  // [tile parity][warp][(m, r, h, limb) x 8 rows g]
    __shared__ int part[IM_WARPS][5];
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, w = threadIdx.x >> 5,
              warps = blockDim.x >> 5, segs = words >> 2;
    if ((int)blockIdx.x >= ntiles) return;  // the whole block: no barrier is left waiting
    uint2 *xq = reinterpret_cast<uint2 *>(dyn);  // [in_pad / 8][4 limbs] (P_l, Q_l)
    uint4 *ring = dyn + in_pad / 4 + w * IM_STAGES * WS * 32;  // [stage][word][lane]
    const int ntk = (ntiles - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;  // this block's tiles
    const int spw = w < segs ? (segs - w + warps - 1) / warps : 0;  // this warp's segments per tile
    const int steps = spw * ntk;
    // step p of this warp's stream into its ring slot (a commit group even when past the end: the waits
    // count groups)
    auto issue = [&](int p) {
        if (p < steps) {
            const int tl = (int)blockIdx.x + (p / spw) * (int)gridDim.x, seg = w + (p % spw) * warps;
            uint4 *slot = ring + (p % IM_STAGES) * WS * 32 + lane;
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < R16; r++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int row = min(tl * 16 * R16 + 16 * r + g + 8 * h, rows - 1);
                        im_cp16(slot + ((m * R16 + r) * 2 + h) * 32, W[m] + (u64)row * words + 4 * seg + t);
                    }
        }
        im_commit();
    };
    int sb[4];
    bool bad;
    double scale;  // 2^e
    const int e = im_stage<FMT>(xq, x, in_pad, part, sb, bad, [&] {
#pragma unroll
        for (int q = 0; q < IM_STAGES - 1; q++) issue(q);  // in flight while x is staged
    });
    scale = __longlong_as_double((long long)(1023 + e) << 52);
    static_assert(R16 <= 2, "the tile's reduction gives each lane of one warp one row");
    for (int k = 0; k < ntk; k++) {
        const int tile = (int)blockIdx.x + k * (int)gridDim.x;
        const bool reducer = w == k % warps;  // this warp finishes the tile: its lane i gets row i's scales now
        float sc[NM];
#pragma unroll
        for (int m = 0; m < NM; m++)
            sc[m] = reducer && lane < 16 * R16 ? __ldg(S[m] + min(tile * 16 * R16 + lane, rows - 1)) : 0.0f;
        int acc[NM][R16][4];  // columns 2t, 2t + 1 (limbs, t < 2) of rows g and g + 8
#pragma unroll
        for (int m = 0; m < NM; m++)
#pragma unroll
            for (int r = 0; r < R16; r++)
#pragma unroll
                for (int c = 0; c < 4; c++) acc[m][r][c] = 0;
        for (int sg = 0; sg < spw; sg++) {
            const int p = k * spw + sg, seg = w + sg * warps;
            issue(p + IM_STAGES - 1);
            im_wait();  // step p's group has landed (at most IM_STAGES - 1 newer ones pending)
            const uint4 *slot = ring + (p % IM_STAGES) * WS * 32 + lane;
            uint4 cur[NM][R16][2];
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < R16; r++)
#pragma unroll
                    for (int h = 0; h < 2; h++) cur[m][r][h] = slot[((m * R16 + r) * 2 + h) * 32];
#ifdef COLIBRI_READ_ONLY  // benchmarks only: the same loads and barriers without the sums (wrong results)
            acc[0][0][0] += (int)(cur[0][0][0].x ^ cur[NM - 1][R16 - 1][1].w);
            continue;
#endif
#pragma unroll
            for (int j = 0; j < KS; j++) {
                uint2 b = make_uint2(0u, 0u);  // lanes g < 4: limb g of this lane's 8 columns; others zero
                if (g < 4) b = xq[((seg * KS + j) * 4 + t) * 4 + g];
#pragma unroll
                for (int m = 0; m < NM; m++)
#pragma unroll
                    for (int r = 0; r < R16; r++) {
                        unsigned a0, a1, a2, a3;
                        if (FMT == F_INT4) {
                            const unsigned v0 = word_part(cur[m][r][0], j), v1 = word_part(cur[m][r][1], j);
                            a0 = v0 & 0x0F0F0F0Fu;  // nibbles 0, 2, 4, 6 of row g
                            a2 = (v0 >> 4) & 0x0F0F0F0Fu;  // nibbles 1, 3, 5, 7
                            a1 = v1 & 0x0F0F0F0Fu;  // row g + 8
                            a3 = (v1 >> 4) & 0x0F0F0F0Fu;
                        } else {
                            a0 = word_part(cur[m][r][0], 2 * j);
                            a2 = word_part(cur[m][r][0], 2 * j + 1);
                            a1 = word_part(cur[m][r][1], 2 * j);
                            a3 = word_part(cur[m][r][1], 2 * j + 1);
                        }
                        mma_i8(acc[m][r], a0, a1, a2, a3, b.x, b.y);
                    }
            }
        }
        // limb l of row g (g + 8) is column l: c0 / c1 (c2 / c3) of the lanes t = l / 2
        int(*mine)[NM * R16 * 64] = red[k & 1];
        if (t < 2) {
#pragma unroll
            for (int m = 0; m < NM; m++)
#pragma unroll
                for (int r = 0; r < R16; r++)
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        mine[w][(((m * R16 + r) * 2 + (c >> 1)) * 4 + 2 * t + (c & 1)) * 8 + g] = acc[m][r][c];
        }
        __syncthreads();  // one barrier per tile: red alternates, so the next tile's writes go elsewhere
        if (reducer && lane < 16 * R16) {  // lane = row 16 r + 8 h + gg of the tile
            const int r = lane >> 4, h = (lane >> 3) & 1, gg = lane & 7;
            float v[NM];
#pragma unroll
            for (int m = 0; m < NM; m++) {
                int c[4] = {0, 0, 0, 0};
#pragma unroll
                for (int q = 0; q < IM_WARPS; q++)  // unrolled: the loads are all in flight at once
#pragma unroll
                    for (int l = 0; l < 4; l++)
                        if (q < warps) c[l] += mine[q][(((m * R16 + r) * 2 + h) * 4 + l) * 8 + gg];
                double d = 0.0;
#pragma unroll
                for (int l = 3; l >= 0; l--) d = d * 256.0 + (double)(FMT == F_INT4 ? c[l] - 8 * sb[l] : c[l]);
                v[m] = bad ? __int_as_float(0x7FC00000) : (float)(d * scale * (double)sc[m]);
            }
            emit(tile * 16 * R16 + lane, v);
        }
    }
    im_wait_all();  // no copy may still target the ring when the block's shared memory is handed on
}

// mm / mm_args for T = 1: entry W, S, x, y, T, rows, y_stride, 0 (matmul.cu's mm_entry); T = 0 writes nothing
template <int FMT, int R16>
__device__ __forceinline__ void mm_imma_entry(const u64 *e, int rows, int in_pad, int y_stride) {
    const uint4 *W[1] = {reinterpret_cast<const uint4 *>(e[0])};
    const float *S[1] = {reinterpret_cast<const float *>(e[1])};
    const float *x = reinterpret_cast<const float *>(e[2]);
    float *y = reinterpret_cast<float *>(e[3]);
    if (e[5]) rows = (int)e[5];
    if (e[4] == 0) return;
    imma_rows<FMT, R16, 1>(W, S, rows, (rows + 16 * R16 - 1) / (16 * R16), in_pad / Cols<FMT>::n, x, in_pad,
                           [&](int row, const float (&v)[1]) {
        if (row < rows) y[row] = v[0];
    });
    (void)y_stride;  // one token: row 0 of y only
}

template <int FMT, int R16>
__global__ void IM_BOUNDS mm_imma(const u64 *__restrict__ table, int rows, int in_pad, int y_stride, int gshift) {
    mm_imma_entry<FMT, R16>(table + 8 * blockIdx.y, rows, in_pad, y_stride);
}

template <int FMT, int R16>
__global__ void IM_BOUNDS mm_args_imma(const MMArgs t, int rows, int in_pad, int y_stride, int gshift) {
    mm_imma_entry<FMT, R16>(t.e + 8 * blockIdx.y, rows, in_pad, y_stride);
}

// gate_up for T = 1: entry gate W, gate S, up W, up S, x, h, T, idx (matmul.cu's gate_up; idx, when not 0,
// holds the row of x that is the token). h[r] = SiLU(g) u for r < rows, 0 for rows <= r < h_stride.
template <int FMT, int R16>
__global__ void IM_BOUNDS gate_up_imma(const u64 *__restrict__ table, int rows, int in_pad, int h_stride, int gshift) {
    const u64 *e = table + 8 * blockIdx.y;
    const uint4 *W[2] = {reinterpret_cast<const uint4 *>(e[0]), reinterpret_cast<const uint4 *>(e[2])};
    const float *S[2] = {reinterpret_cast<const float *>(e[1]), reinterpret_cast<const float *>(e[3])};
    const int *idx = reinterpret_cast<const int *>(e[7]);
    if (e[6] == 0) return;
    const float *x = reinterpret_cast<const float *>(e[4]) + (u64)(idx ? idx[0] : 0) * in_pad;
    float *h = reinterpret_cast<float *>(e[5]);
    imma_rows<FMT, R16, 2>(W, S, rows, (h_stride + 16 * R16 - 1) / (16 * R16), in_pad / Cols<FMT>::n, x, in_pad,
                           [&](int row, const float (&v)[2]) {
        if (row < h_stride) h[row] = row < rows ? v[0] / (1.0f + expf(-v[0])) * v[1] : 0.0f;
    });
}
