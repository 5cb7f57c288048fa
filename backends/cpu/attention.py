"""numba kernel of the ``cpu`` backend's ``d_attention``: causal GQA attention over a KV cache, float32.

One (query row, query head) pair per ``prange`` step; scores of the visible keys in a scratch row,
max-subtracted softmax, the weighted sum of value rows accumulated in float32 (the reference,
``device_ops.attention_ref``, is float64: the cross-backend oracle bounds the difference).
``fastmath`` is limited to reassociation and contraction so the dot products vectorise over the head
dimension while -inf and NaN keep their meaning.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from colibri_plan.backends.cpu import kernels as _kernels  # noqa: F401 (OpenMP's spin, first)


@njit(parallel=True, fastmath={"reassoc", "contract"}, cache=True)
def gqa_attention(q, k, v, n_keys, pos0, scale, window, out):
    """out [T, Hq·d] = softmax(scale · q·kᵀ) · v per query head, causal (and windowed when window > 0).

    q float32 [T, Hq, d]; k, v float32 [C, Hkv, d] with the first ``n_keys`` rows valid; query row t is
    at position pos0 + t and sees keys lo..pos0+t (lo = max(0, pos0 + t − window + 1) when window > 0);
    query head h reads kv head h // (Hq / Hkv). out float32 [T, Hq·d] written in place.
    """
    T, hq, d = q.shape
    g = hq // k.shape[1]
    for i in prange(T * hq):
        t = i // hq
        h = i - t * hq
        kv = h // g
        hi = min(pos0 + t, n_keys - 1)
        lo = max(0, pos0 + t - window + 1) if window > 0 else 0
        s = np.empty(hi - lo + 1, np.float32)
        m = np.float32(-np.inf)
        for j in range(lo, hi + 1):
            acc = np.float32(0.0)
            for c in range(d):
                acc += q[t, h, c] * k[j, kv, c]
            acc *= scale
            s[j - lo] = acc
            m = max(m, acc)
        total = np.float32(0.0)
        for j in range(s.shape[0]):
            s[j] = np.exp(s[j] - m)
            total += s[j]
        o = out[t, h * d: (h + 1) * d]
        o[:] = 0.0
        for j in range(lo, hi + 1):
            p = s[j - lo]
            for c in range(d):
                o[c] += p * v[j, kv, c]
        inv = np.float32(1.0) / total
        for c in range(d):
            o[c] *= inv
