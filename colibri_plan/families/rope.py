"""RoPE parameters of a config.json and the inverse frequencies they give (default, linear, YaRN).

Reading follows ``PretrainedConfig.standardize_rope_params`` of transformers 5: the v5 ``rope_parameters``
dict {rope_type, rope_theta, factor, partial_rotary_factor, ...} or the older top-level ``rope_theta`` /
``partial_rotary_factor`` / ``rope_scaling`` {type|rope_type, factor, ...}; a top-level
``original_max_position_embeddings`` wins over the dict's (Phi-3 rule), the default is
``max_position_embeddings``.

The maths follows ``transformers/modeling_rope_utils.py`` (``_compute_default_rope_parameters``,
``_compute_yarn_parameters``) in float32 like torch does, and the DeepSeek softmax scale of
``transformers/models/deepseek_v3/modeling_deepseek_v3.py`` (``yarn_get_mscale``, ``yarn_apply_mscale``):

- default: inv_freq[i] = 1 / theta^(2i / dim), i < dim / 2 (dim = the rotated channels of a head);
- linear: positions are divided by ``factor`` (ArchConfig.rope_scaling_factor);
- yarn: inv_freq blends interpolation 1 / (factor · theta^(2i/dim)) and extrapolation 1 / theta^(2i/dim)
  with a linear ramp between the correction dims of ``beta_fast`` / ``beta_slow`` rotations over
  ``original_max_position_embeddings`` (floored/ceiled when ``truncate``); cos and sin are multiplied by
  ``attention_factor`` (given, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
  set, else mscale(factor)); MLA attention also multiplies its softmax scale by mscale(factor,
  mscale_all_dim)² when ``mscale_all_dim`` is set (DeepSeek-V2/V3 ``softmax_scale``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: RoPE types the engine runs; any other is refused for the engine (planning ignores RoPE)
ENGINE_ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class Rope:
    """RoPE settings of a config.

    Attributes:
        theta: base. partial_rotary_factor: rotated fraction of each head (None = the family's default).
        factor: linear position factor (1.0 = none; "linear" only). rope_type: "default", "linear", "yarn".
        yarn: the ArchConfig ``yarn_*`` fields ({} unless rope_type is "yarn").
    """

    theta: float
    partial_rotary_factor: float | None
    factor: float
    rope_type: str
    yarn: dict

    def arch_fields(self) -> dict:
        """The ArchConfig RoPE fields: rope_theta, rope_scaling_factor, rope_type ("default" for a type the
        engine refuses: planning ignores RoPE) and the yarn_* ones."""
        rope_type = self.rope_type if self.rope_type in ENGINE_ROPE_TYPES else "default"
        return {"rope_theta": self.theta, "rope_scaling_factor": self.factor, "rope_type": rope_type,
                **self.yarn}


def _num(c, d: dict, key: str, default):
    """``d[key]`` as a finite float (``default`` when absent/null); a FormatError names the key."""
    from colibri_plan.errors import FormatError

    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FormatError(f"{c.where}: rope parameter {key!r} must be a finite number, got {v!r}")
    return float(v)


def rope(c) -> Rope:
    """RoPE of a :class:`~colibri_plan.families.base.ConfigReader`'s config (module docstring).

    A type other than default/linear/yarn (llama3, longrope, dynamic, ...) or per-layer-type parameters
    are refused for the engine (``c.refuse``), not for planning.

    Raises:
        FormatError: a yarn parameter is not a number, or a yarn factor is missing and cannot be derived.
    """
    from colibri_plan.errors import FormatError

    rp = c.cfg.get("rope_parameters") or {}
    if rp and all(isinstance(v, dict) for v in rp.values()):
        c.refuse("per-layer-type rope_parameters are not supported")
        rp = {}
    legacy = c.cfg.get("rope_scaling") or {}
    d = {**legacy, **rp} if isinstance(legacy, dict) and isinstance(rp, dict) else {}
    rope_type = str(rp.get("rope_type") or rp.get("type") or legacy.get("rope_type") or legacy.get("type")
                    or "default")
    theta = rp.get("rope_theta", c.cfg.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", c.cfg.get("partial_rotary_factor"))
    factor, yarn = 1.0, {}
    if rope_type == "linear":
        factor = _num(c, d, "factor", 1.0)
    elif rope_type == "yarn":
        max_pos = c.cfg.get("max_position_embeddings")
        orig = c.cfg.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") \
            or max_pos
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            raise FormatError(f"{c.where}: yarn RoPE needs original_max_position_embeddings (or "
                              f"max_position_embeddings) as a positive integer, got {orig!r}")
        yf = _num(c, d, "factor", None)
        if yf is None:  # transformers: max_position_embeddings / original_max_position_embeddings
            if not isinstance(max_pos, int) or isinstance(max_pos, bool):
                raise FormatError(f"{c.where}: yarn RoPE without 'factor' needs max_position_embeddings")
            yf = max_pos / orig
        af = _num(c, d, "attention_factor", None)
        yarn = {"yarn_factor": yf, "yarn_original_max_position": int(orig),
                "yarn_beta_fast": _num(c, d, "beta_fast", 0.0) or 32.0,
                "yarn_beta_slow": _num(c, d, "beta_slow", 0.0) or 1.0,
                "yarn_mscale": _num(c, d, "mscale", 0.0),
                "yarn_mscale_all_dim": _num(c, d, "mscale_all_dim", 0.0),
                "yarn_attention_factor": af, "yarn_truncate": bool(d.get("truncate", True))}
    elif rope_type != "default":
        c.refuse(f"RoPE type {rope_type!r} is not supported (default, linear and yarn are)")
    return Rope(float(theta), None if prf is None else float(prf), factor, rope_type, yarn)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 · mscale · ln(scale) + 1 for scale > 1, else 1 (DeepSeek / transformers ``get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(arch) -> float:
    """Multiplier of cos and sin: the YaRN ``attention_factor`` (1.0 for default/linear RoPE)."""
    if arch.rope_type != "yarn":
        return 1.0
    if arch.yarn_attention_factor is not None:
        return float(arch.yarn_attention_factor)
    f = arch.yarn_factor
    if arch.yarn_mscale and arch.yarn_mscale_all_dim:
        return float(yarn_get_mscale(f, arch.yarn_mscale) / yarn_get_mscale(f, arch.yarn_mscale_all_dim))
    return float(yarn_get_mscale(f))


def mla_softmax_scale(arch) -> float:
    """MLA softmax scale: (qk_nope_head_dim + qk_rope_head_dim)^-0.5, times mscale(factor,
    mscale_all_dim)² for YaRN with ``mscale_all_dim`` (DeepSeek ``yarn_apply_mscale``)."""
    scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    if arch.rope_type == "yarn" and arch.yarn_mscale_all_dim:
        m = yarn_get_mscale(arch.yarn_factor, arch.yarn_mscale_all_dim)
        scale = scale * m * m
    return float(scale)


def inv_freq(arch) -> np.ndarray:
    """Inverse frequencies float32 [rotary_dim / 2] of an ArchConfig (module docstring; float32 as torch)."""
    dim = arch.rotary_dim
    pos_freqs = np.float32(arch.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)  # [dim/2]
    if arch.rope_type != "yarn":
        return extrapolation
    base, factor = arch.rope_theta, arch.yarn_factor

    def correction_dim(rotations: float) -> float:
        turns = arch.yarn_original_max_position / (rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(base))

    low, high = correction_dim(arch.yarn_beta_fast), correction_dim(arch.yarn_beta_slow)
    if arch.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: prevents a division by zero
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extra_w = (np.float32(1.0) - ramp).astype(np.float32)  # weight of extrapolation per frequency
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    return (interpolation * (1 - extra_w) + extrapolation * extra_w).astype(np.float32)
