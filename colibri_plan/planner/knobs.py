"""The engine knobs a plan is solved for, and the plan's ``knobs`` section that makes them visible.

Issue #16 found that real outcomes turned on knobs the solver could not express. Each is now a solve
option with a default, recorded in the plan (``knobs``, docs/plan-format.md) and in ``solve --compare``:

* **target** — the engine the plan is for: ``colibri-plan`` (ours: O_DIRECT reads, no VRAM overhead) or
  ``colibri`` (colibrì: reads at queue depth 1–2, 0.741 MiB of VRAM allocation overhead per expert,
  measured in colibrì #687/#1244; the export then sets ``DIRECT=1``).
* **queue depth** — the number of expert reads the engine really has in flight, and so the disk figure
  the cost model uses: ours reads a layer's misses with ``working_buffers`` = top-k buffers (the best
  measured depth <= top-k, as the plan's read threads); colibrì reads at depth 1–2
  (:data:`COLIBRI_QUEUE_DEPTH`); ``--queue-depth N`` sets it.
* **LRU model** — with a routing trace in the heat, LRU hit rates come from stack distances
  (:mod:`colibri_plan.planner.cache_model`) and ``--lru-slots auto`` searches the slot count per layer
  among a few multiples of top-k (a trace with locality makes a bigger cache with fewer pins faster);
  without one, Che's approximation and the fixed reserve.
* **host copies** — ``--keep-host-copies`` (colibrì ``CUDA_RELEASE_HOST=0``): RAM for a host copy of each
  VRAM expert.
* **page cache** — what the OS page cache could hold beside the plan (:mod:`page_cache`), for engines
  that read through it.
* **re-pinning** — ``--repin-every N`` / ``--repin-window W``: the plan's ``repin`` section
  (:func:`repin_section`), the engine's live re-pinning policy (docs/engine.md, "Live re-pinning").
"""

from __future__ import annotations

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.formats.fields import is_whole
from colibri_plan.formats.plan import TIER_RAM
from colibri_plan.planner.page_cache import page_cache_experts

#: colibrì's measured VRAM allocation overhead per expert (#687, accounted since #1244), bytes
COLIBRI_VRAM_OVERHEAD_BYTES = int(0.741 * 2**20)
#: queue depth colibrì's expert reads reach (issue #16: it reads at depth 1–2)
COLIBRI_QUEUE_DEPTH = 2
#: llama.cpp: the placement is solved as for ours, and the plan's ``llamacpp`` section prices llama.cpp
#: as it runs (planner/llamacpp_cost.py) and picks what it can express (planner/llamacpp_choice.py)
TARGETS = ("colibri-plan", "colibri", "llama.cpp")
#: at most this many LRU slot counts are tried by the trace-driven search
MAX_SLOT_CANDIDATES = 7
#: default re-pinning window, in multiples of ``--repin-every`` (bench/repin_domain_shift.py: 8 and 32)
REPIN_WINDOW_FACTOR = 4
#: swaps per layer and round the plan's ``repin`` section allows (the engine's default)
REPIN_MAX_SWAPS = 4
#: the range formats/plan.py accepts for ``repin.every_tokens`` and ``repin.window_tokens``
REPIN_MAX_TOKENS = 1_000_000


def check_target(target: str) -> str:
    """``target`` if known, else InputError naming the choices."""
    if target not in TARGETS:
        raise InputError(f"--target must be one of {', '.join(TARGETS)}, got {target!r}")
    return target


def repin_section(every: int | None, window: int | None = None) -> dict | None:
    """The plan's ``repin`` section for ``--repin-every every`` / ``--repin-window window``: None when
    ``every`` is 0 or None (off); ``window`` None: :data:`REPIN_WINDOW_FACTOR` x ``every`` (at most
    :data:`REPIN_MAX_TOKENS`).

    Raises:
        InputError: a value outside 1..REPIN_MAX_TOKENS (``every`` may be 0), or a window without
        ``every``.
    """
    def whole(v, name: str, lo: int) -> int:
        if not is_whole(v) or not lo <= v <= REPIN_MAX_TOKENS:
            raise InputError(f"{name} must be a whole number in {lo}..{REPIN_MAX_TOKENS}, got {v!r}")
        return v

    every = whole(0 if every is None else every, "--repin-every", 0)
    if every == 0:
        if window is not None:
            raise InputError("--repin-window needs --repin-every N (tokens between re-pinning rounds)")
        return None
    window = min(REPIN_MAX_TOKENS, REPIN_WINDOW_FACTOR * every) if window is None else \
        whole(window, "--repin-window", 1)
    return {"enabled": True, "every_tokens": every, "window_tokens": window, "max_swaps": REPIN_MAX_SWAPS}


