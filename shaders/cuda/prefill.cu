// Prefill (T > 1) matmul and fused gate/up on tensor cores, appended to matmul.cu by backends/cuda.py (it
// uses matmul.cu's F_* formats, Cols, byte_f, magic_bits and u64). Same tables, entries and outputs as
// matmul.cu's mm / mm_args / gate_up, so the launcher swaps one for the other by token count.
//
// Why: the GEMV kernels sum each weight against every token with one FMA per token (and re-read the
// weights every 4 tokens), so 16 tokens cost ~14x one. Here a warp owns a tile of 16 R16 rows (per
// matrix) x 8 NT tokens and reads each weight once per tile: mma.sync m16n8k16 (bf16 in, f32 accumulate)
// with the dequantized weights as A (rows x k) and the activations as B (k x tokens). (tf32 m16n8k8 took
// 4 mma per 16 columns and ran ~80 TFLOPS on an H200: 3.4x the 1-token time at 16 tokens.)
//
// Precision: int8 and int4 codes are exact in bf16 (8 significant bits); scales are applied in f32 after
// the sums (per row) or per 32-column group (group formats). Activations are split x = hi + lo, both
// bf16 rounded to nearest (|x - hi - lo| <= 2^-17 |x|), and both halves go through the tensor core.
//
// Column order: a dot product may sum its columns in any order, so each lane's share of a k-step is
// taken from the weight bytes it loaded itself. Lane (g = lane / 4, t = lane % 4) loads 16 bytes of rows
// g and g + 8 of each 16-row subtile per 64-byte row segment; a k-step takes, in each lane, 4 columns of
// one of its 32-bit parts (mma k 2t, 2t + 1, 2t + 8, 2t + 9) and the activations of token g at the same
// columns: int4 part columns {2s, 2s + 4}, {2s + 1, 2s + 5} for k-step s of 2 (what masking the nibbles
// of v >> 4j gives), int8 {0, 1}, {2, 3}. Per-row formats: part i of 16-byte word 4 seg + t. Group
// formats: 32-bit word 16 seg + 4 i + t, so the four lanes of a k-step read one 32-column group and its
// partial sums can take that group's scale.

#ifndef COLIBRI_HOST_MMA
// c (16 x 8, f32) += A (16 x 16 bf16: a0 / a2 row g at k 2t.. / 2t + 8.., a1 / a3 row g + 8) . B (16 x 8
// bf16: b0 k 2t, 2t + 1 / b1 k 2t + 8, 2t + 9 at column g); the lower half of a register is the lower k
__device__ __forceinline__ void mma_bf16(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// {lo, hi} -> bf16x2 (lo in the lower half), each rounded to nearest even
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// both bf16 halves minus 136 (128 + nibble -> nibble - 8, exact)
__device__ __forceinline__ unsigned bf16x2_minus136(unsigned p) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(p), "r"(0x3F803F80u), "r"(0xC308C308u));
    return d;
}
#endif

// A pair (mma k 2t, 2t + 1 or 2t + 8, 2t + 9) j of 32-bit weight part v, as bf16x2 codes (scale later):
// int4 j = 0..3: part columns {j, j + 4} = bits 4j and 16 + 4j (0x4300 | nibble is 128 + nibble);
// int8 j = 0, 1: columns {2j, 2j + 1}
template <int FMT>
__device__ __forceinline__ unsigned a_pair(unsigned v, int j) {
    if (FMT == F_INT8) {
        const unsigned u = v ^ 0x80808080u;  // signed q -> q + 128
        return pack_bf16(byte_f<0>(u >> (16 * j), 8388736.0f), byte_f<1>(u >> (16 * j), 8388736.0f));
    }
    return bf16x2_minus136(((v >> (4 * j)) & 0x000F000Fu) | 0x43004300u);
}

// x = hi + lo as two bf16x2 of the columns (c0, c1)
__device__ __forceinline__ void split_bf16(float c0, float c1, unsigned &hi, unsigned &lo) {
    hi = pack_bf16(c0, c1);
    lo = pack_bf16(c0 - __uint_as_float(hi << 16), c1 - __uint_as_float(hi & 0xFFFF0000u));
}

