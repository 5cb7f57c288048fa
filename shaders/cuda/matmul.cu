// Quantized matmul y[t, r] = sum_c x[t, c] * W[r, c] and the fused SwiGLU expert FFN, for a batch of
// matrices in one launch (blockIdx.y picks the matrix; its pointers come from a device table).
//
// Weight layout (backends/base.py padded_layout): rows of in_pad columns (a multiple of 128, so every
// row is 16-byte aligned), padded with the zero code; activations padded with zeros. Semantics are
// colibri_plan/quant.py: int4 (nibble - 8) * s, int2 (crumb - 2) * s, int8 q * s, bf16 bits << 16,
// f16 IEEE half, group formats (nibble - 8) * s[r, c / G]; packing low bits first.
//
// Work shape (decode is bound by weight reads): a warp owns tiles of R rows; each lane reads whole
// 16-byte words (uint4) of consecutive columns, so a warp reads 512 contiguous bytes per row per word
// step, and the next step's words are loaded while the current ones are summed; the activations of up
// to TC tokens sit in shared memory; lanes reduce with shuffles.
// Compiled by NVRTC through CuPy RawModule; `nvcc --ptx` checks it too (no headers needed).

typedef unsigned long long u64;  // NVRTC has no <cstddef>: no size_t

#define F_F32 0
#define F_F16 1
#define F_BF16 2
#define F_INT8 3
#define F_INT4 4
#define F_INT2 5
#define F_INT4G 6

// columns per 16-byte weight word
template <int FMT> struct Cols { static constexpr int n = 32; };
template <> struct Cols<F_F32> { static constexpr int n = 4; };
template <> struct Cols<F_F16> { static constexpr int n = 8; };
template <> struct Cols<F_BF16> { static constexpr int n = 8; };
template <> struct Cols<F_INT8> { static constexpr int n = 16; };
template <> struct Cols<F_INT2> { static constexpr int n = 64; };

// 2^23 + bb as float has bits 0x4B0000bb: one byte permute and one subtract convert a byte code to
// float exactly (cheaper than an int-to-float conversion). The 0x4B000000 word comes from memory: as a
// literal, ptxas makes it the permute's one immediate operand and moves the selector into a register
// instead, an extra instruction per weight.
__device__ unsigned magic_bits = 0x4B000000u;
template <int B>
__device__ __forceinline__ float byte_f(unsigned word, float bias) {
    return __int_as_float(__byte_perm(word, magic_bits, 0x7440 | B)) - bias;
}

__device__ __forceinline__ float half_f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// sum over the columns of one 32-bit part of a weight word: part p of word covers columns
// [p * Cols / 4, (p + 1) * Cols / 4), x points at the word's first column (shared memory).
template <int FMT>
__device__ __forceinline__ float dot_part(unsigned v, const float *x, float acc) {
    if (FMT == F_F32) {
        acc = fmaf(__uint_as_float(v), x[0], acc);
    } else if (FMT == F_F16) {
        acc = fmaf(half_f((unsigned short)(v & 0xFFFFu)), x[0], acc);
        acc = fmaf(half_f((unsigned short)(v >> 16)), x[1], acc);
    } else if (FMT == F_BF16) {
        acc = fmaf(__uint_as_float(v << 16), x[0], acc);
        acc = fmaf(__uint_as_float(v & 0xFFFF0000u), x[1], acc);
    } else if (FMT == F_INT8) {
        const unsigned u = v ^ 0x80808080u;  // signed q -> q + 128
        acc = fmaf(byte_f<0>(u, 8388736.0f), x[0], acc);
        acc = fmaf(byte_f<1>(u, 8388736.0f), x[1], acc);
        acc = fmaf(byte_f<2>(u, 8388736.0f), x[2], acc);
        acc = fmaf(byte_f<3>(u, 8388736.0f), x[3], acc);
    } else if (FMT == F_INT4 || FMT == F_INT4G) {
        const unsigned lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;  // byte b: columns 2b, 2b+1
        acc = fmaf(byte_f<0>(lo, 8388616.0f), x[0], acc);
        acc = fmaf(byte_f<0>(hi, 8388616.0f), x[1], acc);
        acc = fmaf(byte_f<1>(lo, 8388616.0f), x[2], acc);
        acc = fmaf(byte_f<1>(hi, 8388616.0f), x[3], acc);
        acc = fmaf(byte_f<2>(lo, 8388616.0f), x[4], acc);
        acc = fmaf(byte_f<2>(hi, 8388616.0f), x[5], acc);
        acc = fmaf(byte_f<3>(lo, 8388616.0f), x[6], acc);
        acc = fmaf(byte_f<3>(hi, 8388616.0f), x[7], acc);
    } else {  // F_INT2: byte b holds columns 4b .. 4b+3
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const unsigned c = (v >> (2 * i)) & 0x03030303u;
            acc = fmaf(byte_f<0>(c, 8388610.0f), x[i], acc);
            acc = fmaf(byte_f<1>(c, 8388610.0f), x[4 + i], acc);
            acc = fmaf(byte_f<2>(c, 8388610.0f), x[8 + i], acc);
            acc = fmaf(byte_f<3>(c, 8388610.0f), x[12 + i], acc);
        }
    }
    return acc;
}

