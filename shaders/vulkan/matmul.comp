#version 450
// Quantized matmul over a batch of experts: y[t, r] = sum_k x[t, k] * W_e[r, k] for the tokens t of
// expert e. Formats follow colibri_plan/quant.py; weights are read as uvec4 and decoded with bit ops, so
// no 8/16-bit storage extension is needed.
//
// Weight buffer layout (written by backends/vulkan.py): rows padded to a multiple of 16 bytes with the
// format's zero code, then float32 scales (one per row, or one per group) from uint index pc.soff;
// HALF = 1 (int4-gGh): float16 group scales there, two to a uint, low half first.
// Activations x: one row of pc.xstride vec4 per token, zero-padded to the padded row length.
//
// One workgroup computes ROWS rows of one expert (gl_WorkGroupID.y) for NT tokens per pass: every
// invocation strides over the row's uvec4 chunks, then partial sums meet through subgroupAdd and shared
// memory. MODE 1 fuses a SwiGLU expert's gate (A) and up (B) rows: y = SiLU(gate . x) * (up . x).
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

layout(local_size_x_id = 0) in;
layout(constant_id = 1) const uint FMT = 4u;    // 0 f32, 1 f16, 2 bf16, 3 int8, 4 int4, 5 int2
layout(constant_id = 2) const uint GROUP = 0u;  // int4 group size (32, 64, 128); 0: one scale per row
layout(constant_id = 3) const uint NT = 1u;     // tokens per pass
layout(constant_id = 4) const uint ROWS = 4u;   // output rows per workgroup
layout(constant_id = 5) const uint MODE = 0u;   // 0 matmul, 1 fused gate/up with SiLU(gate) * up
layout(constant_id = 6) const uint HALF = 0u;   // group scales: 0 float32, 1 float16 (int4-gGh)

const uint MAXE = 8u;                           // experts per dispatch (descriptor array size)
const uint EPC = FMT == 0u ? 4u : (FMT <= 2u ? 8u : (FMT == 3u ? 16u : (FMT == 4u ? 32u : 64u)));
const uint NV = (MODE == 1u ? 2u : 1u) * ROWS * NT;  // partial sums per invocation
const uint MIN_SUBGROUP = 4u;                   // the host refuses devices with smaller subgroups

layout(std430, binding = 0) readonly restrict buffer WA { uvec4 w[]; } A[MAXE];
layout(std430, binding = 1) readonly restrict buffer WB { uvec4 w[]; } B[MAXE];
layout(std430, binding = 2) readonly restrict buffer XB { vec4 x[]; };
layout(std430, binding = 3) writeonly restrict buffer YB { float y[]; };

layout(push_constant) uniform PC {
    uint nchunk;            // uvec4 chunks per weight row
    uint nrows;             // weight rows in this buffer
    uint xstride;           // vec4 per activation row
    uint ystride;           // floats per output row
    uint yoff;              // output column of this buffer's first row
    uint soff;              // first scale, in uints from the start of the buffer
    uint nscale;            // scales per row
    uint tok[MAXE + 1u];    // expert e owns activation/output rows tok[e] .. tok[e+1]-1
} pc;

shared float red[(gl_WorkGroupSize.x / MIN_SUBGROUP) * NV];

float dotq(uvec4 q, uint xb) {  // EPC weights of one uvec4 chunk times x[xb ...] (vec4 index)
    float s = 0.0;
    if (FMT == 0u) {
        s = dot(uintBitsToFloat(q), x[xb]);
    } else if (FMT <= 2u) {
        for (uint i = 0u; i < 2u; i++) {
            uint a = q[2u * i], b = q[2u * i + 1u];
            vec4 v = FMT == 1u ? vec4(unpackHalf2x16(a), unpackHalf2x16(b))
                               : vec4(uintBitsToFloat(a << 16), uintBitsToFloat(a & 0xFFFF0000u),
                                      uintBitsToFloat(b << 16), uintBitsToFloat(b & 0xFFFF0000u));
            s += dot(v, x[xb + i]);
        }
    } else if (FMT == 3u) {
        for (uint i = 0u; i < 4u; i++)
            s += dot(vec4(ivec4(uvec4(q[i]) << uvec4(24u, 16u, 8u, 0u)) >> 24), x[xb + i]);
    } else if (FMT == 4u) {
        for (uint i = 0u; i < 4u; i++) {
            uvec4 u = uvec4(q[i]);
            s += dot(vec4((u >> uvec4(0u, 4u, 8u, 12u)) & 15u) - 8.0, x[xb + 2u * i])
               + dot(vec4((u >> uvec4(16u, 20u, 24u, 28u)) & 15u) - 8.0, x[xb + 2u * i + 1u]);
        }
    } else {
        for (uint i = 0u; i < 4u; i++)
            for (uint j = 0u; j < 4u; j++)
                s += dot(vec4((uvec4(q[i]) >> (uvec4(0u, 2u, 4u, 6u) + 8u * j)) & 3u) - 2.0,
                         x[xb + 4u * i + j]);
    }
    return s;
}

