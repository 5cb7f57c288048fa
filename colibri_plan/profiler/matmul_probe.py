"""Matmul probe: quantized GEMV/GEMM throughput of every backend and device at the expert shapes.

Each figure goes through the backend's own ``time_matmul`` (the ``matmul`` call inference makes,
synchronized, after one warm-up), at the routed expert's two shapes — gate/up ``[I, H]`` (hidden ->
width) and down ``[H, I]`` (width -> hidden) — and at 1 token (decode) and 16 tokens (prefill batch).
``weight_gbps`` = stored weight bytes (data + scales) / seconds / 1e9. The fused ``expert_ffn`` over
``k`` experts at 1 token (what decode runs per layer) is timed the same way. On a backend that declares
``upload_expert_mapped`` (experts in mapped page-locked host memory, read by the device over its link:
the zero-copy pinned tier) a second ``expert_ffn`` row times the same call with the experts uploaded
that way, tagged ``"memory": "mapped"`` (the device-memory row says ``"memory": "device"``).

Time budget: after the first timed call, a figure takes only as many repetitions (up to the asked
number, at least one) as fit in ``budget_s``, so a slow reference backend cannot stall the profile; the
``repetitions`` field of every figure says how many there were. ``expert_ffn`` is skipped, with the
reason, when its estimate from the matmul figures (k x (2 gate/up + 1 down)) exceeds its budget.

Weights hold random codes: throughput does not depend on the values, and building them is instant.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from colibri_plan.formats.profile import stat
from colibri_plan.quant import FLOAT_FORMATS, QuantTensor, data_shape, quantize, scale_dtype, scales_shape

Progress = Callable[[str], None]


def random_weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> QuantTensor:
    """A valid QuantTensor [out, in] of random codes (float formats: random normal values)."""
    rng = np.random.default_rng(seed)
    if fmt in FLOAT_FORMATS:
        return quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), fmt)
    shape = data_shape(fmt, out_features, in_features)
    dtype = np.int8 if fmt == "int8" else np.uint8
    data = rng.integers(-127 if fmt == "int8" else 0, 128 if fmt == "int8" else 256, shape).astype(dtype)
    scales = np.full(scales_shape(fmt, out_features, in_features), 0.01, scale_dtype(fmt))
    return QuantTensor(fmt, out_features, in_features, data, scales)


def budgeted(timer: Callable[[int], list[float]], max_repetitions: int, budget_s: float) -> list[float]:
    """Call ``timer(n)`` (n timed calls after its own warm-up) once with n = 1, then once more with as
    many calls as fit in ``budget_s`` (at most ``max_repetitions`` in all). Returns every timing."""
    times = list(timer(1))
    more = min(max_repetitions - 1, int(budget_s / max(times[0], 1e-9)) - 2)
    if more > 0:
        times += list(timer(more))
    return times


@dataclass(frozen=True)
class MatmulSettings:
    """What the matmul probe measures and how hard.

    Attributes:
        formats: expert quant formats to time (unsupported ones are skipped with the reason).
        hidden, width: the expert's H and I (elements): gate/up [I, H], down [H, I].
        tokens: token counts of the matmul figures (1: decode; a batch: prefill).
        repetitions: most timed calls per figure. ffn_experts: k of the ``expert_ffn`` figure (0: none).
        budget_s: seconds per matmul figure; ffn_budget_s: per ``expert_ffn`` figure; device_budget_s:
            per device for all of them (formats left when it is spent are skipped).
    """

    formats: Sequence[str]
    hidden: int
    width: int
    tokens: Sequence[int] = (1, 16)
    repetitions: int = 5
    ffn_experts: int = 8
    budget_s: float = 1.0
    ffn_budget_s: float = 3.0
    device_budget_s: float = 30.0


def probe_device(backend: str, index: int, cfg: MatmulSettings,
                 progress: Progress | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """Matmul and expert_ffn figures of one device under ``cfg``. Formats left when
    ``cfg.device_budget_s`` is spent are skipped with that reason.

    Returns:
        (matmul entries, expert_ffn entries, skipped [{"backend", "device_index", "fmt"?, "reason"}]).

    Raises:
        BackendUnavailableError: the device cannot be opened (the caller records it as skipped).
    """
    from colibri_plan.backends import get_backend

    formats, hidden, width, tokens = cfg.formats, cfg.hidden, cfg.width, cfg.tokens
    repetitions, ffn_experts, budget_s = cfg.repetitions, cfg.ffn_experts, cfg.budget_s
    ffn_budget_s, device_budget_s = cfg.ffn_budget_s, cfg.device_budget_s
    cls = get_backend(backend)
    be = cls.open(index)
    rows, ffn_rows, skipped = [], [], []
    dev = be.device
    base = {"backend": backend, "device_index": index, "device_name": dev.name, "device_kind": dev.kind}
    supported = set(cls.formats) & set(dev.formats or cls.formats)
    rng = np.random.default_rng(1)

    def skip(fmt: str, what: str, reason: str) -> None:
        skipped.append({"backend": backend, "device_index": index, "fmt": fmt, "what": what,
                        "reason": reason})

    t_start = time.perf_counter()
    try:
        for fmt in formats:
            spent = time.perf_counter() - t_start
            if spent > device_budget_s:
                skip(fmt, "matmul", f"this mode's {device_budget_s:g} s budget per device was spent "
                                    f"({spent:.1f} s); measure it alone with --backends {backend}")
                continue
            if fmt not in supported:
                skip(fmt, "matmul", f"{backend} kernels do not implement {fmt}")
                continue
            if progress:
                progress(f"matmul: {backend}:{index} {dev.name} {fmt} [{width}x{hidden}] and "
                         f"[{hidden}x{width}]")
            try:
                mine = _probe_fmt(be, base, fmt, hidden, width, tokens, repetitions, budget_s, rng)
                rows += mine
            except Exception as exc:  # noqa: BLE001 - one format failing must not sink the device
                skip(fmt, "matmul", f"{type(exc).__name__}: {exc}")
                continue
            if ffn_experts <= 0:
                continue
            one = {(r["out_features"], r["in_features"]): r["seconds"]["median"] for r in mine
                   if r["tokens"] == min(tokens)}
            estimate = ffn_experts * (2 * one[(width, hidden)] + one[(hidden, width)])
            if 2 * estimate > ffn_budget_s:  # warm-up + one timed call must fit
                skip(fmt, "expert_ffn", f"estimated {estimate:.2f} s per call ({ffn_experts} experts) "
                                        f"exceeds the {ffn_budget_s:g} s budget of this mode")
                continue
            for memory in ("device", "mapped") if maps_experts(cls) else ("device",):
                try:
                    ffn_rows.append(_probe_ffn(be, base, fmt, (hidden, width), ffn_experts, repetitions,
                                               ffn_budget_s, memory))
                except Exception as exc:  # noqa: BLE001
                    skip(fmt, "expert_ffn" if memory == "device" else "expert_ffn mapped",
                         f"{type(exc).__name__}: {exc}")
    finally:
        be.close()
    return rows, ffn_rows, skipped


def maps_experts(cls) -> bool:
    """Whether backend class ``cls`` declares ``upload_expert_mapped`` (False, too, under a contract that
    does not know the op yet: ``supports`` refuses an op it does not know)."""
    from colibri_plan.errors import InputError

    try:
        return bool(cls.supports("upload_expert_mapped"))
    except InputError:
        return False


def _probe_fmt(be, base: dict, fmt: str, hidden: int, width: int, tokens: Sequence[int],
               repetitions: int, budget_s: float, rng: np.random.Generator) -> list[dict]:
    rows = []
    for out_f, in_f in ((width, hidden), (hidden, width)):  # gate/up [I, H], down [H, I]
        w = be.upload(random_weight(fmt, out_f, in_f))
        try:
            for t in tokens:
                x = rng.standard_normal((t, in_f), dtype=np.float32)  # activations [T, in]
                secs = budgeted(lambda n, x=x, w=w: be.time_matmul(x, w, repeats=n), repetitions, budget_s)
                rows.append({**base, "fmt": fmt, "out_features": out_f, "in_features": in_f,
                             "tokens": int(t), "weight_bytes": int(w.nbytes),
                             "method": "backend.time_matmul (synchronized, after one warm-up)",
                             "seconds": stat(secs), "weight_gbps": stat(w.nbytes / s / 1e9 for s in secs)})
        finally:
            be.free(w)
    return rows


def _probe_ffn(be, base: dict, fmt: str, shape: tuple[int, int], k: int, repetitions: int,
               budget_s: float, memory: str = "device") -> dict:
    """One ``expert_ffn`` row: k experts of ``shape`` (H, I) at 1 token each, uploaded into the device's
    memory (``memory`` "device": ``upload_expert``) or mapped host memory ("mapped":
    ``upload_expert_mapped``)."""
    # k distinct experts (own memory each, so no cache reuse flatters the figure) at 1 token each
    hidden, width = shape
    upload = be.upload_expert if memory == "device" else be.upload_expert_mapped
    proto = [random_weight(fmt, width, hidden, 2), random_weight(fmt, width, hidden, 3),
             random_weight(fmt, hidden, width, 4)]
    experts, held = [], 0
    try:
        for _ in range(k):
            copies = [QuantTensor(q.fmt, q.out_features, q.in_features, q.data.copy(),
                                  None if q.scales is None else q.scales.copy()) for q in proto]
            experts.append(upload(*copies))
            held += sum(q.nbytes for q in copies)
        xs = [np.random.default_rng(i).standard_normal((1, hidden), dtype=np.float32) for i in range(k)]
        secs = budgeted(lambda n: be.time_expert_ffn(xs, experts, repeats=n), repetitions, budget_s)
    finally:
        for e in experts:
            for w in e:
                be.free(w)
    return {**base, "fmt": fmt, "experts": k, "tokens": 1, "hidden": hidden, "width": width,
            "weight_bytes": held, "memory": memory,
            "method": "backend.expert_ffn over k experts, 1 token each"
                      + ("" if memory == "device" else ", in mapped host memory (upload_expert_mapped)"),
            "seconds": stat(secs), "weight_gbps": stat(held / s / 1e9 for s in secs)}


def probe_matmul(devices: list[dict], cfg: MatmulSettings,
                 progress: Progress | None = None) -> tuple[list[dict], list[dict], list[dict]]:
    """Run :func:`probe_device` with ``cfg`` on every device; a device that fails is skipped with the
    reason.

    Returns:
        (matmul entries, expert_ffn entries, skipped entries).
    """
    rows, ffn_rows, skipped = [], [], []
    for d in devices:
        try:
            r, f, s = probe_device(d["backend"], d["index"], cfg, progress)
        except Exception as exc:  # noqa: BLE001 - one backend failing must not sink the profile
            skipped.append({"backend": d["backend"], "device_index": d["index"], "what": "matmul",
                            "reason": f"{type(exc).__name__}: {exc}"})
            continue
        rows += r
        ffn_rows += f
        skipped += s
    return rows, ffn_rows, skipped
