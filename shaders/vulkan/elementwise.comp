#version 450
// Elementwise ops of the device activations (backends/vulkan_device.py), one output float per
// invocation in a grid-stride loop over pc.n floats; pc.op picks the op, pc.d is the row length of y:
//   0 add           y[i] = a[i] + b[i]
//   1 add, 1-D b    y[i] = a[i] + b[i % d]                 (b [d] broadcast over the rows)
//   2 SiLU * mul    y[i] = a[i] / (1 + exp(-a[i])) * b[i]
//   3 scale rows    y[i] = a[i] * b[i / d]                 (b [rows] of scales)
//   4 RoPE          a = x [T, e0 heads, d], b = table [P, e1/2, 2] of (cos, sin), positions e2 + t,
//                   e3 = 1: pairs (2k, 2k+1), else rotate_half pairs (k, k + e1/2); channels >= e1 copied
//   5 padded copy   y [rows, d] = a [rows, e0] with zeros in columns e0 .. d-1 (matmul.comp's x rows)
//   6 gated sum     y[i] = 0 + b[0] * a[i] + b[1] * a[n + i] + ... over e0 arrays of n floats (the routed
//                   experts' outputs, b their gates): float32 products and sums in that order, never fused,
//                   as the host's combine
// Bindings follow matmul.comp's layout: inputs a = A[0], b = A[1] (binding 0), y at binding 3.
layout(local_size_x_id = 0) in;

layout(std430, binding = 0) readonly restrict buffer AB { float v[]; } A[8];  // inputs may alias: read-only
layout(std430, binding = 3) writeonly restrict buffer YB { float y[]; };  // always a fresh buffer
layout(push_constant) uniform PC { uint op, n, d, e0, e1, e2, e3; } pc;

float rope(uint i) {
    const uint c = i % pc.d, t = i / pc.d / pc.e0, half_ = pc.e1 / 2u;
    const float x = A[0].v[i];
    if (c >= pc.e1) return x;
    const uint k = pc.e3 != 0u ? c / 2u : (c < half_ ? c : c - half_);
    const uint tb = ((pc.e2 + t) * half_ + k) * 2u;
    const float cs = A[1].v[tb], sn = A[1].v[tb + 1u];
    if (pc.e3 != 0u) return (c & 1u) == 0u ? x * cs - A[0].v[i + 1u] * sn : x * cs + A[0].v[i - 1u] * sn;
    return c < half_ ? x * cs - A[0].v[i + half_] * sn : x * cs + A[0].v[i - half_] * sn;
}

void main() {
    const uint stride = gl_NumWorkGroups.x * gl_WorkGroupSize.x;
    for (uint i = gl_GlobalInvocationID.x; i < pc.n; i += stride) {
        float r;
        if (pc.op == 0u) r = A[0].v[i] + A[1].v[i];
        else if (pc.op == 1u) r = A[0].v[i] + A[1].v[i % pc.d];
        else if (pc.op == 2u) r = A[0].v[i] / (1.0 + exp(-A[0].v[i])) * A[1].v[i];
        else if (pc.op == 3u) r = A[0].v[i] * A[1].v[i / pc.d];
        else if (pc.op == 4u) r = rope(i);
        else if (pc.op == 5u) {
            const uint c = i % pc.d;
            r = c < pc.e0 ? A[0].v[i / pc.d * pc.e0 + c] : 0.0;
        } else {
            precise float s = 0.0;  // precise: no fused multiply-add, the host rounds each product
            for (uint e = 0u; e < pc.e0; e++) {
                precise float p = A[1].v[e] * A[0].v[e * pc.n + i];
                s = s + p;
            }
            r = s;
        }
        y[i] = r;
    }
}
