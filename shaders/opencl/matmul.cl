// Quantized matmul y[t, r] = sum_c x[t, c] * W[r, c] and the fused SwiGLU gate/up of an expert.
//
// Weight layout (backends/base.py padded_layout): rows of `row_bytes`, columns padded to `in_pad`
// (a multiple of 128) with the zero code; activations padded with zeros, so there is no tail loop.
// Value semantics are colibri_plan/quant.py: int4 (nibble - 8) * s, int2 (crumb - 2) * s, int8 q * s,
// bf16 bits << 16, f16 IEEE half; packing low bits first.
//
// Build options: -DFMT=<0..6> -DLS=<work-items per row> -DTPI=<tokens per work-item> [-DGROUP=<G>]
// [-DSCALE_HALF: group scales are float16 (int4-gGh), read with vload_half; else float32].
// One work-group of LS work-items computes one row for TPI tokens; LS = 1 is one work-item per row
// (best on CPU devices), LS > 1 splits the row and reduces in local memory (GPUs).

#define F_F32 0
#define F_F16 1
#define F_BF16 2
#define F_INT8 3
#define F_INT4 4
#define F_INT2 5
#define F_INT4G 6

#if FMT == F_F32
#define ROW_BYTES(n) ((ulong)(n) * 4)
#elif FMT == F_F16 || FMT == F_BF16
#define ROW_BYTES(n) ((ulong)(n) * 2)
#elif FMT == F_INT8
#define ROW_BYTES(n) ((ulong)(n))
#elif FMT == F_INT2
#define ROW_BYTES(n) ((ulong)(n) / 4)
#else
#define ROW_BYTES(n) ((ulong)(n) / 2)
#endif

#define ROW_SCALED (FMT == F_INT8 || FMT == F_INT4 || FMT == F_INT2)

// the scale dtype: only int4-gGh (FMT 6) is built with SCALE_HALF; vload_half needs no fp16 extension
#ifdef SCALE_HALF
#define SCALE_T half
#define SCALE_AT(S, i) vload_half((i), (S))
#else
#define SCALE_T float
#define SCALE_AT(S, i) ((S)[i])
#endif

// LS = 1: a work-group holds several rows, one per work-item (fewer, larger groups are cheaper to
// schedule on CPUs); the grid is rounded up, so items past the last row leave early (no barriers).
#if LS == 1
#define LANE 0
#define ROW_ID get_global_id(0)
#define ROW_GUARD(n) if (r >= (n)) return
#else
#define LANE get_local_id(0)
#define ROW_ID get_group_id(0)
#define ROW_GUARD(n)
#endif

// the 8 weights of chunk c (columns 8c .. 8c+7) of one row, without scales
inline float8 wload(global const uchar *row, uint c) {
#if FMT == F_F32
    return vload8(c, (global const float *)row);
#elif FMT == F_F16
    return vload_half8(c, (global const half *)row);
#elif FMT == F_BF16
    return as_float8(convert_uint8(vload8(c, (global const ushort *)row)) << 16);
#elif FMT == F_INT8
    return convert_float8(vload8(c, (global const char *)row));
#elif FMT == F_INT2
    uint v = ((global const ushort *)row)[c];
    return convert_float8(((uint8)(v) >> (uint8)(0, 2, 4, 6, 8, 10, 12, 14)) & 3u) - 2.0f;
#else
    uint v = ((global const uint *)row)[c];  // byte j holds columns 2j (low nibble), 2j+1 (high)
    return convert_float8(((uint8)(v) >> (uint8)(0, 4, 8, 12, 16, 20, 24, 28)) & 15u) - 8.0f;
#endif
}

// acc[m * TPI + j] = dot(W_m[r], x[t0 + j]) for the NW (1 or 2) weights W_0, W_1 and j < TPI, complete
// in every work-item of the group. Both weights share each activation load (gate and up of an expert).
// Token rows past T are clamped to T-1 (valid memory, results discarded by the caller).
inline void row_dot(const int NW, global const uchar *W0, global const SCALE_T *S0, global const uchar *W1,
                    global const SCALE_T *S1, uint r, global const float *x, uint in_pad, uint T, uint t0,
                    local float *red, float *acc) {
    uint lane = LANE;
    ulong base = (ulong)r * ROW_BYTES(in_pad);
    global const uchar *row0 = W0 + base, *row1 = W1 + base;
    ulong xo[TPI];  // first float of each token row of x
    float8 a0[TPI], a1[TPI];
    for (int j = 0; j < TPI; j++) {
        xo[j] = (ulong)min(t0 + j, T - 1) * in_pad;
        a0[j] = (float8)(0.0f);
        a1[j] = (float8)(0.0f);
    }
    uint nchunk = in_pad / 8;
    for (uint c = lane; c < nchunk; c += LS) {
        float8 w0 = wload(row0, c), w1 = NW > 1 ? wload(row1, c) : (float8)(0.0f);
#if FMT == F_INT4G
        ulong g = (ulong)r * (in_pad / GROUP) + c / (GROUP / 8);
        w0 *= SCALE_AT(S0, g);
        if (NW > 1) w1 *= SCALE_AT(S1, g);
#endif
        for (int j = 0; j < TPI; j++) {
            float8 xv = vload8(c, x + xo[j]);
            a0[j] = fma(w0, xv, a0[j]);
            if (NW > 1) a1[j] = fma(w1, xv, a1[j]);
        }
    }
    for (int j = 0; j < TPI; j++) {
        float4 s0 = a0[j].lo + a0[j].hi, s1 = a1[j].lo + a1[j].hi;
        acc[j] = (s0.x + s0.y) + (s0.z + s0.w);
        if (NW > 1) acc[TPI + j] = (s1.x + s1.y) + (s1.z + s1.w);
    }
#if LS > 1
    for (int k = 0; k < NW * TPI; k++) red[k * LS + lane] = acc[k];
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint half_ = LS / 2; half_ > 0; half_ >>= 1) {
        if (lane < half_)
            for (int k = 0; k < NW * TPI; k++) red[k * LS + lane] += red[k * LS + lane + half_];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int k = 0; k < NW * TPI; k++) acc[k] = red[k * LS];