template <int FMT>
__device__ __forceinline__ float dot_word(uint4 w, const float *x) {
    constexpr int q = Cols<FMT>::n / 4;
#ifdef COLIBRI_READ_ONLY  // benchmarks only: the same loads without the arithmetic (memory side alone)
    return __uint_as_float(w.x ^ w.y ^ w.z ^ w.w) * x[0];
#endif
    float acc = dot_part<FMT>(w.x, x, 0.0f);
    acc = dot_part<FMT>(w.y, x + q, acc);
    acc = dot_part<FMT>(w.z, x + 2 * q, acc);
    return dot_part<FMT>(w.w, x + 3 * q, acc);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

// Shared-memory layout of the activations: word k's F = Cols / 4 float4s are stored rotated, float4 q
// at k * F + (q ^ (k mod F)). The 8 lanes of one 128-bit shared load phase read consecutive words k at
// the same q, so they hit 8 different 16-byte bank groups; the plain layout (stride Cols floats) put
// them all in one group, an 8-way bank conflict that capped int4 decode at about a quarter of HBM.
template <int FMT>
__device__ __forceinline__ int swz(int i) {  // logical float4 index -> stored index
    constexpr int F = Cols<FMT>::n / 4;
    if (F == 1) return i;
    const int k = i / F, q = i % F;
    return k * F + (q ^ (k & (F - 1)));
}

// x[t] (in_pad floats, 16-byte aligned) -> shared memory, in the rotated layout
template <int FMT>
__device__ __forceinline__ void stage(float *xs, const float *x, int in_pad) {
    const float4 *src = reinterpret_cast<const float4 *>(x);
    float4 *dst = reinterpret_cast<float4 *>(xs);
    for (int i = threadIdx.x; i < in_pad / 4; i += blockDim.x) dst[swz<FMT>(i)] = src[i];
}

// the Cols activations of word k, from the rotated layout into registers
template <int FMT>
__device__ __forceinline__ void load_x(const float *xs, int k, float (&xv)[Cols<FMT>::n]) {
    constexpr int F = Cols<FMT>::n / 4;
    const float4 *s = reinterpret_cast<const float4 *>(xs) + k * F;
#pragma unroll
    for (int q = 0; q < F; q++) {
        const float4 v = s[F == 1 ? 0 : (q ^ (k & (F - 1)))];
        xv[4 * q] = v.x;
        xv[4 * q + 1] = v.y;
        xv[4 * q + 2] = v.z;
        xv[4 * q + 3] = v.w;
    }
}

// The Cols / 4 activations of part p (0..3) of word k (formats of at least 16 columns per word: 4 float4s
// or more per word, a whole number per part), from the rotated layout into registers.
template <int FMT>
__device__ __forceinline__ void load_x_part(const float *xs, int k, int p, float (&xv)[Cols<FMT>::n / 4]) {
    constexpr int F = Cols<FMT>::n / 4, Q = F / 4;  // float4s per word, per part
    const float4 *s = reinterpret_cast<const float4 *>(xs) + k * F;
#pragma unroll
    for (int q = 0; q < Q; q++) {
        const float4 v = s[(p * Q + q) ^ (k & (F - 1))];
        xv[4 * q] = v.x;
        xv[4 * q + 1] = v.y;
        xv[4 * q + 2] = v.z;
        xv[4 * q + 3] = v.w;
    }
}

__device__ __forceinline__ unsigned word_part(uint4 w, int p) {
    return p == 0 ? w.x : p == 1 ? w.y : p == 2 ? w.z : w.w;
}

// One step of a warp's stream: U 16-byte words per lane of R rows of NW matrices, with their scales
// (group formats: each word's group scale; per-row formats: the row scale, in s[m][i][0]).
template <int FMT, int R, int NW, int U>
struct Step {
    uint4 w[NW][R][U];
    float s[NW][R][U];
};

// Issue the loads of one step: this lane's words k0 + 32 u of rows row0 .. row0 + R - 1 (rows past
// `rows` are clamped to the last row, valid memory; words past the row end read as zero, never used).
template <int FMT, int R, int NW, int U>
__device__ __forceinline__ void load_step(Step<FMT, R, NW, U> &st, const uint4 *const *W, const float *const *S,
                                          int row0, int rows, int words, int gshift, int k0) {
    const int ngroups = words >> gshift;
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int i = 0; i < R; i++) {
            const int r = min(row0 + i, rows - 1);
            const uint4 *wr = W[m] + (u64)r * words;
#pragma unroll
            for (int u = 0; u < U; u++) {
                const int k = k0 + 32 * u;
                st.w[m][i][u] = k < words ? __ldg(wr + k) : make_uint4(0u, 0u, 0u, 0u);
                if (FMT == F_INT4G) st.s[m][i][u] = k < words ? __ldg(S[m] + (u64)r * ngroups + (k >> gshift)) : 0.0f;
            }
            if (FMT == F_INT8 || FMT == F_INT4 || FMT == F_INT2) st.s[m][i][0] = __ldg(S[m] + r);
        }
}

