// Elementwise ops of the device trunk (backends/device_ops.py: d_add, d_silu_mul, d_scale_rows, d_rope)
// and the zero-padding of activations for matmul.cl. One work-item per output element; the grid is
// rounded up to whole work-groups, so items past n leave at once. Every kernel starts with its output y
// (a fresh buffer) and its element count n; offsets (`*o`) are in floats: a DArray's offset into its buffer.

// y = a + b; b is [d] broadcast over the rows of a (bcast = 1) or a's shape (bcast = 0)
kernel void add(global float *y, ulong n, global const float *a, ulong ao, global const float *b, ulong bo,
                uint d, uint bcast) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    y[i] = a[ao + i] + b[bo + (bcast ? i % d : i)];
}

// y = SiLU(g) * u
kernel void silu_mul(global float *y, ulong n, global const float *g, ulong go, global const float *u,
                     ulong uo) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    const float x = g[go + i];
    y[i] = x / (1.0f + exp(-x)) * u[uo + i];
}

// y[r, c] = a[r, c] * s[r], rows of d floats
kernel void scale_rows(global float *y, ulong n, global const float *a, ulong ao, global const float *s,
                       uint d) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    y[i] = a[ao + i] * s[i / d];
}

// RoPE of x [T, heads, d] at positions pos0 + t from tab [P, rd/2, 2] of (cos, sin); channels >= rd
// are copied. rotate_half pairs channel j with j + rd/2, interleaved pairs (2j, 2j+1).
kernel void rope(global float *y, ulong n, global const float *x, ulong xo, global const float *tab, ulong to,
                 uint heads, uint d, uint rd, uint pos0, uint interleave) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    global const float *xr = x + xo + (i / d) * d;  // this (t, head) row
    const uint c = i % d, t = (uint)(i / ((ulong)d * heads)), half_ = rd / 2;
    if (c >= rd) {
        y[i] = xr[c];
        return;
    }
    const uint j = interleave ? c / 2 : (c < half_ ? c : c - half_);
    // partner channel and the sign of its sine term: out_a = a cos - b sin, out_b = b cos + a sin
    const uint first = interleave ? (c % 2 == 0) : (c < half_);
    const uint other = interleave ? (first ? c + 1 : c - 1) : (first ? c + half_ : c - half_);
    global const float *cs = tab + to + ((ulong)(pos0 + t) * half_ + j) * 2;
    y[i] = first ? xr[c] * cs[0] - xr[other] * cs[1] : xr[c] * cs[0] + xr[other] * cs[1];
}

// y [T, in_pad] = x [T, n_in] with zeros in columns n_in .. in_pad-1 (matmul.cl reads padded rows and
// the weights' padding holds the zero code, so the sums stay exact)
kernel void pad_rows(global float *y, ulong n, global const float *x, ulong xo, uint n_in, uint in_pad) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    const uint c = i % in_pad;
    y[i] = c < n_in ? x[xo + (i / in_pad) * n_in + c] : 0.0f;
}

// y = Σ_j gates[j] · ys[j] over k arrays ys [k, n] (the routed experts' outputs), accumulated from 0 in
// j order with the product rounded before the add: the host combine's float32 result (no fma contraction)
#pragma OPENCL FP_CONTRACT OFF
kernel void expert_sum(global float *y, ulong n, global const float *ys, global const float *gates, uint k) {
    const ulong i = get_global_id(0);
    if (i >= n) return;
    float acc = 0.0f;
    for (uint j = 0; j < k; j++) {
        const float p = gates[j] * ys[(ulong)j * n + i];
        acc = acc + p;
    }
    y[i] = acc;
}

// Per-head matrices (d_head_matmul): y[t, b] = w[b] . x[t, b] for x [T, B, K], w [B, N, K], y [T, B, N]
// (MLA's absorbed projections). A work-group of HM_N x HM_T items makes HM_N outputs of HM_T tokens of
// head b = get_group_id(2): K is taken HM_K columns at a time, the x and w tiles staged in local memory
// (each w element is read once per HM_T tokens). Build option -DHM_T=<tokens per group> (1 at decode).
#ifndef HM_T
#define HM_T 16
#endif
#define HM_N 16
#define HM_K 16
kernel void head_matmul(global float *y, global const float *x, ulong xo, global const float *w, ulong wo,
                        uint T, uint B, uint N, uint K) {
    local float xs[HM_T][HM_K + 1], ws[HM_N][HM_K + 1];  // +1: rows fall in different banks
    const uint ln = get_local_id(0), lt = get_local_id(1), b = get_group_id(2);
    const uint n0 = get_group_id(0) * HM_N, t0 = get_group_id(1) * HM_T;
    float acc = 0.0f;
    for (uint k0 = 0; k0 < K; k0 += HM_K) {
        const uint k = k0 + ln;
        for (uint r = lt; r < HM_N; r += HM_T)  // w rows n0 .. n0 + HM_N - 1, columns k0 .. k0 + HM_K - 1
            ws[r][ln] = n0 + r < N && k < K ? w[wo + ((ulong)b * N + n0 + r) * K + k] : 0.0f;
        xs[lt][ln] = t0 + lt < T && k < K ? x[xo + ((ulong)(t0 + lt) * B + b) * K + k] : 0.0f;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (uint i = 0; i < HM_K; i++) acc = fma(xs[lt][i], ws[ln][i], acc);
        barrier(CLK_LOCAL_MEM_FENCE);  // the tiles are rewritten next
    }
    if (t0 + lt < T && n0 + ln < N) y[((ulong)(t0 + lt) * B + b) * N + n0 + ln] = acc;
}
