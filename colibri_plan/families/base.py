"""Shared typed readers of a Hugging Face ``config.json``, and what every family file returns.

A family file (``colibri_plan/families/<family>.py``) reads its config through :class:`ConfigReader`
(required integers raise a :class:`~colibri_plan.errors.FormatError` naming the key), builds the
engine's :class:`~colibri_plan.formats.arch.ArchConfig` and, for the planner, a :class:`PlanGeometry`
(the ArchConfig plus what a ModelSpec needs beyond it: KV-cache values per context token, MTP heads,
expert biases). Key names are those of the published checkpoints' config.json, which are the attribute
names of the transformers configuration classes (``MixtralConfig``, ``Qwen2MoeConfig``, ...). Library
defaults are used only where transformers' modeling code would use them for a missing key.

Also here: the HF tensor names every family shares (:data:`COMMON_LAYER_NAMES`) and the
:class:`TensorNames` record a runnable family exports for the checkpoint importer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from colibri_plan.errors import FormatError
from colibri_plan.families.rope import Rope, rope  # noqa: F401  (RoPE reading lives in rope.py)
from colibri_plan.formats.arch import MAX_EXPERTS, MAX_LAYERS, MAX_SIZE, ArchConfig

#: config keys that hold the number of routed experts E, by family: Mixtral/gpt-oss/PhiMoE
#: ``num_local_experts``; Qwen2/3-MoE, OLMoE, Jamba ``num_experts``; DeepSeek, GLM, Kimi ``n_routed_experts``
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_MISSING = object()
#: upper bounds of the integer fields that size per-layer / per-expert tables (others: MAX_SIZE)
_INT_LIMITS = {"num_hidden_layers": MAX_LAYERS, "num_nextn_predict_layers": 64,
               **{k: MAX_EXPERTS for k in EXPERT_KEYS}}


def text_config(config: dict) -> dict:
    """The language-model part of a config: ``text_config`` of multimodal wrappers (Qwen3.5-MoE, Kimi
    K2.5) when it holds a routed-expert key, else ``config`` itself."""
    tc = config.get("text_config")
    if isinstance(tc, dict) and any(k in tc for k in EXPERT_KEYS):
        return tc
    return config


class ConfigReader:
    """Typed access to one config dict; every error names ``where`` (a path or a catalogue entry).

    Attributes:
        cfg: the (language-model) config dict.
        where: prefix of every error message.
        refusals: reasons the engine cannot run this config (collected by :meth:`refuse`; planning
            ignores them, :func:`colibri_plan.families.arch_from_config` raises the first).
    """

    def __init__(self, cfg: dict, where: str = "config.json"):
        if not isinstance(cfg, dict):
            raise FormatError(f"{where} must hold a JSON object, got {type(cfg).__name__}")
        self.cfg, self.where = cfg, where
        self.refusals: list[str] = []
        self._check_structure()

    def _check_structure(self) -> None:
        """Types of the structured keys every family reads, checked before any family code runs:
        ``architectures`` a list of strings, ``rope_parameters`` / ``rope_scaling`` objects (of objects,
        per layer type) whose ``rope_type`` / ``type`` are strings and whose ``rope_theta`` / ``factor`` /
        ``partial_rotary_factor`` are finite numbers, as are the top-level ``rope_theta`` and
        ``partial_rotary_factor``.

        Raises:
            FormatError: naming the key and the value.
        """
        _ = self.architecture
        for key in ("rope_theta", "partial_rotary_factor"):
            self.opt_float(key, 0.0)
        for d, where in [(self.cfg, self.where)] + [(self.cfg.get(k), f"{self.where}: {k}")
                                                    for k in ("rope_parameters", "rope_scaling")]:
            if isinstance(d, dict) and "rope_theta" in d and d["rope_theta"] is None:
                raise FormatError(f"{where}: 'rope_theta' is null; give the RoPE base as a number or leave "
                                  "the key out")
        for key in ("rope_parameters", "rope_scaling"):
            d = self.opt_dict(key)
            subs = list(d.values()) if d and all(isinstance(v, dict) for v in d.values()) else [d]
            for sub in subs:
                r = ConfigReader.__new__(ConfigReader)
                r.cfg, r.where, r.refusals = sub, f"{self.where}: {key}", []
                for k in ("rope_theta", "factor", "partial_rotary_factor"):
                    r.opt_float(k, 0.0)
                for k in ("rope_type", "type"):
                    r.opt_str(k, "")

    @property
    def model_type(self) -> str:
        """``model_type`` (``PretrainedConfig.model_type``), e.g. "mixtral"."""
        return str(self.cfg.get("model_type") or "")

    @property
    def architecture(self) -> str:
        """First entry of ``architectures`` (e.g. "MixtralForCausalLM"), or "".

        Raises:
            FormatError: ``architectures`` is not a list of strings.
        """
        archs = self.opt_list("architectures")
        if not all(isinstance(a, str) for a in archs):
            raise FormatError(f"{self.where}: config field 'architectures' must be a list of class names "
                              f"(strings), got {str(archs)[:80]}")
        return archs[0] if archs else ""

    def has(self, key: str) -> bool:
        """The key is present and not null."""
        return self.cfg.get(key) is not None

    def need_int(self, *keys: str) -> int:
        """The first of ``keys`` that is present, as a non-negative integer.

        Raises:
            FormatError: none is present (naming them all), or the value is not a non-negative integer.
        """
        for key in keys:
            if self.has(key):
                return self._int(key)
        names = " / ".join(repr(k) for k in keys)
        raise FormatError(f"{self.where}: config has no {names}; it is needed to size and run the model "
                          "(copy it from the model's published config.json)")

    def opt_int(self, key: str, default: int) -> int:
        """``key`` as a non-negative integer, or ``default`` when absent or null."""
        return self._int(key) if self.has(key) else default

    def _int(self, key: str) -> int:
        v = self.cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise FormatError(f"{self.where}: config field {key!r} must be a non-negative integer, "
                              f"got {str(v)[:80]}")
        most = _INT_LIMITS.get(key, MAX_SIZE)
        if v > most:  # a corrupt count must not size per-layer / per-expert tables
            raise FormatError(f"{self.where}: config field {key!r} is {v}, more than {most:,} (no real model "
                              "comes near); fix config.json")
        return v

    def opt_float(self, key: str, default: float) -> float:
        """``key`` as a finite number, or ``default`` when absent or null."""
        if not self.has(key):
            return default
        v = self.cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise FormatError(f"{self.where}: config field {key!r} must be a finite number, "
                              f"got {str(v)[:80]}")
        return float(v)

    def opt_bool(self, key: str, default: bool) -> bool:
        """``key`` as true/false (0/1 accepted), or ``default`` when absent or null."""
        if not self.has(key):
            return default
        v = self.cfg[key]
        if v not in (True, False):
            raise FormatError(f"{self.where}: config field {key!r} must be true or false, got {v!r}")
        return bool(v)

    def opt_list(self, key: str) -> list:
        """``key`` as a list of plain values (numbers, strings, true/false, null; [] when absent or null).

        Raises:
            FormatError: not a list, or an entry is itself a list or an object.
        """
        v = self.cfg.get(key)
        if v is None:
            return []
        if not isinstance(v, list) or any(isinstance(x, (list, dict)) for x in v):
            raise FormatError(f"{self.where}: config field {key!r} must be a list of plain values, "
                              f"got {str(v)[:80]}")
        return v

    def opt_dict(self, key: str) -> dict:
        """``key`` as an object ({} when absent or null).

        Raises:
            FormatError: present and not an object.
        """
        v = self.cfg.get(key)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise FormatError(f"{self.where}: config field {key!r} must be an object, got {str(v)[:80]}")
        return v

    def opt_str(self, key: str, default: str) -> str:
        """``key`` as a string, or ``default`` when absent or null.

        Raises:
            FormatError: present and not a string.
        """
        v = self.cfg.get(key)
        if v is None:
            return default
        if not isinstance(v, str):
            raise FormatError(f"{self.where}: config field {key!r} must be a string, got {str(v)[:80]}")
        return v

    def refuse(self, reason: str) -> None:
        """Record that the engine's forward pass cannot run this config (planning still works)."""
        self.refusals.append(f"{self.model_type}: {reason}")