// acc[j][m][i] += W_m[row i] . x_j over the step's words, for the tn <= TC tokens staged at xs + j * in_pad
template <int FMT, int R, int NW, int U, int TC>
__device__ __forceinline__ void dot_step(const Step<FMT, R, NW, U> &st, const float *xs, int in_pad, int tn,
                                         int words, int k0, float (&acc)[TC][NW][R]) {
#pragma unroll
    for (int u = 0; u < U; u++) {
        const int k = k0 + 32 * u;
        if (k >= words) break;
#pragma unroll
        for (int j = 0; j < TC; j++) {
            if (j >= tn) break;
#if defined(COLIBRI_X_BY_PART) && !defined(COLIBRI_READ_ONLY)
            // a launcher setting (backends/cuda.py _GEMV_TUNE x_by_part): the activations one 32-bit part at a
            // time, Cols / 4 registers instead of Cols (int4: 8, not 32), for more resident warps; the same
            // sums in the same order as dot_word
            if (Cols<FMT>::n >= 16) {
                float d[NW][R];
#pragma unroll
                for (int p = 0; p < 4; p++) {
                    float xp[Cols<FMT>::n / 4];
                    load_x_part<FMT>(xs + j * in_pad, k, p, xp);
#pragma unroll
                    for (int m = 0; m < NW; m++)
#pragma unroll
                        for (int i = 0; i < R; i++)
                            d[m][i] = dot_part<FMT>(word_part(st.w[m][i][u], p), xp, p == 0 ? 0.0f : d[m][i]);
                }
#pragma unroll
                for (int m = 0; m < NW; m++)
#pragma unroll
                    for (int i = 0; i < R; i++)
                        acc[j][m][i] = FMT == F_INT4G ? fmaf(d[m][i], st.s[m][i][u], acc[j][m][i])
                                                      : acc[j][m][i] + d[m][i];
                continue;
            }
#endif
            float x[Cols<FMT>::n];
            load_x<FMT>(xs + j * in_pad, k, x);
#pragma unroll
            for (int m = 0; m < NW; m++)
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const float d = dot_word<FMT>(st.w[m][i][u], x);
                    acc[j][m][i] = FMT == F_INT4G ? fmaf(d, st.s[m][i][u], acc[j][m][i]) : acc[j][m][i] + d;
                }
        }
    }
}

