#version 450
// Per-head matrices (d_head_matmul of backends/vulkan_device.py): y[t, b] = w[b] . x[t, b] for
// x [T, B, K], w [B, N, K], y [T, B, N], float32 (MLA's absorbed projections). Bindings follow
// matmul.comp's layout: A[0] x, A[1] w (binding 0), y at binding 3.
// A workgroup of HN x TT invocations makes HN outputs n0 .. n0 + HN - 1 of TT tokens t0 .. t0 + TT - 1 of
// head b = gl_WorkGroupID.z; K is taken HK columns at a time, the x and w tiles staged in shared memory,
// so each w element is read once per TT tokens (TT = 1 at decode: no idle invocations).
layout(local_size_x = 16, local_size_y_id = 0) in;

layout(std430, binding = 0) readonly restrict buffer AB { float v[]; } A[8];  // inputs may alias: read-only
layout(std430, binding = 3) writeonly restrict buffer YB { float y[]; };  // always a fresh buffer
layout(push_constant) uniform PC { uint T, B, N, K; } pc;

const uint HN = 16u, HK = 16u, TT = gl_WorkGroupSize.y;
shared float xs[TT][HK + 1u];  // +1: rows fall in different banks
shared float ws[HN][HK + 1u];

void main() {
    const uint ln = gl_LocalInvocationID.x, lt = gl_LocalInvocationID.y, b = gl_WorkGroupID.z;
    const uint n0 = gl_WorkGroupID.x * HN, t0 = gl_WorkGroupID.y * TT;
    float acc = 0.0;
    for (uint k0 = 0u; k0 < pc.K; k0 += HK) {  // uniform over the workgroup: barriers are safe
        const uint k = k0 + ln;
        for (uint r = lt; r < HN; r += TT)
            ws[r][ln] = n0 + r < pc.N && k < pc.K ? A[1].v[(b * pc.N + n0 + r) * pc.K + k] : 0.0;
        xs[lt][ln] = t0 + lt < pc.T && k < pc.K ? A[0].v[((t0 + lt) * pc.B + b) * pc.K + k] : 0.0;
        barrier();
        for (uint i = 0u; i < HK; i++) acc = fma(xs[lt][i], ws[ln][i], acc);
        barrier();  // the tiles are rewritten next
    }
    if (t0 + lt < pc.T && n0 + ln < pc.N) y[((t0 + lt) * pc.B + b) * pc.N + n0 + ln] = acc;
}
