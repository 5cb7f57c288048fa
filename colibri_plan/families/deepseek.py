"""Multi-head latent attention (MLA) families: DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash, and the DSA variants
DeepSeek-V3.2 and GLM-5 (as MLA up to ``index_topk`` context tokens).

| model_type      | model                                   | transformers config class | engine          |
|-----------------|-----------------------------------------|---------------------------|-----------------|
| deepseek_v2     | DeepSeek-V2, V2-Lite                    | ``DeepseekV2Config``      | runs            |
| deepseek_v3     | DeepSeek-V3/R1 (Kimi K2 ships this too) | ``DeepseekV3Config``      | runs            |
| kimi_k2         | Kimi K2 (DeepSeek-V3 architecture)      | (remote code)             | runs (as V3)    |
| glm4_moe_lite   | GLM-4.7-Flash                           | ``Glm4MoeLiteConfig``     | runs (as V3)    |
| deepseek_v32    | DeepSeek-V3.2 (+ DSA indexer)           | ``DeepseekV32Config``     | runs ≤ topk     |
| glm_moe_dsa     | GLM-5 / GLM-5.x (+ DSA indexer)         | ``GlmMoeDsaConfig``       | runs ≤ topk     |

DeepSeek Sparse Attention (``modeling_deepseek_v32.py``, ``modeling_glm_moe_dsa.py``): each layer's
indexer (GLM-5: the ``indexer_types`` "full" layers; "shared" ones reuse the previous choice) scores the
T visible keys and keeps ``topk = min(index_topk, T)`` of them; the attention mask is then
``causal & selected``. While T ≤ index_topk every key is selected (top-T of T, causally masked ones
included since their score is -inf but still among the T), the mask is the causal mask, and the layer is
exactly DeepSeek-V3 MLA (same projections, norms, interleaved RoPE on the rope part, softmax scale, router,
MoE). So ``read`` gives an MLA ArchConfig with ``index_topk`` and the engine runs it for contexts up to
index_topk tokens, refusing longer ones (``colibri_plan.engine.mla.check_dsa_context``). DSA always has a
q LoRA (the indexer reads q_a_layernorm's output) and always interleaves RoPE (no ``rope_interleave``).

config.json keys: ``n_routed_experts`` (E), ``num_experts_per_tok`` (k), ``moe_intermediate_size`` (I),
``n_shared_experts`` (n_shared · I wide), ``first_k_dense_replace`` (default 0) + ``moe_layer_freq``, or
``mlp_layer_types`` (GLM); ``q_lora_rank`` (null = a plain q_proj, V2-Lite), ``kv_lora_rank`` (R, the cached
latent), ``qk_nope_head_dim`` + ``qk_rope_head_dim`` (a query/key head's channels), ``v_head_dim``;
``num_nextn_predict_layers`` (MTP heads: planned, not run). Router, as the transformers modeling files:
DeepSeek-V2 (``modeling_deepseek_v2.py``) softmax, ``topk_method`` "greedy" or "group_limited_greedy"
(group max), no renormalisation, ``routed_scaling_factor``; the others (``modeling_deepseek_v3.py``,
``modeling_glm4_moe_lite.py``) sigmoid + ``e_score_correction_bias`` with group-limited top-k
(``n_group`` / ``topk_group``, top-2-sum groups; ``topk_method`` "noaux_tc"), ``norm_topk_prob``,
``routed_scaling_factor``. RoPE on the rope part only, interleaved pairs (V2 always; V3 ``rope_interleave``).

Tensors (after ``model.layers.{i}.self_attn.``): ``q_proj`` [nh·(dn+dr), H] or ``q_a_proj`` [Rq, H] +
``q_a_layernorm`` [Rq] + ``q_b_proj`` [nh·(dn+dr), Rq]; ``kv_a_proj_with_mqa`` [R+dr, H],
``kv_a_layernorm`` [R], ``kv_b_proj`` [nh·(dn+dv), R], ``o_proj`` [H, nh·dv] (canonical names in
engine/mla.py); MoE as GLM-4.x (``mlp.gate``, ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts``).
DSA indexer (``self_attn.indexer.``): ``wq_b`` [nI·dI, Rq], ``wk`` [dI, H], ``k_norm`` (LayerNorm weight and
bias) [dI], ``weights_proj`` [nI, H] (nI = ``index_n_heads``, dI = ``index_head_dim``): unused up to
index_topk tokens but needed beyond, so loaded, packed and counted as dense bytes.

Planning: KV bytes per token = (kv_lora_rank + qk_rope_head_dim) values per layer (bf16 = 2 B), one more
layer per MTP head; the DSA indexer's cache is not counted.
"""

