"""GQA self-attention with RoPE and a KV cache (numpy float32 reference path).

Follows the transformers eager attention of the supported families: q/k/v projections (optional bias),
optional q/k RMSNorm (per head, or over the whole projection for OLMoE), optional clip_qkv, RoPE on the
first ``rotary_dim`` channels of each head (rotate_half layout: channel i pairs with i + rotary_dim/2;
or interleaved pairs (2i, 2i+1) for DeepSeek layouts), causal softmax(q·kᵀ/√d) in float32, query head
h reads key/value head h // (n_heads / n_kv_heads), then the output projection.
"""

from __future__ import annotations

import numpy as np

from colibri_plan.families.rope import attention_factor, inv_freq
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.formats.plan_trunk import HOST_KV_BYTES_PER_VALUE

#: dtype of the host KV caches (this KVCache, mla.LatentCache): built from the constant the planner
#: prices a CPU trunk's cache with, so the two cannot drift (float32)
HOST_KV_DTYPE = np.dtype(f"float{8 * HOST_KV_BYTES_PER_VALUE}")


def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x²) + eps) · weight, float32 (any leading shape)."""
    # Σ x² / n as np.mean computes it (same pairwise sum; its float64 division by the count rounds to
    # the same float32 as this one), without np.mean's ~10 µs of Python per call (70 calls a token)
    var = np.add.reduce(x * x, axis=-1, dtype=np.float32, keepdims=True) / np.float32(x.shape[-1])
    return (x / np.sqrt(var + np.float32(eps))) * weight


class KVCache:
    """Keys and values of past tokens, per layer.

    Attributes:
        length: tokens cached so far (the position of the next token).
        k[layer], v[layer]: :data:`HOST_KV_DTYPE` (float32) [n_kv_heads, capacity, head_dim]; rows <
            length are valid (keys are stored after RoPE). Capacity doubles when full.
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int = 256):
        cap = max(1, int(capacity))
        self.length = 0
        self.k = [np.zeros((n_kv_heads, cap, head_dim), HOST_KV_DTYPE) for _ in range(n_layers)]
        self.v = [np.zeros((n_kv_heads, cap, head_dim), HOST_KV_DTYPE) for _ in range(n_layers)]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v [n_kv, T, d] after the ``length`` cached tokens; return all keys/values so far.

        ``length`` itself advances in :meth:`advance` once every layer has appended.
        """
        end = self.length + k.shape[1]
        if end > self.k[layer].shape[1]:
            cap = max(end, 2 * self.k[layer].shape[1])
            for store in (self.k, self.v):
                grown = np.zeros((k.shape[0], cap, k.shape[2]), HOST_KV_DTYPE)
                grown[:, : self.length] = store[layer][:, : self.length]
                store[layer] = grown
        self.k[layer][:, self.length: end] = k
        self.v[layer][:, self.length: end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as cached (called by the model after all layers ran)."""
        self.length += int(n)

    def nbytes(self) -> int:
        """Bytes held by the valid rows of every layer."""
        return sum(2 * k.shape[0] * self.length * k.shape[2] * 4 for k in self.k)


def rope_inv_freq(arch: ArchConfig) -> np.ndarray:
    """Inverse frequencies float32 [rotary_dim / 2]: 1 / theta^(2i / rotary_dim) (transformers' default),
    or YaRN's blend (:func:`colibri_plan.families.rope.inv_freq`)."""
    return inv_freq(arch)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray, arch: ArchConfig
                 ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [T, rotary_dim / 2] at ``positions`` [T], with YaRN's attention factor."""
    pos = positions.astype(np.float32) / np.float32(arch.rope_scaling_factor)
    freqs = pos[:, None] * inv_freq[None, :]  # [T, rd/2]
    cos, sin = np.cos(freqs), np.sin(freqs)
    af = attention_factor(arch)
    if af != 1.0:
        cos, sin = cos * np.float32(af), sin * np.float32(af)
    return cos, sin


