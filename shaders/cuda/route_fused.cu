// A decode token's whole MoE routing in one launch (backends/cuda/routing.py _d_route_fused): the router
// GEMV (x [1, H] . W_router [E, H]^T, f32), route.cu's top-k rule on the logits and, given the layer's
// expert table, the launch table of the indexed expert kernels (trunk.cu tr_expert_table's). It replaces
// three launches of a decode layer (mm_args, route_topk, tr_expert_table) and their gaps in the graph.
//
// Compiled after matmul.cu and route.cu, as one NVRTC source (backends/cuda/launch.py), so the logits
// come from matmul.cu's own warp_rows<F_F32> on x staged as mm_args stages it (zeros past H): each lane
// sums its 16-byte words in ascending order, each word's four fmaf from 0, then warp_sum's butterfly,
// whatever the (rows, words) tile shape, so the logits have the bits of d_matmul's GEMV. The rule is
// route.cu's route_row and the table trunk.cu tr_expert_table's code: ids, weights and table entries have
// the bits of the three-launch path.
//
// Grid (blocks, 1), blocks of a multiple of 32 threads, dynamic shared memory 4 * in_pad bytes. The
// blocks' warps stream the router rows (warp g of the grid: rows g, g + all warps, ...) into logits [E]
// (global scratch); the last block to finish (an atomic count of finished blocks, the CUDA samples'
// threadFenceReduction; it sets the count back to 0 for the next launch on the stream) copies them to
// shared memory, then its warp 0 runs the rule and its lanes < K write ids, weights and the table. One
// block on its own would stream a router of 1 MB (Qwen3-30B-A3B's 128 x 2048) through one SM's ~64 bytes
// a clock: slower than the three launches together.

#define RF_MAXK 64  // backends/routing.py MAX_TOP_K (route_row's two choices a lane)
#define RF_U 8      // words per lane per step (the bits do not depend on it): a router row of 2048 floats
                    // in two steps, both loads in flight at once (4 took four latency-bound steps)

// experts [E, 6] u64 (ExpertTable.dev) and out not null: the launch table at out, as tr_expert_table's:
// [K gate/up entries | K down entries] of 8 u64, then K gates (float32), the choices by ascending id.
extern "C" __global__ void route_fused(const float *__restrict__ wr, const float *__restrict__ x,
                                       const float *__restrict__ bias, float *logits, int *count, int *ids,
                                       float *w, const u64 *__restrict__ experts, u64 *out, u64 xe, u64 h,
                                       u64 y, int h_row_bytes, int y_row_bytes, int E, int H, int in_pad,
                                       int K, int softmax, int n_group, int topk_group, int group_max,
                                       int norm, float eps, float scale) {
    extern __shared__ float4 smem4[];
    __shared__ float lg[ROUTE_MAXE], s[ROUTE_MAXE], cc[ROUTE_MAXE];  // logits, route_row's scratch
    __shared__ int sid[RF_MAXK];
    __shared__ float sg[RF_MAXK];
    __shared__ int last;
    float *xs = reinterpret_cast<float *>(smem4);
    for (int c = threadIdx.x; c < in_pad; c += blockDim.x) xs[c] = c < H ? x[c] : 0.0f;  // F_F32: no swizzle
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const uint4 *W[1] = {reinterpret_cast<const uint4 *>(wr)};
    const float *S[1] = {wr};  // f32 has no scales (never read)
    warp_rows<F_F32, 1, 1, RF_U, 1>(W, S, E, E, in_pad / 4, 0, xs, in_pad, 1,
                                    [&](int row, float (&acc)[1][1][1]) {
        if (lane == 0) logits[row] = acc[0][0][0];
    });
    if (gridDim.x > 1) {  // uniform: the last block to finish routes
        __threadfence();  // this block's logits reach L2 before its count does
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(count, 1) == (int)gridDim.x - 1;
        __syncthreads();
        if (!last) return;
        if (threadIdx.x == 0) *count = 0;  // for the next launch
    } else {
        __syncthreads();  // the block's global writes are visible to the block
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) lg[e] = __ldcg(logits + e);  // L2, not a stale L1
    __syncthreads();
    if (threadIdx.x >= 32) return;
    route_row(lg, bias, sid, sg, s, cc, E, K, softmax, n_group, topk_group, group_max, norm, eps, scale);
    __syncwarp();  // sid and sg complete for every lane
    for (int c = lane; c < K; c += 32) { ids[c] = sid[c]; w[c] = sg[c]; }
    if (experts == nullptr || lane >= K) return;
    // tr_expert_table (trunk.cu), K <= 32: a lane per choice, its place the count of lower ids (distinct)
    const int id = sid[lane];
    int j = 0;
    for (int i = 0; i < K; i++) j += sid[i] < id;
    float *gates = (float *)(out + 16 * K);
    const u64 *e = experts + 6 * (u64)id;
    const u64 hj = h + (u64)j * h_row_bytes, yj = y + (u64)j * y_row_bytes;
    const bool absent = (e[0] & 1) != 0;  // lives on the host: another expert's weights, gate 0
    u64 *gu = out + 8 * j, *dn = out + 8 * (K + j);
    gu[0] = e[0] & ~(u64)1; gu[1] = e[1]; gu[2] = e[2]; gu[3] = e[3]; gu[4] = xe; gu[5] = hj; gu[6] = 1; gu[7] = 0;
    dn[0] = e[4]; dn[1] = e[5]; dn[2] = hj; dn[3] = yj; dn[4] = 1; dn[5] = 0; dn[6] = 0; dn[7] = 0;
    gates[j] = absent ? 0.0f : sg[lane];
}