void main() {
    const uint e = gl_WorkGroupID.y;
    const uint row0 = gl_WorkGroupID.x * ROWS;
    const uint lid = gl_LocalInvocationID.x;
    const uint tb = pc.tok[e], te = pc.tok[e + 1u];
    for (uint t0 = tb; t0 < te; t0 += NT) {
        float acc[NV];
        for (uint i = 0u; i < NV; i++) acc[i] = 0.0;
        for (uint c = lid; c < pc.nchunk; c += gl_WorkGroupSize.x) {
            uvec4 qa[ROWS], qb[ROWS];
            float sa[ROWS], sb[ROWS];
            for (uint r = 0u; r < ROWS; r++) {  // rows past the end re-read the last row, never stored
                uint row = min(row0 + r, pc.nrows - 1u);
                qa[r] = A[e].w[row * pc.nchunk + c];
                qb[r] = MODE == 1u ? B[e].w[row * pc.nchunk + c] : uvec4(0u);
                sa[r] = 1.0;
                sb[r] = 1.0;
                if (GROUP > 0u && HALF == 0u) {  // a uvec4 chunk never straddles a group (GROUP >= EPC = 32)
                    uint si = pc.soff + row * pc.nscale + c * EPC / GROUP;
                    sa[r] = uintBitsToFloat(A[e].w[si >> 2][si & 3u]);
                    if (MODE == 1u) sb[r] = uintBitsToFloat(B[e].w[si >> 2][si & 3u]);
                } else if (GROUP > 0u) {  // float16 scale hi: uint hi / 2 of the buffer, its low or high half
                    uint hi = 2u * pc.soff + row * pc.nscale + c * EPC / GROUP;
                    sa[r] = unpackHalf2x16(A[e].w[hi >> 3][(hi >> 1) & 3u])[hi & 1u];
                    if (MODE == 1u) sb[r] = unpackHalf2x16(B[e].w[hi >> 3][(hi >> 1) & 3u])[hi & 1u];
                }
            }
            for (uint t = 0u; t < NT; t++) {
                uint xb = min(t0 + t, te - 1u) * pc.xstride + c * (EPC / 4u);
                for (uint r = 0u; r < ROWS; r++) {
                    acc[r * NT + t] += sa[r] * dotq(qa[r], xb);
                    if (MODE == 1u) acc[(ROWS + r) * NT + t] += sb[r] * dotq(qb[r], xb);
                }
            }
        }
        for (uint i = 0u; i < NV; i++) {
            float v = subgroupAdd(acc[i]);
            if (subgroupElect()) red[gl_SubgroupID * NV + i] = v;
        }
        barrier();
        for (uint i = lid; i < ROWS * NT; i += gl_WorkGroupSize.x) {  // one invocation per (row, token)
            uint r = i / NT, t = i % NT, row = row0 + r;
            if (row < pc.nrows && t0 + t < te) {
                float a = 0.0, b = 0.0;
                for (uint g = 0u; g < gl_NumSubgroups; g++) {
                    a += red[g * NV + i];
                    if (MODE == 1u) b += red[g * NV + ROWS * NT + i];
                }
                if (FMT >= 3u && GROUP == 0u) {  // one scale per row
                    uint si = pc.soff + row;
                    a *= uintBitsToFloat(A[e].w[si >> 2][si & 3u]);
                    if (MODE == 1u) b *= uintBitsToFloat(B[e].w[si >> 2][si & 3u]);
                }
                if (MODE == 1u) a = a / (1.0 + exp(-a)) * b;
                y[(t0 + t) * pc.ystride + pc.yoff + row] = a;
            }
        }
        barrier();
    }
}
