"""The prefill cost model: predicted seconds of a P-token prompt's forward pass under a plan (pure).

The engine runs the prompt as one batch of P rows: every weight it touches is read once per batch and
multiplied by all the rows that need it. Time to first token is the prefill itself (the first new
token comes out of the prompt's last row), so ``ttft_s == prefill_s``. Per prompt of P tokens::

    prefill_s   = Σ_decode layers max(cpu_l, gpu_l,d + xfer_l,d for each d)  +  trunk_s
    q_e         = 1 − (1 − p_e)^P          probability the batch touches expert e at least once
    n_e         = P · p_e / q_e            expected rows of a touched expert
    gpu_l,d     = Σ_{e on d} q_e · b / g_d · f(n_e, r_d)
    xfer_l,d    = (1 − Π_{e on d} (1 − q_e)) · (P · H · 4 · (1/h2d_d + 1/d2h_d) / 1e9 + 2 · latency_d)
    cpu_l       = max(ram_l + verify_l + stream_l, disk_l + stream_l / max(1, M_l))   (reads and compute
                                                         pipeline)
    ram_l       = Σ_{e pinned} q_e · b / g_cpu · f(n_e, r_cpu)
    disk_l      = Σ_{e on disk} q_e · b / disk GB/s    (a touched miss is read once per batch)
    verify_l    = Σ_{e on disk} q_e · b / crc32 GB/s   (the reader threads check every streamed expert, CPU
                                                         time the pinned compute cannot use; as at decode)
    M_l         = Σ_{e on disk} q_e                    expected distinct misses of the batch

**Pipelined reads**: a prefill's misses outnumber the reader threads (the plan's queue depth), so their
reads land one after another (in waves of the engine's working buffers, docs/engine.md) and each
streamed expert is computed as soon as its read lands, while later reads are in flight. Compute and
reads therefore overlap as a whole: the path is the longer of all the CPU work (pinned and streamed
compute, crc32 checks) and all the reads, the latter plus the compute of the last expert read, which
has no read left to hide behind. (At decode a layer's few misses land together and their compute
follows: decode's max(a, d) + stream.) Measured on the fixture (``bench/prefill_accuracy.py``), the
run's disk wait was a third of its read time at 64 and 256 prompt tokens, not the serial sum.
    stream_l    = Σ_{e on disk} q_e · b / g_cpu · f(n_e, r_cpu)
    trunk_s     = (dense − lm) / g_t · f(P, r_t) + lm / g_lm  +  n_layers · ops_per_layer · op_s
                  + (P² / 2) · kv_bytes_per_token / kv GB/s(P)  +  n_moe · handoff_t(P)
    handoff_t(P) = roundtrip_s + (P − 1) · H · 4 · (1/h2d + 1/d2h) / 1e9   (0 with the trunk on the CPU)

**Offload** (a CUDA trunk, ``P >= offload_tokens``: the engine's PREFILL_OFFLOAD_TOKENS, recorded in the
figures; engine/offload.py): every touched host expert (pinned or on disk) is copied to the trunk's GPU t
and computed there with its VRAM experts, in place of the CPU compute::

    h2d_l       = Σ_{e pinned or on disk} q_e · b / h2d_t            (the uploads; ``offload_h2d_s``)
    host_l      = max(h2d_pinned_l + verify_l + h2d_disk_l, disk_l + h2d_disk_l / max(1, M_l))
                                                  (each miss goes up as its read lands, as it computed)
    gpu_l,t     = Σ_{e on t} q_e · b / g_t · f(n_e, r_t) + host_l + Σ_{e host} q_e · b / g_t · f(n_e, r_t)
                                                  (one device call after the uploads: no overlap)

and cpu_l is host_l. Plans recorded without ``offload_tokens`` are priced as before.

``p_e`` is the heat's per-token selection probability (a layer's p sum to top-k), ``b`` the expert's
bytes, ``g`` a tier's weight GB/s at 1 token (the plan's decode figures). **Independence**: the P
tokens are taken to select experts independently of each other with the heat's probabilities, so
``q_e`` is the chance at least one of them picks e; real prompts repeat experts more (topic locality),
so this over-counts distinct experts, a pessimistic bias that grows with P. The LRU is taken as empty
(every touched disk expert is read): conservative at the start of a prompt.

**Batched rate** ``f(T, r)``: seconds of one matmul over T rows relative to 1 row. The profile's
``matmul`` section measures weight GB/s at 1 and 16 tokens; ``r = g(1) / g(16)`` is the time of a 16-row
call over a 1-row call (clamped to [1, 16]). Between 1 and 16 rows the time is interpolated linearly,
``f(T) = 1 + (T − 1) · (r − 1) / 15``; above 16 the kernel runs ⌈T/16⌉ passes, taken fractionally (an
expectation), ``f(T) = r · T / 16``. Without a 16-token figure ``r = 16``: no batching gain, each row
costs a full read (f(T) = T). An expert's r is the byte-weighted mean of its gate/up shape ([I, H], 2 of
3 bytes) and its down shape ([H, I]). The trunk's r is that of its device at the dense format (else at
the expert format). The LM head runs on the last row only (1 row at the LM head GB/s). Attention is
causal: row i reads i keys, Σ_i i ≈ P²/2 K+V rows at the ``attention`` section's KV GB/s at context P. A
split trunk is priced on its first device. Every GPU holding experts of a layer pays the P-row round
trip, except the trunk's own GPU on CUDA (``device_x``: its VRAM experts run on the device's rows at
prefill, ``d_expert_ffn_rows``; on other backends a device trunk's prefill sends every routed expert
through the host path, so its GPU pays the trip too), and the host tiers are computed on the CPU even
where a unified GPU computes them at decode (the plan's ``compute`` section), unless the offload above
moves them to a CUDA trunk's GPU. Coefficients are not
applied (they are fitted on decode runs): the prefill figures are uncalibrated.

The plan records the figures (``predicted.prefill.figures``) so :func:`prefill_for_plan` can predict
again at another prompt length from the plan alone, and the prefill at 1, 2, 4, ... 32768 tokens
(``predicted.prefill.curve``), which ``verify`` (no planner import) interpolates at the run's prompt length.
"""

