"""llama.cpp's page faults when its mapped GGUF does not fit the page cache (pure, toy-checkable).

llama.cpp maps the model (``mmap``, its default) and sets ``POSIX_FADV_SEQUENTIAL``; a token reads, in
layer order, each layer's dense tensors and, in each expert tensor (``ffn_{gate,up,down}_exps``, one
contiguous slice of ``expert_bytes / 3`` per expert, experts in index order), the slices of its top-k
experts. An uncached page is read by a page fault: the faulting thread waits while the kernel reads a
read-around window of ``W`` bytes centred on the fault (the device's readahead, doubled by the
fadvise), and a long run is then streamed by asynchronous readahead. The profile's fault probe
(:mod:`colibri_plan.profiler.fault`) measures, for isolated runs of L bytes, the seconds ``s(L)`` and
the bytes read; ``W`` is the bytes read for its shortest run. Per token:

* **Faults per expert tensor.** Slice j misses with probability ``m_j`` (selected and not cached); it
  costs a fault unless the window of a fault on one of the ``c`` slices before it already read it:
  ``c = floor((W/2) / slice) - 1`` (the window reaches W/2 past the fault), so
  ``faults = sum_j m_j * prod_{i=j-c..j-1} (1 - m_i)``. Each fault starts a run that readahead streams
  while the next misses come within ``c`` slices; the runs span
  ``span = slice * sum_j (1 - prod_{i=j-c..j} (1 - m_i))`` bytes, and the tensor costs
  ``min(faults * s(span / faults), s(tensor bytes))`` seconds: never more than streaming all of it.
* **Dense.** Each layer's dense tensors are :data:`DENSE_RUNS` runs (attention before the expert
  tensors, the rest after them in the GGUF), ``s(dense / DENSE_RUNS)`` each when missed.
* **The cache.** One LRU of ``cache`` bytes (RAM limit - anonymous) holds every mapped page, and every
  fault inserts W bytes. When the bytes a token inserts with nothing cached
  (``faults * W`` + dense bytes) are at least ``cache``, the access pattern is a cyclic scan larger
  than the LRU: each page is evicted before the next token reaches it, so nothing hits (the LRU's worst
  case; ``regime`` "cyclic"). Otherwise Che's approximation over items of ``3 W`` bytes (an expert's
  three slices) and the dense layers (requested every token) gives the hit rates (``regime`` "che").

Prefill: a micro-batch of U tokens touches expert j with ``1 - (1 - p_j)^U`` and the same formulas hold
per micro-batch. Units: bytes, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_plan.planner.cache_model import che_hit_rates

#: dense runs per layer in the GGUF's tensor order: attention (+ norms, router) before the expert
#: tensors, the shared expert after them
DENSE_RUNS = 2
PROJECTIONS = 3


@dataclass(frozen=True)
class FaultCurve:
    """Probe rows for isolated uncached runs: ``runs`` = ((run_bytes, seconds, read_bytes), ...)."""

    runs: tuple

    def __post_init__(self):
        rows = sorted((float(a), float(b), float(c)) for a, b, c in self.runs)
        object.__setattr__(self, "runs", tuple(rows))

    @property
    def window_bytes(self) -> float:
        """W: bytes one fault reads (the read-around window; the shortest run's bytes read)."""
        return max(self.runs[0][2], self.runs[0][0])

    def seconds(self, run_bytes: float) -> float:
        """s(L): a run shorter than the shortest probed costs that one (a whole window is read); between
        rows linear; beyond the longest, its last segment's slope."""
        x = [r[0] for r in self.runs]
        y = [r[1] for r in self.runs]
        if run_bytes <= x[0]:
            return y[0]
        if run_bytes >= x[-1]:
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2]) if len(x) > 1 else y[-1] / x[-1]
            return y[-1] + (run_bytes - x[-1]) * slope
        return float(np.interp(run_bytes, x, y))


def faults_per_tensor(m: np.ndarray, cover: int) -> float:
    """Expected faults in one expert tensor: ``m`` [E] miss probabilities in index order, ``cover`` the
    slices after a fault its window already read (module docstring)."""
    return runs_of(m, cover)[0]


def runs_of(m: np.ndarray, cover: int) -> tuple[float, float]:
    """(expected faults, expected slices spanned by the runs they start) in one expert tensor (module
    docstring): ``m`` [E] miss probabilities in index order, ``cover`` as :func:`cover_slices`."""
    m = np.clip(np.asarray(m, dtype=np.float64), 0.0, 1.0)
    faults = span = 0.0
    for j in range(m.size):
        free = 1.0
        for i in range(max(0, j - cover), j):
            free *= 1.0 - m[i]
        faults += m[j] * free
        span += 1.0 - free * (1.0 - m[j])
    return faults, span


