// Router top-k of d_router_topk (backends/cuda/routing.py): the rule of backends/routing.py on router
// logits [T, E], one token row per thread (grid-stride). Outputs: ids [T, K] int32 in descending choice
// order (ties to the lower id, as a stable sort), w [T, K] float32. Sums run in expert order; no fast
// math (NVRTC's defaults), so expf and the divisions round as the host's float32 within an ulp or two.
// Compiled by NVRTC with trunk.cu's options; no headers.

#define ROUTE_MAXE 512  // backends/routing.py MAX_EXPERTS
#define ROUTE_MAXG 32   // MAX_GROUPS: one bit per group
#define ROUTE_NEG (-3.402823466e38f)

// s: the row's scores; c(e) = s[e] (+ bias[e]): the choice score
__device__ __forceinline__ float route_choice(const float *s, const float *bias, int e) {
    return bias ? s[e] + bias[e] : s[e];
}

// ints as routing.kernel_params: E, K, softmax, (bias: a null pointer when none), n_group (1: not
// grouped), topk_group, group_max, norm; eps added to a renormalised sum, scale multiplies the weights
extern "C" __global__ void route_topk(const float *__restrict__ logits, const float *__restrict__ bias,
                                      int *__restrict__ ids, float *__restrict__ w, int T, int E, int K,
                                      int softmax, int n_group, int topk_group, int group_max, int norm,
                                      float eps, float scale) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < T; t += gridDim.x * blockDim.x) {
        const float *l = logits + (long long)t * E;
        float s[ROUTE_MAXE];
        if (softmax) {
            float m = l[0];
            for (int e = 1; e < E; e++) m = fmaxf(m, l[e]);
            float sum = 0.0f;
            for (int e = 0; e < E; e++) { s[e] = expf(l[e] - m); sum += s[e]; }
            for (int e = 0; e < E; e++) s[e] = s[e] / sum;
        } else {
            for (int e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-l[e]));
        }
        const int gs = E / n_group;  // experts per group (E when not grouped)
        unsigned keep = 1u;  // bit g: group g competes
        if (n_group > 1) {
            float gsc[ROUTE_MAXG];
            for (int g = 0; g < n_group; g++) {  // the group's best and second best choice scores
                float b1 = ROUTE_NEG, b2 = ROUTE_NEG;
                for (int j = 0; j < gs; j++) {
                    const float c = route_choice(s, bias, g * gs + j);
                    if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) b2 = c;
                }
                gsc[g] = (group_max || gs == 1) ? b1 : b2 + b1;
            }
            keep = 0u;
            for (int r = 0; r < topk_group; r++) {
                int bg = -1;
                for (int g = 0; g < n_group; g++)
                    if (!((keep >> g) & 1u) && (bg < 0 || gsc[g] > gsc[bg])) bg = g;
                keep |= 1u << bg;
            }
        }
        unsigned taken[ROUTE_MAXE / 32];
        for (int i = 0; i < ROUTE_MAXE / 32; i++) taken[i] = 0u;
        int *id = ids + (long long)t * K;
        float *wt = w + (long long)t * K;
        float sum = 0.0f;
        for (int k = 0; k < K; k++) {
            int bi = -1;
            float bv = 0.0f;
            for (int e = 0; e < E; e++) {
                if (!((keep >> (e / gs)) & 1u) || ((taken[e >> 5] >> (e & 31)) & 1u)) continue;
                const float c = route_choice(s, bias, e);
                if (bi < 0 || c > bv) { bi = e; bv = c; }
            }
            taken[bi >> 5] |= 1u << (bi & 31);
            id[k] = bi;
            wt[k] = s[bi];
            sum += s[bi];
        }
        const float den = sum + eps;
        for (int k = 0; k < K; k++) wt[k] = (norm ? wt[k] / den : wt[k]) * scale;
    }
}
