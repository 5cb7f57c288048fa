"""What the trunk holds on its device: the tensors it uploads, MLA's absorbed per-head weights, their bytes.

The trunk (:mod:`colibri_plan.engine.trunk`) uploads, once at open, on its backend (a GPU, or a host
backend, where an upload keeps the arrays in RAM):

- matrices with ``backend.upload``: GQA attention q/k/v/o; MLA q (or q_a, q_b), kv_a split into its latent
  rows [R, H] and rope rows [dr, H] (so the latent is normed and the rope key rotated apart, no slicing on
  the device), o; shared experts, dense FFN layers, the LM head. A pack's quantized
  :class:`~colibri_plan.engine.dense_quant.QuantLinear` goes up as its QuantTensor, a float array as an f32
  QuantTensor;
- vectors with ``d_put``: norms, biases (kv_a's split like its rows);
- MLA's absorbed per-head projections (:func:`absorbed_weights`, float32 DArrays for ``d_head_matmul``);
- a RoPE table of the planned context in whole 64-token pages (``rotary_dim / 2`` (cos, sin) pairs).

The embedding, routers, router biases and Qwen2-MoE's shared-expert gate stay on the host (gathered, or
read by the host's routing).
"""

from __future__ import annotations

import numpy as np

from colibri_plan.engine.dense_quant import QuantLinear
from colibri_plan.engine.kv_device import device_kv_bytes, latent_kv_bytes
from colibri_plan.formats.plan_trunk import PAGE_TOKENS

__all__ = ["absorbed_weights", "rope_positions", "trunk_dense_bytes", "trunk_kv_bytes", "trunk_tensors"]

_GQA_ATTN = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm")
_MLA_ATTN = ("q", "q_a", "q_a_bias", "q_a_norm", "q_b", "kv_a_norm", "o", "o_bias")


def trunk_tensors(arch, dense: dict) -> list[tuple[str, np.ndarray | QuantLinear, bool]]:
    """(key on the device, tensor, is a matrix) of every tensor the trunk uploads as stored (MLA's
    absorbed weights aside: :func:`absorbed_weights`); kv_a is split into ``attn.kv_a.latent`` [R, H] and
    ``attn.kv_a.rope`` [dr, H] (its bias likewise, ``..._bias``)."""
    out = []
    mla = arch.attention == "mla"
    for i in range(arch.n_layers):
        p = f"layers.{i}."
        names = [p + "attn_norm", p + "ffn_norm"]
        names += [p + "attn." + n for n in (_MLA_ATTN if mla else _GQA_ATTN)]
        names += [p + f"{g}.{n}" for g in ("shared", "ffn") for n in ("gate", "up", "down")]
        out += [(n, dense[n], dense[n].ndim == 2) for n in names if n in dense]
        if mla:
            r = arch.kv_lora_rank
            kv_a = np.asarray(dense[p + "attn.kv_a"], np.float32)  # [R + dr, H]: latent rows, then rope rows
            out += [(p + "attn.kv_a.latent", kv_a[:r], True), (p + "attn.kv_a.rope", kv_a[r:], True)]
            bias = dense.get(p + "attn.kv_a_bias")
            if bias is not None:
                b = np.asarray(bias, np.float32)
                out += [(p + "attn.kv_a.latent_bias", b[:r], False),
                        (p + "attn.kv_a.rope_bias", b[r:], False)]
    out.append(("final_norm", dense["final_norm"], False))
    out.append(("lm_head", dense["embed" if arch.tie_word_embeddings else "lm_head"], True))
    return out


def absorbed_weights(arch, kv_b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MLA's kv_b [nh·(dn + dv), R] as the two per-head matrices of the absorbed core (float32).

    - absorb_q [nh, dr + R, dn + dr]: maps a head's query [q_nope | q_rope] to [q_rope | W_uk[h]ᵀ q_nope],
      an identity block passing the rope part (rotated after) and the key half of kv_b absorbed, so the
      query scores a cache row [k_rope | latent] in one dot product;
    - absorb_o [nh, dv, dr + R]: maps the attention output over cache rows [· | o_lat] to W_uv[h] o_lat
      (zero columns over the rope part).

    The zero and identity entries are exact: y = W·x adds only x's own value or 0·finite terms.
    Source: the absorbed decode of transformers' ``DeepseekV3Attention`` reordered (docs/engine.md).
    """
    nh, dn, dr, dv, r = (arch.n_heads, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim,
                         arch.kv_lora_rank)
    w = np.asarray(kv_b, np.float32).reshape(nh, dn + dv, r)
    aq = np.zeros((nh, dr + r, dn + dr), np.float32)
    aq[:, np.arange(dr), dn + np.arange(dr)] = 1.0  # rope channels pass through
    aq[:, dr:, :dn] = w[:, :dn].transpose(0, 2, 1)  # W_uk[h]ᵀ [R, dn]
    ao = np.zeros((nh, dv, dr + r), np.float32)
    ao[:, :, dr:] = w[:, dn:]  # W_uv[h] [dv, R]
    return aq, ao


def rope_positions(tokens: int) -> int:
    """Rows of the RoPE table for ``tokens`` positions: whole 64-token pages, at least one."""
    return max(1, -(-int(tokens) // PAGE_TOKENS)) * PAGE_TOKENS


def trunk_dense_bytes(arch, dense: dict, context_tokens: int = 0) -> int:
    """Device bytes the trunk uploads for ``dense`` (matrices in their stored format — a float array at
    f32 —, norms and biases at f32, MLA's absorbed weights at f32, and the RoPE table of
    ``context_tokens`` positions in whole 64-token pages)."""
    total = 0
    for _, v, _ in trunk_tensors(arch, dense):
        total += v.nbytes if isinstance(v, QuantLinear) else 4 * int(np.prod(v.shape))
    if arch.attention == "mla":
        nh, dn, dr, dv, r = (arch.n_heads, arch.qk_nope_head_dim, arch.qk_rope_head_dim, arch.v_head_dim,
                             arch.kv_lora_rank)
        total += arch.n_layers * 4 * nh * (dr + r) * (dn + dr + dv)  # absorb_q + absorb_o
    if arch.rotary_dim:
        total += rope_positions(context_tokens) * arch.rotary_dim * 4  # [P, rd/2, 2] float32
    return total


def trunk_kv_bytes(arch, context_tokens: int) -> int:
    """Device bytes of the cache the trunk reserves for ``context_tokens``: K and V (GQA), or the latent
    rows [k_rope | latent] (MLA), float32 in whole 64-token pages."""
    if arch.attention == "mla":
        return latent_kv_bytes(arch.n_layers, arch.qk_rope_head_dim, arch.kv_lora_rank, context_tokens)
    return device_kv_bytes(arch.n_layers, arch.n_kv_heads, arch.head_dim, context_tokens)
