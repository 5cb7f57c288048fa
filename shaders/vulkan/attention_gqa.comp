#version 450
// Causal GQA attention over a KV cache, float32 (d_attention of backends/vulkan_device.py).
// One workgroup per (query head h = gl_WorkGroupID.x, query row t = gl_WorkGroupID.y):
//   y[t, h*D + c] = sum_j softmax_j(scale * q[t, h] . k[j, kh]) * v[j, kh, c],   kh = h / (HQ / HKV),
// over the keys j = lo .. pos, pos = pos0 + t (causal), lo = pos - window + 1 for a sliding-window layer
// (window > 0), else 0. Bindings (matmul.comp's layout): A[0] q [T, HQ, D], A[1] k and A[2] v
// [C, HKV, D] (rows past pos never read), y [T, HQ*D] at binding 3.
// Decode has too few (row, head) workgroups to fill a GPU, so a row's keys may be cut into pc.splits
// equal slices (gl_WorkGroupID.z): each slice then writes its unnormalised sums, max m and sum l to
// y = part [T*HQ, splits, D + 2], and a second dispatch with COMBINE = 1 (one workgroup per row and
// head, A[0] = part) merges them into [T, HQ*D]: an empty slice has m = LOWEST and l = 0, weight 0.
// Keys are taken in tiles of TILE. Scores: one subgroup per key (lanes over D, subgroupAdd), the query
// row staged in shared memory, the tile's scores kept in shared memory. Across tiles an online softmax
// keeps the running max m and sum l and rescales the accumulators by exp(m_old - m_new). Values:
// invocation i owns the columns c = i + k*WG (D <= MAXD: at most NC per invocation, in registers) and
// reads v[j, kh, c] for the tile's keys, so a workgroup reads each K and V float once, in consecutive
// addresses; staging K/V tiles in shared memory would not save a read.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint TILE = 64u;
layout(constant_id = 2) const uint COMBINE = 0u;
const uint MIN_SUBGROUP = 4u;
const uint MAXD = 256u;
const uint NC = (MAXD + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;
const float LOWEST = -3.402823466e38;

layout(std430, binding = 0) readonly restrict buffer AB { float v[]; } A[8];  // inputs may alias: read-only
layout(std430, binding = 3) writeonly restrict buffer YB { float y[]; };  // always a fresh buffer
layout(push_constant) uniform PC { uint hq, hkv, d, pos0, window, scale_bits, splits; } pc;

shared float qs[MAXD];
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

void combine() {
    const uint r = gl_WorkGroupID.x, D = pc.d, S = pc.splits, rs = D + 2u;  // r = t * HQ + h
    float mx = LOWEST;
    for (uint s = 0u; s < S; s++) mx = max(mx, A[0].v[(r * S + s) * rs + D]);
    float den = 0.0;
    for (uint s = 0u; s < S; s++) {
        const uint b = (r * S + s) * rs;
        den = fma(A[0].v[b + D + 1u], exp(A[0].v[b + D] - mx), den);
    }
    for (uint c = gl_LocalInvocationID.x; c < D; c += gl_WorkGroupSize.x) {
        float num = 0.0;
        for (uint s = 0u; s < S; s++) {
            const uint b = (r * S + s) * rs;
            num = fma(A[0].v[b + c], exp(A[0].v[b + D] - mx), num);
        }
        y[r * D + c] = num / den;
    }
}

void attend() {
    const uint h = gl_WorkGroupID.x, t = gl_WorkGroupID.y, lid = gl_LocalInvocationID.x;
    const uint WG = gl_WorkGroupSize.x, lane = gl_SubgroupInvocationID, SG = gl_SubgroupSize, D = pc.d;
    const uint kb = h / (pc.hq / pc.hkv) * D, kstride = pc.hkv * D;  // kv head's first float, row stride
    const uint pos = pc.pos0 + t, qb = (t * pc.hq + h) * D;
    const uint lo = pc.window > 0u && pos + 1u > pc.window ? pos + 1u - pc.window : 0u;
    const float scale = uintBitsToFloat(pc.scale_bits);
    const uint len = pos + 1u - lo, chunk = (len + pc.splits - 1u) / pc.splits, sl = gl_WorkGroupID.z;
    const uint jb = lo + min(sl * chunk, len), je = lo + min((sl + 1u) * chunk, len);  // this slice's keys
    for (uint c = lid; c < D; c += WG) qs[c] = A[0].v[qb + c];
    barrier();
    float acc[NC];
    for (uint k = 0u; k < NC; k++) acc[k] = 0.0;
    float m = LOWEST, l = 0.0;
    for (uint j0 = jb; j0 < je; j0 += TILE) {  // uniform over the workgroup: barriers are safe
        const uint n = min(TILE, je - j0);
        for (uint i = gl_SubgroupID; i < n; i += gl_NumSubgroups) {
            const uint kr = (j0 + i) * kstride + kb;
            float s = 0.0;
            for (uint c = lane; c < D; c += SG) s = fma(qs[c], A[1].v[kr + c], s);
            s = subgroupAdd(s);
            if (subgroupElect()) p[i] = s * scale;
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
        const float alpha = exp(m - mn);  // 0 on the first tile, where l and acc are 0 too
        l = fma(l, alpha, group_reduce(sum, false));  // its barriers also publish p
        m = mn;
        for (uint k = 0u; k < NC; k++) {
            const uint c = lid + k * WG;
            if (c < D) {
                float a = 0.0;
                for (uint i = 0u; i < n; i++) a = fma(p[i], A[2].v[(j0 + i) * kstride + kb + c], a);
                acc[k] = fma(acc[k], alpha, a);
            }
        }
        barrier();  // p is rewritten by the next tile
    }
    if (pc.splits == 1u) {
        const float inv = 1.0 / l;  // l >= 1: the key at pos itself is always seen
        for (uint k = 0u; k < NC; k++) {
            const uint c = lid + k * WG;
            if (c < D) y[qb + c] = acc[k] * inv;
        }
        return;
    }
    const uint pb = ((t * pc.hq + h) * pc.splits + sl) * (D + 2u);
    for (uint k = 0u; k < NC; k++) {
        const uint c = lid + k * WG;
        if (c < D) y[pb + c] = acc[k];
    }
    if (lid == 0u) {
        y[pb + D] = m;
        y[pb + D + 1u] = l;
    }
}

void main() {
    if (COMBINE == 1u) combine();
    else attend();
}
