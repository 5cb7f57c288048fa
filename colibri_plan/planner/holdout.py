"""How far a plan's VRAM share carries beyond the heat it was solved on: two-fold cross-validation.

The solver places experts by the routing of one recorded run; the predicted share of selections served
from VRAM is measured on that same run, so it is optimistic for any other one. With a routing trace in the
heat, :func:`held_out_vram_share` splits its decode steps (forward calls of one token) into halves, picks in
each MoE layer as many experts as the plan holds in VRAM there by one half's counts, and measures their
share of the other half's selections, both ways. The mean is what a run with other tokens of the same
kind can expect; in-sample against held-out is how much the prediction counts on the heat repeating.
Measured on an H200 host (bench/results/h200-llamacpp-r6/heat-holdout.json): a 2.5 GB plan covered 99.9%
of its heat's decode selections in sample, 95.8% held out; the timed decode got 93.3%.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MIN_DECODE_STEPS", "decode_rows", "held_out_vram_share", "plan_held_out"]

#: fewer decode steps than this in the trace: no held-out figure (halves too small to say anything)
MIN_DECODE_STEPS = 16


def decode_rows(ids: np.ndarray, steps) -> np.ndarray:
    """The rows of one-token forward calls: ``ids`` int [tokens, K] of one layer (every call's rows in
    order), ``steps`` the rows per call -> int [decode steps, K]."""
    ends = np.cumsum(np.asarray(steps, np.int64))
    one = ends[np.asarray(steps) == 1] - 1  # the row of each one-token call
    return np.asarray(ids)[one]


def _coverage(rows: np.ndarray, chosen: np.ndarray) -> float:
    return float(np.isin(rows, chosen).mean()) if rows.size else 0.0


def _top(rows: np.ndarray, n: int, n_experts: int) -> np.ndarray:
    counts = np.bincount(rows.ravel(), minlength=n_experts)  # [E]
    return np.argsort(-counts, kind="stable")[:n]  # the n most selected, the lower id first on ties


def held_out_vram_share(trace, vram: dict[int, list[int]], n_experts: int) -> dict | None:
    """In-sample and held-out VRAM shares of a trace's decode selections.

    Args:
        trace: a :class:`~colibri_plan.formats.heat_trace.RoutingTrace` (``layers``, ``steps``,
            ``rows(layer)`` int [tokens, K]).
        vram: MoE layer id -> the expert ids the plan holds in VRAM (every GPU's), for the traced layers.
        n_experts: experts per MoE layer.

    Returns:
        {"in_sample", "held_out" (shares in [0, 1], means over the traced layers), "decode_steps"}, or
        None when the trace has fewer than :data:`MIN_DECODE_STEPS` decode steps or no layer of ``vram``.
    """
    ins, held, n_steps = [], [], 0
    for layer in trace.layers:
        if layer not in vram:
            continue
        rows = decode_rows(trace.rows(layer), trace.steps)  # [steps, K]
        n_steps = len(rows)
        if n_steps < MIN_DECODE_STEPS:
            return None
        chosen = np.asarray(sorted(vram[layer]), np.int64)
        a, b = rows[: n_steps // 2], rows[n_steps // 2:]
        n = len(chosen)
        ins.append(_coverage(rows, chosen))
        held.append((_coverage(b, _top(a, n, n_experts)) + _coverage(a, _top(b, n, n_experts))) / 2)
    if not ins:
        return None
    return {"in_sample": float(np.mean(ins)), "held_out": float(np.mean(held)), "decode_steps": int(n_steps)}


def plan_held_out(trace, layers: list, n_experts: int) -> dict | None:
    """:func:`held_out_vram_share` of a plan's ``layers`` (the plan file's list: ``layer``, ``vram``
    {GPU key: expert ids}) over ``trace`` (None, or a trace without calls: None); None too when the plan
    holds no expert in VRAM."""
    if trace is None or not trace.steps:
        return None
    vram = {e["layer"]: [i for ids in e["vram"].values() for i in ids] for e in layers}
    if not any(vram.values()):
        return None
    return held_out_vram_share(trace, vram, n_experts)
