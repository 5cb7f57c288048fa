"""Architecture description of a MoE decoder: the document an expert pack stores.

:class:`ArchConfig` is everything the forward pass needs to know about a model's shape and routing; it
is plain data (``to_dict``/``from_dict`` round-trip through JSON, so an expert pack stores it). It is read
from a Hugging Face ``config.json`` by the model's family file under ``colibri_plan/families/``
(:func:`colibri_plan.families.arch_from_config`; key names as in the transformers configuration classes;
both the v5 ``rope_parameters`` dict and the older top-level ``rope_theta``/``partial_rotary_factor``/
``rope_scaling`` keys are accepted). The families the engine knows:

| family (model_type)  | attention                       | router                                   |
|----------------------|---------------------------------|------------------------------------------|
| mixtral              | GQA, RoPE                       | softmax, top-k, always renormalised      |
| qwen2_moe            | GQA, q/k/v bias, RoPE           | softmax, norm_topk_prob; shared expert    |
|                      |                                 | scaled by sigmoid(shared_expert_gate · x) |
| qwen3_moe            | GQA, RMSNorm on q/k per head    | softmax, norm_topk_prob                  |
| olmoe                | GQA, RMSNorm on the full q/k    | softmax, norm_topk_prob                  |
|                      | projections, optional clip_qkv  |                                          |
| glm4_moe             | GQA, partial RoPE, opt. q/k norm| sigmoid + e_score_correction_bias,       |
|                      |                                 | group-limited top-k, routed scaling;     |
|                      |                                 | shared experts; first_k_dense_replace    |
| deepseek_v2/v3,      | MLA (multi-head latent          | v2: softmax, group max (greedy /          |
| kimi_k2              | attention; optional q LoRA),    | group_limited_greedy); v3/kimi: as        |
|                      | interleaved RoPE on the rope    | glm4_moe (sigmoid + bias, top-2-sum       |
|                      | part, YaRN                      | groups); shared experts; dense prefix     |
| deepseek_v32,        | MLA + DSA indexer (index_topk): | as deepseek_v3                           |
| glm_moe_dsa          | runs as MLA up to index_topk    |                                          |
|                      | context tokens                  |                                          |
| gpt_oss, qwen3_next, | not implemented: planned only   | (described for planning)                 |
| phimoe, jamba, ...   |                                 |                                          |

The list of families and which of them run is :data:`colibri_plan.families.FAMILIES` /
:data:`colibri_plan.families.ENGINE_FAMILIES`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from colibri_plan.errors import FormatError, UnsupportedError
from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

#: most decoder layers / routed experts per layer / elements along one dimension a model may declare:
#: real models have at most ~100 layers, 512 experts and 2**18 vocabulary rows; the bounds stop a corrupt
#: count from sizing per-layer or per-expert tables (every reader checks them before it allocates)
MAX_LAYERS = 4096
MAX_EXPERTS = 2**20
MAX_SIZE = 2**31 - 1
#: most routed experts of a whole model (MoE layers x experts; GLM-5.2 has 19,456)
MAX_ROUTED_EXPERTS = 2**20


@dataclass(frozen=True)
class ArchConfig:
    """Shape and routing of a MoE decoder (every size in elements, not bytes).

    Attributes:
        family: HF ``model_type`` ("mixtral", "qwen3_moe", ...) or "synthetic" for generated models.
        vocab_size, hidden_size, n_layers: V, H and the number of decoder layers (MTP heads excluded).
        n_heads, n_kv_heads, head_dim: query heads, key/value heads (GQA groups) and per-head width.
        rope_theta: RoPE base. partial_rotary_factor: fraction of ``head_dim`` that is rotated (the
            first ``rotary_dim`` channels; GLM-4.x-MoE uses 0.5). rope_interleave: rotate pairs
            (x0, x1), (x2, x3) instead of the rotate_half halves (only DeepSeek layouts set it).
        rope_scaling_factor: linear position scaling (positions / factor); 1.0 = none.
        rope_type: "default", "linear" or "yarn" (inverse frequencies: colibri_plan/families/rope.py).
        yarn_factor, yarn_original_max_position, yarn_beta_fast, yarn_beta_slow, yarn_mscale,
            yarn_mscale_all_dim, yarn_attention_factor, yarn_truncate: the YaRN parameters
            (``rope_parameters`` keys factor, original_max_position_embeddings, beta_fast, beta_slow,
            mscale, mscale_all_dim, attention_factor (None = derived), truncate); unused otherwise.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias: q/k/v projections carry a bias (o may too; the loader keeps any bias it finds).
        qk_norm: None, "head" (RMSNorm over each head's ``head_dim``: Qwen3-MoE, GLM with use_qk_norm)
            or "full" (RMSNorm over the whole q / k projection: OLMoE).
        clip_qkv: clamp q, k, v to ±clip_qkv after projection (OLMoE option), or None.
        sliding_window: attention window in tokens on ``sliding_layers``, or None.
        n_experts, top_k: routed experts per MoE layer and experts chosen per token.
        moe_intermediate_size: width I of one routed expert (gate/up [I, H], down [H, I]).
        dense_intermediate_size: width of the FFN of layers without experts (0 if none).
        n_shared_experts: shared experts per MoE layer (stored fused as one MLP).
        shared_intermediate_size: total width of the fused shared-expert MLP (0 if none).
        shared_expert_gate: the shared expert output is scaled by sigmoid(w · x), w [1, H] (Qwen2-MoE).
        first_k_dense_replace: the first k layers are dense (informative; ``moe_layers`` is the truth).
        moe_layers: ids of layers with routed experts, ascending.
        scoring: "softmax" or "sigmoid" router scores.
        norm_topk_prob: renormalise the chosen top-k weights to sum to 1.
        routed_scaling_factor: multiplies the routed weights after normalisation.
        n_group, topk_group: group-limited top-k: experts form n_group equal groups, only experts in
            the topk_group best groups are eligible (1, 1 = plain top-k).
        group_score: how a group is scored: "top2_sum" (DeepSeek-V3/GLM) or "max" (DeepSeek-V2).
        e_score_correction_bias: a per-expert bias is added to the scores for choosing only (the
            weights use the unbiased scores), as in DeepSeek-V3/GLM-4.x-MoE.
        hidden_act: activation of the SwiGLU MLPs; only "silu" is implemented.
        attention: "gqa" or "mla" (multi-head latent attention: DeepSeek-V2/V3, Kimi-K2).
        q_lora_rank: MLA query compression rank (q_a_proj → q_a_layernorm → q_b_proj); 0 = a plain
            q_proj (DeepSeek-V2-Lite).
        kv_lora_rank: R, the cached kv latent per token (MLA; 0 for GQA).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA per-head widths of the key part without
            RoPE, the decoupled rotary part (shared by all heads in the cache) and the value; for MLA
            head_dim = qk_nope_head_dim + qk_rope_head_dim and n_kv_heads = n_heads.
        index_topk, index_n_heads, index_head_dim: DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the
            indexer keeps the top ``index_topk`` context tokens per query, with ``index_n_heads`` heads of
            ``index_head_dim`` channels; 0 = no indexer. Up to index_topk context tokens DSA is plain MLA.
        architecture: the HF architecture class name, when known.
    """

    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    moe_intermediate_size: int
    moe_layers: tuple[int, ...]
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    rope_interleave: bool = False
    rope_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str | None = None
    clip_qkv: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    n_shared_experts: int = 0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False
    first_k_dense_replace: int = 0
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    e_score_correction_bias: bool = False
    hidden_act: str = "silu"
    attention: str = "gqa"
    architecture: str = ""
    rope_type: str = "default"
    yarn_factor: float = 1.0
    yarn_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 0.0
    yarn_mscale_all_dim: float = 0.0
    yarn_attention_factor: float | None = None
    yarn_truncate: bool = True
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0

    def __post_init__(self):
        _check_types(self)
        for name, most in (("n_layers", MAX_LAYERS), ("n_experts", MAX_EXPERTS)):
            if getattr(self, name) > most:  # before anything is sized by them
                raise FormatError(f"invalid architecture: {name} {getattr(self, name)} is more than "
                                  f"{most:,} (no real model comes near); the file is corrupt")
        for name in _INT_FIELDS:
            if getattr(self, name) > MAX_SIZE:
                raise FormatError(f"invalid architecture: {name} {getattr(self, name)} is more than "
                                  f"{MAX_SIZE:,}; the file is corrupt")
        if len(self.moe_layers) * self.n_experts > MAX_ROUTED_EXPERTS:
            raise FormatError(f"invalid architecture: {len(self.moe_layers)} MoE layers x {self.n_experts} "
                              f"experts is more than {MAX_ROUTED_EXPERTS:,} routed experts; the file is "
                              "corrupt")
        object.__setattr__(self, "moe_layers", tuple(int(i) for i in self.moe_layers))
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        problems = []
        for name in ("rope_theta", "rope_scaling_factor", "rms_norm_eps", "routed_scaling_factor"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            problems.append(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            problems.append(f"clip_qkv must be > 0 or null, got {self.clip_qkv!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            problems.append(f"sliding_window must be >= 1 or null, got {self.sliding_window!r}")
        if any(not 0 <= i < self.n_layers for i in self.sliding_layers):
            problems.append(f"sliding_layers must be layer ids in 0..{self.n_layers - 1}")
        for name in ("dense_intermediate_size", "n_shared_experts", "shared_intermediate_size",
                     "first_k_dense_replace"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.moe_layers and (self.n_experts < 1 or self.moe_intermediate_size < 1):
            problems.append("n_experts and moe_intermediate_size must be > 0 when there are MoE layers")
        for name in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be > 0")
        if self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if any(not 0 <= i < self.n_layers for i in self.moe_layers) or list(self.moe_layers) != sorted(
                set(self.moe_layers)):
            problems.append(f"moe_layers must be distinct ascending ids in 0..{self.n_layers - 1}")
        if self.moe_layers and not 0 < self.top_k <= self.n_experts:
            problems.append(f"top_k {self.top_k} must be in 1..n_experts ({self.n_experts})")
        if self.scoring not in ("softmax", "sigmoid"):
            problems.append(f"scoring {self.scoring!r} must be 'softmax' or 'sigmoid'")
        if self.group_score not in ("top2_sum", "max"):
            problems.append(f"group_score {self.group_score!r} must be 'top2_sum' or 'max'")
        if self.n_group < 1 or self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            problems.append(f"n_group {self.n_group} must divide n_experts {self.n_experts} and "
                            f"topk_group {self.topk_group} be in 1..n_group")
        if self.qk_norm not in (None, "head", "full"):
            problems.append(f"qk_norm {self.qk_norm!r} must be None, 'head' or 'full'")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            problems.append(f"rotary_dim {self.rotary_dim} (head_dim × partial_rotary_factor) must be even")
        if self.n_layers > len(set(self.moe_layers)) and self.dense_intermediate_size <= 0:
            problems.append("layers without experts need dense_intermediate_size > 0")
        problems += _rope_mla_problems(self)
        if problems:
            raise FormatError("invalid architecture: " + "; ".join(problems))

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates: qk_rope_head_dim for MLA, else
        int(head_dim · partial_rotary_factor)."""
        if self.attention == "mla" and self.qk_rope_head_dim:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_values_per_token(self) -> int:
        """Values one layer caches per context token: kv_lora_rank + qk_rope_head_dim (MLA latent and
        rope rows) or 2 · n_kv_heads · head_dim (GQA keys and values)."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.n_kv_heads * self.head_dim

    @property
    def n_moe_layers(self) -> int:
        """Number of layers with routed experts."""
        return len(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """True when ``layer`` has routed experts (else it has a dense FFN)."""
        return layer in self.moe_layers

    def check_supported(self) -> None:
        """Raise UnsupportedError when the forward pass cannot run this architecture (an attention other
        than GQA/MLA, MLA without its widths, non-SiLU)."""
        if self.attention not in ("gqa", "mla"):
            raise UnsupportedError(f"{self.family}: attention {self.attention!r} is not supported (gqa and "
                                   "mla are)")
        if self.attention == "mla" and not self.kv_lora_rank:
            raise UnsupportedError(f"{self.family}: MLA attention without kv_lora_rank / qk_*_head_dim / "
                                   "v_head_dim (an architecture stored for planning only) cannot run; "
                                   "re-read the model's config.json")
        if self.hidden_act != "silu":
            raise UnsupportedError(f"{self.family}: activation {self.hidden_act!r} is not supported "
                                   "(only SiLU/SwiGLU experts)")

    def to_dict(self) -> dict:
        """JSON-ready dict (tuples become lists)."""
        d = asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        d["sliding_layers"] = list(self.sliding_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ArchConfig:
        """Inverse of :meth:`to_dict`.

        Raises:
            FormatError: a required field is missing or a value is invalid; unknown keys are ignored.
        """
        if not isinstance(d, dict):
            raise FormatError(f"architecture must be a JSON object, got {type(d).__name__}")
        known = {fl.name for fl in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:
            raise FormatError(f"architecture is missing fields: {e}") from None


_INT_FIELDS = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts",
               "top_k", "moe_intermediate_size", "dense_intermediate_size", "n_shared_experts",
               "shared_intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
               "yarn_original_max_position", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
               "qk_rope_head_dim", "v_head_dim", "index_topk", "index_n_heads", "index_head_dim")
_FLOAT_FIELDS = ("rope_theta", "partial_rotary_factor", "rope_scaling_factor", "rms_norm_eps",
                 "routed_scaling_factor", "yarn_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale",
                 "yarn_mscale_all_dim")
_BOOL_FIELDS = ("rope_interleave", "tie_word_embeddings", "attention_bias", "shared_expert_gate",
                "norm_topk_prob", "e_score_correction_bias", "yarn_truncate")
_STR_FIELDS = ("family", "scoring", "group_score", "hidden_act", "attention", "architecture", "rope_type")
#: MLA widths: all 0 for GQA; kv_lora_rank, qk_nope/rope_head_dim and v_head_dim > 0 for runnable MLA
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _rope_mla_problems(a: ArchConfig) -> list[str]:
    """Consistency of the RoPE type, the YaRN parameters and the MLA widths (messages name the field)."""
    problems = []
    if a.rope_type not in ("default", "linear", "yarn"):
        problems.append(f"rope_type {a.rope_type!r} must be 'default', 'linear' or 'yarn'")
    if a.rope_type == "yarn":
        if not a.yarn_factor > 0 or a.yarn_original_max_position < 1:
            problems.append("yarn_factor must be > 0 and yarn_original_max_position >= 1 for YaRN RoPE")
        if not a.yarn_beta_fast > 0 or not a.yarn_beta_slow > 0:
            problems.append("yarn_beta_fast and yarn_beta_slow must be > 0")
    if a.attention not in ("gqa", "mla"):
        problems.append(f"attention {a.attention!r} must be 'gqa' or 'mla'")
    if any(getattr(a, n) < 0 for n in _MLA_FIELDS):
        problems.append(f"{', '.join(_MLA_FIELDS)} must be >= 0")
    elif a.attention == "gqa" and any(getattr(a, n) for n in _MLA_FIELDS):
        problems.append(f"{', '.join(_MLA_FIELDS)} are MLA widths; a GQA architecture has them 0")
    elif a.attention == "mla" and a.kv_lora_rank:  # 0 = stored for planning only (check_supported)
        if min(a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim) < 1 or a.qk_rope_head_dim % 2:
            problems.append("MLA needs qk_nope_head_dim, v_head_dim > 0 and an even qk_rope_head_dim > 0")
        if a.head_dim != a.qk_nope_head_dim + a.qk_rope_head_dim:
            problems.append(f"MLA head_dim {a.head_dim} must be qk_nope_head_dim + qk_rope_head_dim "
                            f"({a.qk_nope_head_dim} + {a.qk_rope_head_dim})")
        if a.n_kv_heads != a.n_heads:
            problems.append(f"MLA n_kv_heads {a.n_kv_heads} must equal n_heads {a.n_heads}")
    dsa = (a.index_topk, a.index_n_heads, a.index_head_dim)
    if any(v < 0 for v in dsa) or (any(dsa) and (a.attention != "mla" or min(dsa) < 1)):
        problems.append("index_topk, index_n_heads and index_head_dim (the DSA indexer) must be all 0, or "
                        "all > 0 on an MLA architecture")
    return problems


def _check_types(a: ArchConfig) -> None:
    """Types and finiteness of every field (a hand-edited pack index may hold strings, NaN, 1.5 layers...).

    Raises:
        FormatError: naming the first bad field (``arch.<field>``).
    """
    d, at = a.__dict__, At("invalid architecture", path=("arch",), repr_values=True)
    for name in _INT_FIELDS:
        f.whole(d, name, at)
    for name in _FLOAT_FIELDS:
        f.number(d, name, at)
    for name in _BOOL_FIELDS:
        f.flag(d, name, at)
    for name in _STR_FIELDS:
        f.text(d, name, at)
    f.number(d, "yarn_attention_factor", at, optional=True, want="null or a finite number")
    f.text(d, "qk_norm", at, optional=True, want="null or a string")
    f.number(d, "clip_qkv", at, optional=True, want="null or a finite number")
    f.whole(d, "sliding_window", at, optional=True, want="null or a whole number")
    for name in ("moe_layers", "sliding_layers"):
        v = d[name]
        if not isinstance(v, (list, tuple)) or not all(f.is_whole(i) for i in v):
            (at / name).bad("a list of whole layer ids", v)