def choose_queue_depth(res, top_k: int, queue_depth="auto", target: str = "colibri-plan"):
    """The resources at the queue depth the target engine reads with, and where that depth came from.

    Returns:
        (resources, source): ``resources.disk_queue_depth`` / ``disk_read_gbps`` at the chosen depth.

    Raises:
        InputError: ``queue_depth`` is not "auto" or a whole number in 1..64.
    """
    if str(queue_depth) != "auto":
        try:
            q = int(str(queue_depth))
        except ValueError:
            q = 0
        if not 1 <= q <= 64:
            raise InputError(f"--queue-depth must be 'auto' or a whole number in 1..64, got {queue_depth!r}")
        return res.at_queue_depth(q), f"--queue-depth {q} (nearest measured depth <= it)"
    if target == "colibri":
        return (res.at_queue_depth(COLIBRI_QUEUE_DEPTH),
                f"colibrì reads at depth 1-{COLIBRI_QUEUE_DEPTH} (nearest measured depth <= "
                f"{COLIBRI_QUEUE_DEPTH})")
    return res, (f"the engine's working buffers: top-{top_k} reads in flight (best measured depth "
                 f"<= {top_k}; the engine reads with that many threads)")


def lru_slot_candidates(base: int, top_k: int, n_experts: int, fit: int) -> list[int]:
    """Slot counts per decode layer the trace-driven search tries: the automatic reserve ``base`` and
    top-k x {1/2, 1, 2, 3, 4, 6}, within 1..min(n_experts, ``fit``) (what the RAM budget holds)."""
    hi = max(1, min(int(n_experts), int(fit)))
    cands = {int(base)} | {max(1, int(round(top_k * m))) for m in (0.5, 1, 2, 3, 4, 6)}
    out = sorted(c for c in cands if 1 <= c <= hi)
    return out[:MAX_SLOT_CANDIDATES] or [min(max(1, int(base)), hi)]


def search_lru_slots(problem, solve, candidates: list[int]):
    """Solve once per uniform slot count (decode rows only) and keep the fastest by the full cost model.

    Args:
        problem: a :class:`~colibri_plan.planner.solve.Problem` (its ``lru_slots`` are replaced per try).
        solve: ``fn(problem) -> Solution``; candidates: slot counts per decode layer.

    Returns:
        (solution, problem of the best try, tries [{"slots", "tok_s", "lru_hit_rate"}]).
    """
    import dataclasses

    decode = problem.weights > 0
    best, tries = None, []
    for s in candidates:
        pr = dataclasses.replace(problem, lru_slots=np.where(decode, int(s), 0))
        try:
            sol = solve(pr)
        except Exception as exc:  # noqa: BLE001 - a slot count the budgets cannot hold is just skipped
            tries.append({"slots": int(s), "error": str(exc)[:120]})
            continue
        h = sol.cost["hit_rate"]
        streamed = h["lru"] + h["disk"]
        tries.append({"slots": int(s), "tok_s": sol.cost["tok_s"],
                      "lru_hit_rate": h["lru"] / streamed if streamed else 0.0})
        if best is None or sol.cost["decode_s_per_token"] < best[0].cost["decode_s_per_token"]:
            best = (sol, pr)
    if best is None:
        raise InputError("no LRU slot count fits the budgets; give --lru-slots or more --ram")
    return best[0], best[1], tries


def knobs_section(setup, tiers: np.ndarray, slots: np.ndarray, cost: dict) -> dict:
    """The plan's ``knobs`` section (docs/plan-format.md) for a placement under ``setup``."""
    pr, res = setup.problem, setup.res
    k = setup.knobs
    th = pr.trace_hits
    host = pr.host_copies(tiers)
    unified = [d for d, g in enumerate(res.gpus) if g.unified]
    resident = int(np.sum(tiers == TIER_RAM)) + int(np.isin(tiers, unified).sum()) + host
    trace = {}
    if th is not None:
        steps = th.trace.steps
        trace = {"trace_layers": th.rows_covered(), "trace_calls": len(steps),
                 "trace_decode_calls": int(sum(1 for s in steps if s == 1)),
                 "trace_dropped_calls": int(th.trace.dropped_steps),
                 # --time-limit passed during the stack distances: the rest was priced with Che
                 "trace_time_limited": bool(th.time_limited)}
    slot_rows = slots[pr.weights > 0] if np.any(pr.weights > 0) else slots
    return {
        "target": k["target"],
        "cache_model": {"kind": cost.get("cache_model", "che"), "lru_slots_mode": k["lru_slots_mode"],
                        "lru_slots_max": int(slots.max()) if slots.size else 0,
                        "lru_slots_mean": float(slot_rows.mean()) if slot_rows.size else 0.0,
                        **trace, "lru_search": list(k.get("lru_search", []))},
        "queue_depth": int(res.disk_queue_depth), "queue_depth_source": k["queue_depth_source"],
        "disk_read_gbps": res.disk_read_gbps,
        "o_direct": bool(k["o_direct"]),
        "vram_overhead_bytes_per_expert": int(pr.vram_overhead_bytes),
        "keep_host_copies": bool(pr.keep_host_copies), "host_copy_bytes": int(host * pr.expert_bytes),
        # the pool priced: the engine's own (buffered reads inside the budget) when used, else the machine's
        "page_cache": {"pool_bytes": int(res.page_cache_pool_bytes or k["page_cache_pool_bytes"]),
                       "capacity_bytes": pr.expert_bytes * page_cache_experts(
                           int(res.page_cache_pool_bytes or k["page_cache_pool_bytes"]), pr.expert_bytes,
                           resident, int(np.sum(slots))),
                       "used": bool(res.page_cache_pool_bytes > 0)},
        "ram_warnings": list(k.get("ram_warnings", [])),
    }
