"""Real routing counts (OLMoE, Mixtral) and whole-model heat synthesised from them.

The counts in ``colibri_plan/data/olmoe_mixtral_expert_counts.json`` were published in the OLMoE
repository (allenai/OLMoE, ``scripts/routing_output``, Apache-2.0): per-expert top-k assignment counts
of OLMoE-1B-7B (64 experts, top-8) and Mixtral-8x7B (8 experts, top-2) at layers 0, 7 and 15 over
several text domains, 2048-token sequences.

Synthesis method (docs/heat.md): for each MoE layer of the target model, pick a real layer profile
(the recorded layer nearest in relative depth, a seeded random domain), sort its probabilities
descending, interpolate its log-probability over the rank quantile to E ranks (so the Lorenz curve —
what share the hottest x% of experts carry — is preserved), normalise to top-k selections per token
(capping each probability at 1), and assign the ranks to expert ids by a seeded random permutation.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.formats.heat import Heat, fnv1a32

DATA_FILE = "olmoe_mixtral_expert_counts.json"
#: model key in the data file -> (experts, top-k, transformer layers)
REAL_MODELS = {"olmoe": (64, 8, 16), "olmoe-sft": (64, 8, 16), "olmoe-dpo": (64, 8, 16),
               "mistral": (8, 2, 32), "mixtral": (8, 2, 32)}


@lru_cache(maxsize=1)
def load_real_counts() -> dict:
    """The parsed data file (``{"source", "layers_recorded", "note", "data": {model: {kind: {domain:
    {layer: [counts]}}}}}``). Raises InputError if the package data is missing."""
    try:
        text = resources.files("colibri_plan").joinpath("data", DATA_FILE).read_text(encoding="utf-8")
    except (FileNotFoundError, OSError) as exc:
        raise InputError(f"package data {DATA_FILE} is missing; reinstall colibri-plan") from exc
    return json.loads(text)


def _key(model: str) -> str:
    key = "mistral" if model == "mixtral" else model
    if key not in load_real_counts()["data"]:
        raise InputError(f"no real routing counts for {model!r}; choose one of {sorted(REAL_MODELS)}")
    return key


def real_domains(model: str = "olmoe", kind: str = "topk") -> list[str]:
    """Text domains recorded for ``model`` and ``kind`` ("topk" or "top1")."""
    return sorted(load_real_counts()["data"][_key(model)][kind])


def real_heat(model: str = "olmoe", domain: str = "c4", kind: str = "topk") -> Heat:
    """A Heat of the recorded layers (0, 7, 15) of a real model on one text domain.

    ``tokens`` is the assignments of a row divided by the top-k (1 for kind "top1").

    Raises:
        InputError: unknown model, kind or domain.
    """
    key = _key(model)
    e, k, _ = REAL_MODELS[key]
    by_domain = load_real_counts()["data"][key].get(kind)
    if by_domain is None or domain not in by_domain:
        raise InputError(f"no {kind} counts for {model} on domain {domain!r}; domains: "
                         f"{sorted(by_domain or {})}")
    rows = by_domain[domain]
    layers = sorted(int(x) for x in rows)
    counts = np.array([rows[str(layer)] for layer in layers], dtype=np.float64)
    top_k = k if kind == "topk" else 1
    tokens = int(round(counts[0].sum() / top_k))
    src = load_real_counts()["source"]
    return Heat(n_experts=e, layers=tuple(layers), counts=counts, top_k=top_k, tokens=tokens,
                source=f"real {kind} counts of {key} on {domain} ({src})")


def real_profiles(model: str = "olmoe") -> dict[tuple[str, int], np.ndarray]:
    """Per (domain, recorded layer) selection probabilities ``[E]`` (top-k counts / tokens)."""
    out = {}
    for domain in real_domains(model):
        h = real_heat(model, domain)
        for i, layer in enumerate(h.layers):
            out[(domain, layer)] = h.probabilities()[i]
    return out


def resample_profile(p: np.ndarray, n_experts: int, top_k: int) -> np.ndarray:
    """Resample one layer's probabilities ``[E0]`` to ``n_experts`` ranks, hottest first.

    Log-probability is interpolated linearly over the rank quantile ``(r + 0.5) / E``; the result is
    scaled so it sums to ``top_k`` with every value <= 1 (water-filling the excess of capped values).

    Returns:
        float64 ``[n_experts]``, descending, sum == top_k.
    """
    src = np.sort(np.maximum(np.asarray(p, dtype=np.float64), 1e-12))[::-1]
    x_src = (np.arange(src.size) + 0.5) / src.size
    x_dst = (np.arange(n_experts) + 0.5) / n_experts
    out = np.exp(np.interp(x_dst, x_src, np.log(src)))
    return cap_probabilities(out, top_k)


def cap_probabilities(w: np.ndarray, top_k: int) -> np.ndarray:
    """Scale non-negative weights ``[E]`` to sum ``top_k`` with each value <= 1 (water-filling).

    Raises:
        InputError: top_k > E (impossible) or all weights are zero.
    """
    w = np.asarray(w, dtype=np.float64)
    if top_k > w.size or w.sum() <= 0:
        raise InputError(f"cannot spread top-{top_k} selections over {w.size} experts with weights summing "
                         f"to {w.sum()}")
    out = np.zeros_like(w)
    capped = np.zeros(w.size, dtype=bool)
    for _ in range(w.size):
        rest = top_k - capped.sum()
        free = w * ~capped
        out = np.where(capped, 1.0, free / free.sum() * rest)
        over = (out > 1.0) & ~capped
        if not over.any():
            break
        capped |= over
    return out


def synth_heat(spec, domain: str | None = None, seed: int = 0, source_model: str = "olmoe",
               tokens: int = 1_000_000) -> Heat:
    """Synthesise whole-model heat for ``spec`` from real per-layer distributions (module docstring).

    Args:
        spec: a ModelSpec (uses n_experts, top_k, moe_layers, n_layers, fingerprint()).
        domain: text domain of the real counts; None draws one per layer (seeded).
        seed: permutation and draw seed; the same seed gives the same heat.
        source_model: "olmoe" (skewed) or "mixtral" (near-uniform) real counts.
        tokens: nominal token count (counts = probability * tokens).

    Returns:
        Heat with one row per MoE layer of the spec; ``source`` records the method.
    """
    rng = np.random.default_rng(seed)
    profiles = real_profiles(source_model)
    recorded = sorted({layer for _, layer in profiles})
    domains = sorted({d for d, _ in profiles})
    if domain is not None and domain not in domains:
        raise InputError(f"no {source_model} counts on domain {domain!r}; domains: {domains}")
    depth_src = REAL_MODELS[_key(source_model)][2]
    rows = []
    n_layers = max(spec.n_layers, 1)
    for layer in spec.moe_layers:
        rel = min(layer / n_layers, 1.0)
        near = min(recorded, key=lambda r, rel=rel: abs(r / depth_src - rel))
        dom = domain if domain is not None else domains[int(rng.integers(len(domains)))]
        prof = resample_profile(profiles[(dom, near)], spec.n_experts, spec.top_k)
        rows.append(prof[rng.permutation(spec.n_experts)] * tokens)
    return Heat(n_experts=spec.n_experts, layers=tuple(spec.moe_layers), counts=np.array(rows),
                top_k=spec.top_k, tokens=tokens, model_fingerprint=spec.fingerprint(),
                n_model_layers=spec.n_layers, engine_id=fnv1a32(spec.family),
                source=f"synthesised from real {source_model} routing ({domain or 'mixed domains'}, "
                       f"seed {seed}); see docs/heat.md")


def sample_trace(probs: np.ndarray, n_tokens: int, top_k: int, seed: int = 0) -> np.ndarray:
    """Draw a token-level routing trace for one layer: int64 ``[n_tokens, top_k]`` distinct expert ids.

    Each token picks ``top_k`` experts without replacement with probability proportional to ``probs``
    (Gumbel top-k), tokens independent. The per-expert selection frequency of such a trace is close to,
    but not exactly, ``probs`` when ``probs`` is skewed (sampling without replacement flattens it).
    """
    rng = np.random.default_rng(seed)
    logw = np.log(np.maximum(np.asarray(probs, dtype=np.float64), 1e-300))
    g = logw[None, :] + rng.gumbel(size=(n_tokens, logw.size))   # scores [T, E]
    return np.argpartition(-g, top_k - 1, axis=1)[:, :top_k]     # -> top-k ids [T, K]
