// Causal attention over a KV cache (backends/cuda/device.py d_attention): attention_gqa, then
// attention_combine when the keys were split. MLA runs the same kernels on its latent cache (one kv head,
// d = rope + kv_lora_rank). Compiled by NVRTC (backends/cuda/launch.py) with matmul.cu's options; no headers.

#ifndef ATT_TILE
#define ATT_TILE 256  // keys scored in shared memory at once
#endif
#define ATT_LOWEST (-3.402823466e38f)  // the running max before any key (exp of it minus a real max is 0)
typedef unsigned long long att_u64;

__device__ __forceinline__ float att_warp_reduce(float v, bool is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, other) : v + other;
    }
    return v;
}

// q [T, Hq, d], k/v [C, Hkv, d] (row stride Hkv * d), out [T, Hq * d]; query row t sits at position pos0 + t
// and sees keys lo .. pos0 + t (lo = pos0 + t - window + 1 for a sliding window, else 0); query head h reads
// kv head h / (Hq / Hkv). Grid (T, Hkv * head chunks, splits), blockDim.x a multiple of 32 and >= d
// (the backend: 256, 8 warps).
// A block takes up to GQA_HEADS query heads of one kv head group (each K/V row is read once for all of
// them) and one of `splits` equal slices of its query row's key range: decode has too few (row, kv head)
// blocks to fill the GPU, so the keys are split and attention_combine merges the slices' (max, sum,
// unnormalised output) afterwards; splits == 1 writes out directly.
// Per tile of ATT_TILE keys: scores in shared memory (a warp per key row, lanes over d, all heads at
// once), then warp w updates the running max and sum of heads w, w + warps, ... (online softmax), then
// threads own (column, row group) pairs of P.V (d = 128: two groups of 128 columns; an odd d leaves
// blockDim % d threads idle), rescaling their partial sums by exp(m_old - m_new). Float32 throughout.
// Dynamic shared memory: (GQA_HEADS * (d + ATT_TILE + blockDim.x) + 3 * GQA_HEADS) floats.
#ifndef GQA_HEADS
#define GQA_HEADS 8
#endif
#ifndef GQA_SMEM  // the dynamic shared memory (a host harness of the tests declares its own)
#define GQA_SMEM extern __shared__ float sm[]
#endif

