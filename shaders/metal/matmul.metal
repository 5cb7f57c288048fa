// Quantized matmul y[t, r] = sum_c x[t, c] * W[r, c], the fused SwiGLU gate/up of an expert, rmsnorm.
// UNVERIFIED: written to the same layout and semantics as shaders/opencl/matmul.cl but never compiled
// or run on our machines (no macOS there).
//
// Weight layout (backends/base.py padded_layout): rows of in_pad columns (a multiple of 128), padded
// with the zero code; activations padded with zeros. Semantics are colibri_plan/quant.py.
// One simdgroup (32 threads) per row; lanes stride over chunks of 8 columns and reduce with simd_sum.

#include <metal_stdlib>
using namespace metal;

#define F_F32 0
#define F_F16 1
#define F_BF16 2
#define F_INT8 3
#define F_INT4 4
#define F_INT2 5
#define F_INT4G 6

struct Params {
    uint in_pad;   // padded columns of W and of each activation row
    uint rows;     // valid rows (out features)
    uint T;        // tokens
    uint stride;   // output row stride (floats)
    uint x_off;    // first float of x in its buffer
    uint y_off;    // first float of y in its buffer
    uint ngroups;  // in_pad / G for group formats
    uint gchunks;  // G / 8: chunks of 8 columns per group
};

// bits per stored weight
constexpr uint bits_of(int fmt) {
    return fmt == F_F32 ? 32 : fmt == F_F16 || fmt == F_BF16 ? 16 : fmt == F_INT8 ? 8 : fmt == F_INT2 ? 2 : 4;
}

// the 8 weights of chunk c (columns 8c .. 8c+7), without scales: w0 = columns 0..3, w1 = 4..7
template <int FMT>
inline void wload(device const uchar *row, uint c, thread float4 &w0, thread float4 &w1) {
    if (FMT == F_F32) {
        device const float4 *p = (device const float4 *)row;
        w0 = p[2 * c];
        w1 = p[2 * c + 1];
    } else if (FMT == F_F16) {
        device const half4 *p = (device const half4 *)row;
        w0 = float4(p[2 * c]);
        w1 = float4(p[2 * c + 1]);
    } else if (FMT == F_BF16) {
        device const ushort4 *p = (device const ushort4 *)row;
        w0 = as_type<float4>(uint4(p[2 * c]) << 16);
        w1 = as_type<float4>(uint4(p[2 * c + 1]) << 16);
    } else if (FMT == F_INT8) {
        device const char4 *p = (device const char4 *)row;
        w0 = float4(p[2 * c]);
        w1 = float4(p[2 * c + 1]);
    } else if (FMT == F_INT2) {
        uint v = ((device const ushort *)row)[c];
        w0 = float4((uint4(v) >> uint4(0, 2, 4, 6)) & 3u) - 2.0f;
        w1 = float4((uint4(v) >> uint4(8, 10, 12, 14)) & 3u) - 2.0f;
    } else {  // int4: byte j holds columns 2j (low nibble) and 2j+1
        uint v = ((device const uint *)row)[c];
        w0 = float4((uint4(v) >> uint4(0, 4, 8, 12)) & 15u) - 8.0f;
        w1 = float4((uint4(v) >> uint4(16, 20, 24, 28)) & 15u) - 8.0f;
    }
}

// dot(W[r], x) over the padded row, complete in every lane of the simdgroup; ST: the scale dtype
// (float; half for int4-gGh, the *_6h instances)
template <int FMT, typename ST>
inline float row_dot(device const uchar *W, device const ST *S, uint r, device const float *x,
                     constant Params &p, uint lane) {
    device const uchar *row = W + (ulong)r * (p.in_pad * bits_of(FMT) / 8);
    device const float4 *x4 = (device const float4 *)x;
    float acc = 0.0f;
    for (uint c = lane; c < p.in_pad / 8; c += 32) {
        float4 w0, w1;
        wload<FMT>(row, c, w0, w1);
        float d = dot(w0, x4[2 * c]) + dot(w1, x4[2 * c + 1]);
        acc += FMT == F_INT4G ? d * float(S[(ulong)r * p.ngroups + c / p.gchunks]) : d;
    }
    acc = simd_sum(acc);
    if (FMT == F_INT8 || FMT == F_INT4 || FMT == F_INT2) acc *= float(S[r]);
    return acc;
}