from __future__ import annotations

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.formats.plan import PREFILL_OFFLOAD_TOKENS
from colibri_plan.formats.profile_trunk import kv_gbps_at

#: the token count of the profile's batched ``matmul`` figure
BATCH_TOKENS = 16
#: prompt length ``solve`` predicts the prefill at by default
DEFAULT_PROMPT_TOKENS = 512
#: prompt lengths of the recorded curve (``predicted.prefill.curve``): powers of two, 1 .. 32768
CURVE_TOKENS = tuple(2 ** i for i in range(16))


def batch_factor(rows, r: float):
    """Seconds of a ``rows``-row matmul relative to a 1-row one (module docstring: f(T, r)): a float for a
    number of rows, a float64 array of the same shape for an array of them.

    Pure: f(1, r) = 1; f(16, r) = r; f(8.5, 4) = 1 + 7.5 · 3 / 15 = 2.5; f(32, 4) = 8; f(T, 16) = T.
    """
    r = min(float(BATCH_TOKENS), max(1.0, float(r)))
    t = np.maximum(1.0, np.asarray(rows, dtype=np.float64))
    f = np.where(t <= BATCH_TOKENS, 1.0 + (t - 1.0) * (r - 1.0) / (BATCH_TOKENS - 1), r * t / BATCH_TOKENS)
    return float(f) if f.ndim == 0 else f


def distinct_experts(p: np.ndarray, prompt_tokens: int) -> np.ndarray:
    """float64 ``[..., E]`` q_e = 1 − (1 − p_e)^P: the chance a P-token batch touches each expert (tokens
    choosing independently). Σ q over a layer is the expected number of distinct experts read.
    E.g. p = 0.5, P = 2: 0.75."""
    p = np.clip(np.asarray(p, dtype=np.float64), 0.0, 1.0)
    return 1.0 - (1.0 - p) ** int(prompt_tokens)