def apply_rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, arch: ArchConfig,
               cos_sin: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Rotate the first ``rotary_dim`` channels of x [heads, T, d] at ``positions`` [T]; cos and sin carry
    YaRN's attention factor (1 otherwise), as transformers' rotary embeddings do. ``cos_sin``: those of
    :func:`rope_cos_sin` for the same positions (q and k share them), None = computed here."""
    rd = arch.rotary_dim
    if rd == 0:
        return x
    cos, sin = rope_cos_sin(positions, inv_freq, arch) if cos_sin is None else cos_sin
    rot, rest = x[..., :rd], x[..., rd:]
    if arch.rope_interleave:  # pairs (2i, 2i+1) share frequency i
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = np.empty_like(rot)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = b * cos + a * sin
    else:  # rotate_half: channel i pairs with i + rd/2
        half = rd // 2
        a, b = rot[..., :half], rot[..., half:]
        out = np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return np.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def stacked_qk_norm(arch: ArchConfig, dense: dict[str, np.ndarray], layer: int) -> np.ndarray | None:
    """float32 [nh + nkv, 1, d]: layer's per-head q_norm weight for each query head, then k_norm for each
    key head (what :func:`attention` takes as ``qk_norm_w``); None unless ``arch.qk_norm == "head"``."""
    if arch.qk_norm != "head":
        return None
    p, d = f"layers.{layer}.attn.", arch.head_dim
    qn, kn = (np.asarray(dense[p + n], np.float32) for n in ("q_norm", "k_norm"))
    return np.concatenate([np.broadcast_to(qn, (arch.n_heads, d)),
                           np.broadcast_to(kn, (arch.n_kv_heads, d))]).reshape(-1, 1, d)


def attention(x: np.ndarray, layer: int, arch: ArchConfig, dense: dict[str, np.ndarray], cache: KVCache,
              inv_freq: np.ndarray, cos_sin: tuple[np.ndarray, np.ndarray] | None = None,
              qk_norm_w: np.ndarray | None = None, norm=rmsnorm) -> np.ndarray:
    """Self-attention of x float32 [T, H] (post-norm) at positions cache.length.. -> [T, H].

    Appends this call's keys/values to ``cache`` (the caller advances ``cache.length``). ``cos_sin``:
    :func:`rope_cos_sin` of those positions (the same for every layer of a forward call), None = here.
    ``qk_norm_w``: :func:`stacked_qk_norm` of this layer; given, the q and k heads are normed and rotated
    as one array (each head's row as alone: the same numbers in half the numpy calls). ``norm``: the
    RMSNorm of 2-D rows to use at one token (:func:`rmsnorm` or a host backend's ``rmsnorm_rows``,
    the same bits).
    """
    p = f"layers.{layer}.attn."
    t = x.shape[0]
    nh, nkv, d = arch.n_heads, arch.n_kv_heads, arch.head_dim
    q, k, v = (x @ dense[p + n].T for n in "qkv")  # [T, nh·d], [T, nkv·d], [T, nkv·d]
    q, k, v = (m + dense[p + n + "_bias"] if p + n + "_bias" in dense else m
               for m, n in zip((q, k, v), "qkv"))
    if arch.qk_norm == "full":  # OLMoE: one RMSNorm over the whole projection
        q = rmsnorm(q, dense[p + "q_norm"], arch.rms_norm_eps)
        k = rmsnorm(k, dense[p + "k_norm"], arch.rms_norm_eps)
    if arch.clip_qkv is not None:
        c = np.float32(arch.clip_qkv)
        q, k, v = np.clip(q, -c, c), np.clip(k, -c, c), np.clip(v, -c, c)
    v = v.reshape(t, nkv, d).transpose(1, 0, 2)  # [nkv, T, d]
    start = cache.length
    positions = np.arange(start, start + t)
    cs = cos_sin
    if cs is None and arch.rotary_dim:
        cs = rope_cos_sin(positions, inv_freq, arch)  # shared by q and k
    if qk_norm_w is not None and arch.qk_norm == "head":  # q and k heads as one [nh + nkv, T, d] array
        qk = np.concatenate([q.reshape(t, nh, d), k.reshape(t, nkv, d)], axis=1).transpose(1, 0, 2)
        r = nh + nkv
        qk = (norm(qk.reshape(r, d), qk_norm_w.reshape(r, d), arch.rms_norm_eps).reshape(r, 1, d) if t == 1
              else rmsnorm(qk, qk_norm_w, arch.rms_norm_eps))  # [nh + nkv, T, d]
        qk = apply_rope(qk, positions, inv_freq, arch, cs)
        q, k = qk[:nh], qk[nh:]  # [nh, T, d], [nkv, T, d]
    else:
        q = q.reshape(t, nh, d).transpose(1, 0, 2)  # [nh, T, d]
        k = k.reshape(t, nkv, d).transpose(1, 0, 2)  # [nkv, T, d]
        if arch.qk_norm == "head":
            q = rmsnorm(q, dense[p + "q_norm"], arch.rms_norm_eps)
            k = rmsnorm(k, dense[p + "k_norm"], arch.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq, arch, cs)
        k = apply_rope(k, positions, inv_freq, arch, cs)
    keys, values = cache.append(layer, k, v)  # [nkv, S, d] with S = start + T
    s = keys.shape[1]
    g = nh // nkv
    qg = q.reshape(nkv, g, t, d)  # query head h uses kv head h // g
    scores = np.matmul(qg, keys[:, None].transpose(0, 1, 3, 2)) * np.float32(d ** -0.5)  # [nkv, g, T, S]
    window = arch.sliding_window and layer in arch.sliding_layers
    if t > 1 or window:  # one new token without a window sees every key: no mask to apply
        kpos = np.arange(s)[None, :]
        allowed = kpos <= positions[:, None]  # causal [T, S]
        if window:
            allowed &= kpos > positions[:, None] - arch.sliding_window
        scores = np.where(allowed, scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)  # softmax over keys, float32
    out = np.matmul(probs, values[:, None])  # [nkv, g, T, d]
    out = out.reshape(nh, t, d).transpose(1, 0, 2).reshape(t, nh * d)  # [T, nh·d]
    y = out @ dense[p + "o"].T
    if p + "o_bias" in dense:
        y = y + dense[p + "o_bias"]
    return y.astype(np.float32, copy=False)
