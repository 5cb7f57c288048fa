// Weight-absorbed MLA decode attention, one block per head h (blockIdx.x), blockDim.x a multiple of 32:
//   s[t] = scale * (q_abs[h] . latent[t] + q_rope[h] . k_rope[t]),  out[h] = sum_t softmax(s)[t] * latent[t].
// All inputs sit in one float buffer `in` (backends/_shared.py pack): q_abs [H, R] at 0, q_rope [H, Dr] at
// qr, latent [T, R] at lat, k_rope [T, Dr] at kr; out is [H, R]. The cache rows are taken in tiles of
// ATT_TILE whose scores stay in shared memory (one warp per row: lanes over R, coalesced, shuffle sum);
// across tiles an online softmax keeps the running max m and sum l and rescales the partial sums (kept
// in out[h]) by exp(m_old - m_new); T <= ATT_TILE is one pass. Threads own the columns r of out[h].
// Compiled by NVRTC (backends/cuda.py) with the options of matmul.cu; no headers.

#ifndef ATT_TILE
#define ATT_TILE 256
#endif
#define ATT_LOWEST (-3.402823466e38f)
typedef unsigned long long att_u64;

__device__ __forceinline__ float att_warp_reduce(float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, other) : v + other;
    }
    return v;
}

// max (is_max) or sum of v over the block; every thread gets it; red: 32 floats of shared memory
__device__ float att_block_reduce(float *red, float v, bool is_max) {
    v = att_warp_reduce(v, is_max);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float r = red[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) r = is_max ? fmaxf(r, red[w]) : r + red[w];
    __syncthreads();  // red is rewritten by the next reduction
    return r;
}

extern "C" __global__ void attention_absorb(const float *__restrict__ in, float *__restrict__ out, int R, int Dr,
                                            int T, int qr, int lat, int kr, float scale) {
    __shared__ float p[ATT_TILE];
    __shared__ float red[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float *q = in + (att_u64)blockIdx.x * R, *qp = in + qr + (att_u64)blockIdx.x * Dr;
    float *o = out + (att_u64)blockIdx.x * R;
    float m = ATT_LOWEST, l = 0.0f;
    for (int t0 = 0; t0 < T; t0 += ATT_TILE) {
        const int n = min(ATT_TILE, T - t0);
        for (int i = warp; i < n; i += nw) {
            const float *lr = in + lat + (att_u64)(t0 + i) * R, *kp = in + kr + (att_u64)(t0 + i) * Dr;
            float d = 0.0f;
            for (int c = lane; c < R; c += 32) d = fmaf(__ldg(q + c), __ldg(lr + c), d);
            for (int c = lane; c < Dr; c += 32) d = fmaf(__ldg(qp + c), __ldg(kp + c), d);
            d = att_warp_reduce(d, false);
            if (lane == 0) p[i] = d * scale;
        }
        __syncthreads();
        float mx = ATT_LOWEST;
        for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, p[i]);
        const float mn = fmaxf(m, att_block_reduce(red, mx, true));
        float sum = 0.0f;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float e = expf(p[i] - mn);
            p[i] = e;
            sum += e;
        }
        const float alpha = expf(m - mn);  // unused on the first tile
        const float tsum = att_block_reduce(red, sum, false);  // its barriers also publish p
        l = t0 == 0 ? tsum : l * alpha + tsum;
        m = mn;
        for (int c = threadIdx.x; c < R; c += blockDim.x) {
            const float *col = in + lat + (att_u64)t0 * R + c;
            float a = 0.0f;
            for (int i = 0; i < n; i++) a = fmaf(p[i], __ldg(col + (att_u64)i * R), a);
            o[c] = t0 == 0 ? a : fmaf(o[c], alpha, a);
        }
        __syncthreads();  // p is rewritten by the next tile
    }
    const float inv = 1.0f / l;
    for (int c = threadIdx.x; c < R; c += blockDim.x) o[c] *= inv;
}