# ---- attention and RoPE --------------------------------------------------------------------------

def attention_fields(c: ConfigReader, default_prf: float = 1.0,
                     top_k_keys: tuple[str, ...] = ("num_experts_per_tok",)) -> dict:
    """ArchConfig fields every family reads the same way: family, architecture, vocab_size (V),
    hidden_size (H), n_layers (``num_hidden_layers``), n_heads (``num_attention_heads``), n_kv_heads
    (``num_key_value_heads``, default n_heads), head_dim (``head_dim``, default H / n_heads), the RoPE
    fields (:func:`rope`; ``default_prf`` when the config gives no partial_rotary_factor),
    rms_norm_eps, tie_word_embeddings, hidden_act, top_k (the first of ``top_k_keys``) and
    max_position_embeddings (0 when the config has none)."""
    hidden = c.need_int("hidden_size")
    n_heads = c.need_int("num_attention_heads")
    r = rope(c)
    return dict(
        family=c.model_type, architecture=c.architecture, vocab_size=c.need_int("vocab_size"),
        hidden_size=hidden, n_layers=c.need_int("num_hidden_layers"), n_heads=n_heads,
        n_kv_heads=c.opt_int("num_key_value_heads", n_heads),
        head_dim=c.opt_int("head_dim", hidden // max(n_heads, 1)), **r.arch_fields(),
        partial_rotary_factor=default_prf if r.partial_rotary_factor is None else r.partial_rotary_factor,
        rms_norm_eps=c.opt_float("rms_norm_eps", 1e-6),
        tie_word_embeddings=c.opt_bool("tie_word_embeddings", False),
        hidden_act=str(c.cfg.get("hidden_act") or "silu"), top_k=c.need_int(*top_k_keys),
        max_position_embeddings=c.opt_int("max_position_embeddings", 0))


def sliding_layers(c: ConfigReader, n_layers: int) -> tuple[int, ...]:
    """Layer ids whose ``layer_types`` entry is "sliding_attention"."""
    return tuple(i for i, t in enumerate(c.opt_list("layer_types")[:n_layers]) if t == "sliding_attention")


def full_attention_layers(c: ConfigReader, n_layers: int) -> int:
    """Layers whose KV cache grows with every context token: the "full_attention" entries of
    ``layer_types``, else n_layers // ``full_attention_interval`` (Qwen3-Next/3.5 hybrids), else all.
    Sliding-window and linear-attention layers hold a fixed-size state."""
    types = c.opt_list("layer_types")
    if types:
        return sum(1 for t in types[:n_layers] if t == "full_attention")
    interval = c.opt_int("full_attention_interval", 0)
    return n_layers // interval if interval else n_layers


# ---- which layers hold routed experts ------------------------------------------------------------

def qwen_moe_layers(c: ConfigReader, n_layers: int) -> tuple[int, ...]:
    """Qwen2/3-MoE rule: layer i has experts unless listed in ``mlp_only_layers``, and when
    (i + 1) % ``decoder_sparse_step`` == 0 (step default 1)."""
    dense = set(c.opt_list("mlp_only_layers"))
    step = c.opt_int("decoder_sparse_step", 1) or 1
    return tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)