from __future__ import annotations

from colibri_plan.families.base import (
    COMMON_LAYER_NAMES,
    ConfigReader,
    PlanGeometry,
    TensorNames,
    attention_fields,
    dense_prefix_moe_layers,
    full_attention_layers,
    shared_expert_names,
)
from colibri_plan.formats.arch import ArchConfig

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm_moe_dsa", "glm4_moe_lite")
#: model_type -> why the engine refuses it (absent = runs); the DSA variants run up to index_topk tokens
REFUSE: dict[str, str] = {}
#: model types with the DSA indexer -> transformers' default index_n_heads (index_head_dim defaults to 128)
DSA_TYPES = {"deepseek_v32": 64, "glm_moe_dsa": 32}
#: HF name after ``model.layers.{i}.`` -> canonical name (shapes in engine/mla.py)
MLA_NAMES = {
    "self_attn.q_a_proj.weight": "attn.q_a", "self_attn.q_a_proj.bias": "attn.q_a_bias",
    "self_attn.q_a_layernorm.weight": "attn.q_a_norm", "self_attn.q_b_proj.weight": "attn.q_b",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.kv_a", "self_attn.kv_a_proj_with_mqa.bias": "attn.kv_a_bias",
    "self_attn.kv_a_layernorm.weight": "attn.kv_a_norm", "self_attn.kv_b_proj.weight": "attn.kv_b",
}
TENSORS = TensorNames(layer={
    **COMMON_LAYER_NAMES, **MLA_NAMES, "mlp.gate.e_score_correction_bias": "router_bias",
    **shared_expert_names("mlp.shared_experts"),
    **{f"self_attn.indexer.{n}.weight": f"attn.indexer.{n}"
       for n in ("wq_b", "wk", "k_norm", "weights_proj")},
    "self_attn.indexer.k_norm.bias": "attn.indexer.k_norm_bias"})
#: topk_method values each router implements (None = the key is absent)
_TOPK_METHODS = {"v2": (None, "greedy", "group_limited_greedy"), "v3": (None, "noaux_tc")}


def _refuse_variants(c: ConfigReader, v2: bool, n_heads: int) -> None:
    """Record (``c.refuse``) the MLA variants the engine does not implement, naming the config field."""
    if c.model_type in DSA_TYPES:
        if not c.opt_int("q_lora_rank", 0):
            c.refuse("config field 'q_lora_rank' must be > 0 (the DSA indexer reads the query LoRA)")
    else:
        for key in ("index_topk", "index_n_heads", "index_head_dim"):
            if c.has(key):
                c.refuse(f"config field {key!r}: DeepSeek Sparse Attention (DSA indexer) is only implemented "
                         f"for {' and '.join(DSA_TYPES)}, not {c.model_type}")
                break
    method = c.cfg.get("topk_method")
    if method not in _TOPK_METHODS["v2" if v2 else "v3"]:
        c.refuse(f"config field 'topk_method' = {method!r} is not implemented for {c.model_type} (known: "
                 f"{', '.join(m for m in _TOPK_METHODS['v2' if v2 else 'v3'] if m)})")
    scoring = c.cfg.get("scoring_func")
    if scoring not in (None, "softmax" if v2 else "sigmoid"):
        c.refuse(f"config field 'scoring_func' = {scoring!r} is not implemented for {c.model_type}")
    if c.opt_int("num_key_value_heads", n_heads) != n_heads:
        c.refuse("config field 'num_key_value_heads' must equal num_attention_heads for MLA")
    if c.has("qk_head_dim") and c.cfg["qk_head_dim"] != c.cfg.get("qk_nope_head_dim", 0) + c.cfg.get(
            "qk_rope_head_dim", 0):
        c.refuse("config field 'qk_head_dim' must be qk_nope_head_dim + qk_rope_head_dim")
    if c.opt_int("qk_rope_head_dim", 0) % 2:
        c.refuse("config field 'qk_rope_head_dim' must be even (RoPE rotates channel pairs)")
    if not c.has("v_head_dim"):
        c.refuse("config has no 'v_head_dim' (the value width of a head); copy it from the published "
                 "config.json")
    if c.opt_bool("mlp_bias", False):
        c.refuse("config field 'mlp_bias' = true is not implemented")
    freq = c.cfg.get("moe_layer_freq")
    if freq not in (None, 1) and not c.has("mlp_layer_types"):
        c.refuse(f"config field 'moe_layer_freq' = {freq!r} is not implemented (transformers makes every "
                 "layer from first_k_dense_replace on a MoE layer)")


