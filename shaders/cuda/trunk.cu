// Device-activation ops of the trunk (backends/cuda_device.py, contract in backends/device_ops.py): float32,
// C-contiguous, row-major; every pointer is a device address. Elementwise kernels take one thread per
// output element (grid-stride, so any grid covers any size); outputs never alias inputs.
// Compiled by NVRTC with the options of matmul.cu; no headers.

typedef unsigned long long tr_u64;

// y = a + b, b [n] or broadcast over rows of d columns (bcast != 0: b [d])
extern "C" __global__ void tr_add(const float *__restrict__ a, const float *__restrict__ b, float *__restrict__ y,
                                  tr_u64 n, int d, int bcast) {
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x)
        y[i] = a[i] + b[bcast ? i % (tr_u64)d : i];
}

// y = SiLU(g) * u
extern "C" __global__ void tr_silu_mul(const float *__restrict__ g, const float *__restrict__ u,
                                       float *__restrict__ y, tr_u64 n) {
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x) {
        const float v = g[i];
        y[i] = v / (1.0f + expf(-v)) * u[i];
    }
}

// y[r, c] = a[r, c] * s[r] (s a device array of the row scales), or * s0 for every row when s is null
extern "C" __global__ void tr_scale_rows(const float *__restrict__ a, const float *__restrict__ s, float s0,
                                         float *__restrict__ y, tr_u64 n, int d) {
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x)
        y[i] = a[i] * (s ? s[i / (tr_u64)d] : s0);
}

// One rotated channel: v the channel, w its partner, (cos_v, sin_v) the table's pair; the one expression of
// tr_rope and tr_qkv_prologue (the same float operations, so the same bits).
__device__ __forceinline__ float tr_rope_value(float v, float w, float cos_v, float sin_v, bool first) {
    return first ? v * cos_v - w * sin_v : v * cos_v + w * sin_v;
}

// Rotated channel c < rd: its pair index k in the table, its partner's offset (partner = x[c + off]) and
// whether it is the pair's first (rotate_half: c and c + rd/2; interleave: 2i and 2i + 1)
__device__ __forceinline__ void tr_rope_pair(int c, int half, int interleave, int &k, int &off, bool &first) {
    if (interleave) {
        k = c >> 1;
        first = (c & 1) == 0;
        off = first ? 1 : -1;
    } else {
        first = c < half;
        k = first ? c : c - half;
        off = first ? half : -half;
    }
}

// RoPE of x [T, heads, d] at positions pos0 + t from table [P, rd/2, 2] of (cos, sin); channels >= rd copied.
// rotate_half pairs c with c + rd/2; interleave pairs (2i, 2i+1).
__device__ __forceinline__ void tr_rope_rows(const float *__restrict__ x, const float *__restrict__ table,
                                             float *__restrict__ y, tr_u64 n, int heads, int d, int rd, int pos0,
                                             int interleave) {
    const int half = rd >> 1;
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x) {
        const int c = (int)(i % (tr_u64)d);
        if (c >= rd) {
            y[i] = x[i];
            continue;
        }
        const tr_u64 t = i / ((tr_u64)d * heads);
        int k, off;
        bool first;
        tr_rope_pair(c, half, interleave, k, off, first);
        const float *cs = table + ((tr_u64)(pos0 + t) * half + k) * 2;
        y[i] = tr_rope_value(x[i], x[(long long)i + off], cs[0], cs[1], first);
    }
}

extern "C" __global__ void tr_rope(const float *__restrict__ x, const float *__restrict__ table,
                                   float *__restrict__ y, tr_u64 n, int heads, int d, int rd, int pos0,
                                   int interleave) {
    tr_rope_rows(x, table, y, n, heads, d, rd, pos0, interleave);
}

// tr_rope at the position a captured decode step reads from device memory (backends/cuda/graph.py):
// pos0 = *posp + delta, so one CUDA graph serves every step of its context range.
extern "C" __global__ void tr_rope_at(const float *__restrict__ x, const float *__restrict__ table,
                                      float *__restrict__ y, tr_u64 n, int heads, int d, int rd,
                                      const int *__restrict__ posp, int delta, int interleave) {
    tr_rope_rows(x, table, y, n, heads, d, rd, *posp + delta, interleave);
}

