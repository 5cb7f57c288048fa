"""Model families: one file per Hugging Face ``model_type`` family that reads its ``config.json``.

Each family module is the only place that parses its keys. It exports:

- ``MODEL_TYPES``: the ``model_type`` values it reads;
- ``REFUSE``: None when the engine runs the family, else why not (the family is then plan-only), or a
  dict model_type -> why not for the model types that are plan-only (the others run);
- ``TENSORS``: its HF tensor names (:class:`~colibri_plan.families.base.TensorNames`), None if plan-only;
- ``read(c: ConfigReader) -> ArchConfig``: the engine's architecture, also the planner's geometry;
- optionally ``plan(c, arch) -> PlanGeometry``: planning hooks (KV bytes per token for MLA or hybrid
  attention, expert biases, MTP heads); default :func:`~colibri_plan.families.base.gqa_plan`.

A new family is one file here plus one line in :data:`_MODULES`.

| module       | model_type                                                      | engine    |
|--------------|-----------------------------------------------------------------|-----------|
| mixtral      | mixtral                                                         | runs      |
| qwen2_moe    | qwen2_moe                                                       | runs      |
| qwen3_moe    | qwen3_moe                                                       | runs      |
| olmoe        | olmoe                                                           | runs      |
| glm4_moe     | glm4_moe                                                        | runs      |
| deepseek     | deepseek_v2/v3, kimi_k2, glm4_moe_lite (MLA)                    | runs      |
|              | deepseek_v32, glm_moe_dsa (GLM-5: MLA + DSA indexer)            | runs (1)  |
| deepseek_v4  | deepseek_v4                                                     | plan only |
| gpt_oss      | gpt_oss                                                         | plan only |
| qwen3_next   | qwen3_next, qwen3_5_moe(_text)                                  | plan only |
| phimoe       | phimoe                                                          | plan only |
| jamba        | jamba                                                           | plan only |

(1) as MLA for contexts up to ``index_topk`` tokens, where DSA selects every token (families/deepseek.py).

Multimodal wrappers are read through their ``text_config`` (:func:`~colibri_plan.families.base.text_config`).
"""

from __future__ import annotations

from types import ModuleType

from colibri_plan.errors import FormatError, UnsupportedError
from colibri_plan.families import (
    deepseek,
    deepseek_v4,
    glm4_moe,
    gpt_oss,
    jamba,
    mixtral,
    olmoe,
    phimoe,
    qwen2_moe,
    qwen3_moe,
    qwen3_next,
)
from colibri_plan.families.base import (
    EXPERT_KEYS,
    ConfigReader,
    PlanGeometry,
    TensorNames,
    gqa_plan,
    text_config,
)
from colibri_plan.formats.arch import ArchConfig

__all__ = ["FAMILIES", "ENGINE_FAMILIES", "PlanGeometry", "TensorNames", "arch_from_config", "plan_geometry",
           "spec_fields_from_config", "tensor_names"]

_MODULES = (mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, deepseek, deepseek_v4, gpt_oss, qwen3_next,
            phimoe, jamba)
#: model_type -> its family module
FAMILIES: dict[str, ModuleType] = {mt: m for m in _MODULES for mt in m.MODEL_TYPES}


def _refusal(module: ModuleType, model_type: str) -> str | None:
    """Why the engine refuses ``model_type`` of ``module`` (None = it runs)."""
    r = module.REFUSE
    return r.get(model_type) if isinstance(r, dict) else r


#: model_type values the engine runs end to end
ENGINE_FAMILIES = tuple(mt for mt, m in FAMILIES.items() if _refusal(m, mt) is None)