def read(c: ConfigReader) -> ArchConfig:
    """ArchConfig of an MLA config (``attention="mla"``; head_dim = nope + rope channels, every head its
    own key/value head)."""
    f = attention_fields(c)
    v2 = c.model_type == "deepseek_v2"
    _refuse_variants(c, v2, f["n_heads"])
    rope_d, nope = c.need_int("qk_rope_head_dim"), c.need_int("qk_nope_head_dim")
    head_dim = nope + rope_d
    n_shared = c.opt_int("n_shared_experts", 0)
    moe_inter = c.need_int("moe_intermediate_size")
    grouped = not v2 or c.cfg.get("topk_method") == "group_limited_greedy"
    f.update(n_kv_heads=f["n_heads"], head_dim=head_dim, partial_rotary_factor=rope_d / max(head_dim, 1))
    dsa = c.model_type in DSA_TYPES
    if dsa:  # transformers' defaults (DeepseekV32Config / GlmMoeDsaConfig)
        f.update(index_topk=c.opt_int("index_topk", 2048), index_head_dim=c.opt_int("index_head_dim", 128),
                 index_n_heads=c.opt_int("index_n_heads", DSA_TYPES[c.model_type]))
    return ArchConfig(
        **f, attention="mla", rope_interleave=True if v2 or dsa else c.opt_bool("rope_interleave", True),
        q_lora_rank=c.opt_int("q_lora_rank", 0), kv_lora_rank=c.need_int("kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_d, v_head_dim=c.opt_int("v_head_dim", nope),
        attention_bias=c.opt_bool("attention_bias", False),
        n_experts=c.need_int("n_routed_experts", "num_experts"), moe_intermediate_size=moe_inter,
        moe_layers=dense_prefix_moe_layers(c, f["n_layers"], default_k=0),
        dense_intermediate_size=c.opt_int("intermediate_size", 0),
        n_shared_experts=n_shared, shared_intermediate_size=n_shared * moe_inter,
        first_k_dense_replace=c.opt_int("first_k_dense_replace", 0), scoring="softmax" if v2 else "sigmoid",
        norm_topk_prob=False if v2 else c.opt_bool("norm_topk_prob", True),  # V2 never renormalises
        routed_scaling_factor=c.opt_float("routed_scaling_factor", 1.0),
        n_group=(c.opt_int("n_group", 1) or 1) if grouped else 1,
        topk_group=(c.opt_int("topk_group", 1) or 1) if grouped else 1,
        group_score="max" if v2 else "top2_sum", e_score_correction_bias=not v2)


def plan(c: ConfigReader, arch: ArchConfig) -> PlanGeometry:
    """MLA cache: kv_lora_rank + qk_rope_head_dim values per layer and context token (what the engine's
    :class:`~colibri_plan.engine.mla.LatentCache` holds, at float32)."""
    types = c.opt_list("layer_types")[:arch.n_layers]  # DSA configs name every layer "indexed_attention"
    kv_layers = (sum(1 for t in types if t in ("full_attention", "indexed_attention")) if types
                 else full_attention_layers(c, arch.n_layers))
    return PlanGeometry(arch, c.need_int("kv_lora_rank") + c.need_int("qk_rope_head_dim"), kv_layers,
                        c.opt_int("num_nextn_predict_layers", 0))