def _rows_seconds(p: np.ndarray, q: np.ndarray, prompt_tokens: int, expert_bytes: int, gbps: float,
                  r: float) -> float:
    """Σ_e q_e · b / g · f(n_e, r) over the experts of ``p`` (n_e = P · p_e / q_e)."""
    touched = q > 0
    if not np.any(touched):
        return 0.0
    q = q[touched]
    f = batch_factor(prompt_tokens * p[touched] / q, r)                           # [n touched]
    return float(np.sum(q * f)) * expert_bytes / (gbps * 1e9)


def layer_seconds(p: np.ndarray, tiers: np.ndarray, prompt_tokens: int, fig: dict) -> dict:
    """One MoE layer's expert seconds for a P-token batch.

    Args:
        p: float64 [E] selection probabilities; tiers: int [E] (device position 0.., -1 RAM, -2 disk).
        fig: the ``figures`` dict (:func:`figures_from_setup`).

    Returns:
        {"layer_s", "cpu_s", "disk_read_s", "verify_s", "gpu_s": {key: s incl. transfer},
        "offload_h2d_s" (0 without the offload), "distinct_experts"}.
    """
    p, tiers = np.asarray(p, dtype=np.float64), np.asarray(tiers)
    q = distinct_experts(p, prompt_tokens)
    b, cpu = int(fig["expert_bytes"]), fig["cpu"]
    ram = tiers == -1
    disk = tiers == -2
    ram_s = _rows_seconds(p[ram], q[ram], prompt_tokens, b, cpu["gbps"], cpu["r"])
    stream_s = _rows_seconds(p[disk], q[disk], prompt_tokens, b, cpu["gbps"], cpu["r"])
    disk_s = 0.0
    if np.any(q[disk] > 0):
        if not fig.get("disk_gbps"):
            raise InputError("the plan streams experts from disk but its prefill figures have no disk GB/s; "
                             "re-solve with a profile that measured the disk")
        disk_s = float(q[disk].sum()) * b / (fig["disk_gbps"] * 1e9)
    # the reader threads' crc32 of every streamed expert takes the cores from the compute (decode's
    # verify_l; 0 for plans recorded without the figure)
    misses = float(q[disk].sum())
    verify_s = misses * b / (fig["checksum_gbps"] * 1e9) if fig.get("checksum_gbps") else 0.0
    # reads land one after another and each miss computes as its read lands (module docstring): all the
    # CPU work against all the reads plus the last miss's compute
    last_s = stream_s / max(1.0, misses)   # one miss's compute (all of it when < 1 is expected)
    cpu_s = max(ram_s + verify_s + stream_s, disk_s + last_s)
    t = offload_gpu(fig, prompt_tokens)
    h2d_s = offload_s = 0.0
    if t is not None:   # the host experts go up to the trunk's GPU and run there (module docstring)
        up_ram = float(q[ram].sum()) * b / (t["h2d_gbps"] * 1e9)
        up_disk = misses * b / (t["h2d_gbps"] * 1e9)
        h2d_s = up_ram + up_disk
        cpu_s = max(up_ram + verify_s + up_disk, disk_s + up_disk / max(1.0, misses))
        host = ram | disk
        offload_s = cpu_s + _rows_seconds(p[host], q[host], prompt_tokens, b, t["gbps"], t["r"])
    gpu = {}
    h = int(fig["hidden_size"])
    for d, g in enumerate(fig["gpus"]):
        on = tiers == d
        if not np.any(on):
            continue
        used = 1.0 - float(np.prod(1.0 - q[on]))
        xfer = 0.0
        if not g.get("unified") and not g.get("device_x"):   # device_x: the trunk's rows are there
            act = prompt_tokens * h * 4
            xfer = used * (act / (g["h2d_gbps"] * 1e9) + act / (g["d2h_gbps"] * 1e9) + 2 * g["latency_s"])
        gpu[g["key"]] = _rows_seconds(p[on], q[on], prompt_tokens, b, g["gbps"], g["r"]) + xfer
    if t is not None and offload_s > 0:
        gpu[t["key"]] = gpu.get(t["key"], 0.0) + offload_s
    return {"layer_s": max([cpu_s, *gpu.values()]), "cpu_s": cpu_s, "disk_read_s": disk_s, "gpu_s": gpu,
            "verify_s": verify_s, "offload_h2d_s": h2d_s, "distinct_experts": float(q.sum())}


