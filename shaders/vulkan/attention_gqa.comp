#version 450
// Causal GQA attention over a KV cache, float32 (d_attention of backends/vulkan_device.py):
//   y[t, h*D + c] = sum_j softmax_j(scale * q[t, h] . k[j, kh]) * v[j, kh, c],   kh = h / (HQ / HKV),
// over the keys j = lo .. pos, pos = pos0 + t (causal), lo = pos - window + 1 for a sliding-window layer
// (window > 0), else 0. Bindings (matmul.comp's layout): A[0] q [T, HQ, D], A[1] k and A[2] v
// [C, HKV, D] (rows past pos never read), y [T, HQ*D] at binding 3.
//
// One workgroup per (query row t = gl_WorkGroupID.y, HG query heads of one kv head from
// h0 = gl_WorkGroupID.x * HG): the group's heads share each K and V float read (HG = 1: a workgroup per
// (row, head)). Keys are taken in tiles of TILE. Scores: one subgroup per key, lanes over D, HG dot
// products per K read, subgroupAdd; the HG query rows and the tile's scores sit in shared memory.
// Softmax: one subgroup per head keeps its running max m and sum l (online softmax across tiles: the
// accumulators are rescaled by exp(m_old - m_new)). Values: invocation i owns the columns
// c = i + k*WG of every head of the group (D <= MAXD: HG*NC accumulators in registers) and reads
// v[j, kh, c] once for all of them. Each K and V float is read once per workgroup, at consecutive
// addresses, so staging K/V tiles in shared memory would not save a read.
//
// Decode has too few workgroups to fill a GPU, so a row's keys may be cut into pc.splits equal slices
// (gl_WorkGroupID.z): each slice then writes its unnormalised sums, m and l to y = part
// [T*HQ, splits, D + 2], and a second dispatch with COMBINE = 1 (one workgroup per (row, head),
// A[0] = part) merges them into [T, HQ*D]; an empty slice has m = LOWEST and l = 0, so weight 0.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint TILE = 64u;
layout(constant_id = 2) const uint COMBINE = 0u;
layout(constant_id = 3) const uint HG = 1u;  // query heads per workgroup, dividing HQ / HKV
layout(constant_id = 4) const uint MAXD = 256u;  // head_dim at most; wider heads (MLA's 576) get 640
const uint NC = (MAXD + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;  // columns per invocation and head
const float LOWEST = -3.402823466e38;

layout(std430, binding = 0) readonly restrict buffer AB { float v[]; } A[8];  // inputs may alias: read-only
layout(std430, binding = 3) writeonly restrict buffer YB { float y[]; };  // always a fresh buffer
layout(push_constant) uniform PC { uint hq, hkv, d, pos0, window, scale_bits, splits; } pc;

shared float qs[HG * MAXD];  // the group's query rows
shared float p[HG * TILE];  // scores, then softmax weights, of the tile: head-major
shared float ms[HG], ls[HG], as_[HG];  // per head: running max, running sum, this tile's rescale

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
    const uint h0 = gl_WorkGroupID.x * HG, t = gl_WorkGroupID.y, lid = gl_LocalInvocationID.x;
    const uint WG = gl_WorkGroupSize.x, lane = gl_SubgroupInvocationID, SG = gl_SubgroupSize, D = pc.d;
    const uint kb = h0 / (pc.hq / pc.hkv) * D, kstride = pc.hkv * D;  // kv head's first float, row stride
    const uint pos = pc.pos0 + t, qb = (t * pc.hq + h0) * D;  // the group's rows are contiguous in q and y
    const uint lo = pc.window > 0u && pos + 1u > pc.window ? pos + 1u - pc.window : 0u;
    const float scale = uintBitsToFloat(pc.scale_bits);
    const uint len = pos + 1u - lo, chunk = (len + pc.splits - 1u) / pc.splits, sl = gl_WorkGroupID.z;
    const uint jb = lo + min(sl * chunk, len), je = lo + min((sl + 1u) * chunk, len);  // this slice's keys
    for (uint i = lid; i < HG * D; i += WG) qs[i / D * MAXD + i % D] = A[0].v[qb + i];
    for (uint h = lid; h < HG; h += WG) {
        ms[h] = LOWEST;
        ls[h] = 0.0;
    }
    barrier();
    float acc[HG * NC];
    for (uint i = 0u; i < HG * NC; i++) acc[i] = 0.0;
    for (uint j0 = jb; j0 < je; j0 += TILE) {  // uniform over the workgroup: barriers are safe
        const uint n = min(TILE, je - j0);
        for (uint i = gl_SubgroupID; i < n; i += gl_NumSubgroups) {
            const uint kr = (j0 + i) * kstride + kb;
            float s[HG];
            for (uint h = 0u; h < HG; h++) s[h] = 0.0;
            for (uint c = lane; c < D; c += SG) {
                const float kc = A[1].v[kr + c];
                for (uint h = 0u; h < HG; h++) s[h] = fma(qs[h * MAXD + c], kc, s[h]);
            }
            for (uint h = 0u; h < HG; h++) {
                const float r = subgroupAdd(s[h]);
                if (subgroupElect()) p[h * TILE + i] = r * scale;
            }
        }
        barrier();
        for (uint h = gl_SubgroupID; h < HG; h += gl_NumSubgroups) {  // a subgroup per head
            float mx = LOWEST;
            for (uint i = lane; i < n; i += SG) mx = max(mx, p[h * TILE + i]);
            const float mo = ms[h], mn = max(mo, subgroupMax(mx));
            float sum = 0.0;
            for (uint i = lane; i < n; i += SG) {
                const float e = exp(p[h * TILE + i] - mn);
                p[h * TILE + i] = e;
                sum += e;
            }
            sum = subgroupAdd(sum);
            if (subgroupElect()) {
                const float alpha = exp(mo - mn);  // 0 on the first tile, where l and acc are 0 too
                as_[h] = alpha;
                ls[h] = fma(ls[h], alpha, sum);
                ms[h] = mn;
            }
        }
        barrier();
        for (uint k = 0u; k < NC; k++) {
            const uint c = lid + k * WG;
            if (c < D) {
                float a[HG];
                for (uint h = 0u; h < HG; h++) a[h] = 0.0;
                for (uint i = 0u; i < n; i++) {
                    const float vc = A[2].v[(j0 + i) * kstride + kb + c];
                    for (uint h = 0u; h < HG; h++) a[h] = fma(p[h * TILE + i], vc, a[h]);
                }
                for (uint h = 0u; h < HG; h++) acc[h * NC + k] = fma(acc[h * NC + k], as_[h], a[h]);
            }
        }
        barrier();  // p and as_ are rewritten by the next tile
    }
    if (pc.splits == 1u) {
        for (uint h = 0u; h < HG; h++) {
            const float inv = 1.0 / ls[h];  // l >= 1: the key at pos itself is always seen
            for (uint k = 0u; k < NC; k++) {
                const uint c = lid + k * WG;
                if (c < D) y[qb + h * D + c] = acc[h * NC + k] * inv;
            }
        }
        return;
    }
    for (uint h = 0u; h < HG; h++) {
        const uint pb = ((t * pc.hq + h0 + h) * pc.splits + sl) * (D + 2u);
        for (uint k = 0u; k < NC; k++) {
            const uint c = lid + k * WG;
            if (c < D) y[pb + c] = acc[h * NC + k];
        }
        if (lid == 0u) {
            y[pb + D] = ms[h];
            y[pb + D + 1u] = ls[h];
        }
    }
}

void main() {
    if (COMBINE == 1u) combine();
    else attend();
}