// A warp's share of the row tiles (R rows each; warp g of the grid takes tiles g, g + all warps, ...),
// as one stream of steps: the loads of the next step, which may belong to the next tile, are in
// flight while this one computes, so a short row (2048 int4 columns are 2 words per lane) does not
// expose the memory latency once per tile. emit(row0, acc) gets each tile's finished sums (every lane
// holds them; per-row scales applied).
template <int FMT, int R, int NW, int U, int TC, class Emit>
__device__ __forceinline__ void warp_rows(const uint4 *const *W, const float *const *S, int rows, int ntiles,
                                          int words, int gshift, const float *xs, int in_pad, int tn, Emit emit) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5, tstep = gridDim.x * warps;
    int tile = blockIdx.x * warps + (threadIdx.x >> 5);
    if (tile >= ntiles) return;
    const int steps = (words + 32 * U - 1) / (32 * U);  // steps per tile, the same for every lane
    int step = 0;
    Step<FMT, R, NW, U> cur, nxt;
    load_step<FMT, R, NW, U>(cur, W, S, tile * R, rows, words, gshift, lane);
    float acc[TC][NW][R];
#pragma unroll
    for (int j = 0; j < TC; j++)
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < R; i++) acc[j][m][i] = 0.0f;
    for (;;) {
        int ntile = tile, nstep = step + 1;
        if (nstep == steps) {
            nstep = 0;
            ntile += tstep;
        }
        const bool more = ntile < ntiles;
        if (more) load_step<FMT, R, NW, U>(nxt, W, S, ntile * R, rows, words, gshift, lane + 32 * U * nstep);
        dot_step<FMT, R, NW, U, TC>(cur, xs, in_pad, tn, words, lane + 32 * U * step, acc);
        if (nstep == 0) {  // the tile is complete: reduce over lanes, hand it out, start the next
#pragma unroll
            for (int j = 0; j < TC; j++)
#pragma unroll
                for (int m = 0; m < NW; m++)
#pragma unroll
                    for (int i = 0; i < R; i++) {
                        float v = warp_sum(acc[j][m][i]);
                        if (FMT == F_INT8 || FMT == F_INT4 || FMT == F_INT2) v *= cur.s[m][i][0];
                        acc[j][m][i] = v;
                    }
            emit(tile * R, acc);
#pragma unroll
            for (int j = 0; j < TC; j++)
#pragma unroll
                for (int m = 0; m < NW; m++)
#pragma unroll
                    for (int i = 0; i < R; i++) acc[j][m][i] = 0.0f;
        }
        if (!more) break;
        tile = ntile;
        step = nstep;
        cur = nxt;
    }
}

// x[t0 .. t0 + tn) (rows of in_pad floats, 16-byte aligned) -> shared memory, token j at xs + j * in_pad
template <int FMT>
__device__ __forceinline__ void stage_tokens(float *xs, const float *x, int in_pad, int tn) {
    for (int j = 0; j < tn; j++) stage<FMT>(xs + j * in_pad, x + (u64)j * in_pad, in_pad);
}

// Tokens go in passes of TC (weights are read once per pass); blocks cover the row tiles of their
// matrix, a few resident per SM (the host sizes gridDim.x), each warp streaming its tiles.

// Table entry per matrix (8 x u64): W, S, x, y, T, rows, y_stride, 0. y[t * y_stride + r] = x[t] . W[r] for
// r < rows; an entry's rows / y_stride of 0 mean the launch's (the host path's entries leave them 0;
// d_matmul_many batches matrices of different heights, q/k/v, in one launch).
// Grid (blocks, n_matrices), block (32 * warps), shared memory TC * in_pad * 4 bytes.
template <int FMT, int R, int U, int TC>
__device__ __forceinline__ void mm_entry(const u64 *e, int rows, int in_pad, int y_stride, int gshift) {
    extern __shared__ float4 smem4[];
    float *xs = reinterpret_cast<float *>(smem4);
    const uint4 *W[1] = {reinterpret_cast<const uint4 *>(e[0])};
    const float *S[1] = {reinterpret_cast<const float *>(e[1])};
    const float *x = reinterpret_cast<const float *>(e[2]);
    float *y = reinterpret_cast<float *>(e[3]);
    if (e[5]) rows = (int)e[5];
    if (e[6]) y_stride = (int)e[6];
    const int T = (int)e[4], words = in_pad / Cols<FMT>::n, ntiles = (rows + R - 1) / R;
    const int lane = threadIdx.x & 31;
    for (int t0 = 0; t0 < T; t0 += TC) {
        const int tn = min(TC, T - t0);
        stage_tokens<FMT>(xs, x + (u64)t0 * in_pad, in_pad, tn);
        __syncthreads();
        warp_rows<FMT, R, 1, U, TC>(W, S, rows, ntiles, words, gshift, xs, in_pad, tn,
                                    [&](int row0, float (&acc)[TC][1][R]) {
#pragma unroll
            for (int j = 0; j < TC; j++)
#pragma unroll
                for (int i = 0; i < R; i++)
                    if (lane == i && j < tn && row0 + i < rows) y[(u64)(t0 + j) * y_stride + row0 + i] = acc[j][0][i];
        });
        __syncthreads();  // xs is overwritten by the next pass
    }
}

