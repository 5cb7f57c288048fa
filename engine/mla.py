"""Multi-head latent attention (MLA): the layer's tensors, their shapes, and the DSA context limit.

The attention itself runs in :class:`~colibri_plan.engine.trunk.Trunk` (the one decoder layer), on any
backend's device ops, weight-absorbed at every length. The maths follows ``DeepseekV3Attention`` /
``DeepseekV2Attention`` of transformers (``models/deepseek_v3/modeling_deepseek_v3.py``,
``models/deepseek_v2/modeling_deepseek_v2.py``), per token x [H] (nh heads; dn = qk_nope_head_dim,
dr = qk_rope_head_dim, dv = v_head_dim, R = kv_lora_rank):

- query: q = q_b(rmsnorm(q_a(x))) (``q_lora_rank`` > 0) or q_proj(x) (V2-Lite), [nh, dn + dr], split into
  q_nope [nh, dn] and q_rope [nh, dr];
- kv: kv_a_proj_with_mqa(x) = [latent_raw (R) | k_rope (dr)]; latent = rmsnorm(latent_raw) [R];
  k_rope [dr] is one rotary key shared by every head; RoPE (interleaved pairs for DeepSeek) rotates
  q_rope and k_rope only. The cache keeps ONLY the latent and k_rope rows;
- kv_b_proj [nh · (dn + dv), R] holds per head the key half W_uk[h] [dn, R] and the value half
  W_uv[h] [dv, R]: k_nope[h, t] = W_uk[h] latent[t], v[h, t] = W_uv[h] latent[t];
- scores s[h, t] = scale · (q_nope[h]·k_nope[h, t] + q_rope[h]·k_rope[t]) with scale =
  (dn + dr)^-0.5 · mscale² under YaRN (:func:`colibri_plan.families.rope.mla_softmax_scale`); causal
  softmax; o[h] = Σ_t p[h, t] v[h, t]; y = o_proj(o).

Absorbed: q_abs[h] = W_uk[h]ᵀ q_nope[h] [R], so q_nope[h]·k_nope[h, t] = q_abs[h]·latent[t]; the core
scores [q_rope | q_abs] against cache rows [k_rope | latent] and returns o_lat[h] = Σ_t p[h, t] latent[t];
then o[h] = W_uv[h] o_lat[h] (:func:`colibri_plan.engine.trunk_weights.absorbed_weights`).

DeepSeek Sparse Attention (DeepSeek-V3.2 ``models/deepseek_v32/modeling_deepseek_v32.py``, GLM-5
``models/glm_moe_dsa/modeling_glm_moe_dsa.py``): the indexer keeps ``min(index_topk, T)`` of the T visible
keys per query and the mask becomes causal & selected; with T ≤ index_topk it keeps all T, so the layer is
the MLA above, exactly. :func:`check_dsa_context` refuses a longer context before any work; the indexer's
tensors (``attn.indexer.*``) are loaded and shape-checked but not used.
"""

from __future__ import annotations

from colibri_plan.errors import UnsupportedError
from colibri_plan.formats.arch import ArchConfig

#: epsilon of q_a_layernorm and kv_a_layernorm: transformers builds them with the RMSNorm default
#: (``DeepseekV3RMSNorm(config.kv_lora_rank)``), not ``rms_norm_eps``
LATENT_NORM_EPS = 1e-6


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
