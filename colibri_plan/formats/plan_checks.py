"""Checks of a plan document beyond its field table (formats/plan.py ``_FIELDS``): found by fuzzing
hand-edited plans (issue 30, round 4).

- :func:`check_finite`: no NaN or infinity anywhere in the document (JSON has no such number; a reader
  that meets one later crashes in a fingerprint or prices with it).
- :func:`check_resources`: the ``resources`` section the what-if re-solve and re-pinning rebuild the
  cost model's machine figures from (``planner.costmodel.Resources`` / ``GpuResource``): every field
  typed and in range, no unknown key.
- :func:`check_sizes`: figures that contradict each other or any machine: hit rates that do not sum to
  1, byte figures beyond the profiled machine's RAM plus the plan's VRAM (a 844,425 GB KV cache, 2^62
  trunk bytes), the model's layer count and top-k present but null.
"""

from __future__ import annotations

import math
import numbers

from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At

#: the resources keys (planner.costmodel.Resources fields) with (type, lo) ; optional ones may be null
_RES = {"cpu_matmul_gbps": ("pos", False), "ram_read_gbps": ("pos", False), "disk_read_gbps": ("pos", True),
        "disk_queue_depth": ("int1", False), "dense_gbps": ("pos", True), "checksum_gbps": ("pos", True),
        "page_cache_pool_bytes": ("int0", False), "cpu_call_s": ("num0", False)}
_GPU = {"key": "str", "matmul_gbps": "pos", "h2d_gbps": "num0", "d2h_gbps": "num0", "budget_bytes": "int0",
        "unified": "bool", "link_latency_s": "num0", "holds_trunk": "bool", "expert_call_s": "num0",
        "segmented": "bool", "handoff_s": "num0", "zero_copy": "bool", "mapped_gbps": "num0",
        "step_expert_gbps": "num0", "step_mapped_gbps": "num0"}
#: no byte figure of any plan comes near this (1,000,000 GB: the --ram bound of planner.budgets)
MAX_BYTES = 10**15


def check_finite(doc, at: At) -> None:
    """Refuse the first NaN or infinity anywhere in ``doc`` (checked without recursion), naming its path.

    Raises:
        FormatError: "<label>: <path> must be a finite number, got NaN; ...".
    """
    level = [((), doc)]
    while level:
        nxt = []
        for path, v in level:
            if isinstance(v, float) and not math.isfinite(v):
                here = at
                for k in path:
                    here = here / k
                here.bad("a finite number", v)
            items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
            nxt.extend((path + (k,), c) for k, c in items)
        level = nxt


def _typed(node: dict, key, kind: str, here: At, optional: bool = False) -> None:
    if kind == "str":
        f.text(node, key, here, nonempty=True)
    elif kind == "bool":
        f.flag(node, key, here)
    elif kind == "pos":
        f.number(node, key, here, lo=0, lo_open=True, optional=optional)
    elif kind == "num0":
        f.number(node, key, here, lo=0, optional=optional)
    else:
        f.whole(node, key, here, lo=1 if kind == "int1" else 0, integral_floats=True, optional=optional)


def check_resources(doc: dict, at: At) -> None:
    """The optional ``resources`` section: the cost model's machine figures, each typed (module
    docstring); ``gpus`` objects of :data:`_GPU`'s fields; ``disk_depth_gbps`` [queue depth, GB/s] pairs;
    ``compute`` [host tier, processor] string pairs.

    Raises:
        FormatError: naming the field, what it must be and what it holds.
    """
    res = doc.get("resources")
    if res is None:
        return
    here = at / "resources"
    for key in res:
        if key not in _RES and key not in ("gpus", "disk_depth_gbps", "compute"):
            here.fail(f"unknown key {key!r} (the what-if re-solve cannot read it back)")
    for key, (kind, optional) in _RES.items():
        if key in res:
            _typed(res, key, kind, here, optional)
    for g, gat in f.each(res, "gpus", here, optional=True):
        if not isinstance(g, dict):
            gat.bad("an object", g)
        for key in g:
            if key not in _GPU:
                gat.fail(f"unknown key {key!r}")
        for key, kind in _GPU.items():
            if key in g or key in ("key", "matmul_gbps"):
                _typed(g, key, kind, gat)
    for pair, pat in f.each(res, "disk_depth_gbps", here, optional=True):
        if not (isinstance(pair, list) and len(pair) == 2 and f.is_whole(pair[0], True) and pair[0] >= 1
                and f.is_number(pair[1]) and pair[1] > 0):
            pat.bad("a [queue depth >= 1, GB/s > 0] pair", pair)
    for pair, pat in f.each(res, "compute", here, optional=True):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            pat.bad("a [host tier, processor] pair of strings", pair)