// A KV cache append of a captured decode step: dst[(*posp + delta) * row + i] = src[i], i < n, dst the
// address held at dst_slot (the step's inputs: one graph serves every cache of the model).
extern "C" __global__ void tr_copy_rows_at(const float *__restrict__ src, const tr_u64 *__restrict__ dst_slot,
                                           tr_u64 n, tr_u64 row, const int *__restrict__ posp, int delta) {
    float *out = (float *)*dst_slot + (tr_u64)(*posp + delta) * row;
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x)
        out[i] = src[i];
}

// ---- the attention prologue of a GQA layer in one launch (backends/cuda/prologue.py) ----------------------
// Per token row of q [T, Hq, d], k and v [T, Hkv, d]: the per-head RMSNorm of q and k (weights qw, kw [d];
// both null: none), RoPE of q and k as tr_rope (table null or rd 0: none), roped q into qo [T, Hq, d], roped
// k and v into the caches' rows pos0..pos0+T-1 (kc, vc [C, Hkv, d]): the bits of rmsnorm, tr_rope and the
// cache append run one after another, in one launch instead of six. A warp per head row (rows: the T·Hq q
// rows, then T·Hkv k rows, then T·Hkv v rows), PRO_WARPS rows per block; the normed row waits in shared
// memory for RoPE's partner channels.
#define PRO_WARPS 4     // rows (warps) per block: backends/cuda/prologue.py PRO_WARPS
#define PRO_MAX_D 1024  // widest head a warp's row buffer holds (rmsnorm's one-warp rows): PRO_MAX_HEAD_DIM
#ifndef PRO_SHARED      // the host harness (tests/test_backend_cuda_trunk_kernels.py): one block at a time
#define PRO_SHARED __shared__
#endif

// matmul.cu's warp_sum: the same butterfly, so the same sum
__device__ __forceinline__ float tr_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

// buf[c] = rmsnorm(x)[c] of one row of d <= PRO_MAX_D floats by one warp (lane 0..31), in the order of
// matmul.cu's rmsnorm at 32 threads (rms_threads for d <= 1024): the float4 path when d is a multiple of 4
// and x and w are 16-byte aligned (its output, a fresh pool array, always is), else the strided one.
__device__ __forceinline__ void tr_norm_row(const float *__restrict__ xr, const float *__restrict__ w, float eps,
                                            int d, float *buf, int lane) {
    const int n4 = d >> 2;
    const bool vec = (d & 3) == 0 && n4 <= 32 * 8 && (((tr_u64)xr | (tr_u64)w) & 15u) == 0;
    float s = 0.0f;
    if (vec) {  // uniform across the warp; rmsnorm's zero float4s past n4 add fmaf(0, 0, s) = s
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = lane + i * 32;
            if (c < n4) {
                const float4 v = reinterpret_cast<const float4 *>(xr)[c];
                s = fmaf(v.x, v.x, s);
                s = fmaf(v.y, v.y, s);
                s = fmaf(v.z, v.z, s);
                s = fmaf(v.w, v.w, s);
            }
        }
    } else {
        for (int c = lane; c < d; c += 32) {
            const float v = xr[c];
            s = fmaf(v, v, s);
        }
    }
    s = tr_warp_sum(s);
    const float inv = rsqrtf(s / (float)d + eps);
    if (vec) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = lane + i * 32;
            if (c < n4) {
                const float4 v = reinterpret_cast<const float4 *>(xr)[c], g = reinterpret_cast<const float4 *>(w)[c];
                buf[4 * c] = v.x * inv * g.x;
                buf[4 * c + 1] = v.y * inv * g.y;
                buf[4 * c + 2] = v.z * inv * g.z;
                buf[4 * c + 3] = v.w * inv * g.w;
            }
        }
    } else {
        for (int c = lane; c < d; c += 32) buf[c] = xr[c] * inv * w[c];
    }
}

// y[c] = RoPE of the row src [d] at position pos, as tr_rope computes each element (channels >= rd copied)
__device__ __forceinline__ void tr_rope_row(const float *src, float *__restrict__ y,
                                            const float *__restrict__ table, int d, int rd, int pos, int interleave,
                                            int lane) {
    const int half = rd >> 1;
    for (int c = lane; c < d; c += 32) {
        if (c >= rd) {
            y[c] = src[c];
            continue;
        }
        int k, off;
        bool first;
        tr_rope_pair(c, half, interleave, k, off, first);
        const float *cs = table + ((tr_u64)pos * half + k) * 2;
        y[c] = tr_rope_value(src[c], src[c + off], cs[0], cs[1], first);
    }
}