def offload_gpu(fig: dict, prompt_tokens: int) -> dict | None:
    """The figures of the trunk's CUDA GPU (``device_x``) when a ``prompt_tokens`` prefill offloads the host
    experts to it (at least ``fig["offload_tokens"]`` tokens); None otherwise, and for plans recorded
    without ``offload_tokens``."""
    n = fig.get("offload_tokens")
    if not n or int(prompt_tokens) < int(n):
        return None
    return next((g for g in fig["gpus"] if g.get("device_x") and not g.get("unified")), None)


def trunk_prefill_seconds(prompt_tokens: int, fig: dict) -> dict:
    """{"dense_s", "lm_head_s", "attention_s", "handoff_s"} of the trunk at P rows (module docstring)."""
    t, n = fig["trunk"], int(prompt_tokens)
    body = max(0, int(t["dense_bytes"]) - int(t["lm_head_bytes"]))
    dense = body / (t["gbps"] * 1e9) * batch_factor(n, t["r"]) + t["fixed_s"]
    lm = int(t["lm_head_bytes"]) / (t["lm_gbps"] * 1e9)
    attention = n * n / 2.0 * t["kv_bytes_per_token"] / (kv_gbps_at(t["kv_gbps"], n) * 1e9)
    handoff = 0.0
    if t.get("link"):
        act = (n - 1) * int(fig["hidden_size"]) * 4
        link = t["link"]
        handoff = t["n_moe_layers"] * (t["roundtrip_s"] + act / (link["h2d_gbps"] * 1e9)
                                       + act / (link["d2h_gbps"] * 1e9))
    return {"dense_s": dense, "lm_head_s": lm, "attention_s": attention, "handoff_s": handoff}


def predict_prefill(probs: np.ndarray, tiers: np.ndarray, decode_rows: np.ndarray, prompt_tokens: int,
                    fig: dict) -> dict:
    """The ``predicted.prefill`` section for a P-token prompt.

    Args:
        probs: float64 [rows, E]; tiers: int [rows, E]; decode_rows: bool [rows] (MTP rows are False: the
            prefill of plain decoding skips them); fig: :func:`figures_from_setup`'s dict.

    Returns:
        {"prompt_tokens", "prefill_s", "ttft_s", "prefill_tok_s", "terms": {experts_s, dense_s,
        lm_head_s, attention_s, handoff_s, disk_read_s, verify_s (crc32 of streamed experts, inside
        experts_s), offload_h2d_s (host experts' uploads to the trunk's GPU, inside experts_s),
        distinct_experts_per_layer}, "figures"}.

    Raises:
        InputError: a prompt length < 1, or disk experts without a disk figure.
    """
    n = int(prompt_tokens)
    if n < 1:
        raise InputError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    experts = disk = verify = distinct = h2d = 0.0
    rows = [i for i, keep in enumerate(np.asarray(decode_rows, dtype=bool)) if keep]
    for i in rows:
        lay = layer_seconds(probs[i], tiers[i], n, fig)
        experts += lay["layer_s"]
        disk += lay["disk_read_s"]
        verify += lay["verify_s"]
        h2d += lay["offload_h2d_s"]
        distinct += lay["distinct_experts"]
    terms = {"experts_s": experts, **trunk_prefill_seconds(n, fig), "disk_read_s": disk, "verify_s": verify,
             "offload_h2d_s": h2d, "distinct_experts_per_layer": distinct / max(1, len(rows))}
    total = sum(terms[k] for k in ("experts_s", "dense_s", "lm_head_s", "attention_s", "handoff_s"))
    return {"prompt_tokens": n, "prefill_s": total, "ttft_s": total, "prefill_tok_s": n / total,
            "terms": terms, "figures": fig}


def prefill_curve(probs: np.ndarray, tiers: np.ndarray, decode_rows: np.ndarray, fig: dict,
                  lengths=CURVE_TOKENS) -> list[list]:
    """[[prompt tokens, prefill seconds], ...] at ``lengths`` (ascending): what the plan records so a
    reader without the planner (``verify``) can interpolate the prefill at a run's prompt length."""
    return [[int(n), predict_prefill(probs, tiers, decode_rows, n, fig)["prefill_s"]] for n in lengths]