def _values(b: dict, key: str) -> list:
    return list(b[key].values()) if isinstance(b.get(key), dict) else []


def _bytes_fields(doc: dict):
    """(At path keys, value) of the plan's byte figures that size memory."""
    b = doc.get("budgets") or {}
    for k in ("ram_budget_bytes", "dense_bytes", "kv_bytes", "working_bytes", "headroom_bytes"):
        yield ("budgets", k), b.get(k)
    for section in ("trunk_vram_bytes", "vram_budget_bytes"):
        sec = b.get(section)
        for k, v in (sec.items() if isinstance(sec, dict) else ()):
            yield ("budgets", section, k), v
    trunk = (doc.get("predicted") or {}).get("trunk")
    if isinstance(trunk, dict):
        yield ("predicted", "trunk", "kv_bytes"), trunk.get("kv_bytes")


def check_sizes(doc: dict, at: At) -> None:
    """Figures that contradict each other or any machine (module docstring).

    Raises:
        FormatError: naming the field and the figure it contradicts.
    """
    model = doc["model"]
    for key in ("n_layers", "top_k"):
        if key in model and model[key] is None:   # absent is an older plan; null is a broken edit
            (at / "model" / key).refuse("is null; it must be a whole number >= 1 (or absent)")
    pred = doc["predicted"]
    f.mapping(pred, "trunk", at / "predicted", optional=True)
    for k in ("dense_s_per_token", "attention_s_per_token", "host_roundtrip_s_per_token", "kv_bytes"):
        if isinstance(pred.get("trunk"), dict) and k in pred["trunk"]:
            f.number(pred["trunk"], k, at / "predicted" / "trunk", lo=0)
    hr = pred.get("hit_rate") or {}
    shares = [hr.get(k) for k in ("vram", "ram_pinned", "lru", "disk")]
    # 0 in all: a plan without selections to serve (no decode layer); else they split every selection
    if all(f.is_number(s) for s in shares) and abs(sum(shares) - 1.0) > 1e-3 and sum(shares) != 0:
        (at / "predicted" / "hit_rate").refuse(
            f"shares sum to {sum(shares):.6g}; every selection is served by exactly one tier, so they sum to "
            "1")
    total = (doc.get("profile") or {}).get("ram_total_bytes")
    b = doc["budgets"]
    held = [*_values(b, "vram_budget_bytes"), *_values(b, "trunk_vram_bytes")]
    vram = sum(v for v in held if f.is_number(v) and 0 <= v <= MAX_BYTES)
    for path, v in _bytes_fields(doc):
        if not isinstance(v, numbers.Real) or isinstance(v, bool):
            continue
        here = at
        for k in path:
            here = here / k
        if v > MAX_BYTES:
            here.refuse(f"is {v:,} B, more than any machine's memory ({MAX_BYTES:,} B)")
        if f.is_whole(total) and total > 0 and path[-1] in ("kv_bytes", "dense_bytes", "working_bytes") \
                and v > total + vram:
            here.refuse(f"is {v:,} B, more than the profiled machine's RAM ({total:,} B) and the plan's "
                        f"VRAM ({vram:,} B) together: the figures contradict each other")
