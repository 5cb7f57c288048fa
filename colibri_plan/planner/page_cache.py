"""The OS page cache as a tier, for engines that read experts through it: a memory-pressure model.

Our engine reads streamed experts with O_DIRECT, so the page cache serves it nothing. Other engines read
through it: llama.cpp maps the model file (``mmap``: its CPU layers' experts *are* page-cache pages), and
colibrì reads with buffered ``pread`` unless ``DIRECT=1`` (its docs call the page cache a "free L2"; with
cap 1 on macOS, or ``COLI_MMAP=1``, it is the only expert cache). For them:

* **Capacity.** What the page cache can hold of the expert file is what the process leaves:
  available memory − everything the process pins or allocates (dense trunk, KV cache, working buffers,
  pinned experts, LRU slots, host copies of VRAM experts, unified-GPU experts) − OS headroom. The
  planner computes the part that does not depend on the placement once
  (``Resources.page_cache_pool_bytes`` = available − dense − KV − buffers − OS headroom) and each
  placement's own allocations here (:func:`page_cache_experts`).
* **Duplicates.** The engine's own LRU slots hold the experts it read most recently, and every read goes
  through the page cache, so those pages are the most recent ones there as well: each LRU slot occupies
  its bytes twice (once allocated, once as page cache). Giving such an engine more ``--ram`` for LRU
  slots therefore *shrinks* what is cached in all: the "more --ram is slower" cases.
* **Hit rate.** The page cache is one LRU over every expert read from the file (all layers together);
  it sees the reads the engine's own tiers miss, each (layer, expert) with probability q = p·(1 − h) per
  token, and its hit rate comes from Che's characteristic-time approximation on those q
  (:func:`~colibri_plan.planner.cache_model.che_hit_rates`; Che, Tung, Wang 2002, applied to the filtered
  miss stream as for a second-level cache).
* **Cost.** A page-cache hit is a copy at RAM read GB/s instead of a disk read (for mmap it is read in
  place: the copy cost is an upper bound).

Units: bytes and shares of requests in [0, 1].
"""

from __future__ import annotations

import numpy as np

from colibri_plan.planner.cache_model import che_hit_rates

GB = 1_000_000_000
#: memory the OS itself keeps (kernel, other processes): the budgets' OS share of available memory
OS_SHARE = 0.05


def page_cache_pool(available_bytes: int, dense_bytes: int, kv_bytes: int, working_bytes: int,
                    os_share: float = OS_SHARE) -> int:
    """Bytes the page cache may use for the expert file before a placement's own allocations: available
    − dense trunk − KV cache − working buffers − ``os_share`` x available (never negative)."""
    return max(0, int(available_bytes - dense_bytes - kv_bytes - working_bytes
                      - os_share * available_bytes))


def page_cache_experts(pool_bytes: int, expert_bytes: int, resident_experts: int, lru_slots: int) -> int:
    """Experts the page cache holds under a placement: (pool − resident experts' bytes − 2 x LRU slot bytes)
    // expert bytes, at least 0. ``resident_experts`` counts every expert the process holds in RAM
    (pinned, unified-GPU, host copies of VRAM experts); the LRU slots count twice (module docstring)."""
    if pool_bytes <= 0 or expert_bytes <= 0:
        return 0
    return max(0, int((pool_bytes - (resident_experts + 2 * lru_slots) * expert_bytes) // expert_bytes))


def page_cache_hit_rates(q: np.ndarray, capacity_experts: int) -> np.ndarray:
    """float ``[rows, E]``: page-cache hit rate of each (layer, expert) read, from the read probabilities
    per token ``q`` ``[rows, E]`` (the misses of the engine's own tiers) and a capacity in experts: Che's
    approximation over all rows as one LRU (module docstring)."""
    q = np.asarray(q, dtype=np.float64)
    if capacity_experts <= 0 or not np.any(q > 0):
        return np.zeros_like(q)
    return che_hit_rates(q.ravel(), int(capacity_experts)).reshape(q.shape)
