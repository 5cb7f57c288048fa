// Weight-absorbed MLA decode attention, one threadgroup per head h (its simdgroups of 32 threads):
//   s[t] = scale * (q_abs[h] . latent[t] + q_rope[h] . k_rope[t]),  out[h] = sum_t softmax(s)[t] * latent[t].
// UNVERIFIED: the same algorithm as shaders/cuda/attention.cu and shaders/vulkan/attention.comp (which are
// tested), never compiled or run on our machines (no macOS there).
// All inputs sit in one float buffer `src` (backends/_shared.py pack): q_abs [H, R] at 0, q_rope [H, Dr] at
// qr, latent [T, R] at lat, k_rope [T, Dr] at kr; out is [H, R]. Cache rows in tiles of ATT_TILE whose
// scores stay in threadgroup memory (one simdgroup per row, simd_sum); across tiles an online softmax
// keeps the running max m and sum l and rescales the partial sums (kept in out[h]) by exp(m_old - m_new).

#include <metal_stdlib>
using namespace metal;

#define ATT_TILE 256
constant float ATT_LOWEST = -3.402823466e38f;

struct AttParams {
    uint R, Dr, T;      // kv_lora_rank, rope dims, cache rows
    uint qr, lat, kr;   // float offsets of q_rope, latent, k_rope in src
    float scale;        // softmax scale
};

// max (is_max) or sum of v over the threadgroup; every thread gets it; red: 32 floats
static float att_reduce(threadgroup float *red, float v, bool is_max, uint sg, uint lane, uint nsg) {
    v = is_max ? simd_max(v) : simd_sum(v);
    if (lane == 0) red[sg] = v;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float r = red[0];
    for (uint g = 1; g < nsg; g++) r = is_max ? max(r, red[g]) : r + red[g];
    threadgroup_barrier(mem_flags::mem_threadgroup);  // red is rewritten by the next reduction
    return r;
}

kernel void attention_absorb(device const float *src [[buffer(0)]], device float *out [[buffer(1)]],
                             constant AttParams &pa [[buffer(2)]], uint h [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]], uint nt [[threads_per_threadgroup]],
                             uint nsg [[simdgroups_per_threadgroup]], uint sw [[threads_per_simdgroup]]) {
    threadgroup float p[ATT_TILE];
    threadgroup float red[32];
    const uint R = pa.R, Dr = pa.Dr;
    device const float *q = src + (ulong)h * R, *qp = src + pa.qr + (ulong)h * Dr;
    device float *o = out + (ulong)h * R;
    float m = ATT_LOWEST, l = 0.0f;
    for (uint t0 = 0; t0 < pa.T; t0 += ATT_TILE) {
        const uint n = min((uint)ATT_TILE, pa.T - t0);
        for (uint i = sg; i < n; i += nsg) {
            device const float *lr = src + pa.lat + (ulong)(t0 + i) * R, *kp = src + pa.kr + (ulong)(t0 + i) * Dr;
            float d = 0.0f;
            for (uint c = lane; c < R; c += sw) d = fma(q[c], lr[c], d);
            for (uint c = lane; c < Dr; c += sw) d = fma(qp[c], kp[c], d);
            d = simd_sum(d);
            if (lane == 0) p[i] = d * pa.scale;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float mx = ATT_LOWEST;
        for (uint i = tid; i < n; i += nt) mx = max(mx, p[i]);
        const float mn = max(m, att_reduce(red, mx, true, sg, lane, nsg));
        float sum = 0.0f;
        for (uint i = tid; i < n; i += nt) {
            const float e = precise::exp(p[i] - mn);
            p[i] = e;
            sum += e;
        }
        const float alpha = precise::exp(m - mn);  // unused on the first tile
        const float tsum = att_reduce(red, sum, false, sg, lane, nsg);  // its barriers also publish p
        l = t0 == 0 ? tsum : l * alpha + tsum;
        m = mn;
        for (uint c = tid; c < R; c += nt) {
            device const float *col = src + pa.lat + (ulong)t0 * R + c;
            float a = 0.0f;
            for (uint i = 0; i < n; i++) a = fma(p[i], col[(ulong)i * R], a);
            o[c] = t0 == 0 ? a : fma(o[c], alpha, a);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);  // p is rewritten by the next tile
    }
    const float inv = 1.0f / l;
    for (uint c = tid; c < R; c += nt) o[c] *= inv;
}
