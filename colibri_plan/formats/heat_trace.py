"""The optional token-level routing trace of a heat document (``heat.trace``).

Counts say how often each expert is chosen; a trace says *in which order*, which is what an LRU cache
feels (temporal locality). `colibri-plan run --stats-out` records one:

```json
"trace": {"layers": [1, 2, 3], "top_k": 8, "steps": [12, 1, 1, 1],
          "ids": [[...sum(steps) x top_k ids...], [...], [...]], "dropped_steps": 0}
```

* ``steps``: token rows of each forward call, in order (a prefill chunk is one call of many rows, each
  decode token one call of one row); the engine looks up the *distinct* experts of a call once.
* ``ids[i]``: MoE layer ``layers[i]``'s top-k ids, token-major (row t's k-th choice at ``t·top_k + k``).
* ``dropped_steps``: calls left out because the trace is size-bounded (``MAX_TRACE_IDS`` ids in all;
  the first calls are kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

#: at most this many expert ids in one trace (all layers): about 10 MB of JSON
MAX_TRACE_IDS = 2_000_000


@dataclass
class RoutingTrace:
    """Top-k ids per token and MoE layer, grouped into forward calls (module docstring).

    Attributes:
        layers: MoE layer ids, one row of ``ids`` each.
        top_k: experts per token.
        steps: token rows per forward call (sum = tokens in the trace).
        ids: int32 ``[len(layers), sum(steps), top_k]``.
        dropped_steps: calls not kept (size bound).
    """

    layers: tuple[int, ...]
    top_k: int
    steps: tuple[int, ...]
    ids: np.ndarray
    dropped_steps: int = 0

    def rows(self, layer: int) -> np.ndarray | None:
        """int32 ``[tokens, top_k]`` of ``layer``, or None when the trace has no such layer."""
        return self.ids[self.layers.index(layer)] if layer in self.layers else None

    @classmethod
    def from_calls(cls, layers, top_k: int, calls: dict, max_ids: int = MAX_TRACE_IDS) -> RoutingTrace:
        """Build a trace from ``calls`` {layer: [int array [rows, top_k] per forward call]} (every layer
        the same calls), keeping the first calls within ``max_ids`` ids."""
        layers = tuple(int(x) for x in layers if calls.get(x))
        if not layers:
            return cls((), int(top_k), (), np.zeros((0, 0, int(top_k)), dtype=np.int32))
        sizes = [int(a.shape[0]) for a in calls[layers[0]]]
        per_row = len(layers) * int(top_k)
        keep, used = 0, 0
        for s in sizes:
            if used + s * per_row > max_ids:
                break
            used += s * per_row
            keep += 1
        n = sum(sizes[:keep])
        ids = np.zeros((len(layers), n, int(top_k)), dtype=np.int32)
        for i, layer in enumerate(layers):
            parts = calls[layer][:keep]
            if parts:
                ids[i] = np.concatenate(parts)[:, :top_k]
        return cls(layers, int(top_k), tuple(sizes[:keep]), ids, len(sizes) - keep)

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "top_k": self.top_k, "steps": list(self.steps),
                "ids": [row.ravel().tolist() for row in self.ids], "dropped_steps": self.dropped_steps}

    @classmethod
    def from_dict(cls, d, n_experts: int, where: str = "heat document") -> RoutingTrace:
        """Inverse of :meth:`to_dict`, checked: ids in 0..n_experts-1, one list of sum(steps) x top_k
        ids per layer, at most ``MAX_TRACE_IDS`` ids.

        Raises:
            FormatError: naming the field and what it must be.
        """
        at = At(where, "re-record it with `colibri-plan run --stats-out`", ("trace",), repr_values=True)
        f.document(d, at)
        k = f.whole(d, "top_k", at, lo=1, hi=n_experts)
        layers, steps, ids = d.get("layers"), d.get("steps"), d.get("ids")
        if not isinstance(layers, list) or not all(f.is_whole(x) and 0 <= x < 2**31 for x in layers) \
                or len(set(layers)) != len(layers):
            (at / "layers").refuse("must be a list of distinct layer ids")
        if not isinstance(steps, list) or not all(f.is_whole(s) and s >= 1 for s in steps):
            (at / "steps").refuse("must be a list of whole numbers >= 1 (token rows per forward call)")
        n = sum(steps)
        if len(layers) * n * k > MAX_TRACE_IDS:
            at.fail(f"holds {len(layers) * n * k:,} ids, more than {MAX_TRACE_IDS:,}")
        if not isinstance(ids, list) or len(ids) != len(layers):
            (at / "ids").refuse(f"must hold one list per layer ({len(layers)})")
        out = np.zeros((len(layers), n, k), dtype=np.int32)
        for i, row in enumerate(ids):
            if not isinstance(row, list) or len(row) != n * k or not all(f.is_whole(v) for v in row):
                (at / "ids" / i).refuse(f"(layer {layers[i]}) must be {n * k} whole numbers (sum(steps) x "
                                        "top_k)")
            a = np.asarray(row, dtype=np.int64)
            if a.size and (a.min() < 0 or a.max() >= n_experts):
                (at / "ids" / i).refuse(f"(layer {layers[i]}) must be expert ids in 0..{n_experts - 1}")
            out[i] = a.reshape(n, k)
        dropped = f.whole(d, "dropped_steps", at, lo=0) if "dropped_steps" in d else 0
        return cls(tuple(layers), int(k), tuple(steps), out, int(dropped))