// The table in device memory (the host path stages it with the activations).
template <int FMT, int R, int U, int TC>
__global__ void mm(const u64 *__restrict__ table, int rows, int in_pad, int y_stride, int gshift) {
    mm_entry<FMT, R, U, TC>(table + 8 * blockIdx.y, rows, in_pad, y_stride, gshift);
}

// The table as a kernel argument (device activations: d_matmul, d_matmul_many): kernel arguments are
// copied at launch, so one launch is the whole op, with no table to upload or to keep until it has run.
#define MM_ARGS_MAX 4  // matrices per launch (backends/cuda_device.py _MM_ARGS_MAX)
struct MMArgs {
    u64 e[8 * MM_ARGS_MAX];
};
template <int FMT, int R, int U, int TC>
__global__ void mm_args(const MMArgs t, int rows, int in_pad, int y_stride, int gshift) {
    mm_entry<FMT, R, U, TC>(t.e + 8 * blockIdx.y, rows, in_pad, y_stride, gshift);
}

// Table entry per expert (8 x u64): gate W, gate S, up W, up S, x, h, T, idx (0, or int32 [T]: token t is
// row idx[t] of x, a device trunk's prefill routing tokens to experts).
// h[t * h_stride + r] = SiLU(gate[r] . x[t]) * (up[r] . x[t]) for r < rows; rows <= r < h_stride
// (padding the down projection reads) get 0. Grid (blocks, n_experts); tiles cover h_stride.
template <int FMT, int R, int U, int TC>
__global__ void gate_up(const u64 *__restrict__ table, int rows, int in_pad, int h_stride, int gshift) {
    extern __shared__ float4 smem4[];
    float *xs = reinterpret_cast<float *>(smem4);
    const u64 *e = table + 8 * blockIdx.y;
    const uint4 *W[2] = {reinterpret_cast<const uint4 *>(e[0]), reinterpret_cast<const uint4 *>(e[2])};
    const float *S[2] = {reinterpret_cast<const float *>(e[1]), reinterpret_cast<const float *>(e[3])};
    const float *x = reinterpret_cast<const float *>(e[4]);
    float *h = reinterpret_cast<float *>(e[5]);
    const int T = (int)e[6], words = in_pad / Cols<FMT>::n, ntiles = (h_stride + R - 1) / R;
    const int lane = threadIdx.x & 31, *idx = reinterpret_cast<const int *>(e[7]);
    for (int t0 = 0; t0 < T; t0 += TC) {
        const int tn = min(TC, T - t0);
        for (int j = 0; j < tn; j++)
            stage<FMT>(xs + j * in_pad, x + (u64)(idx ? idx[t0 + j] : t0 + j) * in_pad, in_pad);
        __syncthreads();
        warp_rows<FMT, R, 2, U, TC>(W, S, rows, ntiles, words, gshift, xs, in_pad, tn,
                                    [&](int row0, float (&acc)[TC][2][R]) {
#pragma unroll
            for (int j = 0; j < TC; j++)
#pragma unroll
                for (int i = 0; i < R; i++) {
                    const int r = row0 + i;
                    if (lane == i && j < tn && r < h_stride) {
                        const float g = acc[j][0][i], u = acc[j][1][i];
                        h[(u64)(t0 + j) * h_stride + r] = r < rows ? g / (1.0f + expf(-g)) * u : 0.0f;
                    }
                }
        });
        __syncthreads();
    }
}