def prefill_lines(pre: dict | None) -> list[str]:
    """The human summary of a ``predicted.prefill`` section (time to first token and its terms), for
    ``solve`` and ``plan show``; [] without one (older plans)."""
    if not isinstance(pre, dict):
        return []
    t = pre["terms"]
    trunk_ms = (t["dense_s"] + t["lm_head_s"]) * 1e3
    return [f"Time to first token at {pre['prompt_tokens']} prompt tokens: {pre['ttft_s']:.3f} s (prefill "
            f"{pre['prefill_tok_s']:.1f} tok/s: experts {t['experts_s'] * 1e3:.1f} ms, "
            f"{t['distinct_experts_per_layer']:.1f} distinct experts/layer; trunk {trunk_ms:.1f} ms, "
            f"attention {t['attention_s'] * 1e3:.1f} ms, hand-off {t['handoff_s'] * 1e3:.1f} ms)"]


def prefill_for_plan(doc: dict, prompt_tokens: int) -> dict | None:
    """Predict the prefill again at ``prompt_tokens`` from a plan document's own figures (its layers'
    ``p``, tiers and ``predicted.prefill.figures``); None when the plan has no prefill figures or no
    probabilities (older plans)."""
    from colibri_plan.formats.plan import Plan, layer_probabilities

    pre = doc.get("predicted", {}).get("prefill")
    if not isinstance(pre, dict) or not isinstance(pre.get("figures"), dict):
        return None
    plan = Plan(doc)
    probs = layer_probabilities(plan)
    if probs is None:
        return None
    n_layers = int(doc["model"].get("n_layers", 1 << 30))
    decode = np.array([lid < n_layers for lid in plan.layer_ids])
    return predict_prefill(probs, plan.tiers(), decode, prompt_tokens, pre["figures"])


def batch_ratio(profile, backend: str, index: int, fmt: str, out_features: int, in_features: int) -> float:
    """r = weight GB/s at 1 token / at 16 tokens of one device's ``matmul`` at ``fmt`` (nearest shape),
    clamped to [1, 16]; 16 (no batching gain) when the profile has no 16-token figure for it."""
    rows = profile.doc.get("matmul")
    have = {r.get("tokens") for r in rows if r.get("backend") == backend and r.get("device_index") == index
            and r.get("fmt") == fmt} if isinstance(rows, list) else set()
    if BATCH_TOKENS not in have or 1 not in have:
        return float(BATCH_TOKENS)
    g1 = profile.matmul_weight_gbps(backend, index, fmt, 1, out_features, in_features)
    g16 = profile.matmul_weight_gbps(backend, index, fmt, BATCH_TOKENS, out_features, in_features)
    return min(float(BATCH_TOKENS), max(1.0, g1 / g16))


def _cpu_device(profile, fmt: str) -> tuple[str, int] | None:
    """(backend, index) of the CPU row the decode figure came from (the fastest CPU backend at ``fmt``)."""
    from colibri_plan.planner.budgets import cpu_matmul_devices

    cpus = cpu_matmul_devices(profile, fmt)
    if not cpus:
        return None
    return max(sorted(cpus), key=lambda c: profile.matmul_weight_gbps(c[0], c[1], fmt, 1))


def _ratio_on(profile, device: tuple[str, int] | None, fmts, out_features: int, in_features: int) -> float:
    """:func:`batch_ratio` at the first of ``fmts`` the device measured at 16 tokens (16 when none)."""
    if device is None:
        return float(BATCH_TOKENS)
    for f in fmts:
        r = batch_ratio(profile, device[0], device[1], f, out_features, in_features)
        if r < BATCH_TOKENS:
            return r
    return float(BATCH_TOKENS)


def _ffn_ratio(profile, device: tuple[str, int] | None, fmt: str, width: int, hidden: int) -> float:
    """r of one expert FFN: gate and up ([width, hidden]) and down ([hidden, width]) weighted by their
    bytes (2 : 1), each :func:`_ratio_on` at its own shape (the profile measures both; a down
    projection batches better than a gate on some CPUs)."""
    return (2.0 * _ratio_on(profile, device, (fmt,), width, hidden)
            + _ratio_on(profile, device, (fmt,), hidden, width)) / 3.0


