// Router top-k of d_router_topk (backends/cuda/routing.py): the rule of backends/routing.py on router
// logits [T, E], one block per token row (grid-stride over rows), its threads (at most ROUTE_MAXT; any
// count, 1 included) sharing the row's experts e = tid, tid + nt, ...: the max and the softmax sum reduce
// through shared memory (each thread's partial in expert order, then the partials in thread order: with
// one thread, the expert order), each top-k round takes every thread's best unchosen expert and the
// best of those (ties to the lower id, as a stable sort). Outputs: ids [T, K] int32 in descending choice
// order, w [T, K] float32. No fast math (NVRTC's defaults), so expf and the divisions round as the host's
// float32 within an ulp or two. Compiled by NVRTC with trunk.cu's options; no headers.

#define ROUTE_MAXE 512  // backends/routing.py MAX_EXPERTS
#define ROUTE_MAXG 32   // MAX_GROUPS: one bit per group
#define ROUTE_MAXT 32   // threads per block at most (backends/cuda/routing.py ROUTE_THREADS)
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
    __shared__ float s[ROUTE_MAXE];           // the row's scores
    __shared__ float pv[ROUTE_MAXT];          // a thread's partial (max, sum) or its best choice score
    __shared__ int pi[ROUTE_MAXT];            // and that choice's expert id (-1: none left)
    __shared__ unsigned taken[ROUTE_MAXE / 32];
    __shared__ unsigned keep_s;               // bit g: group g competes
    const int tid = threadIdx.x, nt = blockDim.x;
    for (int t = blockIdx.x; t < T; t += gridDim.x) {
        const float *l = logits + (long long)t * E;
        if (softmax) {
            float m = ROUTE_NEG;
            for (int e = tid; e < E; e += nt) m = fmaxf(m, l[e]);
            pv[tid] = m;
            __syncthreads();
            m = pv[0];
            for (int i = 1; i < nt; i++) m = fmaxf(m, pv[i]);  // every thread: the same max
            __syncthreads();  // pv is rewritten below
            float part = 0.0f;
            for (int e = tid; e < E; e += nt) { s[e] = expf(l[e] - m); part += s[e]; }
            pv[tid] = part;
            __syncthreads();
            float sum = 0.0f;
            for (int i = 0; i < nt; i++) sum += pv[i];  // thread order: the same sum in every thread
            for (int e = tid; e < E; e += nt) s[e] = s[e] / sum;
        } else {
            for (int e = tid; e < E; e += nt) s[e] = 1.0f / (1.0f + expf(-l[e]));
        }
        for (int i = tid; i < ROUTE_MAXE / 32; i += nt) taken[i] = 0u;
        __syncthreads();  // s complete, pv free
        const int gs = E / n_group;  // experts per group (E when not grouped)
        if (tid == 0) {
            unsigned keep = 1u;
            if (n_group > 1) {  // the groups' best and second best choice scores (few: one thread)
                float gsc[ROUTE_MAXG];
                for (int g = 0; g < n_group; g++) {
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
            keep_s = keep;
        }
        __syncthreads();
        const unsigned keep = keep_s;
        int *id = ids + (long long)t * K;
        float *wt = w + (long long)t * K;
        float sum = 0.0f;  // thread 0's: the chosen scores in choice order
        for (int k = 0; k < K; k++) {
            int bi = -1;
            float bv = 0.0f;
            for (int e = tid; e < E; e += nt) {  // ascending: the lower id wins a tie
                if (!((keep >> (e / gs)) & 1u) || ((taken[e >> 5] >> (e & 31)) & 1u)) continue;
                const float c = route_choice(s, bias, e);
                if (bi < 0 || c > bv) { bi = e; bv = c; }
            }
            pv[tid] = bv;
            pi[tid] = bi;
            __syncthreads();
            if (tid == 0) {
                int b = -1;
                float v = 0.0f;
                for (int i = 0; i < nt; i++) {
                    const int j = pi[i];
                    if (j >= 0 && (b < 0 || pv[i] > v || (pv[i] == v && j < b))) { b = j; v = pv[i]; }
                }
                taken[b >> 5] |= 1u << (b & 31);
                id[k] = b;
                wt[k] = s[b];
                sum += s[b];
            }
            __syncthreads();  // taken updated, pv / pi free
        }
        if (tid == 0) {
            const float den = sum + eps;
            for (int k = 0; k < K; k++) wt[k] = (norm ? wt[k] / den : wt[k]) * scale;
        }
        __syncthreads();  // s is the next row's
    }
}
