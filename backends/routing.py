"""The router's top-k rule of every supported family as data (:class:`RouteRule`), its numpy reference
(:func:`route_ref`, the host rule the engine runs) and the kernel parameters the device kernels of the
optional op ``d_router_topk`` read (:func:`kernel_params`).

The rule (the transformers routers: ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``, ``OlmoeTopKRouter``,
``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter``):

1. scores s [T, E]: softmax of the logits over all experts, or sigmoid of each logit;
2. choice c = s + bias (e_score_correction_bias, sigmoid routers; none: c = s);
3. group-limited top-k when ``n_group > 1`` and ``topk_group < n_group``: experts form n_group equal
   groups of consecutive ids; a group scores the sum of its two best c ("top2_sum") or its best ("max");
   only experts of the ``topk_group`` best groups compete;
4. the top_k experts by c, in descending order, ties to the lower id (a stable sort);
5. weights = s of the chosen (unbiased), renormalised to sum 1 when ``norm_topk_prob`` (sigmoid adds
   1e-20 to the sum), times ``routed_scaling_factor``.

Device kernels (``shaders/*/route.*``) run one token row per invocation with the same steps; their
float32 sums run in expert order, so a weight may differ from the host's in the last bit or two, and
the chosen ids differ only where two choice scores are that close (the property test excludes such
near-ties by a margin).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_plan.errors import InputError, UnsupportedError

#: widest router (experts) and most groups the device kernels take (a per-row array of scores each)
MAX_EXPERTS = 512
MAX_GROUPS = 32
MAX_TOP_K = 64


@dataclass(frozen=True)
class RouteRule:
    """One family's top-k rule (see the module docstring).

    Attributes:
        scoring: "softmax" or "sigmoid".
        top_k: experts chosen per token (K).
        n_group, topk_group: group-limited top-k (1, 1: plain top-k).
        group_score: "top2_sum" or "max".
        norm_topk_prob: renormalise the K weights.
        routed_scaling_factor: multiplies the weights last.
    """

    scoring: str = "softmax"
    top_k: int = 1
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "top2_sum"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0

    @classmethod
    def from_arch(cls, arch) -> RouteRule:
        """The rule of an :class:`~colibri_plan.formats.arch.ArchConfig`."""
        return cls(arch.scoring, int(arch.top_k), int(arch.n_group), int(arch.topk_group), arch.group_score,
                   bool(arch.norm_topk_prob), float(arch.routed_scaling_factor))

    @property
    def grouped(self) -> bool:
        """True when only the experts of the ``topk_group`` best groups compete."""
        return self.n_group > 1 and self.topk_group < self.n_group

    def check(self, n_experts: int) -> None:
        """Raise InputError unless the rule can choose ``top_k`` of ``n_experts`` experts."""
        e, k, g = int(n_experts), self.top_k, self.n_group
        problems = []
        if self.scoring not in ("softmax", "sigmoid"):
            problems.append(f"scoring {self.scoring!r} must be 'softmax' or 'sigmoid'")
        if self.group_score not in ("top2_sum", "max"):
            problems.append(f"group_score {self.group_score!r} must be 'top2_sum' or 'max'")
        if not 1 <= k <= e:
            problems.append(f"top_k {k} must be 1..{e} (the router's experts)")
        if g < 1 or e % g or not 1 <= self.topk_group <= g:
            problems.append(f"n_group {g} / topk_group {self.topk_group} must split {e} experts evenly "
                            "with 1 <= topk_group <= n_group")
        elif self.grouped and self.topk_group * (e // g) < k:
            problems.append(f"topk_group {self.topk_group} groups of {e // g} experts hold fewer than "
                            f"top_k {k}")
        if not np.isfinite(self.routed_scaling_factor):
            problems.append(f"routed_scaling_factor {self.routed_scaling_factor!r} must be finite")
        if problems:
            raise InputError("routing rule: " + "; ".join(problems) + " (fix the model's config)")


def route_ref(logits: np.ndarray, bias: np.ndarray | None, rule: RouteRule) -> tuple[np.ndarray, np.ndarray]:
    """The host rule: logits float32 [T, E], bias float32 [E] or None -> (ids int64 [T, K] in descending
    choice order, weights float32 [T, K]). What ``engine.moe.route`` runs, bit for bit."""
    logits = np.asarray(logits, dtype=np.float32)
    t, e = logits.shape
    if rule.scoring == "softmax":
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)  # probabilities [T, E]
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))  # sigmoid [T, E]
    choice = scores if bias is None else scores + np.asarray(bias, dtype=np.float32)
    if rule.grouped:
        grouped = choice.reshape(t, rule.n_group, e // rule.n_group)  # [T, G, E/G]
        if rule.group_score == "max":
            gscore = grouped.max(axis=2)
        else:  # sum of each group's two best scores
            gscore = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)  # [T, G]
        keep = np.argsort(-gscore, axis=1, kind="stable")[:, : rule.topk_group]  # [T, topk_group]
        mask = np.zeros((t, rule.n_group), dtype=bool)
        np.put_along_axis(mask, keep, True, axis=1)
        choice = np.where(np.repeat(mask, e // rule.n_group, axis=1), choice, -np.inf)
    ids = np.argsort(-choice, axis=1, kind="stable")[:, : rule.top_k]  # [T, E] -> top-k ids [T, K]
    # unbiased scores [T, K] (a fancy-index copy: what np.take_along_axis gives, without its Python)
    weights = scores[np.arange(t)[:, None], ids].astype(np.float32, copy=False)
    if rule.norm_topk_prob:
        eps = 1e-20 if rule.scoring == "sigmoid" else 0.0
        weights = weights / (weights.sum(axis=1, keepdims=True) + eps)
    if rule.routed_scaling_factor != 1.0:  # w · 1.0 == w, bit for bit
        weights = weights * np.float32(rule.routed_scaling_factor)
    return ids.astype(np.int64, copy=False), weights.astype(np.float32, copy=False)


def kernel_params(rule: RouteRule, n_experts: int, has_bias: bool
                  ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The device kernels' scalars: (E, K, softmax, has_bias, n_group (1 when not grouped), topk_group,
    group max, norm) as ints and (eps, scale) as floats (the rule checked by the caller)."""
    e = int(n_experts)
    g = rule.n_group if rule.grouped else 1
    ints = (e, rule.top_k, int(rule.scoring == "softmax"), int(bool(has_bias)), g,
            rule.topk_group if rule.grouped else 1, int(rule.group_score == "max"), int(rule.norm_topk_prob))
    eps = 1e-20 if rule.scoring == "sigmoid" else 0.0
    return ints, (eps, float(np.float32(rule.routed_scaling_factor)))


def check_kernel_limits(ints: tuple) -> None:
    """Raise UnsupportedError when :func:`kernel_params`' ``ints`` exceed the GPU kernels' per-row arrays:
    more than :data:`MAX_EXPERTS` experts, :data:`MAX_GROUPS` groups or :data:`MAX_TOP_K` chosen (the
    engine then routes on the host)."""
    e, k, g = ints[0], ints[1], ints[4]
    if e > MAX_EXPERTS or g > MAX_GROUPS or k > MAX_TOP_K:
        raise UnsupportedError(f"d_router_topk: {e} experts, {g} groups, top-{k}: the device kernels take at "
                               f"most {MAX_EXPERTS}, {MAX_GROUPS} and {MAX_TOP_K} (route on the host)")


def ids_as_float32(ids: np.ndarray) -> np.ndarray:
    """int ids [T, K] as the float32 array whose 4-byte elements are their int32 bits (a device ids
    buffer's contents)."""
    return np.ascontiguousarray(ids, dtype=np.int32).view(np.float32)