// y[y_off + t * stride + r] = x[x_off + t * in_pad] . W[r]; threadgroups of whole simdgroups, one row each
template <int FMT, typename ST>
kernel void mm(device const uchar *W [[buffer(0)]], device const ST *S [[buffer(1)]],
               device const float *x [[buffer(2)]], device float *y [[buffer(3)]],
               constant Params &p [[buffer(4)]], uint tg [[threadgroup_position_in_grid]],
               uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]],
               uint lane [[thread_index_in_simdgroup]]) {
    uint r = tg * nsg + sg;
    if (r >= p.rows) return;  // uniform over the simdgroup; no threadgroup barrier follows
    for (uint t = 0; t < p.T; t++) {
        float acc = row_dot<FMT, ST>(W, S, r, x + p.x_off + (ulong)t * p.in_pad, p, lane);
        if (lane == 0) y[p.y_off + (ulong)t * p.stride + r] = acc;
    }
}

// h[y_off + t * stride + r] = SiLU(G[r] . x[t]) * (U[r] . x[t]) for r < rows; rows <= r < stride get 0
template <int FMT, typename ST>
kernel void gate_up(device const uchar *G [[buffer(0)]], device const ST *SG [[buffer(1)]],
                    device const uchar *U [[buffer(2)]], device const ST *SU [[buffer(3)]],
                    device const float *x [[buffer(4)]], device float *h [[buffer(5)]],
                    constant Params &p [[buffer(6)]], uint tg [[threadgroup_position_in_grid]],
                    uint sg [[simdgroup_index_in_threadgroup]], uint nsg [[simdgroups_per_threadgroup]],
                    uint lane [[thread_index_in_simdgroup]]) {
    uint r = tg * nsg + sg;
    if (r >= p.stride) return;
    for (uint t = 0; t < p.T; t++) {
        float v = 0.0f;
        if (r < p.rows) {
            device const float *xt = x + p.x_off + (ulong)t * p.in_pad;
            float g = row_dot<FMT, ST>(G, SG, r, xt, p, lane), u = row_dot<FMT, ST>(U, SU, r, xt, p, lane);
            v = g / (1.0f + exp(-g)) * u;
        }
        if (lane == 0) h[p.y_off + (ulong)t * p.stride + r] = v;
    }
}

#define INSTANCES(F, N, ST)                                                                         \
    template [[host_name("mm_" #N)]] [[kernel]] decltype(mm<F, ST>) mm<F, ST>;                     \
    template [[host_name("gate_up_" #N)]] [[kernel]] decltype(gate_up<F, ST>) gate_up<F, ST>;

INSTANCES(0, 0, float)
INSTANCES(1, 1, float)
INSTANCES(2, 2, float)
INSTANCES(3, 3, float)
INSTANCES(4, 4, float)
INSTANCES(5, 5, float)
INSTANCES(6, 6, float)
INSTANCES(6, 6h, half)  // int4-gGh: float16 group scales

// y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w; one threadgroup of 256 per token
kernel void rmsnorm(device const float *x [[buffer(0)]], device const float *w [[buffer(1)]],
                    device float *y [[buffer(2)]], constant uint &H [[buffer(3)]],
                    constant float &eps [[buffer(4)]], uint t [[threadgroup_position_in_grid]],
                    uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                    uint lane [[thread_index_in_simdgroup]], uint n [[threads_per_threadgroup]]) {
    threadgroup float part[32];
    device const float *xr = x + (ulong)t * H;
    float s = 0.0f;
    for (uint c = tid; c < H; c += n) s = fma(xr[c], xr[c], s);
    s = simd_sum(s);
    if (lane == 0) part[sg] = s;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float total = 0.0f;
    for (uint i = 0; i < (n + 31) / 32; i++) total += part[i];
    float inv = rsqrt(total / float(H) + eps);
    for (uint c = tid; c < H; c += n) y[(ulong)t * H + c] = xr[c] * inv * w[c];
}
