"""Readers of a profile's optional trunk sections: ``dense_gemv``, ``device_ops``, ``attention``,
``trunk_layer`` and ``step_graph``.

The sections are described in :mod:`colibri_plan.formats.profile` (``trunk_layer``: in
:mod:`colibri_plan.formats.profile_check` and :mod:`colibri_plan.profiler.trunk_layer_probe`) and written
by :mod:`colibri_plan.profiler.trunk_probe`. Profiles written before the trunk probe (and the shipped
``profiles/*.json``) lack them, and a section may be ``{"unavailable": reason}``; every reader then
returns None, so a caller falls back to the ``matmul`` / ``links`` / ``ram`` figures.

Each reader takes the profile document (``MachineProfile.doc``) or the MachineProfile itself, and a
device named by its backend and index (the host CPU is backend "cpu", or "numpy" without numba,
index 0; a tuple of backends reads the entries of any of them, in the profile's order). Figures are the
medians of the stats.
"""

from __future__ import annotations

import math


def _entries(profile, section: str, backend: str | tuple[str, ...], device_index: int) -> list[dict]:
    doc = getattr(profile, "doc", profile)
    rows = doc.get(section) if isinstance(doc, dict) else None
    if not isinstance(rows, list):  # absent, or {"unavailable": reason}
        return []
    want = (backend,) if isinstance(backend, str) else backend
    return [e for e in rows if e.get("backend") in want and e.get("device_index") == device_index]


def has_trunk_figures(profile, backend: str, device_index: int) -> bool:
    """True when the profile holds dense_gemv, device_ops and attention figures of this device."""
    return all(_entries(profile, s, backend, device_index) for s in ("dense_gemv", "device_ops", "attention"))


def dense_gemv_gbps(profile, backend: str | tuple[str, ...], device_index: int, fmt: str,
                    out_features: int | None = None, in_features: int | None = None) -> float | None:
    """Weight GB/s (stored bytes / s / 1e9) of a decode GEMV [1, in] · W[out, in]ᵀ in ``fmt`` on the
    device: the entry nearest the shape (in log out + log in) when one is given, else the median over
    the measured shapes; None when the device was not measured in ``fmt``."""
    rows = [e for e in _entries(profile, "dense_gemv", backend, device_index) if e.get("fmt") == fmt]
    if not rows:
        return None
    if out_features and in_features:
        best = min(rows, key=lambda e: abs(math.log(e["out_features"] / out_features))
                   + abs(math.log(e["in_features"] / in_features)))
        return float(best["weight_gbps"]["median"])
    vals = sorted(float(e["weight_gbps"]["median"]) for e in rows)
    mid = len(vals) // 2
    return vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2


def dense_gemv_formats(profile, backend: str, device_index: int) -> list[str]:
    """The dense formats the device was measured in, in the order they first appear."""
    return list(dict.fromkeys(e["fmt"] for e in _entries(profile, "dense_gemv", backend, device_index)))


def device_op_s(profile, backend: str | tuple[str, ...], device_index: int) -> float | None:
    """Seconds of one small device op (a d_add on [1, 4096] in a chain); None when not measured."""
    rows = _entries(profile, "device_ops", backend, device_index)
    return float(rows[0]["op_seconds"]["median"]) if rows else None


def roundtrip_s(profile, backend: str | tuple[str, ...], device_index: int) -> float | None:
    """Seconds of d_get + d_put of one [1, H] float32 activation (H = 4096); None when not measured."""
    rows = _entries(profile, "device_ops", backend, device_index)
    return float(rows[0]["roundtrip_seconds"]["median"]) if rows else None


def _attention_entry(profile, backend: str, device_index: int, context_tokens: int) -> dict | None:
    rows = _entries(profile, "attention", backend, device_index)
    if not rows:
        return None
    c = max(int(context_tokens), 1)
    return min(rows, key=lambda e: (abs(math.log(e["context_tokens"] / c)), e["context_tokens"]))


def attention_kv_table(profile, backend: str | tuple[str, ...],
                       device_index: int) -> tuple[tuple[int, float], ...]:
    """((context tokens, K+V GB/s), ...) of the device's decode attention calls, ascending context (one
    pair per context: the last entry listed wins); () when not measured."""
    pairs = {int(e["context_tokens"]): float(e["kv_gbps"]["median"])
             for e in _entries(profile, "attention", backend, device_index)}
    return tuple(sorted(pairs.items()))


def kv_gbps_at(pairs, context_tokens: int) -> float:
    """KV GB/s of ``[[context, GB/s], ...]`` (e.g. :func:`attention_kv_table`) at the context nearest
    ``context_tokens`` (log distance; a tie: the shorter context)."""
    c = max(1, int(context_tokens))
    return float(min(pairs, key=lambda x: (abs(math.log(c / max(1, x[0]))), x[0]))[1])