// Fully unrolled loop nests over tc_rows' register arrays (acc[m][r][n][c], cur[m][r][h][i], ...): a
// register array must be indexed by compile-time constants, or it is put in local memory. The trip counts
// are template constants and every loop is #pragma unroll, so once f is inlined (a lambda with the nest's
// body) each call has constant indices, as in a nest written out in place; the PTX is the same, byte for
// byte. (Passing the indices as constant-typed tags, one instance of f per index, was tried: it compiled
// the reduction's inner loop over the warps differently, so not the same code.)
// for4<A, B, C, D>(f): f(a, b, c, d) for a < A, b < B, c < C, d < D, d innermost
template <int A, int B, int C, int D, class F>
__device__ __forceinline__ void for4(F f) {
#pragma unroll
    for (int a = 0; a < A; a++)
#pragma unroll
        for (int b = 0; b < B; b++)
#pragma unroll
            for (int c = 0; c < C; c++)
#pragma unroll
                for (int d = 0; d < D; d++) f(a, b, c, d);
}

// for2<A, B>(f): f(a, b) for a < A, b < B, b innermost
template <int A, int B, class F>
__device__ __forceinline__ void for2(F f) {
    for4<A, B, 1, 1>([&](int a, int b, int, int) { f(a, b); });
}

#define TC_WARPS 8  // warps per block at most (backends/cuda.py _TC_WARPS)
#ifndef TC_SHARED
#define TC_SHARED __shared__
#endif

