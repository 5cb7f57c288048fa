"""Field checks of heat documents: counts are whole selections, ids and sizes stay in range.

Used by :mod:`colibri_plan.formats.heat` when reading (so a file it wrote reads back) and writing (counts are
rounded to whole selections).
"""

from __future__ import annotations

import numpy as np

from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

#: counts on disk are whole numbers below 2**53 (float64 holds each exactly); expert ids below 2**20
MAX_COUNT = 2**53
MAX_EXPERTS = 2**20


def heat_at(where: str) -> At:
    """A heat document's place in messages (``where``: its path, or "heat document")."""
    return At(where, "re-create it", repr_values=True)


def whole_counts(counts: np.ndarray) -> np.ndarray:
    """Counts rounded to whole selections, a positive count below 1 kept as 1 (float64, same shape)."""
    return np.where((counts > 0) & (counts < 1), 1.0, np.round(counts))


def check_count_table(d: dict, at: At) -> None:
    """FormatError when ``d["counts"]`` is not one row per layer id of ``n_experts`` counts each, or a
    count is not a whole JSON number in 0..2**53-1 (a string, a fraction, NaN, 1e30 or negative)."""
    layers, counts, n = d.get("layers"), d.get("counts"), d.get("n_experts")
    if not isinstance(layers, list) or not isinstance(counts, list) or not f.is_whole(n):
        return  # missing / mistyped fields: from_dict's own error names them
    if len(counts) != len(layers):
        at.fail(f"counts has {len(counts)} rows but layers lists {len(layers)} layer ids (one row per layer "
                "id is needed)")
    for i, row in enumerate(counts):
        if not isinstance(row, list) or len(row) != n:
            got = f"{len(row)} values" if isinstance(row, list) else f"a {type(row).__name__}"
            at.fail(f"counts row {i} (layer {layers[i]}) has {got}, expected n_experts = {n} counts")
        for e, v in enumerate(row):
            if not (f.is_whole(v, integral_floats=True) and 0 <= v < MAX_COUNT):
                at.fail(f"count of layer {layers[i]} expert {e} is {v!r:.40}; counts must be whole numbers "
                        "of selections in 0..2**53-1 (JSON numbers)")
