// Router top-k of d_router_topk (backends/cuda/routing.py): the rule of backends/routing.py on router
// logits [T, E], one warp per token row (the block's warps take consecutive rows, grid-strided). Lane l
// holds experts e = l + 32 j (j < ROUTE_PER_LANE) in registers: the max and the softmax sum are xor
// butterflies of __shfl_xor_sync (each lane's partial in its expert order, then the butterfly: every lane
// ends with the same bits, as float addition commutes), each top-k round is every lane's best unchosen
// expert then a butterfly argmax of (choice score, id), ties to the lower id (a stable sort). Grouped
// routing: lane g scores group g from the warp's shared copy of the scores, the kept groups are
// topk_group butterfly argmax rounds. No __syncthreads, no lane-0 serial loops: a decode step's routing
// was 14.5 us per launch with them on an H200 (bench/results/h200-step-profile). Outputs: ids [T, K]
// int32 in descending choice order, w [T, K] float32. No fast math (NVRTC's defaults), so expf and the
// divisions round as the host's float32 within an ulp or two. Compiled by NVRTC with trunk.cu's
// options; no headers. blockDim.x must be a multiple of 32 (ROUTE_THREADS).

#define ROUTE_MAXE 512  // backends/routing.py MAX_EXPERTS
#define ROUTE_MAXG 32   // MAX_GROUPS: one lane (and one bit) per group
#define ROUTE_WARPS 4   // warps per block at most (rows per block; the launch's ROUTE_THREADS: one)
#define ROUTE_PER_LANE (ROUTE_MAXE / 32)
#define ROUTE_NEG (-3.402823466e38f)
#define ROUTE_FULL 0xffffffffu

// the better of (v, i) and (ov, oi): the larger score, ties (and equal scores) to the lower id; id -1: none
__device__ __forceinline__ void route_best(float &v, int &i, float ov, int oi) {
    if (oi >= 0 && (i < 0 || ov > v || (ov == v && oi < i))) { v = ov; i = oi; }
}

// the warp's best (v, i) in every lane: a butterfly, each step commutative, so all lanes agree
__device__ __forceinline__ void route_warp_best(float &v, int &i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(ROUTE_FULL, v, o);
        const int oi = __shfl_xor_sync(ROUTE_FULL, i, o);
        route_best(v, i, ov, oi);
    }
}

// One token row's rule (route_topk's and route_fused's, route_fused.cu): the warp's lanes score the row's
// logits l [E] (global or shared memory), s and cc [E] the warp's shared scratch (weights, choice scores);
// writes id [K] and wt [K] (lanes < K, and lanes < K - 32). Ints as routing.kernel_params: E, K, softmax,
// (bias: a null pointer when none), n_group (1: not grouped), topk_group, group_max, norm; eps added to a
// renormalised sum, scale multiplies the weights. The caller __syncwarp()s before reusing s and cc.
__device__ __forceinline__ void route_row(const float *__restrict__ l, const float *__restrict__ bias,
                                          int *id, float *wt, float *s, float *cc, int E, int K,
                                          int softmax, int n_group, int topk_group, int group_max, int norm,
                                          float eps, float scale) {
    const int lane = threadIdx.x & 31;
    float c[ROUTE_PER_LANE];  // the lane's choice scores, then ROUTE_NEG once unavailable
    unsigned left = 0u;       // bit j: expert lane + 32 j still competes
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; j++) {
        const int e = lane + 32 * j;
        c[j] = e < E ? l[e] : ROUTE_NEG;
        if (e < E) left |= 1u << j;
    }
    if (softmax) {
        float m = ROUTE_NEG;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++) m = fmaxf(m, c[j]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(ROUTE_FULL, m, o));
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++)
            if ((left >> j) & 1u) { c[j] = expf(c[j] - m); sum += c[j]; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(ROUTE_FULL, sum, o);
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++)
            if ((left >> j) & 1u) c[j] = c[j] / sum;
    } else {
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++)
            if ((left >> j) & 1u) c[j] = 1.0f / (1.0f + expf(-c[j]));
    }
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; j++)  // c: s, then the choice score s (+ bias)
        if ((left >> j) & 1u) {
            const int e = lane + 32 * j;
            s[e] = c[j];
            if (bias) c[j] = c[j] + bias[e];
            cc[e] = c[j];
        }
    __syncwarp();  // s and cc complete for every lane
    if (n_group > 1) {  // lane g scores group g (its best and second best choice scores)
        const int gs = E / n_group;
        float gsc = ROUTE_NEG;
        if (lane < n_group) {
            float b1 = ROUTE_NEG, b2 = ROUTE_NEG;
            for (int q = 0; q < gs; q++) {
                const float v = cc[lane * gs + q];
                if (v > b1) { b2 = b1; b1 = v; } else if (v > b2) b2 = v;
            }
            gsc = (group_max || gs == 1) ? b1 : b2 + b1;
        }
        unsigned keep = 0u;  // bit g: group g competes
        for (int r = 0; r < topk_group; r++) {
            float v = gsc;
            int g = (lane < n_group && !((keep >> lane) & 1u)) ? lane : -1;
            route_warp_best(v, g);
            keep |= 1u << g;
        }
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++)
            if (!((keep >> ((lane + 32 * j) / gs)) & 1u)) left &= ~(1u << j);
    }
    int id0 = 0, id1 = 0;  // lane l keeps choices l and l + 32 (scalars: an array indexed by k would
    float w0 = 0.0f, w1 = 0.0f;  // sit in local memory)
    float sum = 0.0f;  // the chosen scores in choice order (every lane the same)
    for (int k = 0; k < K; k++) {
        int bi = -1;
        float bv = 0.0f;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; j++)  // ascending ids: the lower wins a tie
            if (((left >> j) & 1u) && (bi < 0 || c[j] > bv)) { bi = lane + 32 * j; bv = c[j]; }
        route_warp_best(bv, bi);
        if ((bi & 31) == lane) left &= ~(1u << (bi >> 5));
        const float sb = s[bi];
        sum += sb;
        if (k == lane) { id0 = bi; w0 = sb; }
        if (k == lane + 32) { id1 = bi; w1 = sb; }
    }
    const float den = sum + eps;
    if (lane < K) { id[lane] = id0; wt[lane] = (norm ? w0 / den : w0) * scale; }
    if (lane + 32 < K) { id[lane + 32] = id1; wt[lane + 32] = (norm ? w1 / den : w1) * scale; }
}

// logits [T, E] -> ids [T, K], w [T, K]: one warp per row, the block's warps on consecutive rows
extern "C" __global__ void route_topk(const float *__restrict__ logits, const float *__restrict__ bias,
                                      int *__restrict__ ids, float *__restrict__ w, int T, int E, int K,
                                      int softmax, int n_group, int topk_group, int group_max, int norm,
                                      float eps, float scale) {
    __shared__ float ss[ROUTE_WARPS][ROUTE_MAXE];  // a warp's row scores (weights, group scores)
    __shared__ float cs[ROUTE_WARPS][ROUTE_MAXE];  // and choice scores (grouped routing only)
    const int wib = threadIdx.x >> 5, wpb = blockDim.x >> 5;
    for (int t = blockIdx.x * wpb + wib; t < T; t += gridDim.x * wpb) {  // uniform across the warp
        route_row(logits + (long long)t * E, bias, ids + (long long)t * K, w + (long long)t * K, ss[wib],
                  cs[wib], E, K, softmax, n_group, topk_group, group_max, norm, eps, scale);
        __syncwarp();  // s and cc are the warp's next row's
    }
}