def cover_slices(window_bytes: float, slice_bytes: float) -> int:
    """c: slices after a faulting slice that its centred window reads whole (>= 0)."""
    return max(0, int((window_bytes / 2) // max(1.0, slice_bytes)) - 1)


def scan_seconds(q: np.ndarray, expert_bytes: float, dense_bytes: np.ndarray, curve: FaultCurve,
                 dense_miss: np.ndarray, hit: np.ndarray | None = None,
                 proj: np.ndarray | None = None) -> dict:
    """Seconds and counts of one pass (a decode token or a micro-batch).

    Args:
        q: [layers, E] probability each expert is touched in the pass (0 on dense layers / GPU experts).
        expert_bytes: one expert's bytes (three slices). dense_bytes: [layers] mapped dense bytes read.
        dense_miss: [layers] miss probability of the dense bytes. hit: [layers, E] cache hit rates
            (None: nothing cached). proj: [layers] expert tensors of the layer that are mapped (None: 3).

    Returns:
        {"seconds", "faults", "read_bytes" (bytes the kernel reads), "missed_bytes" (touched and not
        cached)}.
    """
    q = np.asarray(q, dtype=np.float64)
    m = q if hit is None else q * (1.0 - hit)
    sl = expert_bytes / PROJECTIONS
    w, c = curve.window_bytes, cover_slices(curve.window_bytes, sl)
    secs = faults = read = 0.0
    proj = np.full(q.shape[0], PROJECTIONS) if proj is None else np.asarray(proj)
    for lay in range(q.shape[0]):
        if m[lay].any() and proj[lay] > 0:
            f, span = runs_of(m[lay], c)
            whole = curve.seconds(q.shape[1] * sl)
            secs += proj[lay] * min(f * curve.seconds(span * sl / f), whole) if f > 0 else 0.0
            faults += proj[lay] * f
            read += proj[lay] * min(max(f * w, span * sl), q.shape[1] * sl)
        d = float(dense_bytes[lay]) * float(dense_miss[lay])
        if d > 0:
            secs += DENSE_RUNS * float(dense_miss[lay]) * curve.seconds(dense_bytes[lay] / DENSE_RUNS)
            faults += DENSE_RUNS * float(dense_miss[lay])
            read += max(d, DENSE_RUNS * float(dense_miss[lay]) * w)
    missed = float(np.sum(m * proj[:, None]) * sl + np.sum(np.asarray(dense_bytes) * np.asarray(dense_miss)))
    return {"seconds": secs, "faults": faults, "read_bytes": read, "missed_bytes": missed}


def pass_cost(q: np.ndarray, expert_bytes: float, dense_bytes: np.ndarray, curve: FaultCurve,
              cache_bytes: float, proj: np.ndarray | None = None) -> dict:
    """:func:`scan_seconds` of one pass with the cache's hit rates (module docstring): ``regime``
    "cyclic" (nothing hits) when a pass with nothing cached inserts at least ``cache_bytes``, else "che".
    Adds ``regime``, ``insert_bytes`` (that all-miss insertion) and ``dense_hit``."""
    dense_bytes = np.asarray(dense_bytes, dtype=np.float64)
    ones = np.ones_like(dense_bytes)
    cold = scan_seconds(q, expert_bytes, dense_bytes, curve, ones, proj=proj)
    if cold["read_bytes"] >= cache_bytes:
        return {**cold, "regime": "cyclic", "insert_bytes": cold["read_bytes"], "dense_hit": 0.0}
    item = PROJECTIONS * curve.window_bytes                    # bytes an expert's misses bring in
    n_dense = int(np.ceil(dense_bytes.sum() / item))
    p = np.concatenate([np.asarray(q, dtype=np.float64).ravel(), np.ones(n_dense)])
    h = che_hit_rates(p, int(cache_bytes // item))
    hit = h[:q.size].reshape(q.shape)
    dh = float(h[q.size:].mean()) if n_dense else 1.0
    out = scan_seconds(q, expert_bytes, dense_bytes, curve, (1.0 - dh) * ones, hit, proj)
    return {**out, "regime": "che", "insert_bytes": cold["read_bytes"], "dense_hit": dh}