#endif
#if ROW_SCALED
    for (int j = 0; j < TPI; j++) {
        acc[j] *= SCALE_AT(S0, r);
        if (NW > 1) acc[TPI + j] *= SCALE_AT(S1, r);
    }
#endif
}


// y[y_off + t * y_stride + r] = x[x_off + t * in_pad] . W[r], grid (>= out * LS, ceil(T / TPI))
kernel void matmul(global const uchar *W, global const SCALE_T *S, global const float *x, uint x_off,
                   global float *y, uint y_off, uint in_pad, uint T, uint y_stride, uint rows) {
    local float red[LS * TPI];
    float acc[TPI];
    uint r = ROW_ID, t0 = get_global_id(1) * TPI;
    ROW_GUARD(rows);
    row_dot(1, W, S, W, S, r, x + x_off, in_pad, T, t0, red, acc);
    if (LANE == 0)
        for (int j = 0; j < TPI; j++)
            if (t0 + j < T) y[y_off + (ulong)(t0 + j) * y_stride + r] = acc[j];
}

// h[t, r] = SiLU(gate[r] . x[t]) * (up[r] . x[t]); rows r >= rows_valid (padding of h) get 0 so the
// down projection reads exact zeros. Grid (>= h_stride * LS, ceil(T / TPI)).
kernel void gate_up(global const uchar *G, global const SCALE_T *SG, global const uchar *U,
                    global const SCALE_T *SU, global const float *x, uint x_off, global float *h,
                    uint h_off, uint in_pad, uint T, uint h_stride, uint rows_valid) {
    local float red[2 * LS * TPI];
    float acc[2 * TPI];
    uint r = ROW_ID, t0 = get_global_id(1) * TPI;
    ROW_GUARD(h_stride);
    // padding rows compute row 0 (valid memory, no divergent barrier) and store 0
    row_dot(2, G, SG, U, SU, r < rows_valid ? r : 0, x + x_off, in_pad, T, t0, red, acc);
    if (LANE == 0)
        for (int j = 0; j < TPI; j++) {
            float g = acc[j], u = acc[TPI + j];
            if (t0 + j < T) h[h_off + (ulong)(t0 + j) * h_stride + r] =
                r < rows_valid ? g / (1.0f + exp(-g)) * u : 0.0f;
        }
}

// Up to four matrices W_0..W_3 of one format and in_pad reading one x, in one launch over their stacked
// rows: matrix i owns global rows e_{i-1} .. e_i - 1 (e_{-1} = 0; unused slots repeat the last end, so
// they own none) and writes y_i[t * (e_i - e_{i-1}) + r - e_{i-1}]. Each row's sum is matmul's.
// Grid (>= e_3 * LS, ceil(T / TPI)).
kernel void matmul_many(global const uchar *W0, global const SCALE_T *S0, global const uchar *W1,
                        global const SCALE_T *S1, global const uchar *W2, global const SCALE_T *S2,
                        global const uchar *W3, global const SCALE_T *S3, global const float *x, uint x_off,
                        global float *y0, global float *y1, global float *y2, global float *y3, uint in_pad,
                        uint T, uint e0, uint e1, uint e2, uint e3) {
    local float red[LS * TPI];
    float acc[TPI];
    uint r = ROW_ID, t0 = get_global_id(1) * TPI;
    ROW_GUARD(e3);
    // the slot of this row: the same for every item of a work-group (no divergent barrier)
    const uint m = r < e0 ? 0 : r < e1 ? 1 : r < e2 ? 2 : 3;
    const uint r0 = m == 0 ? 0 : m == 1 ? e0 : m == 2 ? e1 : e2;
    const uint rows = (m == 0 ? e0 : m == 1 ? e1 : m == 2 ? e2 : e3) - r0;
    global const uchar *W = m == 0 ? W0 : m == 1 ? W1 : m == 2 ? W2 : W3;
    global const SCALE_T *S = m == 0 ? S0 : m == 1 ? S1 : m == 2 ? S2 : S3;
    global float *y = m == 0 ? y0 : m == 1 ? y1 : m == 2 ? y2 : y3;
    row_dot(1, W, S, W, S, r - r0, x + x_off, in_pad, T, t0, red, acc);
    if (LANE == 0)
        for (int j = 0; j < TPI; j++)
            if (t0 + j < T) y[(ulong)(t0 + j) * rows + r - r0] = acc[j];
}
