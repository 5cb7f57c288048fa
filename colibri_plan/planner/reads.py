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

The decision (:func:`choose_reads`, ``solve --reads``) is O_DIRECT unless buffered reads *inside the
budget* beat it beyond :data:`NOISE`; then the plan predicts the warm figure with the page cache inside
``--ram`` and the engine reads buffered, keeping the page cache within those bytes (one LRU over all
layers, engine/streaming.py), so a run measures what the plan priced.
"""

from __future__ import annotations

import dataclasses

NOISE = 0.05


def _priced(setup, tiers, slots, pool: int, cost_of) -> dict:
    res = dataclasses.replace(setup.res, page_cache_pool_bytes=max(0, int(pool)))
    s = dataclasses.replace(setup, res=res, problem=dataclasses.replace(setup.problem, res=res))
    c = cost_of(s, tiers, slots)
    return {"tok_s": c["tok_s"], "decode_s_per_token": c["decode_s_per_token"],
            "page_cache_hit_rate": c["page_cache"]["hit_rate"],
            "page_cache_bytes": int(c["page_cache"]["capacity_experts"]) * setup.problem.expert_bytes,
            "disk_bytes_per_token": c["disk_bytes_per_token"]}


def reads_section(setup, tiers, slots, cost_of) -> dict:
    """The plan's ``reads`` section (module docstring), priced by ``cost_of`` (planner.make's, passed in:
    make imports this module): {"o_direct", "buffered_warm",
    "buffered_warm_beyond", "buffered_cold": {tok_s, decode_s_per_token, page_cache_hit_rate,
    page_cache_bytes, disk_bytes_per_token}, "chosen", "why", "engine_supports"}."""
    budget = int(setup.problem.ram_budget_bytes)
    machine_pool = int(setup.knobs.get("page_cache_pool_bytes", 0))
    direct = _priced(setup, tiers, slots, 0, cost_of)
    warm = _priced(setup, tiers, slots, budget, cost_of)
    beyond = _priced(setup, tiers, slots, max(budget, machine_pool), cost_of)
    copy_s = direct["disk_bytes_per_token"] / (setup.res.ram_read_gbps * 1e9)
    cold_s = direct["decode_s_per_token"] + copy_s
    cold = {**direct, "decode_s_per_token": cold_s, "tok_s": 1 / cold_s if cold_s > 0 else 0.0}
    gain = warm["tok_s"] / direct["tok_s"] - 1 if direct["tok_s"] > 0 else 0.0
    if gain > NOISE:
        why = (f"buffered reads with a warm page cache inside the budget would give {gain:+.0%} "
               f"({warm['tok_s']:.3f} tok/s) but --reads o_direct was asked for; cold they give "
               f"{cold['tok_s']:.3f}")
    else:
        why = (f"buffered reads gain {gain:+.0%} warm inside the budget (the pins and LRU slots leave the "
               f"page cache {warm['page_cache_bytes'] / 1e9:.2f} GB) and lose cold "
               f"({cold['tok_s']:.3f} tok/s)")
    if beyond["tok_s"] > direct["tok_s"] * (1 + NOISE) and machine_pool > budget:
        why += (f"; with {(machine_pool - budget) / 1e9:.2f} GB of page cache beyond --ram they would give "
                f"{beyond['tok_s']:.3f} tok/s: give that memory to --ram instead")
    return {"o_direct": direct, "buffered_warm": warm, "buffered_warm_beyond": beyond, "buffered_cold": cold,
            "chosen": "o_direct", "why": why, "engine_supports": ["o_direct", "buffered"]}


def reads_line(sec: dict) -> str:
    """The "Reads:" line of ``solve`` and ``plan show``."""
    d, w, b, c = (sec[k]["tok_s"] for k in ("o_direct", "buffered_warm", "buffered_warm_beyond",
                                            "buffered_cold"))
    chosen = sec.get("chosen", "o_direct")
    mark = {k: " (chosen)" if chosen == k else "" for k in ("o_direct", "buffered_warm")}
    return (f"Reads: O_DIRECT {d:.3f} tok/s{mark['o_direct']}; buffered warm {w:.3f}{mark['buffered_warm']} "
            f"inside the budget, {b:.3f} with the page cache beyond it, cold {c:.3f}: {sec['why']}")


READ_CHOICES = ("auto", "o_direct", "buffered")


def choose_reads(setup, tiers, slots, cost_of, mode: str = "auto"):
    """O_DIRECT or buffered reads for our engine: ``(setup, section)``.

    ``mode`` "o_direct" / "buffered" forces one; "auto" takes buffered when its warm price inside the
    budget beats O_DIRECT's beyond :data:`NOISE`. With buffered, the returned setup prices the page cache
    inside ``ram_budget_bytes`` (``Resources.page_cache_pool_bytes``; its ``knobs.o_direct`` false), which
    the plan document then predicts and the engine enforces (``knobs.page_cache.capacity_bytes``:
    engine/streaming.py keeps that many experts' pages, plus the LRU slots' copies); otherwise ``setup``
    unchanged. ``section``: :func:`reads_section` with ``chosen`` set and why."""
    sec = reads_section(setup, tiers, slots, cost_of)
    direct_tok_s = sec["o_direct"]["tok_s"]
    gain = sec["buffered_warm"]["tok_s"] / direct_tok_s - 1 if direct_tok_s > 0 else 0.0
    buffered = mode == "buffered" or (mode == "auto" and gain > NOISE)
    if not buffered:
        return setup, sec
    budget = int(setup.problem.ram_budget_bytes)
    res = dataclasses.replace(setup.res, page_cache_pool_bytes=budget)
    new = dataclasses.replace(setup, res=res, problem=dataclasses.replace(setup.problem, res=res),
                              knobs={**setup.knobs, "o_direct": False})
    why = ("--reads buffered" if mode == "buffered"
           else f"buffered reads gain {gain:+.0%} warm inside the budget")
    sec = {**sec, "chosen": "buffered_warm", "engine_supports": ["o_direct", "buffered"],
           "why": f"{why}; a cold cache gives {sec['buffered_cold']['tok_s']:.3f} tok/s until the page "
                  f"cache holds its {sec['buffered_warm']['page_cache_bytes'] / 1e9:.2f} GB"}
    return new, sec
