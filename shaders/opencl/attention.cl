// Causal attention over a KV cache (backends/opencl/device.py d_attention): attention_gqa, then
// attention_combine when the keys were split. MLA runs the same kernels on its latent cache (one kv
// head, D = rope + kv_lora_rank). Build options: -DLS=<items per work-group> (a power of two)
// -DNACC=<ceil(D / LS)>.

// max (is_max) or sum of v over the work-group; every item gets it
float group_reduce(local float *red, float v, int is_max) {
    const uint lane = get_local_id(0);
    red[lane] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint half_ = LS / 2; half_ > 0; half_ >>= 1) {
        if (lane < half_) red[lane] = is_max ? fmax(red[lane], red[lane + half_]) : red[lane] + red[lane + half_];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);  // red is rewritten by the next reduction
    return r;
}

// attention_gqa: one work-group of LS items per query row
// t (get_group_id(1)) and head h (get_group_id(0)); query head h reads kv head h / (Hq / Hkv).
// q [T, Hq, D] at qo, k and v [C, Hkv, D] at ko and vo (offsets in floats), out [T, Hq * D].
// Query row t sits at position pos0 + t and sees keys lo .. pos0 + t (lo = pos0 + t - window + 1 on a
// sliding-window layer, window > 0; else 0). Keys are taken in tiles of `tile` rows: the K tile is
// copied to local memory (loads coalesced over the channels; row stride ks odd, so the items' dot
// products, one cache row each, fall in different banks), then an online softmax (running max m and
// sum l across tiles, partial sums rescaled by exp(m_old - m_new)). V is read
// straight from global memory: items own channels, so those reads are coalesced already and a local
// copy would only add a pass. Accumulation in float32, NACC = ceil(D / LS) channels per item.
// Split keys (decode on GPUs: too few (row, head) groups to fill the device): get_group_id(2) = sp
// takes the sp-th of nsplit equal spans of the row's keys and writes its unnormalised partial sums
// with its m and l to part [T, Hq, nsplit, 2 + D] (m, l, acc); attention_combine merges them.
// Local memory (dynamic): kt [tile * ks], qp [D + tile] (the query row, then the tile's scores).
// GPU shapes (a few channels per item): unrolled, so acc stays in registers; one item per group
// (CPUs, NACC = D) keeps the loops
#if NACC <= 8
#define ACC_UNROLL _Pragma("unroll")
#else
#define ACC_UNROLL
#endif
kernel void attention_gqa(global const float *q, ulong qo, global const float *k, ulong ko,
                          global const float *v, ulong vo, global float *out, uint Hq, uint Hkv, uint D,
                          uint pos0, uint window, float scale, uint tile, uint ks, uint nsplit,
                          global float *part, local float *kt, local float *qp) {
    local float red[LS];
    const uint h = get_group_id(0), t = get_group_id(1), lane = get_local_id(0);
    const uint pos = pos0 + t, lo = window > 0 && pos >= window ? pos + 1 - window : 0;
    const uint chunk = (pos - lo + nsplit) / nsplit, jb = lo + get_group_id(2) * chunk;
    const uint je = min(pos + 1, jb + chunk);  // this split's keys jb .. je-1 (none when jb >= je)
    const ulong rs = (ulong)Hkv * D;  // floats from one cache row to the next
    global const float *kh = k + ko + (ulong)(h / (Hq / Hkv)) * D, *vh = v + vo + (ulong)(h / (Hq / Hkv)) * D;
    local float *qs = qp, *p = qp + D;
    for (uint c = lane; c < D; c += LS) qs[c] = q[qo + ((ulong)t * Hq + h) * D + c];
    float acc[NACC];
    ACC_UNROLL
    for (int a = 0; a < NACC; a++) acc[a] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (uint j0 = jb; j0 < je; j0 += tile) {
        const uint n = min(tile, je - j0);
        for (uint i = 0; i < n; i++) {
            global const float *kr = kh + (ulong)(j0 + i) * rs;
            for (uint c = lane; c < D; c += LS) kt[i * ks + c] = kr[c];
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // publishes the tile (and qs on the first pass)
        float mx = -INFINITY;
        for (uint i = lane; i < n; i += LS) {
            float s = 0.0f;
            for (uint c = 0; c < D; c++) s = fma(qs[c], kt[i * ks + c], s);
            p[i] = s * scale;
            mx = fmax(mx, p[i]);
        }
        const float mn = fmax(m, group_reduce(red, mx, 1));
        float sum = 0.0f;
        for (uint i = lane; i < n; i += LS) {
            const float e = exp(p[i] - mn);
            p[i] = e;
            sum += e;
        }
        const float alpha = exp(m - mn);  // 0 on the first tile (m = -inf)
        l = l * alpha + group_reduce(red, sum, 0);  // its barriers also publish p
        m = mn;
        ACC_UNROLL
        for (int a = 0; a < NACC; a++) {
            const uint c = lane + a * LS;
            if (c < D) {
                global const float *col = vh + (ulong)j0 * rs + c;
                float s = 0.0f;
                for (uint i = 0; i < n; i++) s = fma(p[i], col[(ulong)i * rs], s);
                acc[a] = fma(acc[a], alpha, s);
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);  // kt and p are rewritten by the next tile
    }
    global float *pp = part + (((ulong)t * Hq + h) * nsplit + get_group_id(2)) * (D + 2);
    const float inv = nsplit == 1 ? 1.0f / l : 1.0f;
    ACC_UNROLL
    for (int a = 0; a < NACC; a++) {
        const uint c = lane + a * LS;
        if (c < D) {
            if (nsplit == 1) out[((ulong)t * Hq + h) * D + c] = acc[a] * inv;
            else pp[2 + c] = acc[a];
        }
    }
    if (nsplit > 1 && lane == 0) {
        pp[0] = m;  // -inf for a split without keys: its weight below is 0
        pp[1] = l;
    }
}

// out[t, h] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the nsplit partials of part
// (attention_gqa), M = max_s m_s; a work-group of LS items per (head, row) as in attention_gqa.
kernel void attention_combine(global const float *part, global float *out, uint Hq, uint D, uint nsplit) {
    const uint h = get_group_id(0), t = get_group_id(1), lane = get_local_id(0);
    global const float *pp = part + ((ulong)t * Hq + h) * nsplit * (D + 2);
    float mx = -INFINITY, l = 0.0f;
    for (uint s = 0; s < nsplit; s++) mx = fmax(mx, pp[s * (D + 2)]);
    for (uint s = 0; s < nsplit; s++) l = fma(exp(pp[s * (D + 2)] - mx), pp[s * (D + 2) + 1], l);
    for (uint c = lane; c < D; c += LS) {
        float a = 0.0f;
        for (uint s = 0; s < nsplit; s++) a = fma(exp(pp[s * (D + 2)] - mx), pp[s * (D + 2) + 2 + c], a);
        out[((ulong)t * Hq + h) * D + c] = a / l;
    }
}
