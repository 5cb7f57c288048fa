"""Live re-pinning: count routing online and swap cold resident experts for hot streamed ones (issue #16).

A plan solved from one heat pins that heat's hot experts; when the prompts drift to another domain those
pins go cold while the new hot experts stream from disk on every use. A :class:`Repinner` watches the
routing the engine serves and, every ``every_tokens`` tokens, re-ranks each MoE layer.

**Estimate.** Per layer and expert an exponentially decayed count ``c_e`` of selections and a decayed
token count ``d`` with the same decay ``(1 − 1/window_tokens)`` per token; ``q_e = c_e / d`` is the
expected selections per token over roughly the last ``window_tokens`` tokens.

**Rule** (one swap = the hottest streamed expert ``h`` in, the coldest resident expert ``c`` of one
resident tier out, repeated while it pays):

    saving    = (q_h − q_c) × miss_s × window_tokens        [s]  expected disk time saved over the window
    migration = bytes / disk_gbps (+ bytes / h2d_gbps for a VRAM tier)    [s]  reading h (and uploading it)
    swap  if  saving > migration

with ``miss_s = bytes / disk_gbps``, the disk seconds of one miss at the plan's disk figure (an LRU hit
would have saved some of them: the rule ignores the cache and so errs towards swapping when the hot
expert is often cached). For a pinned tier the rule reduces to ``(q_h − q_c) × window_tokens > 1``: pin
the newcomer when it is expected to be selected at least once more than the expert it replaces over the
window. The evicted expert goes to the disk tier (streamed through the layer's LRU); tokens are
unchanged (the same expert weights, computed on the same processors as the tier it joins).

The rates come from the plan (``resources.disk_read_gbps``, ``resources.gpus[].h2d_gbps``); a migration
is a synchronous read between two tokens, so its seconds show in the decode time and are reported
(``repins``, ``repin_bytes``, ``repin_s`` of the run report).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from colibri_plan.errors import FormatError

#: default disk GB/s when a plan carries no disk figure (a conservative NVMe random-read rate)
DEFAULT_DISK_GBPS = 2.0


@dataclass(frozen=True)
class RepinPolicy:
    """A plan's ``repin`` section.

    Attributes:
        enabled: re-pin at all (plans without the section: off).
        every_tokens: tokens between two re-ranking rounds (>= 1).
        window_tokens: decay window of the routing estimate and the horizon of the saving (>= 1).
        max_swaps: most swaps per layer and round (>= 1).
        disk_gbps: disk random-read GB/s (1e9 B/s) for misses and migrations.
        h2d_gbps: host-to-device GB/s per device key, for migrations into VRAM.
    """

    enabled: bool = False
    every_tokens: int = 16
    window_tokens: int = 64
    max_swaps: int = 4
    disk_gbps: float = DEFAULT_DISK_GBPS
    h2d_gbps: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("every_tokens", "window_tokens", "max_swaps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise FormatError(f"plan repin.{name} must be a whole number >= 1, got {v!r}")
        if not isinstance(self.enabled, bool):
            raise FormatError(f"plan repin.enabled must be true or false, got {self.enabled!r}")
        rates = [("disk_gbps", self.disk_gbps)] + [(f"h2d_gbps.{k}", v) for k, v in self.h2d_gbps.items()]
        for name, v in rates:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v <= 0:
                raise FormatError(f"plan repin {name} must be a positive number of GB/s, got {v!r}")

    @classmethod
    def from_doc(cls, section: dict | None, resources: dict | None = None) -> RepinPolicy | None:
        """The policy of a plan's ``repin`` section with the rates of its ``resources`` (None: no section).

        Raises:
            FormatError: a malformed section (naming the field).
        """
        if section is None:
            return None
        if not isinstance(section, dict):
            raise FormatError(f"plan repin must be an object, got {section!r}")
        unknown = set(section) - {"enabled", "every_tokens", "window_tokens", "max_swaps"}
        if unknown:
            raise FormatError(f"plan repin has unknown keys {sorted(unknown)}")
        res = resources if isinstance(resources, dict) else {}
        disk = res.get("disk_read_gbps") or DEFAULT_DISK_GBPS
        h2d = {g["key"]: g["h2d_gbps"] for g in res.get("gpus") or []
               if isinstance(g, dict) and isinstance(g.get("key"), str) and (g.get("h2d_gbps") or 0) > 0}
        return cls(**section, disk_gbps=disk, h2d_gbps=h2d)

    @classmethod
    def from_plan(cls, plan) -> RepinPolicy | None:
        """:meth:`from_doc` on a loaded plan (``plan.doc``)."""
        return cls.from_doc(plan.doc.get("repin"), plan.doc.get("resources"))

    def swap_pays(self, dq: float, nbytes: int, tier: str) -> bool:
        """The rule (module docstring): ``dq`` × miss seconds × window > migration seconds.

        Args:
            dq: q_hot − q_cold, expected selections per token. nbytes: one expert's bytes.
            tier: "ram_pinned" or a device key ("cuda:0") whose VRAM the newcomer joins.
        """
        miss_s = nbytes / (self.disk_gbps * 1e9)
        migration = miss_s
        if tier != "ram_pinned":
            migration += nbytes / (float(self.h2d_gbps.get(tier, self.disk_gbps)) * 1e9)
        return dq * miss_s * self.window_tokens > migration


class Repinner:
    """Online routing counts and the re-pinning rounds of one :class:`ResidencyManager`.

    Args:
        rm: the residency manager whose tiers it changes (:func:`resident_ids`, :func:`swap_resident`);
            its placement must be its own copy (the manager deep-copies it when re-pinning is on).
        policy: an enabled :class:`RepinPolicy`.
    """

    def __init__(self, rm, policy: RepinPolicy):
        self.rm, self.policy = rm, policy
        arch = rm.pack.arch
        self.first_layer = arch.moe_layers[0]
        self.top_k = arch.top_k
        self.decay = 1.0 - 1.0 / policy.window_tokens
        self.counts = {l: np.zeros(arch.n_experts) for l in arch.moe_layers}  # decayed selections
        self.norm = dict.fromkeys(arch.moe_layers, 0.0)                       # decayed tokens
        self.since = 0   # tokens since the last round

    def observe(self, layer: int, expert_ids, xs) -> None:
        """Count one forward call's routing of ``layer`` (``xs[i]``: the tokens routed to expert i); before
        the first MoE layer of a call, run a round when ``every_tokens`` tokens have passed."""
        n_tok = sum(len(x) for x in xs) / self.top_k   # each token chose top-k distinct experts
        if layer == self.first_layer:
            if self.since >= self.policy.every_tokens:
                self.round()
                self.since = 0
            self.since += int(round(n_tok))
        f = self.decay ** n_tok
        c = self.counts[layer]
        c *= f
        for e, x in zip(expert_ids, xs):
            c[int(e)] += len(x)
        self.norm[layer] = self.norm[layer] * f + n_tok

    def round(self) -> None:
        """One re-ranking of every layer: swap while :meth:`RepinPolicy.swap_pays` (at most max_swaps)."""
        rm, st = self.rm, self.rm.stats
        for layer, c in self.counts.items():
            if self.norm[layer] <= 0:
                continue
            q = c / self.norm[layer]
            for tier, members in resident_ids(rm, layer).items():
                streamed = sorted(set(range(len(c))) - {e for ids in resident_ids(rm, layer).values()
                                                          for e in ids})
                hot = sorted(streamed, key=lambda e: -q[e])
                cold = sorted(members, key=lambda e: q[e])
                for h, k in zip(hot[: self.policy.max_swaps], cold):
                    nbytes = rm.pack.expert_location(layer, int(h))[1]
                    if not self.policy.swap_pays(float(q[h] - q[k]), nbytes, tier):
                        break
                    t0 = time.perf_counter()
                    swap_resident(rm, layer, tier, int(k), int(h))
                    st.repin_s += time.perf_counter() - t0
                    st.repins += 1
                    st.repin_bytes += nbytes


def resident_ids(rm, layer: int) -> dict[str, list[int]]:
    """The resident tiers of ``layer`` in ``rm``'s placement: {device key: VRAM ids, "ram_pinned": ids}."""
    lp = rm.placement.layer(layer)
    return {**{k: list(v) for k, v in lp.vram.items() if v}, "ram_pinned": list(lp.ram_pinned)}


