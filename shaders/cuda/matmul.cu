// Quantized matmul y[t, r] = sum_c x[t, c] * W[r, c] and the fused SwiGLU expert FFN, for a batch of
// matrices in one launch (blockIdx.y picks the matrix; its pointers come from a device table).
//
// Weight layout (backends/base.py padded_layout): rows of in_pad columns (a multiple of 128, so every
// row is 16-byte aligned), padded with the zero code; activations padded with zeros. Semantics are
// colibri_plan/quant.py: int4 (nibble - 8) * s, int2 (crumb - 2) * s, int8 q * s, bf16 bits << 16,
// f16 IEEE half, group formats (nibble - 8) * s[r, c / G]; packing low bits first.
//
// Work shape (decode is bound by weight reads): a warp owns R rows; each lane reads whole 16-byte
// words (uint4) of consecutive columns, so a warp reads 512 contiguous bytes per row per step; the
// activations of one token sit in shared memory; lanes reduce with shuffles.
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

// float whose bits are 0x4B0000bb equals 2^23 + bb: one byte permute + one subtract converts a byte
// code to float exactly (cheaper than an int-to-float conversion)
__device__ __forceinline__ float byte_f(unsigned word, int b, float bias) {
    return __int_as_float(__byte_perm(word, 0x4B000000u, 0x7440u | b)) - bias;
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
        unsigned u = v ^ 0x80808080u;  // signed q -> q + 128
#pragma unroll
        for (int b = 0; b < 4; b++) acc = fmaf(byte_f(u, b, 8388736.0f), x[b], acc);
    } else if (FMT == F_INT4 || FMT == F_INT4G) {
        unsigned lo = v & 0x0F0F0F0Fu, hi = (v >> 4) & 0x0F0F0F0Fu;  // byte b: columns 2b, 2b+1
#pragma unroll
        for (int b = 0; b < 4; b++) {
            acc = fmaf(byte_f(lo, b, 8388616.0f), x[2 * b], acc);
            acc = fmaf(byte_f(hi, b, 8388616.0f), x[2 * b + 1], acc);
        }
    } else {  // F_INT2: byte b holds columns 4b .. 4b+3
#pragma unroll
        for (int i = 0; i < 4; i++) {
            unsigned c = (v >> (2 * i)) & 0x03030303u;
#pragma unroll
            for (int b = 0; b < 4; b++) acc = fmaf(byte_f(c, b, 8388610.0f), x[4 * b + i], acc);
        }
    }
    return acc;
}

template <int FMT>
__device__ __forceinline__ float dot_word(uint4 w, const float *x) {
    constexpr int q = Cols<FMT>::n / 4;
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

// acc[m][i] = W_m[row0 + i] . xs for NW weights, R rows; every lane gets the full sums.
// Rows past `rows` are clamped to the last row (valid memory); callers discard them.
template <int FMT, int R, int NW>
__device__ __forceinline__ void warp_dots(const uint4 *const *W, const float *const *S, int row0, int rows,
                                          int words, int gshift, int ngroups, const float *xs,
                                          float (&acc)[NW][R]) {
    const int lane = threadIdx.x & 31;
    int row[R];
#pragma unroll
    for (int i = 0; i < R; i++) row[i] = min(row0 + i, rows - 1);
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int i = 0; i < R; i++) acc[m][i] = 0.0f;
#pragma unroll 2
    for (int k = lane; k < words; k += 32) {
        uint4 w[NW][R];
#pragma unroll
        for (int m = 0; m < NW; m++)  // issue every load before any math: NW * R words in flight
#pragma unroll
            for (int i = 0; i < R; i++) w[m][i] = __ldg(W[m] + (u64)row[i] * words + k);
        float x[Cols<FMT>::n];
        load_x<FMT>(xs, k, x);
#pragma unroll
        for (int m = 0; m < NW; m++)
#pragma unroll
            for (int i = 0; i < R; i++) {
                float d = dot_word<FMT>(w[m][i], x);
                if (FMT == F_INT4G)
                    acc[m][i] = fmaf(d, __ldg(S[m] + (u64)row[i] * ngroups + (k >> gshift)), acc[m][i]);
                else
                    acc[m][i] += d;
            }
    }
#pragma unroll
    for (int m = 0; m < NW; m++)
#pragma unroll
        for (int i = 0; i < R; i++) {
            float v = warp_sum(acc[m][i]);
            if (FMT == F_INT8 || FMT == F_INT4 || FMT == F_INT2) v *= __ldg(S[m] + row[i]);
            acc[m][i] = v;
        }
}

// Blocks loop over row tiles of R * warps rows (tile = blockIdx.x, += gridDim.x), so one staging of
// x[t] serves several tiles; the host sizes gridDim.x to fill the GPU a few blocks per SM deep.