__device__ __forceinline__ void attention_gqa_body(const float *__restrict__ q, const float *__restrict__ k,
                                                   const float *__restrict__ v, float *__restrict__ out,
                                                   float *__restrict__ part, int Hq, int Hkv, int d, int pos0,
                                                   int window, float scale, int splits) {
    GQA_SMEM;
    const int G = Hq / Hkv, chunks = (G + GQA_HEADS - 1) / GQA_HEADS, chunk_i = blockIdx.y % chunks;
    const int t = blockIdx.x, kvh = blockIdx.y / chunks, h0 = kvh * G + chunk_i * GQA_HEADS;
    const int gb = min(GQA_HEADS, G - chunk_i * GQA_HEADS), split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    float *qs = sm;                                  // [gb][d], pre-scaled
    float *p = qs + GQA_HEADS * d;                   // [GQA_HEADS][ATT_TILE] scores, then exp weights
    float *red = p + GQA_HEADS * ATT_TILE;           // [blockDim.x][GQA_HEADS] row groups' sums at the end
    float *ms = red + blockDim.x * GQA_HEADS;        // running max per head
    float *ls = ms + GQA_HEADS, *al = ls + GQA_HEADS;  // running sum, this tile's rescale factor
    const int qpos = pos0 + t;
    const int lo0 = window > 0 ? max(0, qpos - window + 1) : 0, hi0 = qpos + 1;
    const int per = (hi0 - lo0 + splits - 1) / splits;
    const int lo = lo0 + split * per, hi = min(hi0, lo + per);  // this block's keys (may be empty)
    const float *qr = q + ((att_u64)t * Hq + h0) * d;  // the gb heads' rows are contiguous
    for (int i = tid; i < gb * d; i += blockDim.x) qs[i] = qr[i] * scale;
    if (tid < GQA_HEADS) {
        ms[tid] = ATT_LOWEST;
        ls[tid] = 0.0f;
        al[tid] = 0.0f;
    }
    const int ngrp = blockDim.x / d, grp = tid / d, c = tid - grp * d;
    const bool owner = grp < ngrp;
    float acc[GQA_HEADS];
#pragma unroll
    for (int h = 0; h < GQA_HEADS; h++) acc[h] = 0.0f;
    const att_u64 rs = (att_u64)Hkv * d;  // k/v row stride
    const float *kb = k + (att_u64)kvh * d, *vb = v + (att_u64)kvh * d + c;
    __syncthreads();
    for (int j0 = lo; j0 < hi; j0 += ATT_TILE) {
        const int n = min(ATT_TILE, hi - j0);
        for (int i = warp; i < n; i += nw) {  // scores of key row j0 + i for every head
            const float *kr = kb + (att_u64)(j0 + i) * rs;
            float s[GQA_HEADS];
#pragma unroll
            for (int h = 0; h < GQA_HEADS; h++) s[h] = 0.0f;
#pragma unroll 4
            for (int cc = lane; cc < d; cc += 32) {  // unrolled: several loads of the row in flight
                const float kv = __ldg(kr + cc);
#pragma unroll
                for (int h = 0; h < GQA_HEADS; h++)
                    if (h < gb) s[h] = fmaf(qs[h * d + cc], kv, s[h]);
            }
#pragma unroll
            for (int h = 0; h < GQA_HEADS; h++)
                if (h < gb) {  // gb is uniform: whole warps shuffle
                    const float r = att_warp_reduce(s[h], false);
                    if (lane == 0) p[h * ATT_TILE + i] = r;
                }
        }
        __syncthreads();
        for (int h = warp; h < gb; h += nw) {  // online softmax of head h over this tile
            float *ph = p + h * ATT_TILE;
            float mx = ATT_LOWEST;
            for (int i = lane; i < n; i += 32) mx = fmaxf(mx, ph[i]);
            const float mold = ms[h], mn = fmaxf(mold, att_warp_reduce(mx, true));
            float sum = 0.0f;
            for (int i = lane; i < n; i += 32) {
                const float e = expf(ph[i] - mn);
                ph[i] = e;
                sum += e;
            }
            sum = att_warp_reduce(sum, false);
            __syncwarp();  // every lane has read ms[h] before lane 0 rewrites it
            if (lane == 0) {
                const float alpha = expf(mold - mn);  // 0 on the first tile (mold is the lowest float)
                al[h] = alpha;
                ls[h] = ls[h] * alpha + sum;
                ms[h] = mn;
            }
        }
        __syncthreads();
        if (owner) {  // P.V: column c, rows grp, grp + ngrp, ... of the tile
#pragma unroll
            for (int h = 0; h < GQA_HEADS; h++)
                if (h < gb) acc[h] *= al[h];
#pragma unroll 4
            for (int i = grp; i < n; i += ngrp) {
                const float vv = __ldg(vb + (att_u64)(j0 + i) * rs);
#pragma unroll
                for (int h = 0; h < GQA_HEADS; h++)
                    if (h < gb) acc[h] = fmaf(p[h * ATT_TILE + i], vv, acc[h]);
            }
        }
        __syncthreads();  // p is rewritten by the next tile
    }
    if (owner) {
#pragma unroll
        for (int h = 0; h < GQA_HEADS; h++) red[tid * GQA_HEADS + h] = acc[h];
    }
    __syncthreads();
    if (owner && grp == 0) {
        for (int h = 0; h < gb; h++) {
            float a = 0.0f;
            for (int g = 0; g < ngrp; g++) a += red[(g * d + c) * GQA_HEADS + h];
            const att_u64 row = (att_u64)t * Hq + h0 + h;
            if (splits == 1) {
                out[row * d + c] = a / ls[h];
            } else {  // part [T * Hq][splits][d + 2]: unnormalised output, then max and sum
                float *pp = part + (row * splits + split) * (att_u64)(d + 2);
                pp[c] = a;
                if (c == 0) {
                    pp[d] = ms[h];
                    pp[d + 1] = ls[h];
                }
            }
        }
    }
}

extern "C" __global__ void attention_gqa(const float *__restrict__ q, const float *__restrict__ k,
                                         const float *__restrict__ v, float *__restrict__ out,
                                         float *__restrict__ part, int Hq, int Hkv, int d, int pos0, int window,
                                         float scale, int splits) {
    attention_gqa_body(q, k, v, out, part, Hq, Hkv, d, pos0, window, scale, splits);
}

// attention_gqa of a captured decode step (backends/cuda/graph.py): pos0 = *posp + delta and the cache's
// k / v addresses read from device memory (the step's inputs), so one CUDA graph serves every step and
// cache whose keys its `splits` slices cover.
extern "C" __global__ void attention_gqa_at(const float *__restrict__ q, const att_u64 *__restrict__ k_slot,
                                            const att_u64 *__restrict__ v_slot, float *__restrict__ out,
                                            float *__restrict__ part, int Hq, int Hkv, int d,
                                            const int *__restrict__ posp, int delta, int window, float scale,
                                            int splits) {
    attention_gqa_body(q, (const float *)*k_slot, (const float *)*v_slot, out, part, Hq, Hkv, d, *posp + delta,
                       window, scale, splits);
}

// Merge attention_gqa's key slices: a block per (t, h) (blockIdx.x = t * Hq + h), out [T, Hq * d].
// An empty slice has max = the lowest float and sum 0, so its weight exp(m - M) is 0.
extern "C" __global__ void attention_combine(const float *__restrict__ part, float *__restrict__ out, int d,
                                             int splits) {
    const int rs = d + 2;  // a slice: d unnormalised sums, its max, its sum
    const float *pp = part + (att_u64)blockIdx.x * splits * rs;
    float M = ATT_LOWEST, L = 0.0f;
    for (int s = 0; s < splits; s++) M = fmaxf(M, pp[s * rs + d]);
    for (int s = 0; s < splits; s++) L += pp[s * rs + d + 1] * expf(pp[s * rs + d] - M);
    const float inv = 1.0f / L;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < splits; s++) a += pp[s * rs + c] * expf(pp[s * rs + d] - M);
        out[(att_u64)blockIdx.x * d + c] = a * inv;
    }
}