def swap_resident(rm, layer: int, tier: str, out_e: int, in_e: int) -> None:
    """Replace resident expert ``out_e`` of ``tier`` ("ram_pinned" or a VRAM device key) in ``layer`` by
    the streamed expert ``in_e``: one read of ``in_e`` from the pack (plus its upload on a device); a
    copy of ``in_e`` in the layer's LRU goes back to the free pool; ``out_e`` becomes a streamed expert.

    Raises:
        IntegrityError: the read fails or its checksum does not match (nothing is swapped then).
    """
    lp = rm.placement.layers[layer]
    k_in, k_out = (layer, in_e), (layer, out_e)
    scratch = None
    if tier != "ram_pinned" or k_out in rm._pinned_dev:   # a device holds the only copy: read, upload
        scratch = rm.slot_type(rm.block_bytes)
        rm._read_block(scratch, layer, in_e)
    cached = rm._lru[layer].pop(k_in, None)
    if cached is not None:
        rm._free.append(cached)
    if tier != "ram_pinned":
        ids = lp.vram[tier]
        ids[ids.index(out_e)] = in_e
        dev, w = rm._vram.pop(k_out)
        rm.tc.free(dev, w)
        rm._vram[k_in] = (dev, rm.tc.upload(dev, scratch.weights))
        return
    lp.ram_pinned[lp.ram_pinned.index(out_e)] = in_e
    if scratch is not None:
        dev, w = rm._pinned_dev.pop(k_out)
        rm.tc.free(dev, w)
        rm._pinned_dev[k_in] = (dev, rm.tc.upload(dev, scratch.weights))
        return
    slot = rm._pinned.pop(k_out)   # reuse the pinned buffer: read the newcomer over the old expert
    for w in slot.weights:
        rm.cpu.free(w)
    try:
        rm._read_block(slot, layer, in_e)
    except BaseException:
        rm._read_block(slot, layer, out_e)   # put the old expert back, then report the failure
        rm._pinned[k_out] = slot
        slot.weights = rm.cpu.upload_expert(*slot.weights)
        lp.ram_pinned[lp.ram_pinned.index(in_e)] = out_e
        raise
    slot.weights = rm.cpu.upload_expert(*slot.weights)
    rm._pinned[k_in] = slot