def attention_kv_gbps(profile, backend: str, device_index: int, context_tokens: int) -> float | None:
    """K+V GB/s of one decode attention call at the measured context nearest ``context_tokens`` (in log);
    None when not measured."""
    e = _attention_entry(profile, backend, device_index, context_tokens)
    return float(e["kv_gbps"]["median"]) if e else None


def attention_s(profile, backend: str, device_index: int, context_tokens: int) -> float | None:
    """Seconds of one decode attention call of one layer at ``context_tokens``: the nearest measured
    context's time scaled linearly by the context (the probe's geometry: 32 query heads, 8 KV heads,
    head_dim 128 unless the entry says otherwise); None when not measured."""
    e = _attention_entry(profile, backend, device_index, context_tokens)
    if e is None:
        return None
    return float(e["seconds"]["median"]) * max(int(context_tokens), 1) / e["context_tokens"]


def trunk_layer(profile, backend: str, device_index: int, path: str | None = None) -> dict | None:
    """One decoder layer's measured op sequence on the device (section ``trunk_layer``): None when not
    measured, else a dict of medians, seconds per layer::

        {"path": "device" | "host", "fmt", "hidden", "n_heads", "n_kv_heads", "head_dim",
         "context_tokens", "weight_bytes" (q, k, v, o of one layer), "block_s" (norm .. FFN norm, the
         attention at context_tokens included), "handoff_s" (a MoE layer's extra: x down, routing on the
         host, the sum up), "attention_s" (KV write + attention call at context_tokens),
         and when measured "long_context_tokens", "attention_long_s" (the same call at that context)}

    ``path`` picks an entry of that path (None: the first)."""
    rows = [e for e in _entries(profile, "trunk_layer", backend, device_index)
            if path is None or e.get("path") == path]
    if not rows:
        return None
    e = rows[0]
    out = {k: e[k] for k in ("path", "fmt", "hidden", "n_heads", "n_kv_heads", "head_dim", "context_tokens",
                             "weight_bytes")}
    out.update(block_s=float(e["block_seconds"]["median"]), handoff_s=float(e["handoff_seconds"]["median"]),
               attention_s=float(e["attention_seconds"]["median"]))
    long = e.get("attention_long_seconds")
    if isinstance(long, dict) and isinstance(e.get("long_context_tokens"), int):
        out.update(long_context_tokens=e["long_context_tokens"], attention_long_s=float(long["median"]))
    return out


def expert_call_s(profile, fmt: str | None = None) -> float | None:
    """Fixed seconds of one call of the host CPU's ``expert_ffn`` in the engine's rhythm (section
    ``trunk_layer``, host path): t_1 − (t_k − t_1) / (k − 1) from the medians of 1 and k experts, floored
    at 0; None when not measured (or not in ``fmt`` when one is given)."""
    for backend in ("cpu", "numpy"):
        for e in _entries(profile, "trunk_layer", backend, 0):
            if e.get("path") != "host" or "expert_one_seconds" not in e:
                continue
            if fmt is not None and e.get("expert_fmt") != fmt:
                continue
            t1, tk = float(e["expert_one_seconds"]["median"]), float(e["expert_topk_seconds"]["median"])
            return max(0.0, t1 - (tk - t1) / (int(e["expert_topk"]) - 1))
    return None


def step_graph(profile, backend: str, device_index: int, match: dict | None = None) -> dict | None:
    """The device's replayed decode step (section ``step_graph``,
    :mod:`colibri_plan.profiler.step_probe`): None when not measured or when no entry matches every key of
    ``match`` (e.g. ``{"hidden": 2048, "top_k": 8, "expert_width": 768, "expert_fmt": "int8",
    "fmt": "int8"}``: the figure holds for that model's shapes only), else a dict, seconds per token::

        {"fmt", "expert_fmt", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab", "n_experts", "top_k",
         "expert_width", "expert_bytes", "layer_trunk_bytes", "context_tokens", "layers_short",
         "layers_long", "layer_s" (one layer: trunk + its top-k VRAM experts), "fixed_s" (once per token)}

    Medians; the first matching entry."""
    want = match or {}
    for e in _entries(profile, "step_graph", backend, device_index):
        if all(e.get(k) == v for k, v in want.items()):
            out = {k: e[k] for k in ("fmt", "expert_fmt", "hidden", "n_heads", "n_kv_heads", "head_dim",
                                     "vocab", "n_experts", "top_k", "expert_width", "expert_bytes",
                                     "layer_trunk_bytes", "context_tokens", "layers_short", "layers_long")}
            out.update(layer_s=float(e["layer_seconds"]["median"]),
                       fixed_s=float(e["fixed_seconds"]["median"]))
            return out
    return None


def fastest_gemv_gbps(profile, backend: str, device_index: int) -> float | None:
    """The highest ``dense_gemv`` weight GB/s (median) the device reached at any shape and format: its
    rate on a read large enough to be bound by memory, not by a launch; None when not measured."""
    rows = _entries(profile, "dense_gemv", backend, device_index)
    return max(float(e["weight_gbps"]["median"]) for e in rows) if rows else None
