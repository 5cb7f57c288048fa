"""Promotion under replayed decode steps: a conversation's hot experts move from mapped pinned host memory
into VRAM, cold ones out, between tokens.

A plan pins each layer's experts by the heat it was solved on. A conversation whose routing differs reads
its hot experts over the bus at every token while VRAM holds cold ones: on a random checkpoint the prompt
decides which experts a decode selects (bench/results/routing-context-cpu.json: the hottest half of a heat
made after another prompt served 53.6% of a decode's selections, one made after its own prompt 96.8%).
When the trunk's GPU also computes the mapped pinned tier (``compute.ram_pinned`` names it,
engine/unified.py), every expert of a layer is one that GPU reads, from VRAM or over the bus; moving one
changes where its bytes are read from, not what is computed (the same kernel on the same bytes), so tokens
and logits keep their bits.

**Estimate.** Per MoE layer and expert a decayed count ``q_e`` of selections, decayed by
``(1 - 1/window_tokens)`` per token, fed by every routing the residency manager serves (prefill, eager and
replayed decode steps; the prompt's prefill before the first decode step made the promoter too, kept for
it as ``early_routing``): ``q_e`` is about the selections of ``e`` over the last ``window_tokens`` tokens.

**Rule.** Every ``every_tokens`` decode tokens, per layer, while the hottest mapped expert ``h`` and the
coldest VRAM expert ``c`` have

    q_h - q_c > lead + z * sqrt(q_h + q_c)        (selections over the window; lead 2, z 2)

exchange them (at most ``max_swaps`` a round). A selection of a mapped expert reads its bytes over the bus
once; an exchange moves two experts' bytes over it; so it pays once ``h`` is expected to be picked more
than ``lead`` = 2 times more than ``c`` over the next window. The counts are noisy (a Poisson count's
spread is its square root): the margin ``z * sqrt(q_h + q_c)``, two standard deviations of the
difference, keeps experts picked about as often as each other from trading places on noise. Hand-checkable:
h picked 9 times over the window and c never: 9 > 2 + 2 * 3 = 8, exchanged; h 7 times: 7 < 2 + 2 * 2.65,
kept; 20 against 10: 10 < 2 + 2 * 5.48, kept.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

#: set to 0 to keep the plan's tiers under replayed decode steps
ENV = "COLIBRI_PROMOTE"


@dataclass(frozen=True)
class PromotePolicy:
    """``window_tokens`` of the decayed counts, a round every ``every_tokens`` decode tokens, at most
    ``max_swaps`` exchanges a round, an exchange when the hot expert leads by more than ``lead`` selections
    over the window (2: the bus crossings of an exchange) plus ``z`` standard deviations of the counts'
    difference."""

    window_tokens: int = 32
    every_tokens: int = 4
    max_swaps: int = 64
    lead: float = 2.0
    z: float = 2.0

    def pays(self, q_hot: float, q_cold: float) -> bool:
        """Whether an expert of ``q_hot`` recent selections should take the VRAM of one of ``q_cold``."""
        return q_hot - q_cold > self.lead + self.z * (max(0.0, q_hot + q_cold) ** 0.5)


class MappedPromoter:
    """The decayed counts and exchange rounds of one trunk GPU's VRAM and mapped pinned experts.

    Args:
        rm: the :class:`~colibri_plan.engine.residency.ResidencyManager` (its tiers change through
            ``swap_tiers``); be: the trunk's backend (``d_expert_exchange``); key: its device key;
        tables: MoE layer -> the layer's expert table (engine/decode_graph.py), rows exchanged with the
            experts; policy: a :class:`PromotePolicy`.

    Attributes:
        swaps, swap_bytes, swap_s: exchanges made, bytes moved over the bus (2 experts each) and host
            seconds spent in them.
    """

    def __init__(self, rm, be, key: str, tables: dict, policy: PromotePolicy | None = None):
        self.rm, self.be, self.key, self.tables = rm, be, key, tables
        self.policy = policy or PromotePolicy()
        a = rm.pack.arch
        self.layers = [i for i in a.moe_layers if i in tables and not tables[i].absent]
        self._row = {i: r for r, i in enumerate(self.layers)}
        self.q = np.zeros((len(self.layers), a.n_experts))  # [L, E] decayed selections
        self._decay = 1.0 - 1.0 / max(1, int(self.policy.window_tokens))
        self._k = max(1, int(a.top_k))
        self._tokens = 0
        self.swaps, self.swap_bytes, self.swap_s = 0, 0, 0.0
        # [L, E]: in this GPU's VRAM / in mapped pinned memory it computes, kept in step with the exchanges
        self._in_vram = np.zeros(self.q.shape, bool)
        self._mapped = np.zeros(self.q.shape, bool)
        for i in self.layers:
            v, m = rm.tiers_on(be, i)
            self._in_vram[self._row[i], v], self._mapped[self._row[i], m] = True, True

    @classmethod
    def make(cls, rm, be, key: str | None, tables: dict) -> MappedPromoter | None:
        """A promoter when some layer of ``tables`` holds experts in both VRAM and mapped pinned memory of
        ``be``, the backend can exchange them and :data:`ENV` is not 0; else None."""
        if os.environ.get(ENV, "1").strip() == "0" or key is None or not hasattr(be, "d_expert_exchange"):
            return None
        p = cls(rm, be, key, tables)
        if not any(len(p._split(i)[0]) and len(p._split(i)[1]) for i in p.layers):
            return None
        for layer, ids, counts in getattr(rm, "early_routing", ()):  # the prompt's prefill, served before
            p.observe(layer, ids, counts)
        rm.observers.append(p.observe)
        return p

    def _split(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(VRAM ids, mapped pinned ids) of ``layer`` on this GPU, ascending int64 arrays."""
        r = self._row[layer]
        return np.flatnonzero(self._in_vram[r]), np.flatnonzero(self._mapped[r])

    def observe(self, layer: int, expert_ids, counts=None) -> None:
        """Count a routing of ``layer``: ``expert_ids`` chosen (with ``counts`` selections each, default 1:
        one token), decaying the layer's counts by the tokens it covers; a batch of more tokens than the
        window counts as a window's worth (counts scaled by window / tokens)."""
        r = self._row.get(int(layer))
        if r is None:
            return
        ids = np.asarray(expert_ids, np.int64)
        c = np.ones(len(ids)) if counts is None else np.asarray(counts, np.float64)
        tokens = max(1.0, round(float(c.sum()) / self._k))
        self.q[r] *= self._decay ** tokens
        # a prefill longer than the window: only a window's worth of its tokens counts (its selections
        # spread evenly over its tokens), so that q stays "selections over the last window tokens"
        w = float(self.policy.window_tokens)
        np.add.at(self.q[r], ids, c * (w / tokens) if tokens > w else c)

    def observe_step(self, layers, ids: np.ndarray) -> None:
        """Count one decode token's routing of several layers at once: ``ids`` int [len(layers), K] (a
        replayed step's, engine/decode_graph.py: one numpy update for the step, not one per layer)."""
        rows = [self._row.get(int(i), -1) for i in layers]
        keep = [j for j, r in enumerate(rows) if r >= 0]
        if not keep:
            return
        r = np.array([rows[j] for j in keep])
        sel = np.asarray(ids, np.int64)[keep]  # [n, K]
        self.q[r] *= self._decay
        np.add.at(self.q, (np.repeat(r, sel.shape[1]), sel.ravel()), 1.0)

    def step(self) -> int:
        """After a decode token: a round every ``every_tokens`` tokens. Returns the exchanges made."""
        self._tokens += 1
        return self.rebalance() if self._tokens % max(1, self.policy.every_tokens) == 0 else 0

    def rebalance(self) -> int:
        """One round over the layers (module docstring's rule). Returns the exchanges made."""
        made, t0 = 0, time.perf_counter()
        # every layer's hottest mapped and coldest VRAM count at once: the common case moves nothing
        hot_q = np.where(self._mapped, self.q, -np.inf).max(1)  # [L]
        cold_q = np.where(self._in_vram, self.q, np.inf).min(1)
        with np.errstate(invalid="ignore"):
            lead = hot_q - cold_q - self.policy.z * np.sqrt(np.maximum(0.0, hot_q + cold_q))
        for r in np.flatnonzero(lead > self.policy.lead).tolist():
            layer = self.layers[r]
            q = self.q[r]
            vram, mapped = self._split(layer)
            hot = mapped[np.lexsort((mapped, -q[mapped]))]  # hottest first, ties to the lower id
            cold = vram[np.lexsort((vram, q[vram]))]  # coldest first
            for h, c in zip(hot.tolist(), cold.tolist()):
                if made >= self.policy.max_swaps or not self.policy.pays(q[h], q[c]):
                    break
                self._exchange(layer, h, c)
                made += 1
        if made:
            self.swap_s += time.perf_counter() - t0
        return made

    def _exchange(self, layer: int, hot: int, cold: int) -> None:
        ew_hot, ew_cold = self.rm.held_weights(layer, hot), self.rm.held_weights(layer, cold)
        self.be.d_expert_exchange(self.tables[layer], hot, cold, ew_hot, ew_cold)
        self.rm.swap_tiers(layer, hot, cold)  # hot now in cold's VRAM buffers, cold in hot's mapped ones
        r = self._row[layer]
        self._in_vram[r, [hot, cold]], self._mapped[r, [hot, cold]] = (True, False), (False, True)
        self.swaps += 1
        self.swap_bytes += 2 * sum(w.nbytes for w in ew_hot)