// RMSNorm, one block per token row: y = x / sqrt(mean(x^2) + eps) * w. A row of at most
// blockDim.x * 4 * RMS_VEC floats (H a multiple of 4, 16-byte aligned rows) is read once as float4s into
// registers, w's float4s loaded with it (their latency overlapped), summed by one warp butterfly and (more
// than one warp) one shared-memory step, then scaled from the registers; any other row takes the strided
// loops. backends/cuda/device.py picks the threads: one warp for rows of up to 1024 (Qwen3's per-head
// q_norm / k_norm rows of 128: no shared memory, no __syncthreads), 256 beyond. The old form (x read
// twice, a strided loop of 256 threads per row) took 5.5 us for a row of 2048 on an H200.
#define RMS_VEC 8  // float4s per thread held across the two passes (a row of 8192 floats with 256 threads)
// a float4 of four floats (the host harnesses lack CUDA's constructor helper)
__device__ __forceinline__ float4 rms_f4(float a, float b, float c, float d) {
    float4 v;
    v.x = a; v.y = b; v.z = c; v.w = d;
    return v;
}
#ifndef RMS_SHARED  // the host harness (tests/test_backend_cuda_rmsnorm.py): static, one block at a time
#define RMS_SHARED __shared__
#endif
// Fused with the residual add (b not null: d_add_rmsnorm): the row normalised is x + b, also written to h
// (the same float add as trunk.cu's tr_add; the norm's order that of the plain form: the same bits).
extern "C" __global__ void rmsnorm(const float *__restrict__ x, const float *__restrict__ b,
                                   const float *__restrict__ w, float *y, float *h, int H, float eps) {
    RMS_SHARED float part[32];
    const float *xr = x + (u64)blockIdx.x * H, *br = b ? b + (u64)blockIdx.x * H : b;
    float *yr = y + (u64)blockIdx.x * H, *hr = b ? h + (u64)blockIdx.x * H : h;
    const int tid = threadIdx.x, nt = blockDim.x, n4 = H >> 2;
    const bool vec = (H & 3) == 0 && n4 <= nt * RMS_VEC &&
                     (((u64)xr | (u64)w | (u64)yr | (u64)br | (u64)hr) & 15u) == 0;
    float4 xv[RMS_VEC], wv[RMS_VEC];
    float s = 0.0f;
    if (vec) {  // uniform across the block
        const float4 *x4 = reinterpret_cast<const float4 *>(xr), *w4 = reinterpret_cast<const float4 *>(w);
#pragma unroll
        for (int i = 0; i < RMS_VEC; i++) {
            const int c = tid + i * nt;
            xv[i] = c < n4 ? x4[c] : rms_f4(0.0f, 0.0f, 0.0f, 0.0f);
            wv[i] = c < n4 ? w4[c] : rms_f4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        if (br) {
            const float4 *b4 = reinterpret_cast<const float4 *>(br);
            float4 *h4 = reinterpret_cast<float4 *>(hr);
#pragma unroll
            for (int i = 0; i < RMS_VEC; i++) {
                const int c = tid + i * nt;
                if (c < n4) {
                    const float4 u = b4[c];
                    xv[i] = rms_f4(xv[i].x + u.x, xv[i].y + u.y, xv[i].z + u.z, xv[i].w + u.w);
                    h4[c] = xv[i];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < RMS_VEC; i++) {
            s = fmaf(xv[i].x, xv[i].x, s);
            s = fmaf(xv[i].y, xv[i].y, s);
            s = fmaf(xv[i].z, xv[i].z, s);
            s = fmaf(xv[i].w, xv[i].w, s);
        }
    } else {
        // unrolled: a thread's loads in flight together (the sum's order is unchanged)
#pragma unroll 8
        for (int c = tid; c < H; c += nt) {
            const float v = br ? xr[c] + br[c] : xr[c];
            if (br) hr[c] = v;
            s = fmaf(v, v, s);
        }
    }
    s = warp_sum(s);  // every lane of the warp: the warp's sum
    if (nt > 32) {    // uniform: the warps' sums through shared memory
        if ((tid & 31) == 0) part[tid >> 5] = s;
        __syncthreads();
        s = 0.0f;
        for (int i = 0; i < (nt >> 5); i++) s += part[i];  // warp order: the same sum in every thread
    }
    const float inv = rsqrtf(s / (float)H + eps);
    if (vec) {
        float4 *y4 = reinterpret_cast<float4 *>(yr);
#pragma unroll
        for (int i = 0; i < RMS_VEC; i++) {
            const int c = tid + i * nt;
            if (c < n4)
                y4[c] = rms_f4(xv[i].x * inv * wv[i].x, xv[i].y * inv * wv[i].y, xv[i].z * inv * wv[i].z,
                               xv[i].w * inv * wv[i].w);
        }
    } else {
#pragma unroll 8
        for (int c = tid; c < H; c += nt) yr[c] = (br ? xr[c] + br[c] : xr[c]) * inv * w[c];
    }
}