__device__ __forceinline__ void tr_prologue_rows(const float *__restrict__ q, const float *__restrict__ k,
                                                 const float *__restrict__ v, const float *__restrict__ qw,
                                                 const float *__restrict__ kw, const float *__restrict__ table,
                                                 float *__restrict__ qo, float *kc, float *vc, int T, int hq,
                                                 int hkv, int d, int rd, int interleave, float eps, int pos0,
                                                 float *sbuf) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float *buf = sbuf + warp * PRO_MAX_D;
    const tr_u64 nq = (tr_u64)T * hq, nk = (tr_u64)T * hkv, rows = nq + 2 * nk;
    const tr_u64 at = (tr_u64)pos0 * hkv * d;  // cache row pos0
    if (rd == 0) table = 0;
    for (tr_u64 r = (tr_u64)blockIdx.x * PRO_WARPS + warp; r < rows; r += (tr_u64)gridDim.x * PRO_WARPS) {
        if (r >= nq + nk) {  // a v row: into the cache as it is (the warp's branch is uniform)
            const tr_u64 j = (r - nq - nk) * d;
            for (int c = lane; c < d; c += 32) vc[at + j + c] = v[j + c];
            continue;
        }
        const bool isq = r < nq;
        const tr_u64 j = isq ? r : r - nq;  // the head row among q's (or k's)
        const int t = (int)(j / (tr_u64)(isq ? hq : hkv));
        const float *x = (isq ? q : k) + j * d, *w = isq ? qw : kw;
        float *y = isq ? qo + j * d : kc + at + j * d;
        const float *src = x;
        if (w) {  // the normed row waits in shared memory for its partner channels
            tr_norm_row(x, w, eps, d, buf, lane);
            __syncwarp();
            src = buf;
        }
        if (table)
            tr_rope_row(src, y, table, d, rd, pos0 + t, interleave, lane);
        else
            for (int c = lane; c < d; c += 32) y[c] = src[c];
        __syncwarp();  // buf is the warp's next row's
    }
}

// Eager: the caches' addresses and the position as arguments.
extern "C" __global__ void tr_qkv_prologue(const float *__restrict__ q, const float *__restrict__ k,
                                           const float *__restrict__ v, const float *__restrict__ qw,
                                           const float *__restrict__ kw, const float *__restrict__ table,
                                           float *__restrict__ qo, float *__restrict__ kc, float *__restrict__ vc,
                                           int T, int hq, int hkv, int d, int rd, int interleave, float eps,
                                           int pos0) {
    PRO_SHARED float sbuf[PRO_WARPS * PRO_MAX_D];
    tr_prologue_rows(q, k, v, qw, kw, table, qo, kc, vc, T, hq, hkv, d, rd, interleave, eps, pos0, sbuf);
}

// A captured decode step's (backends/cuda/graph.py): the caches' addresses read from their slots, the
// position from device memory (pos0 = *posp + delta), as tr_copy_rows_at and tr_rope_at.
extern "C" __global__ void tr_qkv_prologue_at(const float *__restrict__ q, const float *__restrict__ k,
                                              const float *__restrict__ v, const float *__restrict__ qw,
                                              const float *__restrict__ kw, const float *__restrict__ table,
                                              float *__restrict__ qo, const tr_u64 *__restrict__ k_slot,
                                              const tr_u64 *__restrict__ v_slot, int T, int hq, int hkv, int d,
                                              int rd, int interleave, float eps, const int *__restrict__ posp,
                                              int delta) {
    PRO_SHARED float sbuf[PRO_WARPS * PRO_MAX_D];
    tr_prologue_rows(q, k, v, qw, kw, table, qo, (float *)*k_slot, (float *)*v_slot, T, hq, hkv, d, rd,
                     interleave, eps, *posp + delta, sbuf);
}