// One block's work items over the row tiles and token passes of one table entry: tile of 16 R16 rows of
// NM matrices (gate and up share the activations) x pass of 8 NT tokens. The block's warps split the
// columns (warp w takes the 64-byte segments w, w + warps, ...: every warp's loads are in flight at once,
// where one warp per tile left ~1/8 of the bandwidth's bytes in flight) and their sums are added in warp
// order through shared memory (deterministic). emit(row0, tok0, acc), called by warp 0, gets the finished
// sums, acc[m][r][n][c]: row row0 + 16 r + g + 8 (c / 2), token tok0 + 8 n + 2 t + c % 2.
// x rows are in_pad floats, 16-byte aligned; token j reads row idx[j] when idx is given, else row j.
template <int FMT, int R16, int NM, int NT, class Emit>
__device__ __forceinline__ void tc_rows(const uint4 *const *W, const float *const *S, int rows, int ntiles,
                                        int words, int gshift, const float *x, const int *idx, int in_pad,
                                        int T, Emit emit) {
    constexpr int CPU = Cols<FMT>::n / 4;  // columns per 32-bit part
    constexpr bool GR = FMT == F_INT4G;
    // int4 too takes the group formats' column order (lane t's part i: 32-bit word 4 i + t of the segment):
    // the four lanes of a k-step then read one 128-byte line of a token's activations, not four (an H200
    // profile of the 16-token gate/up had the L1 at 73% of its throughput, DRAM at 19%)
    constexpr bool WORDS = GR || FMT == F_INT4;
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warps = blockDim.x >> 5;
    const int npass = (T + 8 * NT - 1) / (8 * NT), items = ntiles * npass, segs = words >> 2;
    const int ngroups = words >> gshift;
    const int w = threadIdx.x >> 5;
    TC_SHARED float red[TC_WARPS][NM * R16 * NT * 4][32];  // [warp][sum][lane]: a lane's sums, no conflicts
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        const int tile = item % ntiles, tok0 = (item / ntiles) * 8 * NT, row0 = tile * 16 * R16;
        const uint4 *wr[NM][R16][2];
        const float *sr[NM][R16][2];  // per-row formats: the row's scale; group formats: its group scales
        for4<NM, R16, 2, 1>([&](int m, int r, int h, int) {
            const int row = min(row0 + 16 * r + g + 8 * h, rows - 1);  // past the end: a valid row
            wr[m][r][h] = W[m] + (u64)row * words;
            sr[m][r][h] = S[m] + (GR ? (u64)row * ngroups : (u64)row);
        });
        const float *xr[NT];
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int j = min(tok0 + 8 * n + g, T - 1);  // past the last token: a valid row, never stored
            xr[n] = x + (u64)(idx ? idx[j] : j) * in_pad;
        }
        // part / plo: the hi / lo halves' sums, two independent mma chains (each mma waits for the last
        // one into its accumulator)
        float acc[NM][R16][NT][4], part[NM][R16][NT][4], plo[NM][R16][NT][4];
        for4<NM, R16, NT, 4>([&](int m, int r, int n, int c) {
            acc[m][r][n][c] = part[m][r][n][c] = plo[m][r][n][c] = 0.0f;
        });
        unsigned cur[NM][R16][2][4], nxt[NM][R16][2][4];
        float gs[NM][R16][2][4], gn[NM][R16][2][4];  // group formats: each part's group scale
        // the loads of segment `seg` (64 bytes of each row) into w, s
        auto load = [&](unsigned (&w)[NM][R16][2][4], float (&s)[NM][R16][2][4], int seg) {
            for4<NM, R16, 2, 1>([&](int m, int r, int h, int) {
                if (WORDS) {
                    const unsigned *p = reinterpret_cast<const unsigned *>(wr[m][r][h] + 4 * seg);
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        w[m][r][h][i] = __ldg(p + 4 * i + t);
                        if (GR) s[m][r][h][i] = __ldg(sr[m][r][h] + ((4 * seg + i) >> gshift));
                    }
                } else {
                    const uint4 v = __ldg(wr[m][r][h] + 4 * seg + t);
                    w[m][r][h][0] = v.x;
                    w[m][r][h][1] = v.y;
                    w[m][r][h][2] = v.z;
                    w[m][r][h][3] = v.w;
                }
            });
        };
        if (w < segs) load(cur, gs, w);
        for (int seg = w; seg < segs; seg += warps) {
            const int nseg = seg + warps;
            if (nseg < segs) load(nxt, gn, nseg);  // in flight while this segment is summed
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int q = WORDS ? 16 * seg + 4 * i + t : 4 * (4 * seg + t) + i;  // 32-bit part of the row
                unsigned bh[NT][CPU / 2], bl[NT][CPU / 2];  // token g's activations, B pairs j, split
#pragma unroll
                for (int n = 0; n < NT; n++) {
                    const float *xp = xr[n] + q * CPU;
                    const float4 v = __ldg(reinterpret_cast<const float4 *>(xp));
                    if (CPU == 8) {  // int4: pairs {j, j + 4}
                        const float4 w = __ldg(reinterpret_cast<const float4 *>(xp + 4));
                        split_bf16(v.x, w.x, bh[n][0], bl[n][0]);
                        split_bf16(v.y, w.y, bh[n][1 % (CPU / 2)], bl[n][1 % (CPU / 2)]);
                        split_bf16(v.z, w.z, bh[n][2 % (CPU / 2)], bl[n][2 % (CPU / 2)]);
                        split_bf16(v.w, w.w, bh[n][3 % (CPU / 2)], bl[n][3 % (CPU / 2)]);
                    } else {  // int8: pairs {0, 1}, {2, 3}
                        split_bf16(v.x, v.y, bh[n][0], bl[n][0]);
                        split_bf16(v.z, v.w, bh[n][1], bl[n][1]);
                    }
                }
#pragma unroll
                for (int m = 0; m < NM; m++)
#pragma unroll
                    for (int r = 0; r < R16; r++)
#pragma unroll
                        for (int s = 0; s < CPU / 4; s++) {  // k-steps of 16 columns in this part
                            const unsigned a0 = a_pair<FMT>(cur[m][r][0][i], 2 * s),
                                           a2 = a_pair<FMT>(cur[m][r][0][i], 2 * s + 1),
                                           a1 = a_pair<FMT>(cur[m][r][1][i], 2 * s),
                                           a3 = a_pair<FMT>(cur[m][r][1][i], 2 * s + 1);
#pragma unroll
                            for (int n = 0; n < NT; n++) {
                                mma_bf16(part[m][r][n], a0, a1, a2, a3, bh[n][2 * s], bh[n][2 * s + 1]);
                                mma_bf16(plo[m][r][n], a0, a1, a2, a3, bl[n][2 * s], bl[n][2 * s + 1]);
                            }
                        }
                if (GR) {  // this part's 32 columns are one group of every row: scale and fold
                    for4<NM, R16, NT, 4>([&](int m, int r, int n, int c) {
                        const float v = part[m][r][n][c] + plo[m][r][n][c];
                        acc[m][r][n][c] = fmaf(v, gs[m][r][c >> 1][i], acc[m][r][n][c]);
                        part[m][r][n][c] = plo[m][r][n][c] = 0.0f;
                    });
                }
            }
            if (nseg < segs) {
                for4<NM, R16, 2, 4>([&](int m, int r, int h, int i) {
                    cur[m][r][h][i] = nxt[m][r][h][i];
                    gs[m][r][h][i] = gn[m][r][h][i];
                });
            }
        }
        if (!GR) {  // per-row scales: a row's two scales loaded once, for all its tokens
            for2<NM, R16>([&](int m, int r) {
                const float s0 = __ldg(sr[m][r][0]), s1 = __ldg(sr[m][r][1]);
                for2<NT, 4>([&](int n, int c) {
                    acc[m][r][n][c] = (part[m][r][n][c] + plo[m][r][n][c]) * (c < 2 ? s0 : s1);
                });
            });
        }
        for4<NM, R16, NT, 4>([&](int m, int r, int n, int c) {
            red[w][((m * R16 + r) * NT + n) * 4 + c][lane] = acc[m][r][n][c];
        });
        __syncthreads();
        if (w == 0) {
            for4<NM, R16, NT, 4>([&](int m, int r, int n, int c) {
                const int v = ((m * R16 + r) * NT + n) * 4 + c;
                float sum = red[0][v][lane];
                for (int k = 1; k < warps; k++) sum += red[k][v][lane];
                acc[m][r][n][c] = sum;
            });
            emit(row0, tok0, acc);
        }
        __syncthreads();  // red is rewritten by the next item
    }
}

