"""Field checks of heat documents: counts are whole selections, ids and sizes stay in range.

Used by :mod:`colibri_plan.formats.heat` when reading (so a file it wrote reads back) and writing (counts are
rounded to whole selections).
"""

from __future__ import annotations

import numpy as np

from colibri_plan.errors import FormatError

#: counts on disk are whole numbers below 2**53 (float64 holds each exactly); expert ids below 2**20
MAX_COUNT = 2**53
MAX_EXPERTS = 2**20


def whole_field(v, what: str, where: str, lo: int, hi: int, optional: bool = True) -> int | None:
    """``v`` as an int when it is a whole JSON number in ``lo..hi-1`` (None passes when ``optional``);
    else FormatError naming ``what``. Strings, bools, NaN and infinities are refused."""
    if v is None and optional:
        return None
    ok = not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and v.is_integer()))
    if not ok or not lo <= v < hi:
        raise FormatError(f"{where}: {what} must be a whole number in {lo}..{hi - 1}, got {v!r:.40}; "
                          "re-create it")
    return int(v)


def whole_counts(counts: np.ndarray) -> np.ndarray:
    """Counts rounded to whole selections, a positive count below 1 kept as 1 (float64, same shape)."""
    return np.where((counts > 0) & (counts < 1), 1.0, np.round(counts))


def check_count_table(d: dict, where: str) -> None:
    """FormatError when ``d["counts"]`` is not one row per layer id of ``n_experts`` counts each, or a
    count is not a whole JSON number in 0..2**53-1 (a string, a fraction, NaN, 1e30 or negative)."""
    layers, counts, n = d.get("layers"), d.get("counts"), d.get("n_experts")
    if not isinstance(layers, list) or not isinstance(counts, list) or isinstance(n, bool) \
            or not isinstance(n, int):
        return  # missing / mistyped fields: from_dict's own error names them
    if len(counts) != len(layers):
        raise FormatError(f"{where}: counts has {len(counts)} rows but layers lists {len(layers)} layer ids "
                          "(one row per layer id is needed); re-create it")
    for i, row in enumerate(counts):
        if not isinstance(row, list) or len(row) != n:
            got = f"{len(row)} values" if isinstance(row, list) else f"a {type(row).__name__}"
            raise FormatError(f"{where}: counts row {i} (layer {layers[i]}) has {got}, expected n_experts = "
                              f"{n} counts; re-create it")
        for e, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < MAX_COUNT \
                    or (isinstance(v, float) and not v.is_integer()):
                raise FormatError(f"{where}: count of layer {layers[i]} expert {e} is {v!r:.40}; counts "
                                  "must be whole numbers of selections in 0..2**53-1 (JSON numbers); "
                                  "re-create it")
