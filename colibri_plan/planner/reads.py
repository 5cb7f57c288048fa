"""How our engine reads streamed experts, priced: O_DIRECT against buffered reads, cold or warm page cache.

The plan's ``reads`` section (``solve`` prints it as its "Reads:" line) prices the solved placement four
ways with the one cost model (:func:`~colibri_plan.planner.make.cost_of`):

* ``o_direct`` — what the engine does: every miss is an O_DIRECT read at the plan's queue depth.
* ``buffered_warm`` — buffered reads with a warm page cache *inside the budget*: the page cache may hold
  what ``--ram``'s expert bytes leave after the pins and twice the LRU slots (an LRU slot's pages are
  cached as well; :mod:`.page_cache`).
* ``buffered_warm_beyond`` — the same with the machine's whole page-cache pool (available memory less
  dense, KV, buffers and the OS share): memory beyond the budget, shown, never chosen on its own.
* ``buffered_cold`` — the first pass over a cold cache: no page-cache hit, and every miss also pays the
  copy out of the page cache at RAM read GB/s (``disk bytes per token / RAM GB/s`` on top of O_DIRECT's
  cost): a cold buffered run is never faster than O_DIRECT.

The decision is O_DIRECT unless buffered reads *inside the budget* beat it beyond :data:`NOISE` (the
engine reads with O_DIRECT only: that case is reported as a gain it leaves, ``engine_supports``).
"""

from __future__ import annotations

import dataclasses

NOISE = 0.05


def _priced(setup, tiers, slots, pool: int) -> dict:
    from colibri_plan.planner.make import cost_of

    res = dataclasses.replace(setup.res, page_cache_pool_bytes=max(0, int(pool)))
    s = dataclasses.replace(setup, res=res, problem=dataclasses.replace(setup.problem, res=res))
    c = cost_of(s, tiers, slots)
    return {"tok_s": c["tok_s"], "decode_s_per_token": c["decode_s_per_token"],
            "page_cache_hit_rate": c["page_cache"]["hit_rate"],
            "page_cache_bytes": int(c["page_cache"]["capacity_experts"]) * setup.problem.expert_bytes,
            "disk_bytes_per_token": c["disk_bytes_per_token"]}


def reads_section(setup, tiers, slots) -> dict:
    """The plan's ``reads`` section (module docstring): {"o_direct", "buffered_warm",
    "buffered_warm_beyond", "buffered_cold": {tok_s, decode_s_per_token, page_cache_hit_rate,
    page_cache_bytes, disk_bytes_per_token}, "chosen", "why", "engine_supports"}."""
    budget = int(setup.problem.ram_budget_bytes)
    machine_pool = int(setup.knobs.get("page_cache_pool_bytes", 0))
    direct = _priced(setup, tiers, slots, 0)
    warm = _priced(setup, tiers, slots, budget)
    beyond = _priced(setup, tiers, slots, max(budget, machine_pool))
    copy_s = direct["disk_bytes_per_token"] / (setup.res.ram_read_gbps * 1e9)
    cold_s = direct["decode_s_per_token"] + copy_s
    cold = {**direct, "decode_s_per_token": cold_s, "tok_s": 1 / cold_s if cold_s > 0 else 0.0}
    gain = warm["tok_s"] / direct["tok_s"] - 1 if direct["tok_s"] > 0 else 0.0
    if gain > NOISE:
        why = (f"buffered reads with a warm page cache inside the budget would give {gain:+.0%} "
               f"({warm['tok_s']:.3f} tok/s) but this engine reads with O_DIRECT only; cold they give "
               f"{cold['tok_s']:.3f}")
    else:
        why = (f"buffered reads gain {gain:+.0%} warm inside the budget (the pins and LRU slots leave the "
               f"page cache {warm['page_cache_bytes'] / 1e9:.2f} GB) and lose cold "
               f"({cold['tok_s']:.3f} tok/s)")
    if beyond["tok_s"] > direct["tok_s"] * (1 + NOISE) and machine_pool > budget:
        why += (f"; with {(machine_pool - budget) / 1e9:.2f} GB of page cache beyond --ram they would give "
                f"{beyond['tok_s']:.3f} tok/s: give that memory to --ram instead")
    return {"o_direct": direct, "buffered_warm": warm, "buffered_warm_beyond": beyond, "buffered_cold": cold,
            "chosen": "o_direct", "why": why, "engine_supports": ["o_direct"]}


def reads_line(sec: dict) -> str:
    """The "Reads:" line of ``solve`` and ``plan show``."""
    d, w, b, c = (sec[k]["tok_s"] for k in ("o_direct", "buffered_warm", "buffered_warm_beyond",
                                            "buffered_cold"))
    return (f"Reads: O_DIRECT {d:.3f} tok/s (chosen); buffered warm {w:.3f} inside the budget, {b:.3f} "
            f"with the page cache beyond it, cold {c:.3f}: {sec['why']}")