def _family(config: dict, where: str) -> tuple[ConfigReader, ModuleType]:
    """The reader of ``config``'s language-model part and its family module.

    Raises:
        FormatError: not a JSON object, or no ``model_type``.
        UnsupportedError: an unknown ``model_type`` (a dense model says so).
    """
    if not isinstance(config, dict):
        raise FormatError(f"{where} must hold a JSON object, got {type(config).__name__}")
    c = ConfigReader(text_config(config), where)
    mt = c.model_type
    if not mt:
        raise FormatError(f"{where} has no model_type; it names the model family (e.g. \"mixtral\"): copy it "
                          "from the model's published config.json")
    module = FAMILIES.get(mt)
    if module is None:
        if not any(c.has(k) for k in EXPERT_KEYS):
            raise UnsupportedError(f"{where}: model_type {mt!r} is not a Mixture-of-Experts model (no "
                                   f"{' / '.join(EXPERT_KEYS)} field); colibri-plan sizes and runs MoE "
                                   "models only")
        archs = ", ".join(c.cfg.get("architectures") or []) or "no architectures"
        raise UnsupportedError(f"{where}: model family {mt!r} ({archs}) is not supported; known families: "
                               f"{', '.join(FAMILIES)} (a new family is one file in colibri_plan/families/)")
    return c, module


def _read(c: ConfigReader, module: ModuleType) -> ArchConfig:
    try:
        return module.read(c)
    except FormatError as exc:
        msg = str(exc)
        raise FormatError(msg if msg.startswith(c.where) else f"{c.where}: {msg}") from None


def arch_from_config(config: dict, plan_only: bool = False, where: str = "config.json") -> ArchConfig:
    """The :class:`~colibri_plan.formats.arch.ArchConfig` of a Hugging Face ``config.json`` dict.

    ``plan_only=True`` also returns the geometry of families the forward pass cannot run yet (gpt-oss, hybrid
    attention, RoPE scaling other than linear/YaRN) for planning; the engine leaves it False.

    Raises:
        UnsupportedError: unknown ``model_type`` (named); unless ``plan_only``, a plan-only family or
            variant (the config field named, e.g. ``index_topk`` on a DeepSeek-V3 config) or a RoPE type
            other than default/linear/yarn.
        FormatError: a required key is missing (named) or the values are inconsistent.
    """
    c, module = _family(config, where)
    if _refusal(module, c.model_type) and not plan_only:
        raise UnsupportedError(f"{c.model_type}: {_refusal(module, c.model_type)}. Supported families: "
                               f"{', '.join(ENGINE_FAMILIES)}")
    arch = _read(c, module)
    if c.refusals and not plan_only:
        raise UnsupportedError(c.refusals[0])
    return arch


def plan_geometry(config: dict, where: str = "config.json") -> PlanGeometry:
    """Planning geometry of a config: its ArchConfig (MTP heads excluded) plus the family's hooks.

    Raises:
        UnsupportedError: unknown ``model_type``, or a dense model.
        FormatError: a needed key is missing (named), or no layer has routed experts.
    """
    c, module = _family(config, where)
    arch = _read(c, module)
    if not arch.moe_layers:
        raise FormatError(f"{where}: by its config no layer of this model has routed experts")
    return getattr(module, "plan", gqa_plan)(c, arch)


def spec_fields_from_config(config: dict, where: str = "config.json",
                            mtp_rows: tuple[int, ...] | None = None) -> dict:
    """ModelSpec geometry fields of a config (:meth:`PlanGeometry.spec_fields`, bf16 KV cache).

    Args:
        mtp_rows: MoE row ids of MTP heads; None = one per ``num_nextn_predict_layers``, numbered from
            ``num_hidden_layers``.
    """
    geo = plan_geometry(config, where)
    if mtp_rows is None:
        mtp_rows = tuple(range(geo.arch.n_layers, geo.arch.n_layers + geo.mtp_layers))
    return geo.spec_fields(tuple(mtp_rows))


def tensor_names(family: str) -> TensorNames:
    """The HF tensor names of a family the engine runs.

    Raises:
        UnsupportedError: an unknown or plan-only family.
    """
    module = FAMILIES.get(family)
    if module is None or module.TENSORS is None or _refusal(module, family):
        raise UnsupportedError(f"{family}: the engine has no tensor names for this family; supported: "
                               f"{', '.join(ENGINE_FAMILIES)}")
    return module.TENSORS
