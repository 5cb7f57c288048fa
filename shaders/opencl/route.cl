// Router top-k of d_router_topk (backends/opencl/routing.py): the rule of backends/routing.py on router
// logits [T, E], one token row per work-item. ids [T, K] int32 (in a float buffer, as their bits) in
// descending choice order, ties to the lower id (a stable sort); w [T, K] float32 from float wo (ids and
// w may be one buffer). Sums run in expert order. Offsets (`*o`) are in floats. shaders/cuda/route.cu is the same kernel; comments are there.

#define ROUTE_MAXE 512
#define ROUTE_MAXG 32
#define ROUTE_NEG (-3.402823466e38f)

kernel void route_topk(global const float *logits, ulong lo, global const float *bias, ulong bo,
                       global int *ids, global float *w, ulong wo, uint T, uint E, uint K, uint softmax, uint has_bias,
                       uint n_group, uint topk_group, uint group_max, uint norm, float eps, float scale) {
    const uint t = get_global_id(0);
    if (t >= T) return;
    global const float *l = logits + lo + (ulong)t * E;
    global const float *b = bias + bo;
    float s[ROUTE_MAXE];
    if (softmax) {
        float m = l[0];
        for (uint e = 1; e < E; e++) m = fmax(m, l[e]);
        float sum = 0.0f;
        for (uint e = 0; e < E; e++) { s[e] = exp(l[e] - m); sum += s[e]; }
        for (uint e = 0; e < E; e++) s[e] = s[e] / sum;
    } else {
        for (uint e = 0; e < E; e++) s[e] = 1.0f / (1.0f + exp(-l[e]));
    }
    const uint gs = E / n_group;
    uint keep = 1u;
    if (n_group > 1) {
        float gsc[ROUTE_MAXG];
        for (uint g = 0; g < n_group; g++) {
            float b1 = ROUTE_NEG, b2 = ROUTE_NEG;
            for (uint j = 0; j < gs; j++) {
                const uint e = g * gs + j;
                const float c = has_bias ? s[e] + b[e] : s[e];
                if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) b2 = c;
            }
            gsc[g] = (group_max || gs == 1) ? b1 : b2 + b1;
        }
        keep = 0u;
        for (uint r = 0; r < topk_group; r++) {
            int bg = -1;
            for (uint g = 0; g < n_group; g++)
                if (!((keep >> g) & 1u) && (bg < 0 || gsc[g] > gsc[bg])) bg = (int)g;
            keep |= 1u << bg;
        }
    }
    uint taken[ROUTE_MAXE / 32];
    for (uint i = 0; i < ROUTE_MAXE / 32; i++) taken[i] = 0u;
    global int *id = ids + (ulong)t * K;
    global float *wt = w + wo + (ulong)t * K;
    float sum = 0.0f;
    for (uint k = 0; k < K; k++) {
        int bi = -1;
        float bv = 0.0f;
        for (uint e = 0; e < E; e++) {
            if (!((keep >> (e / gs)) & 1u) || ((taken[e >> 5] >> (e & 31)) & 1u)) continue;
            const float c = has_bias ? s[e] + b[e] : s[e];
            if (bi < 0 || c > bv) { bi = (int)e; bv = c; }
        }
        taken[bi >> 5] |= 1u << (bi & 31);
        id[k] = bi;
        wt[k] = s[bi];
        sum += s[bi];
    }
    const float den = sum + eps;
    for (uint k = 0; k < K; k++) wt[k] = (norm ? wt[k] / den : wt[k]) * scale;
}
