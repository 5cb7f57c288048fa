"""Multi-head latent attention (MLA) with a paged latent cache and the weight-absorbed decode path.

The maths follows ``DeepseekV3Attention`` / ``DeepseekV2Attention`` of transformers
(``models/deepseek_v3/modeling_deepseek_v3.py``, ``models/deepseek_v2/modeling_deepseek_v2.py``), per
token x [H] (nh heads; dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, R = kv_lora_rank):

- query: q = q_b(rmsnorm(q_a(x))) (``q_lora_rank`` > 0) or q_proj(x) (V2-Lite), [nh, dn + dr], split into
  q_nope [nh, dn] and q_rope [nh, dr];
- kv: kv_a_proj_with_mqa(x) = [latent_raw (R) | k_rope (dr)]; latent = rmsnorm(latent_raw) [R];
  k_rope [dr] is one rotary key shared by every head; RoPE (interleaved pairs for DeepSeek) rotates
  q_rope and k_rope only. The cache keeps ONLY latent and k_rope rows (:class:`LatentCache`);
- kv_b_proj [nh · (dn + dv), R] holds per head the key half W_uk[h] [dn, R] and the value half
  W_uv[h] [dv, R]: k_nope[h, t] = W_uk[h] latent[t], v[h, t] = W_uv[h] latent[t];
- scores s[h, t] = scale · (q_nope[h]·k_nope[h, t] + q_rope[h]·k_rope[t]) with scale =
  (dn + dr)^-0.5 · mscale² under YaRN (:func:`colibri_plan.families.rope.mla_softmax_scale`); causal
  softmax; o[h] = Σ_t p[h, t] v[h, t]; y = o_proj(o).

Decode (one new token) uses the weight-absorbed form: q_abs[h] = W_uk[h]ᵀ q_nope[h] [R], so
q_nope[h]·k_nope[h, t] = q_abs[h]·latent[t]; :func:`attention_absorb_ref` (or the host backend's
``attention_absorb`` kernel) scores the latent + rope rows and returns o_lat[h] = Σ_t p[h, t] latent[t]
[R]; then o[h] = W_uv[h] o_lat[h]. Prefill uses the expanded form (k_nope and v per head).

DeepSeek Sparse Attention (DeepSeek-V3.2 ``models/deepseek_v32/modeling_deepseek_v32.py``, GLM-5
``models/glm_moe_dsa/modeling_glm_moe_dsa.py``): the indexer keeps ``min(index_topk, T)`` of the T visible
keys per query and the mask becomes causal & selected; with T ≤ index_topk it keeps all T, so the layer is
the MLA above, exactly. :func:`check_dsa_context` refuses a longer context before any work; the indexer's
tensors (``attn.indexer.*``) are loaded and shape-checked but not used.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from colibri_plan.engine.attention import HOST_KV_DTYPE, apply_rope, rmsnorm
from colibri_plan.errors import BackendUnavailableError, UnsupportedError
from colibri_plan.families.rope import mla_softmax_scale
from colibri_plan.formats.arch import ArchConfig

#: tokens per page of the latent cache
PAGE_TOKENS = 64
#: epsilon of q_a_layernorm and kv_a_layernorm: transformers builds them with the RMSNorm default
#: (``DeepseekV3RMSNorm(config.kv_lora_rank)``), not ``rms_norm_eps``
LATENT_NORM_EPS = 1e-6

AbsorbFn = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float], np.ndarray]


def attention_absorb_ref(q_abs: np.ndarray, q_rope: np.ndarray, latent: np.ndarray, k_rope: np.ndarray,
                         scale: float) -> np.ndarray:
    """Weight-absorbed MLA decode attention in float64, cast to float32 (the reference of
    ``Backend.attention_absorb``; ``backends/numpy_ref.py`` keeps an identical copy).

    Args:
        q_abs: [H, R] query with W_kv_b's key half absorbed; q_rope: [H, Dr] its rotary part.
        latent: [T, R] cached kv latent rows; k_rope: [T, Dr] cached rotary key rows (T ≥ 1). Every row
            is visible: causal masking is the caller's, by passing only the visible rows.
        scale: softmax scale.

    Returns:
        float32 [H, R]: out[h] = Σ_t softmax_t(scale · (q_abs[h]·latent[t] + q_rope[h]·k_rope[t]))
        · latent[t].
    """
    lat = np.asarray(latent, np.float64)
    s = scale * (np.asarray(q_abs, np.float64) @ lat.T + np.asarray(q_rope, np.float64)
                 @ np.asarray(k_rope, np.float64).T)  # [H, T]
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return ((p / p.sum(axis=1, keepdims=True)) @ lat).astype(np.float32)


def select_absorb(backend) -> AbsorbFn:
    """The absorbed core to use: ``backend.attention_absorb`` when the backend has it and its kernel
    answers a 1-row probe like the reference, else :func:`attention_absorb_ref`."""
    fn = getattr(backend, "attention_absorb", None) if backend is not None else None
    if fn is None:
        return attention_absorb_ref
    rng = np.random.default_rng(0)
    probe = [rng.standard_normal(s).astype(np.float32) for s in ((2, 8), (2, 4), (3, 8), (3, 4))]
    try:
        got = fn(*probe, 0.5)
    except (UnsupportedError, BackendUnavailableError, NotImplementedError):
        return attention_absorb_ref
    if not np.allclose(got, attention_absorb_ref(*probe, 0.5), rtol=1e-4, atol=1e-5):
        return attention_absorb_ref
    return fn


class LatentCache:
    """The MLA cache: per layer, the latent and rope rows of past tokens in pages of ``page_tokens``.

    A page is a pair of float32 arrays, latent [page_tokens, R] and the rotated k_rope [page_tokens, Dr],
    kept apart so a layer's rows are contiguous views (the absorbed kernel reads them without a copy while
    they fit one page; past that one gather per step). A layer grows by whole pages and never copies
    earlier pages. Bytes per token and layer: (R + Dr) · 4, the planner's MLA KV term (kv_lora_rank +
    qk_rope_head_dim values) at float32 (:data:`~colibri_plan.engine.attention.HOST_KV_DTYPE`, whose size the
    planner prices a host cache with).

    Attributes:
        length: tokens cached so far (the position of the next token).
        pages[layer]: list of float32 latent pages [page_tokens, R]; rows < length are valid.
        rope_pages[layer]: the matching float32 k_rope pages [page_tokens, Dr].
    """

    def __init__(self, n_layers: int, kv_lora_rank: int, rope_dim: int, page_tokens: int = PAGE_TOKENS):
        self.length = 0
        self.rank, self.rope_dim, self.page_tokens = int(kv_lora_rank), int(rope_dim), int(page_tokens)
        self.pages: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self.rope_pages: list[list[np.ndarray]] = [[] for _ in range(n_layers)]

    def append(self, layer: int, latent: np.ndarray, k_rope: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store latent [T, R] and k_rope [T, Dr] after the ``length`` cached tokens; return every row so far
        (latent [S, R], k_rope [S, Dr], S = length + T). ``length`` advances in :meth:`advance`."""
        pages, ropes, pt = self.pages[layer], self.rope_pages[layer], self.page_tokens
        pos, end = self.length, self.length + latent.shape[0]
        while len(pages) * pt < end:  # grow by whole pages
            pages.append(np.zeros((pt, self.rank), HOST_KV_DTYPE))
            ropes.append(np.zeros((pt, self.rope_dim), HOST_KV_DTYPE))
        done = 0
        while pos < end:
            page, off = divmod(pos, pt)
            n = min(pt - off, end - pos)
            pages[page][off: off + n] = latent[done: done + n]
            ropes[page][off: off + n] = k_rope[done: done + n]
            pos, done = pos + n, done + n
        return self.rows(layer, end)

    def rows(self, layer: int, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Latent [end, R] and k_rope [end, Dr] of the first ``end`` tokens (default ``length``): contiguous
        views of the page when they fit in one, else one gathered copy of each."""
        end = self.length if end is None else int(end)
        n_pages = -(-end // self.page_tokens)
        if n_pages == 1:
            return self.pages[layer][0][:end], self.rope_pages[layer][0][:end]
        return (np.concatenate(self.pages[layer][:n_pages])[:end],  # [end, R]
                np.concatenate(self.rope_pages[layer][:n_pages])[:end])  # [end, Dr]

    def advance(self, n: int) -> None:
        """Mark ``n`` more tokens as cached (called by the model after all layers ran)."""
        self.length += int(n)

    def nbytes(self) -> int:
        """Bytes of the valid rows of every layer: n_layers · length · (R + Dr) · 4."""
        return len(self.pages) * self.length * (self.rank + self.rope_dim) * 4

    def allocated_bytes(self) -> int:
        """Bytes of the allocated pages (the valid rows rounded up to whole pages)."""
        return sum(p.nbytes for layers in (self.pages, self.rope_pages) for layer in layers for p in layer)


def check_dsa_context(arch: ArchConfig, cached: int, new: int) -> None:
    """Refuse a DSA context beyond ``arch.index_topk`` tokens (``cached`` + ``new``), where the indexer's
    sparse selection would differ from plain MLA.

    Raises:
        UnsupportedError: one line naming index_topk (no-op for a model without the indexer).
    """
    if arch.index_topk and int(cached) + int(new) > arch.index_topk:
        n = arch.index_topk
        raise UnsupportedError(f"{arch.family}: a context of {int(cached) + int(new)} tokens: DSA sparse "
                               f"selection beyond index_topk={n} tokens is not implemented; use contexts up "
                               f"to {n}")


def _indexer_shapes(arch: ArchConfig, layer: int, present: set[str]) -> dict[str, tuple[int, ...]]:
    """The DSA indexer tensors of ``layer`` -> shapes: wq_b [nI·dI, Rq], wk [dI, H], k_norm (+ bias) [dI],
    weights_proj [nI, H]; only on layers whose checkpoint has them (GLM-5 "shared" layers have none),
    required on layer 0 (the first layer always runs its own indexer).

    Raises:
        UnsupportedError: layer 0 has no indexer tensors.
    """
    p = f"layers.{layer}.attn.indexer."
    if not any(n.startswith(p) for n in present):
        if layer == 0:
            raise UnsupportedError(f"{arch.family}: the checkpoint has no DSA indexer tensors "
                                   "(self_attn.indexer.*); they select the top index_topk="
                                   f"{arch.index_topk} tokens of longer contexts and a DSA pack keeps them")
        return {}
    ni, di = arch.index_n_heads, arch.index_head_dim
    return {p + "wq_b": (ni * di, arch.q_lora_rank), p + "wk": (di, arch.hidden_size), p + "k_norm": (di,),
            p + "k_norm_bias": (di,), p + "weights_proj": (ni, arch.hidden_size)}


def mla_dense_shapes(arch: ArchConfig, layer: int, present: set[str]) -> dict[str, tuple[int, ...]]:
    """Canonical attention tensors of one MLA layer -> shapes (biases only when ``attention_bias`` or
    present): attn.q [nh·(dn+dr), H] or attn.q_a [Rq, H] + attn.q_a_norm [Rq] + attn.q_b
    [nh·(dn+dr), Rq]; attn.kv_a [R+dr, H], attn.kv_a_norm [R], attn.kv_b [nh·(dn+dv), R], attn.o
    [H, nh·dv]; with DSA the indexer's (:func:`_indexer_shapes`; UnsupportedError when layer 0 lacks
    them)."""
    p = f"layers.{layer}.attn."
    h, nh, r, rq = arch.hidden_size, arch.n_heads, arch.kv_lora_rank, arch.q_lora_rank
    dqk, dv = arch.qk_nope_head_dim + arch.qk_rope_head_dim, arch.v_head_dim
    out = {p + "kv_a": (r + arch.qk_rope_head_dim, h), p + "kv_a_norm": (r,),
           p + "kv_b": (nh * (arch.qk_nope_head_dim + dv), r), p + "o": (h, nh * dv)}
    if rq:
        out.update({p + "q_a": (rq, h), p + "q_a_norm": (rq,), p + "q_b": (nh * dqk, rq)})
    else:
        out[p + "q"] = (nh * dqk, h)
    biases = {"q_a_bias": (rq,) if rq else None, "kv_a_bias": (r + arch.qk_rope_head_dim,), "o_bias": (h,)}
    for name, shape in biases.items():  # attention_bias: q_a, kv_a and o carry one (transformers)
        if shape and (arch.attention_bias or p + name in present):
            out[p + name] = shape
    if arch.index_topk:
        out.update(_indexer_shapes(arch, layer, present))
    return out


def _linear(x: np.ndarray, dense: dict[str, np.ndarray], name: str) -> np.ndarray:
    """x · Wᵀ (+ bias ``name + '_bias'`` when present); x [T, in], W [out, in] -> [T, out]."""
    y = x @ dense[name].T
    b = dense.get(name + "_bias")
    return y if b is None else y + b


def mla_attention(x: np.ndarray, layer: int, arch: ArchConfig, dense: dict[str, np.ndarray],
                  cache: LatentCache, inv_freq: np.ndarray, absorb: AbsorbFn = attention_absorb_ref
                  ) -> np.ndarray:
    """MLA self-attention of x float32 [T, H] (post-norm) at positions cache.length.. -> [T, H].

    Appends this call's latent and rope rows to ``cache`` (the caller advances ``cache.length``). One
    token (decode) takes the absorbed path through ``absorb`` (:func:`select_absorb`); several
    (prefill) the expanded form.
    """
    p = f"layers.{layer}.attn."
    t = x.shape[0]
    nh, dn, dr, dv, r = arch.n_heads, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim, \
        arch.kv_lora_rank
    if arch.q_lora_rank:
        qa = rmsnorm(_linear(x, dense, p + "q_a"), dense[p + "q_a_norm"], LATENT_NORM_EPS)  # [T, Rq]
        q = qa @ dense[p + "q_b"].T  # [T, nh·(dn+dr)]
    else:
        q = x @ dense[p + "q"].T  # [T, nh·(dn+dr)]
    q = q.reshape(t, nh, dn + dr).transpose(1, 0, 2)  # [nh, T, dn+dr]
    q_nope = q[..., :dn]  # [nh, T, dn]
    ckv = _linear(x, dense, p + "kv_a")  # [T, R+dr]
    latent = rmsnorm(ckv[:, :r], dense[p + "kv_a_norm"], LATENT_NORM_EPS)  # [T, R]
    positions = np.arange(cache.length, cache.length + t)
    q_rope = apply_rope(np.ascontiguousarray(q[..., dn:]), positions, inv_freq, arch)  # [nh, T, dr]
    k_rope = apply_rope(ckv[None, :, r:], positions, inv_freq, arch)[0]  # [T, dr]: one key for all heads
    lat_all, kr_all = cache.append(layer, latent, k_rope)  # [S, R], [S, dr], S = start + T
    w_kvb = dense[p + "kv_b"].reshape(nh, dn + dv, r)
    w_uk, w_uv = w_kvb[:, :dn], w_kvb[:, dn:]  # [nh, dn, R], [nh, dv, R]
    scale = mla_softmax_scale(arch)
    if t == 1:  # absorbed decode: score the latent rows directly
        q_abs = np.matmul(q_nope[:, 0, None, :], w_uk)[:, 0]  # [nh, 1, dn] · [nh, dn, R] -> [nh, R]
        o_lat = absorb(np.ascontiguousarray(q_abs, np.float32), np.ascontiguousarray(q_rope[:, 0]),
                       lat_all, kr_all, scale)  # cache rows are contiguous float32 views: [nh, R]
        o = np.matmul(w_uv, o_lat[:, :, None])[..., 0]  # [nh, dv, R] · [nh, R, 1] -> [nh, dv]
        o = o.reshape(1, nh * dv)  # [1, nh·dv]
    else:  # expanded prefill: per-head keys and values from the latent rows
        k_nope = np.matmul(lat_all[None], w_uk.transpose(0, 2, 1))  # [1, S, R] · [nh, R, dn] -> [nh, S, dn]
        v = np.matmul(lat_all[None], w_uv.transpose(0, 2, 1))  # [nh, S, dv]
        scores = (np.matmul(q_nope, k_nope.transpose(0, 2, 1))  # [nh, T, S]
                  + np.matmul(q_rope, kr_all.T[None])) * np.float32(scale)  # + [nh, T, dr]·[dr, S]
        allowed = np.arange(lat_all.shape[0])[None, :] <= positions[:, None]  # causal [T, S]
        scores = np.where(allowed, scores, -np.inf)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)  # softmax over keys, float32
        o = np.matmul(probs, v).transpose(1, 0, 2).reshape(t, nh * dv)  # [nh, T, dv] -> [T, nh·dv]
    return _linear(o.astype(np.float32, copy=False), dense, p + "o").astype(np.float32, copy=False)