def figures_from_setup(profile, setup) -> dict:
    """The figures the prefill model needs, from the solve's setup (``planner.make.Setup``, its trunk
    option chosen) and the profile: a JSON-ready dict the plan records (``predicted.prefill.figures``).

    Raises:
        InputError: the trunk figures are not positive finite numbers (:func:`planner.trunk.device_figures`).
    """
    from colibri_plan.planner.trunk import DEFAULT_OPS_PER_LAYER, dense_read_bytes, device_figures
    from colibri_plan.planner.trunk_layer import lm_head_bytes

    spec, res = setup.spec, setup.res
    fmt, dfmt = spec.expert_format, setup.dense_fmt
    h, i = spec.hidden_size, spec.moe_intermediate_size
    cpu_dev = _cpu_device(profile, fmt)
    fig = {"expert_bytes": int(spec.expert_bytes()), "hidden_size": int(h),
           "disk_gbps": res.disk_read_gbps, "checksum_gbps": res.checksum_gbps,
           "cpu": {"gbps": res.cpu_matmul_gbps, "r": _ffn_ratio(profile, cpu_dev, fmt, i, h)}, "gpus": [],
           "offload_tokens": PREFILL_OFFLOAD_TOKENS}   # a longer prefill's host experts run on a CUDA trunk
    for g in res.gpus:
        backend, _, idx = g.key.partition(":")
        fig["gpus"].append({"key": g.key, "gbps": g.matmul_gbps, "unified": g.unified,
                            "r": _ffn_ratio(profile, (backend, int(idx)), fmt, i, h),
                            "h2d_gbps": g.h2d_gbps, "d2h_gbps": g.d2h_gbps, "latency_s": g.link_latency_s,
                            # the trunk's CUDA GPU runs its VRAM experts on the device rows at prefill
                            "device_x": bool(g.holds_trunk and backend == "cuda")})
    device = setup.trunk.device if setup.trunk is not None else "cpu"
    figs = device_figures(profile, res, spec, dfmt, setup.problem.coef)
    tf = figs.get(device, figs["cpu"])
    gpu = next((g for g in res.gpus if g.key == tf.key), None)
    if gpu is None:   # the host: the CPU backend measured at the dense format, else the experts' one
        dev = _cpu_device(profile, dfmt) or cpu_dev
    else:
        dev = (tf.key.partition(":")[0], int(tf.key.partition(":")[2]))
    n_moe = sum(1 for lid in spec.moe_layers if lid < spec.n_layers)
    fig["trunk"] = {"device": tf.key, "gbps": tf.dense_gbps, "lm_gbps": tf.lm_gbps or tf.dense_gbps,
                    "r": _ratio_on(profile, dev, (dfmt, fmt), h, h),
                    "dense_bytes": int(dense_read_bytes(spec, dfmt)),
                    "lm_head_bytes": int(min(lm_head_bytes(spec, dfmt), dense_read_bytes(spec, dfmt))),
                    "kv_bytes_per_token": int(spec.kv_bytes_per_token),
                    "kv_gbps": [[int(c), float(v)] for c, v in tf.kv_gbps],
                    "fixed_s": spec.n_layers * DEFAULT_OPS_PER_LAYER * tf.op_s,
                    "roundtrip_s": tf.roundtrip_s, "n_moe_layers": n_moe,
                    "link": ({"h2d_gbps": gpu.h2d_gbps, "d2h_gbps": gpu.d2h_gbps}
                             if gpu is not None and not gpu.unified else None)}
    return fig


def prefill_section(profile, setup, tiers: np.ndarray, prompt_tokens: int) -> dict:
    """``predicted.prefill`` of a solved placement ``tiers`` [rows, E] under ``setup`` (see
    :func:`predict_prefill`)."""
    pr = setup.problem
    decode = np.asarray(pr.weights) > 0
    fig = figures_from_setup(profile, setup)
    out = predict_prefill(pr.probs, tiers, decode, prompt_tokens, fig)
    out["curve"] = prefill_curve(pr.probs, tiers, decode, fig)
    return out