// mm / mm_args on tensor cores: entry W, S, x, y, T, rows, y_stride, 0 (matmul.cu's mm_entry)
template <int FMT, int R16, int NT>
__device__ __forceinline__ void mm_tc_entry(const u64 *e, int rows, int in_pad, int y_stride, int gshift) {
    const uint4 *W[1] = {reinterpret_cast<const uint4 *>(e[0])};
    const float *S[1] = {reinterpret_cast<const float *>(e[1])};
    const float *x = reinterpret_cast<const float *>(e[2]);
    float *y = reinterpret_cast<float *>(e[3]);
    if (e[5]) rows = (int)e[5];
    if (e[6]) y_stride = (int)e[6];
    const int T = (int)e[4], g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    tc_rows<FMT, R16, 1, NT>(W, S, rows, (rows + 16 * R16 - 1) / (16 * R16), in_pad / Cols<FMT>::n, gshift, x,
                             nullptr, in_pad, T, [&](int row0, int tok0, float (&acc)[1][R16][NT][4]) {
        for4<1, R16, NT, 4>([&](int, int r, int n, int c) {
            const int row = row0 + 16 * r + g + 8 * (c >> 1), j = tok0 + 8 * n + 2 * t + (c & 1);
            if (row < rows && j < T) y[(u64)j * y_stride + row] = acc[0][r][n][c];
        });
    });
}

template <int FMT, int R16, int NT>
__global__ void mm_tc(const u64 *__restrict__ table, int rows, int in_pad, int y_stride, int gshift) {
    mm_tc_entry<FMT, R16, NT>(table + 8 * blockIdx.y, rows, in_pad, y_stride, gshift);
}

template <int FMT, int R16, int NT>
__global__ void mm_args_tc(const MMArgs t, int rows, int in_pad, int y_stride, int gshift) {
    mm_tc_entry<FMT, R16, NT>(t.e + 8 * blockIdx.y, rows, in_pad, y_stride, gshift);
}

// gate_up on tensor cores: entry gate W, gate S, up W, up S, x, h, T, idx (matmul.cu's gate_up; idx, when
// not 0, the int32 rows of x that are this expert's T tokens: a device trunk's prefill routes tokens).
template <int FMT, int R16, int NT>
__global__ void gate_up_tc(const u64 *__restrict__ table, int rows, int in_pad, int h_stride, int gshift) {
    const u64 *e = table + 8 * blockIdx.y;
    const uint4 *W[2] = {reinterpret_cast<const uint4 *>(e[0]), reinterpret_cast<const uint4 *>(e[2])};
    const float *S[2] = {reinterpret_cast<const float *>(e[1]), reinterpret_cast<const float *>(e[3])};
    const float *x = reinterpret_cast<const float *>(e[4]);
    float *h = reinterpret_cast<float *>(e[5]);
    const int T = (int)e[6], g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    const int *idx = reinterpret_cast<const int *>(e[7]);
    tc_rows<FMT, R16, 2, NT>(W, S, rows, (h_stride + 16 * R16 - 1) / (16 * R16), in_pad / Cols<FMT>::n, gshift,
                             x, idx, in_pad, T, [&](int row0, int tok0, float (&acc)[2][R16][NT][4]) {
        for4<1, R16, NT, 4>([&](int, int r, int n, int c) {  // gate acc[0], up acc[1]
            const int row = row0 + 16 * r + g + 8 * (c >> 1), j = tok0 + 8 * n + 2 * t + (c & 1);
            if (row < h_stride && j < T) {
                const float gv = acc[0][r][n][c], uv = acc[1][r][n][c];
                h[(u64)j * h_stride + row] = row < rows ? gv / (1.0f + expf(-gv)) * uv : 0.0f;
            }
        });
    });
}
