// Device-activation ops of the Metal backend beyond the reference hooks (backends/metal.py).
// UNVERIFIED: never compiled or run on our machines (no macOS there); the OpenCL and Vulkan kernels of the
// same op (shaders/opencl/trunk.cl, shaders/vulkan/head_matmul.comp) are tested.

#include <metal_stdlib>
using namespace metal;

// Per-head matrices (d_head_matmul): y[t, b] = w[b] . x[t, b] for x [T, B, K], w [B, N, K], y [T, B, N]; a
// thread per output (n, b, t) = thread_position_in_grid, threadgroups of 64 along n.
struct HeadParams {
    uint T, B, N, K;
};

kernel void head_matmul(device const float *x [[buffer(0)]], device const float *w [[buffer(1)]],
                        device float *y [[buffer(2)]], constant HeadParams &p [[buffer(3)]],
                        uint3 g [[thread_position_in_grid]]) {
    const uint n = g.x, b = g.y, t = g.z;
    if (n >= p.N) return;
    device const float *xr = x + ((ulong)t * p.B + b) * p.K, *wr = w + ((ulong)b * p.N + n) * p.K;
    float acc = 0.0f;
    for (uint k = 0; k < p.K; k++) acc = fma(xr[k], wr[k], acc);
    y[((ulong)t * p.B + b) * p.N + n] = acc;
}
