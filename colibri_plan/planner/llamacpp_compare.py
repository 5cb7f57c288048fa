"""``solve --compare``'s llama.cpp rows, priced by llama.cpp's own cost model (:mod:`.llamacpp_cost`).

The "llama.cpp --fit layers" row keeps its placement for the our-engine column (``tok_s_our_engine``:
whole layers on the GPU, placement alone) but its as-run figures are llama.cpp's: ``--fit``'s placement
(:func:`~.llamacpp_choice.fit_placement`) with llama.cpp's compute, graph splits and mmap page faults
inside the RAM limit, and its coefficients (``calibrated_on`` says from which replays, or "uncalibrated").
When the llama.cpp pick differs from ``--fit`` and beats it beyond the noise, a row
"llama.cpp (colibri-plan choice)" follows the baselines (it is our recommendation, not a baseline).
When ``--no-mmap`` cannot hold the weights within the RAM limit, "llama.cpp --no-mmap" follows with the
outcome "does not fit (OOM)" instead of a speed.
"""

from __future__ import annotations

FIT_ROW = "llama.cpp --fit layers"
CHOICE_ROW = "llama.cpp (colibri-plan choice)"
NO_MMAP_ROW = "llama.cpp --no-mmap"


def _gpu_share(g, pick: dict) -> float:
    """Share of routed selections served from the GPU (whole expert layers there; uniform per layer)."""
    moe = [lay for lay in range(g.n_layers) if g.moe[lay]]
    return len(pick["gpu_expert_layers"]) / len(moe) if moe else 0.0


def _as_row(base: dict, g, pick: dict, llama: dict, name: str) -> dict:
    """A compare row from ``base`` (the our-model row of the same family) with llama.cpp's figures."""
    row = {**base, "placement": name}
    d = pick["decode_tok_s"]
    gpu = _gpu_share(g, pick)
    host_read = max(1e-12, (1 - gpu) * g.top_k * sum(g.moe) * g.expert_bytes)
    fault = float(pick["fault_bytes_per_token"])
    row.update({"tok_s": d, "decode_s_per_token": 1 / d if d > 0 else float("inf"),
                "prefill_tok_s": pick["prefill_tok_s"], "disk_bytes_per_token": fault,
                "hit_rate": {"vram": gpu, "ram_pinned": 0.0, "lru": 0.0, "disk": 1 - gpu},
                "llama_args": pick["args"], "llama_memory": pick["memory"],
                "calibrated_on": llama["calibrated_on"]})
    row["knobs"] = {**base.get("knobs", {}),
                    "page_cache_hit_rate": max(0.0, 1 - fault / host_read) if gpu < 1 else 0.0,
                    "page_cache_bytes": max(0, int(llama["budgets"]["ram_limit_bytes"])
                                            - int(pick["memory"]["anon_host"])),
                    "o_direct": False, "pinned_experts": 0, "lru_slots_max": 0}
    return row


def apply(rows: list[dict], llama: dict, geometry) -> int:
    """Replace the fit row's as-run figures in ``rows`` with llama.cpp's and append the choice row when
    it differs, and the ``--no-mmap`` row when it does not fit the RAM limit (:func:`oom_row`); returns
    how many rows were appended (0 to 2)."""
    i = next((k for k, r in enumerate(rows) if r["placement"] == FIT_ROW), None)
    if i is None:
        return 0
    fit = llama.get("fit") or llama["chosen"]          # no GPU: --fit runs everything on the CPU
    rows[i] = _as_row(rows[i], geometry, fit, llama, FIT_ROW)
    added = 0
    if llama["verdict"] == "use" and llama.get("fit") and llama["chosen"]["args"] != llama["fit"]["args"]:
        rows.append(_as_row(rows[i], geometry, llama["chosen"], llama, CHOICE_ROW))
        added += 1
    nm = llama.get("no_mmap")
    if isinstance(nm, dict) and nm.get("outcome") == "does not fit (OOM)":
        rows.append(oom_row(rows[i], nm, llama))
        added += 1
    return added


def oom_row(base: dict, nm: dict, llama: dict) -> dict:
    """The ``--no-mmap`` row when its weights and buffers exceed the RAM limit: an outcome, not a speed
    (``tok_s`` 0, ``outcome`` "does not fit (OOM)" and why; no ratio to the baselines)."""
    row = {**base, "placement": NO_MMAP_ROW, "engine": "llama.cpp (no-mmap)", "tok_s": 0.0,
           "tok_s_our_engine": 0.0, "decode_s_per_token": float("inf"), "prefill_tok_s": None,
           "disk_bytes_per_token": 0.0, "outcome": nm["outcome"], "why": nm["why"],
           "llama_args": nm["args"], "llama_memory": nm["memory"], "calibrated_on": llama["calibrated_on"],
           "not_comparable": True}
    row["knobs"] = {**base.get("knobs", {}), "o_direct": False, "page_cache_hit_rate": 0.0}
    return row
