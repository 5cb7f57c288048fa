"""Counters and timers of the residency manager (:class:`TierStats`), per tier, in the plan's vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field

from colibri_plan.formats.report import HIT_TIERS


@dataclass
class TierStats:
    """Counters and timers since the last :meth:`ResidencyManager.reset_stats` (seconds, bytes).

    ``uses`` counts expert computations served by each tier, keyed as a plan's ``hit_rate`` (vram,
    ram_pinned, lru, disk: a disk use is a miss, one read);
    ``disk_busy_s`` sums, per wave of concurrent reads, the time from the first submit to the last read's
    end (so ``disk_bytes / disk_busy_s`` is the disk throughput decode achieved);
    ``disk_wait_s`` is the time the CPU path waited for reads it had nothing else to do during;
    ``device_compute_s`` is per device key ("cuda:0"), wall time of its share of each layer
    (activation transfers included); ``layer_wall_s`` is the wall time inside :meth:`run`;
    ``repins``, ``repin_bytes``, ``repin_s`` count live re-pinning swaps, their bytes and seconds;
    ``page_cache_hits`` counts disk uses read from pages the plan's page cache kept (buffered reads);
    ``offloaded``, ``offload_h2d_bytes``, ``offload_h2d_s``: host experts a prefill copied to the trunk's GPU
    and computed there (engine/offload.py), their bytes and the upload seconds (inside the device's
    ``device_compute_s`` and ``layer_wall_s``; their uses count in the tiers they came from).
    """

    uses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(HIT_TIERS, 0))
    disk_bytes: int = 0
    disk_read_s: float = 0.0
    disk_busy_s: float = 0.0
    disk_wait_s: float = 0.0
    cpu_compute_s: float = 0.0
    device_compute_s: dict[str, float] = field(default_factory=dict)
    layer_wall_s: float = 0.0
    repins: int = 0           # live re-pinning swaps (engine.repin)
    repin_bytes: int = 0      # bytes read (and uploaded) for them
    repin_s: float = 0.0      # seconds the swaps took (between tokens, inside decode time)
    page_cache_hits: int = 0  # disk uses whose expert the plan's page cache kept (buffered reads)
    offloaded: int = 0        # host experts a prefill computed on the trunk's GPU (engine.offload)
    offload_h2d_bytes: int = 0
    offload_h2d_s: float = 0.0

    @property
    def expert_uses(self) -> int:
        return sum(self.uses.values())

    @property
    def misses(self) -> int:
        return self.uses["disk"]

    def hit_rates(self) -> dict[str, float]:
        """Share of expert computations served by each tier, keyed as a plan's ``hit_rate``."""
        n = max(1, self.expert_uses)
        return {tier: count / n for tier, count in self.uses.items()}

    def lru_hit_rate(self) -> float:
        """Hits among experts that are neither in VRAM nor pinned (the LRU cache's own hit rate)."""
        n = self.uses["lru"] + self.uses["disk"]
        return self.uses["lru"] / n if n else 0.0

    def to_dict(self) -> dict:
        d = dict(self.__dict__, uses=dict(self.uses))
        d["hit_rate"] = self.hit_rates()
        d["lru_hit_rate"] = self.lru_hit_rate()
        return d
