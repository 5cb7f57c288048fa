"""llama.cpp priced as it runs: decode and prefill seconds of a llama.cpp placement (pure, toy-checkable).

llama.cpp (``llama-bench``/``llama-server``) places tensors, not experts: ``-ngl N`` puts the last N
layers (their attention, norms, router and, unless overridden, the merged expert tensors
``blk.L.ffn_{gate,up,down}_exps``) on the GPU; ``-ot PATTERN=CPU`` keeps matching tensors in host
buffers, where the CPU computes them at its thread count and quant format. The model file is mapped
(``mmap``, its default): host weights are page-cache pages, read from disk by page faults when the model
exceeds the RAM left to them; ``--no-mmap`` reads them into anonymous memory (the process fails when they
do not fit); ``--mlock`` pins the mapped pages. Per decode token (seconds)::

    decode_s  = c_cpu · cpu_s + c_gpu · gpu_s + c_fault · fault_s + split_s · splits + graph_s
                + c_norepack · cpu_s (only with --no-repack of a quant llama.cpp repacks for the CPU)
    cpu_s     = (host bytes read per token) / CPU GB/s      (dense of CPU layers + top-k experts of the
                                                             host expert tensors + KV of CPU layers)
    gpu_s     = (GPU bytes read per token) / GPU GB/s
    fault_s   = (host mapped bytes a token reads that the page cache misses) / disk GB/s at queue depth 1,
                or, with the profile's fault probe and a model larger than the cache, the page-fault
                model of :mod:`.llamacpp_faults` (read-around windows, one LRU, the cyclic worst case)
    splits    = backend changes along the layer order (each is a graph split: a copy and a sync)

Per prompt token, with the prompt run in micro-batches of U = ``-ub`` tokens::

    prefill_s = c_pp_cpu · pp_cpu_s + c_pp_gpu · pp_gpu_s + c_xfer · xfer_s + c_fault · pp_fault_s
                + split_s · splits / U + graph_s / U
    pp_cpu_s  = host active bytes per token / CPU batched GB/s   (every token multiplies its top-k experts)
    xfer_s    = host weight bytes / (U · H2D GB/s)               (with a GPU, U >= 32: llama.cpp copies a
                                                                  host weight - experts, and the dense ones
                                                                  of CPU layers - to the GPU per micro-batch
                                                                  and computes it there; pp_cpu_s keeps only
                                                                  the host KV's attention)

The page cache (mmap, no mlock): dense weights are read every token and stay cached; the experts share
what is left, ``cache = RAM limit − anonymous (KV, compute buffers, no-mmap weights) − dense host bytes``,
one LRU over the host experts read with probabilities p (Che's approximation,
:func:`~colibri_plan.planner.cache_model.che_hit_rates`). The coefficients are llama.cpp's own
(:class:`LlamaCoefficients`), fitted from replay measurements by :mod:`.llamacpp_calibrate`; uncalibrated
they are 1 and 0. Units: bytes, GB/s (1e9 B/s), seconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from colibri_plan.errors import InputError
from colibri_plan.planner.cache_model import che_hit_rates

#: llama.cpp sends a host weight to the GPU for micro-batches of at least this many tokens (op offload)
OFFLOAD_MIN_BATCH = 32
#: the three merged expert tensors of a layer, in llama.cpp's names
PROJECTIONS = ("gate", "up", "down")


@dataclass(frozen=True)
class LlamaGeometry:
    """The model as llama.cpp holds it (bytes at the GGUF's quant).

    Attributes:
        n_layers: decoder layers (``blk.0`` .. ``blk.N-1``); moe: [n_layers] bool, the layer has experts.
        n_experts, top_k: routed experts per MoE layer and selected per token.
        expert_bytes: one expert's gate+up+down bytes (each projection a third).
        layer_dense_bytes: one layer's non-expert bytes (attention, norms, router, shared expert).
        head_bytes: the output head (read every token; on the GPU once -ngl exceeds n_layers).
        kv_bytes_per_token_layer: KV bytes of one context token in one layer (f16 as llama.cpp keeps it).
        hidden_size, vocab_size: for the compute buffers and the split copies.
        repackable: the quant has a CPU-specific layout llama.cpp repacks host weights into at load
            (Q4_0, Q4_K, IQ4_NL on x86; the replay's Q8_0 on a 2-core EPYC stayed ``CPU_Mapped``).
    """

    n_layers: int
    moe: tuple
    n_experts: int
    top_k: int
    expert_bytes: int
    layer_dense_bytes: int
    head_bytes: int
    kv_bytes_per_token_layer: int
    hidden_size: int
    vocab_size: int
    repackable: bool = False

    @property
    def model_bytes(self) -> int:
        """Every weight: layers' dense and experts, and the head (the token embedding's rows excluded)."""
        return int(self.n_layers * self.layer_dense_bytes + sum(self.moe) * self.n_experts * self.expert_bytes
                   + self.head_bytes)


@dataclass(frozen=True)
class LlamaMachine:
    """Machine figures for llama.cpp (from a profile, or by hand in tests).

    cpu_gbps: CPU weight GB/s at 1 token (the quant's CPU matmul, capped by RAM read); cpu_batch_gbps:
    weight-rows GB/s of a batched CPU matmul (weight GB/s x rows); fault_gbps: disk read GB/s at queue
    depth 1 (page faults), None: no disk figure; gpu_gbps / gpu_batch_gbps: the same on the GPU (0: none);
    h2d_gbps: host-to-device copy GB/s; ram_limit_bytes: memory the process and its page cache may use
    (the cgroup limit, or --ram); vram_bytes: the GPUs' bytes for llama.cpp (0: no GPU); n_gpus: over
    how many GPUs llama.cpp splits its GPU layers (its default ``-sm layer``: whole layers per GPU, the
    VRAM pooled; each GPU holds its own compute buffer, each boundary between them is one more split);
    fault_runs: the fault probe's ((run_bytes, seconds, read_bytes), ...) for isolated uncached runs of a
    mapped file (:mod:`colibri_plan.profiler.fault`); empty: faults priced at ``fault_gbps``."""

    cpu_gbps: float
    cpu_batch_gbps: float
    fault_gbps: float | None = None
    gpu_gbps: float = 0.0
    gpu_batch_gbps: float = 0.0
    h2d_gbps: float = 0.0
    ram_limit_bytes: int = 0
    vram_bytes: int = 0
    n_gpus: int = 1
    fault_runs: tuple = ()


@dataclass(frozen=True)
class LlamaPlacement:
    """A placement in llama.cpp's own terms.

    ngl: ``-ngl``: the last ``ngl`` of the n_layers + 1 (the output head counts as the last) on the
    GPU, as llama.cpp's loader numbers them (ngl 1: the head alone; n_layers + 1: all); cpu_experts:
    {layer: projections kept in host buffers} from ``-ot ...=CPU`` (a layer not on the GPU keeps all its
    tensors on the CPU anyway); kv_on_gpu: the KV cache of GPU layers on the GPU (llama.cpp's default;
    ``-nkvo`` keeps it on the host); context, ubatch, threads: ``-c``, ``-ub``, ``-t``; load: "mmap",
    "no-mmap" or "mlock"; repack: False is ``--no-repack`` (the CPU computes the file's layout)."""

    ngl: int = 0
    cpu_experts: dict = field(default_factory=dict)
    kv_on_gpu: bool = True
    context: int = 4096
    ubatch: int = 512
    threads: int = 0
    load: str = "mmap"
    repack: bool = True

    def on_gpu(self, layer: int, n_layers: int) -> bool:
        """Layer ``layer`` (``n_layers``: the output head) runs on the GPU: it is among the last -ngl."""
        return self.ngl > 0 and layer >= n_layers + 1 - self.ngl

    def host_projections(self, layer: int, n_layers: int) -> tuple:
        """The layer's expert projections in host buffers."""
        if not self.on_gpu(layer, n_layers):
            return PROJECTIONS
        return tuple(p for p in PROJECTIONS if p in set(self.cpu_experts.get(layer, ())))


@dataclass(frozen=True)
class LlamaCoefficients:
    """llama.cpp's cost coefficients (multipliers on the roofline terms, and seconds per event).

    ``fitted_on``: what they were fitted from (replay files, placements, machine), empty: uncalibrated."""

    c_cpu: float = 1.0
    c_gpu: float = 1.0
    c_fault: float = 1.0
    split_s: float = 0.0
    graph_s: float = 0.0
    c_pp_cpu: float = 1.0
    c_pp_gpu: float = 1.0
    c_xfer: float = 1.0
    c_norepack: float = 0.0       # extra CPU seconds per raw CPU second without the repacked layout
    c_pp_norepack: float = 0.0
    fitted_on: tuple = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fitted_on"] = list(self.fitted_on)
        return d

    @property
    def calibrated_on(self) -> str:
        """What a compare row says of these coefficients."""
        return "; ".join(self.fitted_on) if self.fitted_on else "uncalibrated"


DECODE_TERMS = ("cpu_s", "gpu_s", "fault_s", "splits", "graph", "norepack_s")
PREFILL_TERMS = ("pp_cpu_s", "pp_gpu_s", "xfer_s", "pp_fault_s", "pp_splits", "pp_graph", "pp_norepack_s")


def memory(g: LlamaGeometry, pl: LlamaPlacement) -> dict:
    """llama.cpp's own accounting of a placement, bytes: ``host_model`` (host weight buffers; mapped
    unless no-mmap), ``gpu_model``, ``host_kv`` / ``gpu_kv``, ``compute`` (each backend's compute buffer:
    4 B x min(ubatch, context) x (vocab + 16 x hidden), a bound above llama.cpp's reservations in the replay
    logs), ``anon_host`` (what the page cache cannot take back) and ``gpu_total``."""
    host = gpu = 0
    host_kv = gpu_kv = 0
    for layer in range(g.n_layers):
        kv = pl.context * g.kv_bytes_per_token_layer
        if pl.on_gpu(layer, g.n_layers):
            gpu += g.layer_dense_bytes
            gpu_kv += kv if pl.kv_on_gpu else 0
            host_kv += 0 if pl.kv_on_gpu else kv
        else:
            host += g.layer_dense_bytes
            host_kv += kv
        if g.moe[layer]:
            n_host = len(pl.host_projections(layer, g.n_layers))
            per = g.n_experts * g.expert_bytes / len(PROJECTIONS)
            host += int(n_host * per)
            gpu += int((len(PROJECTIONS) - n_host) * per)
    head_gpu = pl.on_gpu(g.n_layers, g.n_layers)
    gpu += g.head_bytes if head_gpu else 0
    host += 0 if head_gpu else g.head_bytes
    compute = 4 * min(pl.ubatch, max(1, pl.context)) * (g.vocab_size + 16 * g.hidden_size)
    anon = host_kv + compute + (host if pl.load == "no-mmap" else 0)
    has_gpu = pl.ngl > 0
    return {"host_model": int(host), "gpu_model": int(gpu), "host_kv": int(host_kv), "gpu_kv": int(gpu_kv),
            "compute": int(compute), "anon_host": int(anon),
            "gpu_total": int(gpu + gpu_kv + (compute if has_gpu else 0))}


def check_placement(g: LlamaGeometry, m: LlamaMachine, pl: LlamaPlacement) -> str | None:
    """Why llama.cpp cannot run ``pl`` within the budgets (None when it can): its GPU buffers over the
    VRAM, or (no-mmap / mlock) its host weights and buffers over the RAM limit."""
    mem = memory(g, pl)
    gpu_total = mem["gpu_total"] + (max(1, m.n_gpus) - 1) * mem["compute"]   # a compute buffer per GPU
    if pl.ngl > 0 and gpu_total > m.vram_bytes:
        return (f"GPU buffers {gpu_total / 2**20:.0f} MiB exceed the VRAM budget "
                f"{m.vram_bytes / 2**20:.0f} MiB")
    held = mem["anon_host"] + (mem["host_model"] if pl.load == "mlock" else 0)   # no-mmap: in anon_host
    if pl.load != "mmap" and m.ram_limit_bytes and held > m.ram_limit_bytes:
        return (f"{pl.load}: host weights and buffers {held / 2**20:.0f} MiB exceed the RAM limit "
                f"{m.ram_limit_bytes / 2**20:.0f} MiB")
    return None


def _expert_probs(g: LlamaGeometry, probs: np.ndarray | None) -> np.ndarray:
    """[n_layers, E] selection probabilities per token (uniform top_k/E without heat; 0 on dense layers)."""
    if probs is None:
        p = np.full((g.n_layers, g.n_experts), g.top_k / g.n_experts)
    else:
        p = np.asarray(probs, dtype=np.float64)
        if p.shape != (g.n_layers, g.n_experts):
            raise InputError(f"llama.cpp pricing: heat of shape {p.shape}, the model has "
                             f"({g.n_layers}, {g.n_experts}); give heat for this model")
    return np.where(np.asarray(g.moe, dtype=bool)[:, None], p, 0.0)


def _cached_share(g: LlamaGeometry, m: LlamaMachine, pl: LlamaPlacement, q: np.ndarray) -> np.ndarray:
    """[n_layers, E] page-cache hit rate of each host expert's pages (1 when everything fits or pinned)."""
    mem = memory(g, pl)
    if pl.load != "mmap" or not m.ram_limit_bytes or m.fault_gbps is None:
        return np.ones_like(q)
    expert_host = mem["host_model"] - sum(g.layer_dense_bytes for lay in range(g.n_layers)
                                          if not pl.on_gpu(lay, g.n_layers)) \
        - (0 if pl.on_gpu(g.n_layers, g.n_layers) else g.head_bytes)
    cache = m.ram_limit_bytes - mem["anon_host"] - (mem["host_model"] - expert_host)
    if cache >= expert_host:
        return np.ones_like(q)
    if cache <= 0 or not np.any(q > 0):
        return np.zeros_like(q)
    # one item per (layer, expert) host slice; its size is the host share of the expert
    return che_hit_rates(q.ravel(), int(cache // max(1, g.expert_bytes))).reshape(q.shape)


def raw_terms(g: LlamaGeometry, m: LlamaMachine, pl: LlamaPlacement, probs: np.ndarray | None = None) -> dict:
    """The uncoefficiented terms of :func:`decode_seconds` and :func:`prefill_seconds` (module docstring):
    seconds for the ``*_s`` terms, counts for ``splits``/``graph`` (and their prefill ``pp_*``
    versions, per prompt token), plus ``host_read_bytes``/``fault_bytes`` per decode token."""
    p = _expert_probs(g, probs)                                     # [n_layers, E]
    share = np.array([[len(pl.host_projections(lay, g.n_layers)) / len(PROJECTIONS)]
                      for lay in range(g.n_layers)])                # [n_layers, 1] host share of an expert
    host_exp = p * share * g.expert_bytes                           # [n_layers, E] host bytes per token
    gpu_exp = p * (1 - share) * g.expert_bytes
    kv = pl.context * g.kv_bytes_per_token_layer
    dense_host = dense_gpu = 0.0
    weights_host = 0.0                                              # dense weights in host buffers
    for lay in range(g.n_layers):
        if pl.on_gpu(lay, g.n_layers):
            dense_gpu += g.layer_dense_bytes + (kv if pl.kv_on_gpu else 0)
            dense_host += 0 if pl.kv_on_gpu else kv
        else:
            dense_host += g.layer_dense_bytes + kv
            weights_host += g.layer_dense_bytes
    head_gpu = pl.on_gpu(g.n_layers, g.n_layers)
    dense_gpu += g.head_bytes if head_gpu else 0
    dense_host += 0 if head_gpu else g.head_bytes
    weights_host += 0 if head_gpu else g.head_bytes
    hit = _cached_share(g, m, pl, np.where(share > 0, p, 0.0))
    fault_bytes = float(np.sum(host_exp * (1 - hit)))
    host_bytes = dense_host + float(host_exp.sum())
    gpu_bytes = dense_gpu + float(gpu_exp.sum())
    # backend changes along the graph: layer by layer, dense part then expert part
    seq = []
    for lay in range(g.n_layers):
        d = "gpu" if pl.on_gpu(lay, g.n_layers) else "cpu"
        seq.append(d)
        if g.moe[lay]:
            hp = pl.host_projections(lay, g.n_layers)
            seq += ["cpu"] * bool(hp) + ["gpu"] * (len(hp) < len(PROJECTIONS))
    seq.append("gpu" if head_gpu else "cpu")
    splits = sum(1 for a, b in zip(seq, seq[1:]) if a != b) + (max(1, m.n_gpus) - 1) * ("gpu" in seq)
    u = max(1, min(pl.ubatch, pl.context or pl.ubatch))
    gpu = m.gpu_gbps > 0 and pl.ngl > 0
    offload = gpu and u >= OFFLOAD_MIN_BATCH and m.h2d_gbps > 0
    host_exp_tensor = float(np.sum(share[:, 0] * np.asarray(g.moe)) * g.n_experts * g.expert_bytes)
    # op offload moves every host weight of a GPU-supported op, dense ones included (ggml_backend_sched:
    # a weight buffer on the host, a batch of >= 32): only the host KV's attention stays on the CPU
    offloaded = weights_host if offload else 0.0
    # prefill: all touched experts' pages once per micro-batch; a batch of u touches 1-(1-p)^u of them
    touched = 1.0 - (1.0 - np.clip(p, 0, 1)) ** u
    pp_fault = float(np.sum(touched * share * g.expert_bytes * (1 - hit))) / u
    faults = _fault_model(g, m, pl, p, share[:, 0], u)
    if faults is not None:                        # the probe's page-fault model replaces the GB/s terms
        dec, pre = faults
        fault_bytes = dec["missed_bytes"]
        pp_fault = pre["missed_bytes"] / u
    plain = g.repackable and not pl.repack                       # --no-repack of a repacked quant
    pp_cpu = (dense_host - offloaded + (0.0 if offload else float(host_exp.sum()))) / (m.cpu_batch_gbps * 1e9)
    out = {
        "cpu_s": host_bytes / (m.cpu_gbps * 1e9),
        "gpu_s": gpu_bytes / (m.gpu_gbps * 1e9) if gpu_bytes and m.gpu_gbps > 0 else 0.0,
        "fault_s": fault_bytes / (m.fault_gbps * 1e9) if fault_bytes and m.fault_gbps else 0.0,
        "splits": float(splits), "graph": 1.0,
        "pp_cpu_s": pp_cpu, "norepack_s": host_bytes / (m.cpu_gbps * 1e9) if plain else 0.0,
        "pp_norepack_s": pp_cpu if plain else 0.0,
        "pp_gpu_s": ((gpu_bytes + (float(host_exp.sum()) + offloaded if offload else 0.0))
                     / (m.gpu_batch_gbps * 1e9) if gpu and m.gpu_batch_gbps > 0 else 0.0),
        "xfer_s": (host_exp_tensor + offloaded) / (u * m.h2d_gbps * 1e9) if offload else 0.0,
        "pp_fault_s": pp_fault / (m.fault_gbps * 1e9) if pp_fault and m.fault_gbps else 0.0,
        "pp_splits": splits / u, "pp_graph": 1.0 / u,
        "host_read_bytes": host_bytes, "fault_bytes": fault_bytes,
    }
    if faults is not None:
        out.update(fault_s=dec["seconds"], pp_fault_s=pre["seconds"] / u, fault_regime=dec["regime"],
                   faults_per_token=dec["faults"], fault_read_bytes=dec["read_bytes"],
                   fault_insert_bytes=dec["insert_bytes"], fault_dense_hit=dec["dense_hit"],
                   pp_fault_regime=pre["regime"], pp_faults_per_batch=pre["faults"])
    return out


def _fault_model(g: LlamaGeometry, m: LlamaMachine, pl: LlamaPlacement, p: np.ndarray, share: np.ndarray,
                 u: int):
    """(decode pass, micro-batch pass) of :func:`.llamacpp_faults.pass_cost` when llama.cpp maps a model
    larger than the page cache it is left and the profile has the fault probe; None otherwise."""
    if pl.load != "mmap" or not m.ram_limit_bytes or not m.fault_runs:
        return None
    from colibri_plan.planner.llamacpp_faults import FaultCurve, pass_cost

    mem = memory(g, pl)
    cache = m.ram_limit_bytes - mem["anon_host"]
    if mem["host_model"] <= cache:
        return None
    dense = np.array([0.0 if pl.on_gpu(lay, g.n_layers) else float(g.layer_dense_bytes)
                      for lay in range(g.n_layers)])
    if not pl.on_gpu(g.n_layers, g.n_layers):
        dense[-1] += g.head_bytes                 # the head, read after the last layer
    proj = np.round(share * len(PROJECTIONS))
    q = np.where(proj[:, None] > 0, p, 0.0)
    curve = FaultCurve(m.fault_runs)
    touched = 1.0 - (1.0 - np.clip(q, 0, 1)) ** u
    return (pass_cost(q, g.expert_bytes, dense, curve, cache, proj),
            pass_cost(touched, g.expert_bytes, dense, curve, cache, proj))


def decode_seconds(t: dict, c: LlamaCoefficients) -> float:
    """Seconds per decode token from :func:`raw_terms` ``t`` and coefficients ``c``."""
    return (c.c_cpu * t["cpu_s"] + c.c_gpu * t["gpu_s"] + c.c_fault * t["fault_s"] + c.split_s * t["splits"]
            + c.graph_s * t["graph"] + c.c_norepack * t["norepack_s"])


def prefill_seconds(t: dict, c: LlamaCoefficients) -> float:
    """Seconds per prompt token (prefill) from :func:`raw_terms` ``t`` and coefficients ``c``."""
    return (c.c_pp_cpu * t["pp_cpu_s"] + c.c_pp_gpu * t["pp_gpu_s"] + c.c_xfer * t["xfer_s"]
            + c.c_fault * t["pp_fault_s"] + c.split_s * t["pp_splits"] + c.graph_s * t["pp_graph"]
            + c.c_pp_norepack * t["pp_norepack_s"])


def predict(g: LlamaGeometry, m: LlamaMachine, pl: LlamaPlacement, c: LlamaCoefficients,
            probs: np.ndarray | None = None) -> dict:
    """Predicted llama.cpp figures of ``pl``: decode/prefill tok/s and s/token, its memory by llama.cpp's
    accounting, the raw terms, and ``infeasible`` (why it cannot run; None when it can)."""
    t = raw_terms(g, m, pl, probs)
    d, p = decode_seconds(t, c), prefill_seconds(t, c)
    return {"decode_s_per_token": d, "decode_tok_s": 1.0 / d if d > 0 else 0.0,
            "prefill_s_per_token": p, "prefill_tok_s": 1.0 / p if p > 0 else 0.0,
            "memory": memory(g, pl), "terms": t, "infeasible": check_placement(g, m, pl),
            "calibrated_on": c.calibrated_on}
