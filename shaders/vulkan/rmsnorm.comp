#version 450
// RMSNorm of one token per workgroup: y[t, i] = x[t, i] / sqrt(mean_i(x[t, i]^2) + eps) * w[i].
// Row t = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x (a 2-D grid past 65535 rows), t < pc.rows.
// x is rows of pc.n floats from the start of binding 2; the weight w sits at float index pc.woff of the
// same buffer (WBIND 0: host calls pack both) or of A[0] at binding 0 (WBIND 1: device activations,
// matmul.comp's layout); y has rows of pc.n floats.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint WBIND = 0u;
const uint MIN_SUBGROUP = 4u;

layout(std430, binding = 0) readonly restrict buffer WB { float w[]; } A[8];
layout(std430, binding = 2) readonly restrict buffer XB { float x[]; };
layout(std430, binding = 3) writeonly restrict buffer YB { float y[]; };
layout(push_constant) uniform PC { uint n; uint woff; float eps; uint rows; } pc;

shared float red[gl_WorkGroupSize.x / MIN_SUBGROUP];

void main() {
    const uint row = gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
    if (row >= pc.rows) return;  // the whole workgroup: before any barrier
    const uint base = row * pc.n, lid = gl_LocalInvocationID.x;
    float s = 0.0;
    for (uint i = lid; i < pc.n; i += gl_WorkGroupSize.x) s += x[base + i] * x[base + i];
    s = subgroupAdd(s);
    if (subgroupElect()) red[gl_SubgroupID] = s;
    barrier();
    float total = 0.0;
    for (uint g = 0u; g < gl_NumSubgroups; g++) total += red[g];
    float inv = inversesqrt(total / float(pc.n) + pc.eps);
    for (uint i = lid; i < pc.n; i += gl_WorkGroupSize.x)
        y[base + i] = x[base + i] * inv * (WBIND == 1u ? A[0].w[pc.woff + i] : x[pc.woff + i]);
}
