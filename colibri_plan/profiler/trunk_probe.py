"""Trunk probe: the dense trunk's GEMVs, small device ops and decode attention of every device.

Everything goes through the device-activation contract (:mod:`colibri_plan.backends.device_ops`): the
public ``d_*`` methods, so a figure is whatever the backend implements (a GPU backend that still inherits
the numpy reference hooks shows its host round trips). Three sections of the profile come out
(:mod:`colibri_plan.formats.profile`):

- ``dense_gemv``: ``d_matmul`` of x [1, in] already on the device by W [out, in] at trunk-like shapes
  (``TRUNK_SHAPES`` of :mod:`colibri_plan.profiler.trunk_shapes`, plus the model's own with
  ``profile --model``) in the dense formats the device supports (``DENSE_FORMATS``); ``weight_gbps`` =
  stored bytes (data + scales) / seconds / 1e9.
- ``device_ops``: ``op_seconds`` = one ``d_add`` on [1, H] in a chain of N ended by one ``d_get``, minus
  that ``d_get`` alone, / N; ``roundtrip_seconds`` = ``d_get`` of [1, H] + ``d_put`` of [1, H] (H = 4096),
  what a GPU trunk pays per MoE layer to hand the normed hidden state to the host experts and back.
- ``attention``: one decode ``d_attention`` (T = 1, 32 query heads, 8 KV heads, head_dim 128 by default)
  over a float32 KV cache of ``context_tokens`` rows built with ``d_zeros`` + ``d_write_rows``;
  ``kv_gbps`` = 2 · context · kv_heads · head_dim · 4 B / seconds / 1e9.

Timing: one warm-up call (compiles, first touch), one call to size the chain, then repetitions of a
chain of N calls (N such that a chain lasts about ``chain_s``) synchronised by one ``d_get`` of the last
output and divided by N. Every figure is a stat (:func:`colibri_plan.formats.profile.stat`) over the
repetitions.

Budget: each opened device gets ``budget_s`` seconds (weights built and uploaded included); measurements
run cheapest first and one whose estimate (from what was measured already) does not fit the time left, or
whose weight / KV cache exceeds ``memory_fraction`` of the device's free memory or ``max_bytes``, is left
out, named in one ``skipped`` entry per device and section. Weights repeat a small random block (cheap
to build; throughput does not depend on the values).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from colibri_plan.formats.profile import stat
from colibri_plan.profiler.step_probe import StepSettings, probe_step
from colibri_plan.profiler.trunk_layer_probe import (  # noqa: F401 - MAX_CHAIN, time_chain re-exported
    MAX_CHAIN,
    LayerGeometry,
    probe_layer,
    time_chain,
)
from colibri_plan.profiler.trunk_shapes import (
    CONTEXTS,
    DENSE_FORMATS,
    HOST_BACKENDS,
    TRUNK_SHAPES,
    tiled_weight,
)
from colibri_plan.quant import tensor_bytes

Progress = Callable[[str], None]

SECTIONS = ("dense_gemv", "device_ops", "attention", "trunk_layer", "step_graph")
#: the most bytes the trunk_layer chain places on a device (weights beyond the largest caches)
LAYER_MAX_BYTES = 384 << 20


@dataclass
class TrunkSettings:
    """What the trunk probe measures and how hard.

    Attributes:
        shapes: [out, in] GEMV shapes (elements). formats: dense formats (unsupported ones are skipped).
        contexts: attention context lengths, tokens. n_heads, n_kv_heads, head_dim: attention geometry.
        hidden: H of the device-op and round-trip figures (elements).
        repetitions: most repetitions per figure. budget_s: seconds per device for all three sections.
        chain_s: target seconds of one timed chain. layer: the decoder layer of the ``trunk_layer``
            figure (:mod:`colibri_plan.profiler.trunk_layer_probe`; None: not measured). step: the
            replayed decode step's figure on a backend with ``d_capture_step``, at ``layer``'s shapes when
            they are a model's (:mod:`colibri_plan.profiler.step_probe`; None: not measured).
        memory_fraction, max_bytes: the largest weight or KV
            cache tried, as a fraction of the device's free memory and in bytes (building larger ones
            would take longer than measuring them).
    """

    shapes: Sequence[tuple[int, int]] = TRUNK_SHAPES
    formats: Sequence[str] = DENSE_FORMATS
    contexts: Sequence[int] = CONTEXTS
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    repetitions: int = 5
    budget_s: float = 6.0
    chain_s: float = 0.01
    memory_fraction: float = 0.25
    max_bytes: int = 512 << 20
    layer: LayerGeometry | None = LayerGeometry()
    step: StepSettings | None = None


def device_limit_bytes(device: dict, ram_available_bytes: int | None, fraction: float) -> int | None:
    """Bytes the probe may place on ``device`` (free memory, host RAM for host-memory devices, times
    ``fraction``); None when unknown."""
    if device.get("backend") in HOST_BACKENDS or device.get("unified_memory"):
        free = ram_available_bytes or device.get("free_memory_bytes") or device.get("total_memory_bytes")
    else:
        free = device.get("free_memory_bytes") or device.get("total_memory_bytes")
    return int(free * fraction) if free else None


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


class _Budget:
    """Wall-clock budget of one device."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()

    def warm(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once outside the budget: a kernel's first call compiles it (NVRTC on a cold machine,
        seconds), which would otherwise leave a 3 s budget one shape measured and the fastest GEMV
        figure that of the smallest, latency-bound one (an H200 host's fresh profile: 50 GB/s against
        2389, and predictions 2x low)."""
        t0 = time.perf_counter()
        fn()
        self.end += time.perf_counter() - t0


def probe_device_ops(be, base: dict, hidden: int, repetitions: int, budget_s: float,
                     chain_s: float) -> dict:
    """The ``device_ops`` entry of one opened backend (see the module docstring)."""
    rng = np.random.default_rng(5)
    a = be.d_put(rng.standard_normal((1, hidden), np.float32))  # [1, H]
    b = be.d_put(np.full((1, hidden), 1e-3, np.float32))        # [1, H]
    gets, _ = time_chain(lambda: a, be.d_get, max(repetitions, 5), budget_s / 4, 0.0)  # d_get alone
    get_s = float(np.median(gets))
    state = {"a": a}

    def add() -> object:
        state["a"] = be.d_add(state["a"], b)  # each op depends on the last, as in a layer
        return state["a"]

    chains, n = time_chain(add, be.d_get, repetitions, budget_s / 4, max(chain_s, 200 * 1e-6))
    # the chain's one d_get taken out; a difference below 1 ns is noise, floored there
    ops = [max((c * n - get_s) / n, 1e-9) for c in chains]
    rt = {"a": a}

    def roundtrip() -> object:
        rt["a"] = be.d_put(be.d_get(rt["a"]))  # [1, H] down to the host and back up
        return rt["a"]

    trips, _ = time_chain(roundtrip, be.d_get, repetitions, budget_s / 4, chain_s)
    return {**base, "hidden": int(hidden), "op": f"d_add [1, {hidden}]", "chain_ops": int(n),
            "op_seconds": stat(ops), "roundtrip_seconds": stat(trips),
            "roundtrip_bytes": int(2 * 4 * hidden), "get_seconds": stat(gets),
            "method": "d_add chain ended by one d_get, minus the d_get alone, per op; round trip = "
                      "d_get + d_put of [1, H] float32"}


class _Rate:
    """Bytes/s of building and uploading test data: the best of what was seen, and none from one
    observation alone (the first upload may compile a kernel or grow a pool)."""

    def __init__(self):
        self.rates: list[float] = []

    def add(self, nbytes: int, seconds: float) -> None:
        self.rates.append(nbytes / max(seconds, 1e-6))

    def seconds(self, nbytes: int) -> float:
        return nbytes / max(self.rates) if len(self.rates) >= 2 else 0.0


class _LeftOut:
    """What a section left out, by reason, summarised in one ``skipped`` line."""

    def __init__(self):
        self.memory: list[str] = []
        self.budget: list[str] = []

    def message(self, limit: int | None, budget_s: float) -> str | None:
        def few(labels: list[str], n: int = 6) -> str:
            return ", ".join(labels[:n]) + (f" and {len(labels) - n} more" if len(labels) > n else "")

        parts = []
        if self.memory:
            parts.append(f"left out, over the {_mib(limit or 0)} this probe places on the device: "
                         f"{few(self.memory)}")
        if self.budget:
            parts.append(f"left out, not measured within the {budget_s:g} s per device (give more with "
                         f"--trunk-seconds): {few(self.budget)}")
        return "; ".join(parts) or None


def _fits(need_s: float, left_s: float) -> bool:
    return left_s > 0 and need_s <= left_s


def _dense(be, base: dict, cfg: TrunkSettings, shapes: list[tuple[int, int, str]], formats: list[str],
           limit: int | None, budget: _Budget, reserve_s: float,
           say: Progress) -> tuple[list[dict], _LeftOut]:
    """dense_gemv entries of one device, and what was left out. Each format is first measured at its
    smallest shape; then the cheapest figure left (estimated from its format's measured GB/s) goes next,
    so a slow path (bf16 through numpy on the host) gives up its large shapes before a fast format does.
    ``reserve_s`` of the budget stays for the attention figures."""
    rows, left_out = [], _LeftOut()
    gbps: dict[str, float] = {}
    prep = _Rate()  # bytes/s of building + uploading a weight
    x_cache: dict[int, object] = {}
    pending = []
    for out_f, in_f, src, fmt in ((o, i, src, f) for o, i, src in shapes for f in formats):
        if limit is not None and tensor_bytes(fmt, out_f, in_f) > limit:
            left_out.memory.append(f"{fmt} [{out_f}x{in_f}]")
        else:
            pending.append((out_f, in_f, src, fmt))

    def cost(item: tuple[int, int, str, str]) -> tuple[bool, float, int]:
        nbytes = tensor_bytes(item[3], item[0], item[1])
        known = gbps.get(item[3]) or (min(gbps.values()) if gbps else None)
        call_s = nbytes / (known * 1e9) if known else 0.0
        need = prep.seconds(nbytes) + 2 * call_s + max(call_s, cfg.chain_s)
        return item[3] in gbps, need, nbytes

    while pending:
        pending.sort(key=cost)
        out_f, in_f, src, fmt = item = pending.pop(0)
        label = f"{fmt} [{out_f}x{in_f}]"
        if not _fits(cost(item)[1], budget.left() - reserve_s):
            left_out.budget.append(label)
            continue
        nbytes = tensor_bytes(fmt, out_f, in_f)
        say(f"trunk: {base['backend']}:{base['device_index']} dense_gemv {label}")
        t0 = time.perf_counter()
        w = be.upload(tiled_weight(fmt, out_f, in_f))
        prep.add(nbytes, time.perf_counter() - t0)
        try:
            if in_f not in x_cache:  # x stays on the device, as the trunk's activations do
                x_cache[in_f] = be.d_put(np.random.default_rng(in_f).standard_normal((1, in_f), np.float32))
            x = x_cache[in_f]  # [1, in]
            if fmt not in gbps:  # this format's first shape: its kernels compile here, off the budget
                budget.warm(lambda x=x, w=w: be.d_get(be.d_matmul(x, w)))
            secs, n = time_chain(lambda x=x, w=w: be.d_matmul(x, w), be.d_get, cfg.repetitions,
                                 max(budget.left() - reserve_s, 0.0), cfg.chain_s)
        finally:
            be.free(w)
        g = [nbytes / s / 1e9 for s in secs]
        gbps[fmt] = float(np.median(g))
        rows.append({**base, "fmt": fmt, "out_features": int(out_f), "in_features": int(in_f), "tokens": 1,
                     "weight_bytes": int(nbytes), "shape_source": src, "chain_calls": int(n),
                     "seconds": stat(secs), "weight_gbps": stat(g)})
    rows.sort(key=lambda e: (formats.index(e["fmt"]), e["weight_bytes"], e["out_features"]))
    return rows, left_out


def _attention(be, base: dict, cfg: TrunkSettings, limit: int | None, budget: _Budget,
               say: Progress) -> tuple[list[dict], _LeftOut]:
    """attention entries of one device (shortest context first), and what was left out."""
    rows, left_out = [], _LeftOut()
    hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rng = np.random.default_rng(7)
    q = be.d_put(rng.standard_normal((1, hq, d), np.float32))  # [T=1, Hq, d]
    block = rng.standard_normal((min(256, max(cfg.contexts)), hkv, d), np.float32) * 0.1  # [rows, Hkv, d]
    scale = 1.0 / math.sqrt(d)
    per_token_s, prep = None, _Rate()  # seconds per context token from the last context measured
    for ctx in sorted(set(int(c) for c in cfg.contexts)):
        kv_bytes = 2 * ctx * hkv * d * 4
        if limit is not None and kv_bytes > limit:
            left_out.memory.append(f"context {ctx}")
            continue
        call_s = per_token_s * ctx if per_token_s else 0.0
        need = prep.seconds(kv_bytes) + 2 * call_s + max(call_s, cfg.chain_s)
        if not _fits(need, budget.left()):
            left_out.budget.append(f"context {ctx}")
            continue
        say(f"trunk: {base['backend']}:{base['device_index']} attention context {ctx}")
        t0 = time.perf_counter()
        k, v = be.d_zeros((ctx, hkv, d)), be.d_zeros((ctx, hkv, d))  # [C, Hkv, d] each, as KV pages are
        src = be.d_put(block)
        for r0 in range(0, ctx, block.shape[0]):
            part = src if r0 + block.shape[0] <= ctx else be.d_put(block[: ctx - r0])
            be.d_write_rows(k, r0, part)
            be.d_write_rows(v, r0, part)
        prep.add(kv_bytes, time.perf_counter() - t0)
        if not rows:  # the first context: the attention kernel compiles here, off the budget
            budget.warm(lambda k=k, v=v, ctx=ctx: be.d_get(be.d_attention(q, k, v, ctx, ctx - 1, scale)))
        secs, n = time_chain(lambda k=k, v=v, ctx=ctx: be.d_attention(q, k, v, ctx, ctx - 1, scale),
                             be.d_get, cfg.repetitions, max(budget.left(), 0.0), cfg.chain_s)
        del k, v, src
        per_token_s = float(np.median(secs)) / ctx
        rows.append({**base, "n_heads": hq, "n_kv_heads": hkv, "head_dim": d, "context_tokens": ctx,
                     "tokens": 1, "kv_bytes": int(kv_bytes), "chain_calls": int(n), "seconds": stat(secs),
                     "kv_gbps": stat(kv_bytes / s / 1e9 for s in secs)})
    return rows, left_out


def probe_trunk_device(device: dict, cfg: TrunkSettings, model_shapes: Sequence[tuple[int, int, str]] = (),
                       ram_available_bytes: int | None = None,
                       progress: Progress | None = None) -> tuple[dict[str, list[dict]], list[dict]]:
    """The three trunk sections of one device (a DeviceInfo dict: backend, index, name, ...).

    Args:
        model_shapes: extra (out, in, source) GEMV shapes, e.g. a model's own projections.
        ram_available_bytes: host RAM free for the probe (host-memory devices).

    Returns:
        ({"dense_gemv": [...], "device_ops": [...], "attention": [...]}, skipped entries
        [{"backend", "device_index", "what", "reason"}]).

    Raises:
        BackendUnavailableError: the device cannot be opened (the caller records it as skipped).
    """
    from colibri_plan.backends import get_backend

    say = progress or (lambda _m: None)
    cls = get_backend(device["backend"])
    be = cls.open(device["index"])
    budget = _Budget(cfg.budget_s)  # from here: opening a device (driver, kernel cache) is not the probe's
    out: dict[str, list[dict]] = {s: [] for s in SECTIONS}
    skipped: list[dict] = []
    base = {"backend": device["backend"], "device_index": int(device["index"]), "device_name": be.device.name}
    where = {"backend": base["backend"], "device_index": base["device_index"]}

    def skip(what: str, reason: str) -> None:
        skipped.append({**where, "what": what, "reason": reason})

    limit = device_limit_bytes(device, ram_available_bytes, cfg.memory_fraction)
    # the layer chain must outgrow the caches (a decode token reads the whole trunk), whatever max_bytes
    layer_limit = LAYER_MAX_BYTES if limit is None else min(limit, LAYER_MAX_BYTES)
    limit = cfg.max_bytes if limit is None else min(limit, cfg.max_bytes)
    supported = set(cls.formats) & set(be.device.formats or cls.formats)
    formats = [f for f in cfg.formats if f in supported]
    if len(formats) < len(cfg.formats):
        skip("dense_gemv", f"{base['backend']} kernels do not implement "
                           f"{', '.join(f for f in cfg.formats if f not in supported)}")
    sources = {(int(o), int(i)): "generic" for o, i in cfg.shapes}
    for o, i, src in model_shapes:
        key = (int(o), int(i))
        if sources.get(key, "generic") == "generic":  # a shared shape is measured once, as the model's
            sources[key] = str(src)
    unique = [(o, i, s) for (o, i), s in sources.items()]
    try:
        say(f"trunk: {base['backend']}:{base['device_index']} device_ops")
        try:
            out["device_ops"].append(probe_device_ops(be, base, cfg.hidden, cfg.repetitions,
                                                      min(0.1 * cfg.budget_s, budget.left()), cfg.chain_s))
        except Exception as exc:  # noqa: BLE001 - one section failing must not sink the device
            skip("device_ops", f"{type(exc).__name__}: {exc}")
        try:  # dense first: the planner's largest term; attention gets what is left (at least 35 %)
            rows, left_out = _dense(be, base, cfg, unique, formats, limit, budget, 0.35 * cfg.budget_s, say)
            out["dense_gemv"] = rows
            if left_out.message(limit, cfg.budget_s):
                skip("dense_gemv", left_out.message(limit, cfg.budget_s))
        except Exception as exc:  # noqa: BLE001
            skip("dense_gemv", f"{type(exc).__name__}: {exc}")
        try:
            rows, left_out = _attention(be, base, cfg, limit, budget, say)
            out["attention"] = rows
            if left_out.message(limit, cfg.budget_s):
                skip("attention", left_out.message(limit, cfg.budget_s))
        except Exception as exc:  # noqa: BLE001
            skip("attention", f"{type(exc).__name__}: {exc}")
        if cfg.layer is not None and formats:  # beside the budget: the figure the planner needs most
            try:
                path = "host" if base["backend"] in HOST_BACKENDS else "device"
                say(f"trunk: {base['backend']}:{base['device_index']} trunk_layer ({path}, {formats[0]})")
                out["trunk_layer"].append(probe_layer(be, base, cfg.layer, formats[0], path, layer_limit,
                                                      cfg.repetitions, max(0.3 * cfg.budget_s, 0.5)))
            except Exception as exc:  # noqa: BLE001
                skip("trunk_layer", f"{type(exc).__name__}: {exc}")
        if cfg.step is not None and cfg.layer is not None and cfg.layer.vocab and formats \
                and be.supports("d_capture_step"):  # beside the budget too: the replayed step's figure
            try:
                out["step_graph"].append(probe_step(be, base, cfg.layer, formats[0], cfg.step, progress=say))
            except Exception as exc:  # noqa: BLE001
                skip("step_graph", f"{type(exc).__name__}: {exc}")
    finally:
        be.close()
    if not out["step_graph"]:  # optional: no empty section (a profile's sections list entries)
        del out["step_graph"]
    return out, skipped


def probe_trunk(devices: list[dict], cfg: TrunkSettings, model_shapes: Sequence[tuple[int, int, str]] = (),
                ram_available_bytes: int | None = None,
                progress: Progress | None = None) -> tuple[dict[str, list[dict]], list[dict]]:
    """Run :func:`probe_trunk_device` on every device; a device that fails is skipped with the reason.

    Returns:
        ({"dense_gemv", "device_ops", "attention"}: lists of entries, skipped entries).
    """
    out: dict[str, list[dict]] = {s: [] for s in SECTIONS}
    skipped: list[dict] = []
    for d in devices:
        try:
            got, s = probe_trunk_device(d, cfg, model_shapes, ram_available_bytes, progress)
        except Exception as exc:  # noqa: BLE001 - one backend failing must not sink the profile
            skipped.append({"backend": d["backend"], "device_index": d["index"], "what": "trunk",
                            "reason": f"{type(exc).__name__}: {exc}"})
            continue
        for k in SECTIONS:
            out[k] += got.get(k, [])
        skipped += s
    if not out["step_graph"]:
        del out["step_graph"]
    return out, skipped