def dense_prefix_moe_layers(c: ConfigReader, n_layers: int, default_k: int) -> tuple[int, ...]:
    """DeepSeek/GLM rule: ``mlp_layer_types`` ("dense"/"sparse" per layer; newer GLM) when given, else
    layers >= ``first_k_dense_replace`` (default ``default_k``) with i % ``moe_layer_freq`` == 0; a
    list-valued ``moe_layer_freq`` (Megatron style, e.g. [0]*3 + [1]*58) marks each layer directly."""
    types = c.opt_list("mlp_layer_types")
    if types:
        return tuple(i for i in range(min(n_layers, len(types)))
                     if str(types[i]).lower() in ("sparse", "moe"))
    k = c.opt_int("first_k_dense_replace", default_k)
    freq = c.cfg.get("moe_layer_freq") or 1
    if isinstance(freq, list):
        return tuple(i for i in range(k, min(n_layers, len(freq))) if freq[i])
    freq = c.opt_int("moe_layer_freq", 1) or 1
    return tuple(i for i in range(k, n_layers) if i % freq == 0)


# ---- what the planner needs beyond the ArchConfig ------------------------------------------------

@dataclass(frozen=True)
class PlanGeometry:
    """Planning geometry of a config: the ArchConfig plus the family's planning hooks.

    Attributes:
        arch: shape and routing (MTP heads excluded).
        kv_values_per_layer: cached values per context token per attention layer: 2 · n_kv_heads ·
            head_dim (GQA) or kv_lora_rank + qk_rope_head_dim (MLA latent).
        kv_layers: decoder layers whose cache grows per token (:func:`full_attention_layers`).
        mtp_layers: MTP heads the config declares (``num_nextn_predict_layers``); each is one more
            attention layer and, when its experts are counted, one more MoE row.
        expert_bias: routed experts carry biases (gpt-oss): 2·I + H values per expert.
    """

    arch: ArchConfig
    kv_values_per_layer: int
    kv_layers: int
    mtp_layers: int = 0
    expert_bias: bool = False

    def kv_bytes_per_token(self, mtp_layers: int = 0, bytes_per_value: int = 2) -> int:
        """KV-cache bytes per context token (``bytes_per_value`` 2 = a bf16 cache), MTP heads included."""
        return (self.kv_layers + int(mtp_layers)) * self.kv_values_per_layer * int(bytes_per_value)

    def spec_fields(self, mtp_rows: tuple[int, ...] = (), bytes_per_value: int = 2) -> dict:
        """The geometry fields of a :class:`~colibri_plan.formats.model_spec.ModelSpec`: family,
        n_layers, moe_layers (decoder rows + ``mtp_rows``), n_experts, top_k, n_shared_experts,
        hidden_size, moe_intermediate_size, shared_intermediate_size, vocab_size, expert_bias and
        kv_bytes_per_token (one attention layer per MTP row)."""
        a = self.arch
        return {"family": a.family, "n_layers": a.n_layers, "moe_layers": a.moe_layers + tuple(mtp_rows),
                "n_experts": a.n_experts, "top_k": a.top_k, "n_shared_experts": a.n_shared_experts,
                "hidden_size": a.hidden_size, "moe_intermediate_size": a.moe_intermediate_size,
                "shared_intermediate_size": a.shared_intermediate_size, "vocab_size": a.vocab_size,
                "expert_bias": self.expert_bias,
                "kv_bytes_per_token": self.kv_bytes_per_token(len(mtp_rows), bytes_per_value)}