// The launch table of one decode token's routed experts, built on the device from d_router_topk's output
// (backends/cuda/graph.py): ids [K] int32 and w [K] float32 of the token, experts [E][6] u64 (gate W, S,
// up W, S, down W, S) of the layer. The K choices are taken in ascending expert id (the host's order of
// summation), then out holds matmul.cu's table (K gate/up entries of 8 u64: gate W, S, up W, S, x, h_j, 1,
// 0; K down entries: down W, S, h_j, y_j, 1, 0, 0, 0) followed by the K gates as float32: the layout of
// backends/cuda/experts.py ffn_table + gates. An expert row whose gate W has bit 0 set lives on the host
// (Build 4's hybrid layers): its entries read another expert's weights and its gate is 0, so the device's
// sum gets +0 from it. K <= 32.
extern "C" __global__ void tr_expert_table(const int *__restrict__ ids, const float *__restrict__ w,
                                           const tr_u64 *__restrict__ experts, tr_u64 *__restrict__ out,
                                           int K, tr_u64 x, tr_u64 h, tr_u64 y, int h_row_bytes,
                                           int y_row_bytes) {
    // a thread per choice (one block of >= K threads): its place is the count of lower ids (ids are
    // distinct); one thread walking all K made it 6 us of dependent loads on an H200
    __shared__ int sid[32];
    __shared__ float sg[32];
    const int c = threadIdx.x;
    if (blockIdx.x != 0) return;
    if (c < K) { sid[c] = ids[c]; sg[c] = w[c]; }
    __syncthreads();
    if (c >= K) return;
    const int id = sid[c];
    int j = 0;
    for (int i = 0; i < K; i++) j += sid[i] < id;
    float *gates = (float *)(out + 16 * K);
    const tr_u64 *e = experts + 6 * (tr_u64)id;
    const tr_u64 hj = h + (tr_u64)j * h_row_bytes, yj = y + (tr_u64)j * y_row_bytes;
    const bool absent = (e[0] & 1) != 0;  // lives on the host: another expert's weights, gate 0
    tr_u64 *gu = out + 8 * j, *dn = out + 8 * (K + j);
    gu[0] = e[0] & ~(tr_u64)1; gu[1] = e[1]; gu[2] = e[2]; gu[3] = e[3]; gu[4] = x; gu[5] = hj; gu[6] = 1; gu[7] = 0;
    dn[0] = e[4]; dn[1] = e[5]; dn[2] = hj; dn[3] = yj; dn[4] = 1; dn[5] = 0; dn[6] = 0; dn[7] = 0;
    gates[j] = absent ? 0.0f : sg[c];
}

// Before matmul.cu's mm_args when x's rows are not [T, in_pad] floats at a 16-byte aligned address: copy
// x [T, in] into xp [T, in_pad] with zeros in columns in .. in_pad-1 (the weights' padding holds the zero
// code, so the padded sums are exact).
extern "C" __global__ void tr_pad_rows(const float *__restrict__ x, float *__restrict__ xp, int T, int in,
                                       int in_pad) {
    const tr_u64 n = (tr_u64)T * in_pad;
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x) {
        const int c = (int)(i % (tr_u64)in_pad);
        xp[i] = c < in ? x[(i / in_pad) * in + c] : 0.0f;
    }
}

// The routed experts' weighted sum (backends/cuda_experts.py): y[i] = sum_j gates[j] * ys[j * n + i] over the
// k expert outputs ys [k, n], j ascending from 0, each product and sum rounded as the host's float32 numpy
// does (no fused multiply-add), so the order of the engine's host combine is kept.
extern "C" __global__ void tr_expert_sum(const float *__restrict__ ys, const float *__restrict__ gates,
                                         float *__restrict__ y, tr_u64 n, int k) {
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; j++) acc = __fadd_rn(acc, __fmul_rn(gates[j], ys[(tr_u64)j * n + i]));
        y[i] = acc;
    }
}

// Routed experts of a prefill: y[t, c] = sum over experts j (in order) of gates[j, t] * ys[pos[j, t], c],
// skipping pos -1 (token t not routed to expert j); ys holds every expert's rows [rows_j, H] one after
// another, pos / gates are [k, T]; n = T * H.
extern "C" __global__ void tr_expert_scatter(const float *__restrict__ ys, const int *__restrict__ pos,
                                             const float *__restrict__ gates, float *__restrict__ y, tr_u64 n,
                                             int H, int k) {
    const tr_u64 T = n / (tr_u64)H;
    for (tr_u64 i = blockIdx.x * (tr_u64)blockDim.x + threadIdx.x; i < n; i += (tr_u64)gridDim.x * blockDim.x) {
        const tr_u64 t = i / (tr_u64)H, c = i % (tr_u64)H;
        float acc = 0.0f;
        for (int j = 0; j < k; j++) {
            const int p = pos[j * T + t];
            if (p >= 0) acc = __fadd_rn(acc, __fmul_rn(gates[j * T + t], ys[(tr_u64)p * H + c]));
        }
        y[i] = acc;
    }
}
