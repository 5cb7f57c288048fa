"""Choosing the next token from the logits: greedy (argmax) by default, or temperature / top-k / top-p
sampling with a seeded generator, so that a run and a server request with the same seed give the same ids.

Order of the filters (as the usual inference servers apply them): scale the logits by 1 / temperature,
keep the ``top_k`` largest, softmax, keep the smallest set of most probable tokens whose probabilities add
up to ``top_p`` (the most probable one always stays), renormalise, draw one id by inverse CDF from a numpy
``Generator(PCG64(seed))``. Arithmetic is float64, so the draw does not depend on float32 rounding.

Usage::

    params = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
    model.generate(prompt, 32, sample=make_sampler(params))   # None for greedy: argmax, as verify runs
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from colibri_plan.errors import InputError

__all__ = ["SamplingParams", "Sampler", "make_sampler", "tap", "MAX_TEMPERATURE"]

#: the largest temperature accepted (OpenAI's API allows 0..2; past that the draw is close to uniform)
MAX_TEMPERATURE = 2.0


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen.

    Attributes:
        temperature: 0 = greedy (argmax; the other fields are then ignored), else 0 < t <= 2.
        top_p: nucleus mass kept, 0 < top_p <= 1 (1 keeps every token).
        top_k: keep the k most probable tokens, 0 = all.
        seed: seed of the generator (0 .. 2**64 - 1); None = fresh entropy per request (not reproducible).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        """True when the choice is the argmax (temperature 0)."""
        return self.temperature == 0.0

    def check(self) -> SamplingParams:
        """Return self after checking every field's range.

        Raises:
            InputError: naming the field, the value and the range it must lie in.
        """
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or not 0.0 <= t <= MAX_TEMPERATURE:
            raise InputError(f"temperature must be a number in 0..{MAX_TEMPERATURE:g} (0 = greedy), "
                             f"got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) \
                or not 0.0 < p <= 1.0:
            raise InputError(f"top_p must be a number in (0, 1] (1 keeps every token), got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InputError(f"top_k must be a whole number >= 0 (0 keeps every token), got {k!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64):
            raise InputError(f"seed must be a whole number in 0..2**64-1, got {s!r}")
        return self


class Sampler:
    """A seeded sampler: ``sampler(logits float32 [V]) -> token id`` (module docstring for the filters).

    Args:
        params: checked :class:`SamplingParams` with temperature > 0.

    Attributes:
        seed: the seed used (drawn from entropy when ``params.seed`` is None, so a run can be repeated).

    Raises:
        InputError: out-of-range parameters, or temperature 0 (use greedy decoding: ``sample=None``).
    """

    def __init__(self, params: SamplingParams):
        self.params = params.check()
        if params.greedy:
            raise InputError("a Sampler needs temperature > 0; temperature 0 is greedy decoding "
                             "(sample=None)")
        self.seed = int(np.random.SeedSequence().entropy % 2**64) if params.seed is None else params.seed
        self._rng = np.random.Generator(np.random.PCG64(self.seed))

    def probabilities(self, logits: np.ndarray) -> np.ndarray:
        """The distribution the next id is drawn from: float64 [V], zero outside top-k / top-p, sum 1.

        Raises:
            InputError: ``logits`` is not 1-D, is empty or has no finite value.
        """
        z = np.asarray(logits, dtype=np.float64)
        if z.ndim != 1 or z.size == 0:
            raise InputError(f"logits must be a non-empty 1-D array [V], got shape {z.shape}")
        z = np.where(np.isfinite(z), z, -np.inf) / self.params.temperature   # [V]; NaN never chosen
        top = np.max(z)
        if not np.isfinite(top):
            raise InputError("no finite logit to sample from")
        k = self.params.top_k
        if 0 < k < z.size:   # ties at the k-th value all stay (argpartition would pick among them)
            kth = np.partition(z, z.size - k)[z.size - k]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - top)
        p /= p.sum()
        if self.params.top_p < 1.0:
            order = np.argsort(-p, kind="stable")                # most probable first; ties by id
            cum = np.cumsum(p[order])
            n_keep = int(np.searchsorted(cum, self.params.top_p)) + 1   # the set reaching top_p
            kept = np.zeros_like(p)
            kept[order[:n_keep]] = p[order[:n_keep]]
            p = kept / kept.sum()
        return p

    def __call__(self, logits: np.ndarray) -> int:
        """Draw the next token id from ``logits`` float32 [V] (advances the generator by one draw)."""
        p = self.probabilities(logits)
        cdf = np.cumsum(p)   # [V]
        u = self._rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), p.size - 1))


def tap(sample: Callable[[np.ndarray], int] | None, on_choice: Callable[[int], None]
        ) -> Callable[[np.ndarray], int]:
    """A ``sample`` that chooses as ``sample`` does (None: argmax, the engine's greedy choice) and hands
    each id to ``on_choice`` as soon as it is chosen (streaming the text of a run)."""
    def choose(logits: np.ndarray) -> int:   # logits float32 [V]
        tok = int(np.argmax(logits)) if sample is None else int(sample(logits))
        on_choice(tok)
        return tok
    return choose


def make_sampler(params: SamplingParams | None) -> Callable[[np.ndarray], int] | None:
    """The ``sample`` argument of ``Model.generate`` for ``params``: None for greedy (argmax), else a
    :class:`Sampler`.

    Raises:
        InputError: out-of-range parameters.
    """
    if params is None or params.check().greedy:
        return None
    return Sampler(params)