def gqa_plan(c: ConfigReader, arch: ArchConfig, expert_bias: bool = False) -> PlanGeometry:
    """The default planning hook: a GQA cache of 2 · n_kv_heads · head_dim values per full-attention
    layer, MTP heads from ``num_nextn_predict_layers``."""
    return PlanGeometry(arch, 2 * arch.n_kv_heads * arch.head_dim, full_attention_layers(c, arch.n_layers),
                        c.opt_int("num_nextn_predict_layers", 0), expert_bias)


# ---- Hugging Face tensor names -------------------------------------------------------------------

#: HF name after ``model.layers.{i}.`` -> canonical suffix after ``layers.{i}.`` (engine/weights.py),
#: for the attention, norms, router and dense FFN every runnable family shares
COMMON_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    **{f"self_attn.{p}_proj.weight": f"attn.{p}" for p in "qkvo"},
    **{f"self_attn.{p}_proj.bias": f"attn.{p}_bias" for p in "qkvo"},
    "self_attn.q_norm.weight": "attn.q_norm", "self_attn.k_norm.weight": "attn.k_norm",
    "mlp.gate.weight": "router",
    **{f"mlp.{p}_proj.weight": f"ffn.{p}" for p in ("gate", "up", "down")},
}


def shared_expert_names(prefix: str) -> dict[str, str]:
    """HF names of a fused shared-expert MLP under ``prefix`` (e.g. "mlp.shared_experts") -> canonical
    ``shared.{gate,up,down}``."""
    return {f"{prefix}.{p}_proj.weight": f"shared.{p}" for p in ("gate", "up", "down")}


#: role token of a per-expert tensor -> index in (gate, up, down)
ROLES = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


@dataclass(frozen=True)
class TensorNames:
    """How a family names its tensors inside ``model.layers.{i}.``.

    Attributes:
        layer: HF name -> canonical suffix of the dense tensors (shapes in engine/weights.py).
        expert: matches one routed expert's matrix; group 1 = expert id, group 2 = a ``roles`` key.
        roles: role token -> 0 (gate [I, H]), 1 (up [I, H]) or 2 (down [H, I]).
        fused: fused expert tensors -> "gate_up" ([E, 2I, H]) or "down" ([E, H, I]).
    """

    layer: dict[str, str]
    expert: re.Pattern = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    roles: dict[str, int] = field(default_factory=lambda: dict(ROLES))
    fused: dict[str, str] = field(default_factory=lambda: {"mlp.experts.gate_up_proj": "gate_up",
                                                           "mlp.experts.down_proj": "down"})