// Table entry per matrix (8 x u64): W, S, x, y, T. y[t * y_stride + r] = x[t] . W[r] for r < rows.
// Grid (tile blocks, n_matrices), block (32 * warps), shared memory in_pad * 4 bytes.
template <int FMT, int R>
__global__ void mm(const u64 *__restrict__ table, int rows, int in_pad, int y_stride, int gshift) {
    extern __shared__ float4 smem4[];
    float *xs = reinterpret_cast<float *>(smem4);
    const u64 *e = table + 8 * blockIdx.y;
    const uint4 *W[1] = {reinterpret_cast<const uint4 *>(e[0])};
    const float *S[1] = {reinterpret_cast<const float *>(e[1])};
    const float *x = reinterpret_cast<const float *>(e[2]);
    float *y = reinterpret_cast<float *>(e[3]);
    const int T = (int)e[4], words = in_pad / Cols<FMT>::n, ngroups = (words >> gshift);
    const int warps = blockDim.x >> 5, tiles = (rows + R * warps - 1) / (R * warps), lane = threadIdx.x & 31;
    for (int t = 0; t < T; t++) {
        stage<FMT>(xs, x + (u64)t * in_pad, in_pad);
        __syncthreads();
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const int row0 = (tile * warps + (threadIdx.x >> 5)) * R;
            float acc[1][R];
            warp_dots<FMT, R, 1>(W, S, row0, rows, words, gshift, ngroups, xs, acc);
#pragma unroll
            for (int i = 0; i < R; i++)
                if (lane == i && row0 + i < rows) y[(u64)t * y_stride + row0 + i] = acc[0][i];
        }
        __syncthreads();  // xs is overwritten by the next token
    }
}

// Table entry per expert (8 x u64): gate W, gate S, up W, up S, x, h, T.
// h[t * h_stride + r] = SiLU(gate[r] . x[t]) * (up[r] . x[t]) for r < rows; rows <= r < h_stride
// (padding the down projection reads) get 0. Grid (tile blocks, n_experts), tiles cover h_stride.
template <int FMT, int R>
__global__ void gate_up(const u64 *__restrict__ table, int rows, int in_pad, int h_stride, int gshift) {
    extern __shared__ float4 smem4[];
    float *xs = reinterpret_cast<float *>(smem4);
    const u64 *e = table + 8 * blockIdx.y;
    const uint4 *W[2] = {reinterpret_cast<const uint4 *>(e[0]), reinterpret_cast<const uint4 *>(e[2])};
    const float *S[2] = {reinterpret_cast<const float *>(e[1]), reinterpret_cast<const float *>(e[3])};
    const float *x = reinterpret_cast<const float *>(e[4]);
    float *h = reinterpret_cast<float *>(e[5]);
    const int T = (int)e[6], words = in_pad / Cols<FMT>::n, ngroups = (words >> gshift);
    const int warps = blockDim.x >> 5, tiles = (h_stride + R * warps - 1) / (R * warps);
    const int lane = threadIdx.x & 31;
    for (int t = 0; t < T; t++) {
        stage<FMT>(xs, x + (u64)t * in_pad, in_pad);
        __syncthreads();
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            const int row0 = (tile * warps + (threadIdx.x >> 5)) * R;
            float acc[2][R];
            warp_dots<FMT, R, 2>(W, S, row0, rows, words, gshift, ngroups, xs, acc);
#pragma unroll
            for (int i = 0; i < R; i++) {
                const int r = row0 + i;
                if (lane == i && r < h_stride) {
                    const float g = acc[0][i], u = acc[1][i];
                    h[(u64)t * h_stride + r] = r < rows ? g / (1.0f + expf(-g)) * u : 0.0f;
                }
            }
        }
        __syncthreads();
    }
}

// RMSNorm, one block per token: y = x / sqrt(mean(x^2) + eps) * w
extern "C" __global__ void rmsnorm(const float *__restrict__ x, const float *__restrict__ w, float *y, int H,
                                   float eps) {
    __shared__ float part[32];
    const float *xr = x + (u64)blockIdx.x * H;
    float s = 0.0f;
    for (int c = threadIdx.x; c < H; c += blockDim.x) s = fmaf(xr[c], xr[c], s);
    s = warp_sum(s);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? part[threadIdx.x] : 0.0f;
        v = warp_sum(v);
        if (threadIdx.x == 0) part[0] = v;
    }
    __syncthreads();
    const float inv = rsqrtf(part[0] / (float)H + eps);
    for (int c = threadIdx.x; c < H; c += blockDim.x) y[(u64)blockIdx.x * H + c] = xr[c] * inv * w[c];
}
