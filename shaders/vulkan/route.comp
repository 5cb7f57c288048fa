#version 450
// Router top-k of d_router_topk (backends/vulkan/routing.py): the rule of backends/routing.py on router
// logits [T, E] = A[0], bias [E] = A[1] (read when pc.has_bias), one token row per invocation. Outputs:
// ids [T, K] int32 at binding 2 (the x slot, written here) in descending choice order, ties to the lower
// id (a stable sort); weights [T, K] float32 at binding 3. shaders/cuda/route.cu is the same kernel.
layout(local_size_x_id = 0) in;

layout(std430, binding = 0) readonly restrict buffer AB { float v[]; } A[8];
layout(std430, binding = 2) writeonly restrict buffer IB { int ids[]; };
layout(std430, binding = 3) writeonly restrict buffer YB { float w[]; };
layout(push_constant) uniform PC {
    uint T, E, K, softmax, has_bias, n_group, topk_group, group_max, norm; float eps, scale;
} pc;

#define ROUTE_MAXE 512
#define ROUTE_MAXG 32
#define ROUTE_NEG (-3.402823466e38)

float s[ROUTE_MAXE];

float choice(uint e) { return pc.has_bias != 0u ? s[e] + A[1].v[e] : s[e]; }

void main() {
    const uint t = gl_GlobalInvocationID.x;
    if (t >= pc.T) return;
    const uint E = pc.E, l0 = t * E;
    if (pc.softmax != 0u) {
        float m = A[0].v[l0];
        for (uint e = 1u; e < E; e++) m = max(m, A[0].v[l0 + e]);
        float sum = 0.0;
        for (uint e = 0u; e < E; e++) { s[e] = exp(A[0].v[l0 + e] - m); sum += s[e]; }
        for (uint e = 0u; e < E; e++) s[e] = s[e] / sum;
    } else {
        for (uint e = 0u; e < E; e++) s[e] = 1.0 / (1.0 + exp(-A[0].v[l0 + e]));
    }
    const uint gs = E / pc.n_group;
    uint keep = 1u;
    if (pc.n_group > 1u) {
        float gsc[ROUTE_MAXG];
        for (uint g = 0u; g < pc.n_group; g++) {
            float b1 = ROUTE_NEG, b2 = ROUTE_NEG;
            for (uint j = 0u; j < gs; j++) {
                const float c = choice(g * gs + j);
                if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) b2 = c;
            }
            gsc[g] = (pc.group_max != 0u || gs == 1u) ? b1 : b2 + b1;
        }
        keep = 0u;
        for (uint r = 0u; r < pc.topk_group; r++) {
            int bg = -1;
            for (uint g = 0u; g < pc.n_group; g++)
                if (((keep >> g) & 1u) == 0u && (bg < 0 || gsc[g] > gsc[bg])) bg = int(g);
            keep |= 1u << uint(bg);
        }
    }
    uint taken[ROUTE_MAXE / 32];
    for (uint i = 0u; i < ROUTE_MAXE / 32; i++) taken[i] = 0u;
    float sum = 0.0, chosen[64];  // routing.py MAX_TOP_K
    for (uint k = 0u; k < pc.K; k++) {
        int bi = -1;
        float bv = 0.0;
        for (uint e = 0u; e < E; e++) {
            if (((keep >> (e / gs)) & 1u) == 0u || ((taken[e >> 5] >> (e & 31u)) & 1u) != 0u) continue;
            const float c = choice(e);
            if (bi < 0 || c > bv) { bi = int(e); bv = c; }
        }
        const uint b = uint(bi);
        taken[b >> 5] |= 1u << (b & 31u);
        ids[t * pc.K + k] = bi;
        chosen[k] = s[b];
        sum += s[b];
    }
    const float den = sum + pc.eps;
    for (uint k = 0u; k < pc.K; k++) w[t * pc.K + k] = (pc.norm != 0u ? chosen[k] / den : chosen[k]) * pc.scale;
}
