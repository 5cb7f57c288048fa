// RMSNorm y[t, :] = x[t, :] / sqrt(mean(x[t, :]^2) + eps) * w, one work-group of LS items per token.
// Build options: -DLS=<work-items per token row> (a power of two).

kernel void rmsnorm(global const float *x, global const float *w, global float *y, uint H, float eps) {
    local float red[LS];
    uint t = get_group_id(0), lane = get_local_id(0);
    global const float *xr = x + (ulong)t * H;
    float s = 0.0f;
    for (uint c = lane; c < H; c += LS) s = fma(xr[c], xr[c], s);
    red[lane] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (uint half_ = LS / 2; half_ > 0; half_ >>= 1) {
        if (lane < half_) red[lane] += red[lane + half_];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    float inv = rsqrt(red[0] / (float)H + eps);
    for (uint c = lane; c < H; c += LS) y[(ulong)t * H + c] = xr[c] * inv * w[c];
}
