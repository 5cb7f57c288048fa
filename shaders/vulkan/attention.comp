#version 450
// Weight-absorbed MLA decode attention, one workgroup per head h (gl_WorkGroupID.x):
//   s[t] = scale * (q_abs[h] . latent[t] + q_rope[h] . k_rope[t]),  y[h] = sum_t softmax(s)[t] * latent[t].
// Binding 2 holds a header (R, Dr, T, the float offsets in x of q_rope, latent and k_rope, the bits of
// scale) and then x: q_abs [H, R] at 0, q_rope [H, Dr], latent [T, R], k_rope [T, Dr]; y is [H, R]. The
// header (not push constants) carries T, so one recorded command buffer serves every cache length.
// The cache rows are taken in tiles of TILE whose scores stay in shared memory (one subgroup per row,
// lanes over R, subgroupAdd); across tiles an online softmax keeps the running max m and sum l and
// rescales the partial sums (kept in y[h]) by exp(m_old - m_new). Invocations own the columns r of y.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint TILE = 256u;
const uint MIN_SUBGROUP = 4u;
const float LOWEST = -3.402823466e38;

layout(std430, binding = 2) readonly restrict buffer XB { uint R, Dr, T, qr, lat, kr, scale_bits, pad_; float x[]; };
layout(std430, binding = 3) restrict buffer YB { float y[]; };

shared float p[TILE];
shared float red[gl_WorkGroupSize.x / MIN_SUBGROUP];

// max (is_max) or sum of v over the workgroup; every invocation gets it
float group_reduce(float v, bool is_max) {
    v = is_max ? subgroupMax(v) : subgroupAdd(v);
    if (subgroupElect()) red[gl_SubgroupID] = v;
    barrier();
    float r = red[0];
    for (uint g = 1u; g < gl_NumSubgroups; g++) r = is_max ? max(r, red[g]) : r + red[g];
    barrier();  // red is rewritten by the next reduction
    return r;
}

void main() {
    const uint h = gl_WorkGroupID.x, lid = gl_LocalInvocationID.x, WG = gl_WorkGroupSize.x;
    const uint lane = gl_SubgroupInvocationID, SG = gl_SubgroupSize;
    const float scale = uintBitsToFloat(scale_bits);
    float m = LOWEST, l = 0.0;
    for (uint t0 = 0u; t0 < T; t0 += TILE) {
        const uint n = min(TILE, T - t0);
        for (uint i = gl_SubgroupID; i < n; i += gl_NumSubgroups) {
            const uint lr = lat + (t0 + i) * R, kp = kr + (t0 + i) * Dr;
            float d = 0.0;
            for (uint c = lane; c < R; c += SG) d = fma(x[h * R + c], x[lr + c], d);
            for (uint c = lane; c < Dr; c += SG) d = fma(x[qr + h * Dr + c], x[kp + c], d);
            d = subgroupAdd(d);
            if (subgroupElect()) p[i] = d * scale;
        }
        barrier();
        float mx = LOWEST;
        for (uint i = lid; i < n; i += WG) mx = max(mx, p[i]);
        const float mn = max(m, group_reduce(mx, true));
        float sum = 0.0;
        for (uint i = lid; i < n; i += WG) {
            const float e = exp(p[i] - mn);
            p[i] = e;
            sum += e;
        }
        const float alpha = exp(m - mn);  // unused on the first tile
        const float tsum = group_reduce(sum, false);  // its barriers also publish p
        l = t0 == 0u ? tsum : l * alpha + tsum;
        m = mn;
        for (uint c = lid; c < R; c += WG) {
            float a = 0.0;
            for (uint i = 0u; i < n; i++) a = fma(p[i], x[lat + (t0 + i) * R + c], a);
            y[h * R + c] = t0 == 0u ? a : fma(y[h * R + c], alpha, a);
        }
        barrier();  // p is rewritten by the next tile
    }
    const float inv = 1.0 / l;
    for (uint c = lid; c < R; c += WG) y[h * R + c] *= inv;
}
