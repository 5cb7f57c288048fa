"""Where every (layer, expert) of a model lives, as the engine reads it from a plan file.

A :class:`Placement` is the engine's view of a plan's tiers: per MoE layer the experts resident in VRAM
on each device ("cuda:0"), the experts pinned in RAM, and the number of LRU slots; every other expert
of the layer is streamed from disk through that layer's LRU cache; ``trunk`` says where the dense trunk,
attention and the KV cache run (the plan's ``trunk`` section). It is built from a loaded plan
(:meth:`Placement.from_plan`, the only place a plan becomes a Placement) or directly (tests, the all-RAM
reference, `run` without a plan).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from colibri_plan.errors import FormatError


@dataclass
class LayerPlacement:
    """Tiers of one MoE layer.

    Attributes:
        vram: device key ("<backend>:<index>") -> expert ids resident there.
        ram_pinned: expert ids loaded into RAM at start-up.
        lru_slots: streamed experts this layer keeps cached in RAM (least recently used evicted).
    """

    vram: dict[str, list[int]] = field(default_factory=dict)
    ram_pinned: list[int] = field(default_factory=list)
    lru_slots: int = 0

    def resident(self) -> set[int]:
        """Experts that never touch the disk after start-up (VRAM or pinned)."""
        ids = set(self.ram_pinned)
        for v in self.vram.values():
            ids.update(v)
        return ids


@dataclass
class Placement:
    """Per-layer tiers for a whole model: ``layers[layer_id] -> LayerPlacement``.

    ``compute`` maps the host tiers ("ram_pinned", "lru", "disk") to the processor that computes them:
    "cpu" (the default for a missing tier) or a unified-memory device key (docs/engine.md,
    :mod:`colibri_plan.engine.unified`). ``repin`` is the live re-pinning policy (a
    :class:`colibri_plan.engine.repin.RepinPolicy`, None = off). ``trunk`` is a
    :class:`colibri_plan.formats.plan_trunk.TrunkPlacement` (None = the host CPU); its device is opened
    beside :meth:`device_keys` by the session. ``page_cache_experts`` (None: O_DIRECT reads) is a plan
    that chose buffered reads: the page cache may keep the last that many streamed experts read
    (the plan's ``knobs.page_cache.capacity_bytes`` plus the LRU slots' copies, planner/reads.py).
    """

    layers: dict[int, LayerPlacement]
    compute: dict[str, str] = field(default_factory=dict)
    repin: object = None
    trunk: object = None
    page_cache_experts: int | None = None

    def layer(self, layer_id: int) -> LayerPlacement:
        """The tiers of one MoE layer (an empty placement — everything streamed, no slots — if absent)."""
        return self.layers.get(int(layer_id), LayerPlacement())

    def device_keys(self) -> list[str]:
        """Every device key with VRAM experts or computing a host tier (the devices a run opens)."""
        keys = {k for lp in self.layers.values() for k, ids in lp.vram.items() if ids}
        return sorted(keys | {k for k in self.compute.values() if k != "cpu"})

    def validate(self, moe_layers: Iterable[int], n_experts: int) -> None:
        """Check that layers exist, ids are in range and no expert is in two tiers.

        Raises:
            FormatError: naming the layer and expert at fault.
        """
        valid = set(int(l) for l in moe_layers)
        for lid, lp in self.layers.items():
            if lid not in valid:
                raise FormatError(f"placement names layer {lid}, which is not a MoE layer of this model "
                                  f"({sorted(valid)})")
            if lp.lru_slots < 0:
                raise FormatError(f"layer {lid}: lru_slots must be >= 0, got {lp.lru_slots}")
            seen: set[int] = set()
            for tier, ids in [("ram_pinned", lp.ram_pinned)] + [(f"vram {k}", v) for k, v in lp.vram.items()]:
                for e in ids:
                    if not 0 <= int(e) < n_experts:
                        raise FormatError(f"layer {lid}: expert {e} in {tier} is out of range "
                                          f"0..{n_experts - 1}")
                    if int(e) in seen:
                        raise FormatError(f"layer {lid}: expert {e} is placed in two tiers")
                    seen.add(int(e))

    @classmethod
    def all_ram(cls, moe_layers: Iterable[int], n_experts: int) -> Placement:
        """Every expert pinned in RAM (the CPU reference)."""
        return cls({int(l): LayerPlacement(ram_pinned=list(range(n_experts))) for l in moe_layers})

    @classmethod
    def all_disk(cls, moe_layers: Iterable[int], lru_slots: int = 1) -> Placement:
        """Every expert streamed, ``lru_slots`` cached per layer."""
        return cls({int(l): LayerPlacement(lru_slots=lru_slots) for l in moe_layers})

    @classmethod
    def from_plan(cls, plan) -> Placement:
        """The engine's placement of a loaded plan (:class:`colibri_plan.formats.plan.Plan`): the one place
        a plan becomes a Placement. Tier codes come from :meth:`Plan.tiers` (device position in
        ``plan.device_keys``, ``TIER_RAM`` pinned, ``TIER_DISK`` streamed), slots from
        :meth:`Plan.lru_slots`, the trunk from :func:`~colibri_plan.formats.plan_trunk.parse_trunk`.

        Raises:
            FormatError: a malformed plan or trunk section (load plans with ``load_plan``, which checks
                them first).
        """
        from colibri_plan.formats.plan import TIER_RAM
        from colibri_plan.formats.plan_trunk import parse_trunk

        try:
            tiers, slots, keys = plan.tiers(), plan.lru_slots(), plan.device_keys
            out = {int(lid): LayerPlacement(
                       vram={k: np.flatnonzero(row == d).tolist() for d, k in enumerate(keys)
                             if np.any(row == d)},
                       ram_pinned=np.flatnonzero(row == TIER_RAM).tolist(), lru_slots=int(s))
                   for lid, row, s in zip(plan.layer_ids, tiers, slots)}
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise FormatError(f"plan layer entry is malformed ({exc!r}); re-create the plan") from exc
        from colibri_plan.engine.repin import RepinPolicy

        n_layers = plan.doc["model"].get("n_layers")
        trunk = parse_trunk(plan.doc, plan.device_keys, n_layers if isinstance(n_layers, int) else None)
        return cls(out, compute=dict(plan.doc.get("compute") or {}), repin=RepinPolicy.from_plan(plan),
                   trunk=trunk, page_cache_experts=_page_cache_experts(plan.doc, sum(slots)))

    @classmethod
    def all_resident(cls, moe_layers: Iterable[int], n_experts: int, device: str | None = None) -> Placement:
        """Every expert resident: pinned in RAM (``device`` None), or in VRAM on ``device``
        ("<backend>:<index>"). What `run` without a plan uses."""
        if device is None:
            return cls.all_ram(moe_layers, n_experts)
        return cls({int(l): LayerPlacement(vram={device: list(range(n_experts))}) for l in moe_layers})

    def summary(self) -> dict:
        """Counts per tier over all layers."""
        return {
            "vram": {k: sum(len(lp.vram.get(k, [])) for lp in self.layers.values())
                     for k in self.device_keys()},
            "ram_pinned": sum(len(lp.ram_pinned) for lp in self.layers.values()),
            "lru_slots": sum(lp.lru_slots for lp in self.layers.values()),
        }


def _page_cache_experts(doc: dict, lru_slots_total: int) -> int | None:
    """Experts the page cache may keep under a plan with ``knobs.o_direct`` false (None: O_DIRECT): its
    ``knobs.page_cache.capacity_bytes`` in experts, plus the LRU slots, whose experts the page cache
    holds a second copy of (the cost model prices those bytes twice, planner/page_cache.py)."""
    knobs = doc.get("knobs") or {}
    if knobs.get("o_direct", True) is not False:
        return None
    cap = (knobs.get("page_cache") or {}).get("capacity_bytes", 0)
    expert_bytes = doc["model"]["expert_bytes"]
    return int(cap // expert_bytes) + int(lru_slots_total) if expert_bytes > 0 else int(lru_slots_total)
