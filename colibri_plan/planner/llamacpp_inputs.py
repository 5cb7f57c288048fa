"""The llama.cpp cost model's inputs from what the planner already reads: a ModelSpec, a profile, budgets.

* :func:`geometry` — the spec at the GGUF's bytes per weight: llama.cpp's block quants carry a float16
  scale per 32 weights, so Q8_0 is 8.5 bits and Q4_0 4.5 (GGUF type table, ggml-common.h); a GGUF file
  gives its own figure (file bytes over parameters).
* :func:`machine` — the profile's CPU matmul at the nearest of our formats (our kernels, not llama.cpp's:
  ``c_cpu`` takes up the difference once calibrated), its batched figure at the most rows measured, the
  disk at queue depth 1 (one page fault in flight per faulting thread), the page-fault probe's runs
  (:func:`fault_runs`), the first discrete GPU.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from colibri_plan.planner.llamacpp_cost import LlamaGeometry, LlamaMachine

#: bits per weight of llama.cpp's quant types (GGUF block layouts: 32 weights + f16 scale (+ f16 min))
GGUF_BITS = {"F32": 32.0, "F16": 16.0, "BF16": 16.0, "Q8_0": 8.5, "Q6_K": 6.5625, "Q5_K": 5.5, "Q5_0": 5.5,
             "Q4_K": 4.5, "Q4_0": 4.5, "Q4_1": 5.0, "Q3_K": 3.4375, "Q2_K": 2.625}
#: the llama.cpp type nearest each of our expert formats (same bits, a block scale)
FOR_OURS = {"int8": "Q8_0", "int4": "Q4_0", "int2": "Q2_K", "f16": "F16", "bf16": "BF16", "f32": "F32",
            "int4-g32": "Q4_0", "int4-g64": "Q4_0", "int4-g128": "Q4_0"}


def bits_per_weight(spec, quant: str | None = None) -> tuple[float, str]:
    """(bits per weight, where it came from): ``quant`` (a llama.cpp type) when given, else a GGUF
    file's bytes over the spec's parameters, else the llama.cpp type of the spec's expert format."""
    if quant:
        return GGUF_BITS[quant.upper()], f"{quant.upper()} ({GGUF_BITS[quant.upper()]:g} bits per weight)"
    src = str(getattr(spec, "source", "") or "")
    if src.startswith("gguf: ") and Path(src[6:]).is_file() and spec.total_params:
        bpw = Path(src[6:]).stat().st_size * 8 / spec.total_params
        return bpw, f"the GGUF's size over its parameters ({bpw:.2f} bits per weight)"
    q = FOR_OURS.get(spec.expert_format, "Q8_0")
    return GGUF_BITS[q], (f"{q}, llama.cpp's type nearest {spec.expert_format} ({GGUF_BITS[q]:g} bits "
                          "per weight)")


#: llama.cpp types it repacks into a CPU layout at load on x86 (ggml-cpu's repack buffer type)
REPACKED = ("Q4_0", "Q4_K", "IQ4_NL")


def geometry(spec, bpw: float, quant: str | None = None) -> LlamaGeometry:
    """:class:`LlamaGeometry` of ``spec`` at ``bpw`` bits per weight (MTP rows are not llama.cpp layers);
    ``quant``: the llama.cpp type (None: the one nearest the spec's format)."""
    quant = (quant or FOR_OURS.get(spec.expert_format, "")).upper()
    head = spec.vocab_size * spec.hidden_size
    # the token embedding is looked up, not read whole, per token: out of the dense bytes read
    per_layer = max(0, spec.dense_params - 2 * head) / max(1, spec.n_layers)
    moe = tuple(lay in set(spec.moe_layers) for lay in range(spec.n_layers))
    return LlamaGeometry(n_layers=spec.n_layers, moe=moe, n_experts=spec.n_experts, top_k=spec.top_k,
                         expert_bytes=int(spec.expert_params * bpw / 8),
                         layer_dense_bytes=int(per_layer * bpw / 8), head_bytes=int(head * bpw / 8),
                         kv_bytes_per_token_layer=int(spec.kv_bytes_per_token // max(1, spec.n_layers)),
                         hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                         repackable=quant in REPACKED)


def _batched_gbps(profile, backend: str, index: int, one_token_gbps: float) -> float:
    """Weight-rows GB/s of the device's matmul at the most rows the profile measured (x rows): what a
    micro-batch reaches; the 1-token figure when the profile has no batched row."""
    best = one_token_gbps
    for r in profile.doc.get("matmul", []):
        if r.get("backend") == backend and r.get("device_index") == index and r.get("tokens", 1) > 1:
            best = max(best, float(r["weight_gbps"]["median"]) * int(r["tokens"]))
    return best


def machine(profile, res, ram_limit_bytes: int, vram_bytes: int) -> LlamaMachine:
    """:class:`LlamaMachine` from a profile and the plan's resources ``res`` (costmodel.Resources)."""
    cpu_rows = [(r["backend"], r["device_index"]) for r in profile.doc.get("matmul", [])
                if r.get("device_kind") == "cpu"]
    b, i = cpu_rows[0] if cpu_rows else ("cpu", 0)
    fault = None
    if res.disk_depth_gbps:
        fault = sorted(res.disk_depth_gbps)[0][1]
    elif res.disk_read_gbps is not None:
        fault = res.disk_read_gbps
    gpu = next((g for g in res.gpus if not g.unified), None)
    gb, gi = (gpu.key.split(":")[0], int(gpu.key.split(":")[1])) if gpu else ("", 0)
    return LlamaMachine(fault_runs=fault_runs(profile.doc), cpu_gbps=res.cpu_gbps,
                        cpu_batch_gbps=_batched_gbps(profile, b, i, res.cpu_gbps),
                        fault_gbps=fault, gpu_gbps=gpu.matmul_gbps if gpu else 0.0,
                        gpu_batch_gbps=_batched_gbps(profile, gb, gi, gpu.matmul_gbps) if gpu else 0.0,
                        h2d_gbps=gpu.h2d_gbps if gpu else 0.0, ram_limit_bytes=int(ram_limit_bytes),
                        vram_bytes=int(vram_bytes) if gpu else 0)


def fault_runs(profile_doc: dict) -> tuple:
    """The profile's page-fault probe rows as ((run_bytes, seconds, read_bytes), ...) for
    :class:`LlamaMachine` (``disk.mmap_fault``, :mod:`colibri_plan.profiler.fault`); () when the profile
    predates the probe or it was unavailable (faults are then priced at the QD1 disk GB/s)."""
    sec = ((profile_doc.get("disk") or {}).get("mmap_fault") or {})
    rows = sec.get("rows") if isinstance(sec, dict) else None
    if not isinstance(rows, list):
        return ()
    return tuple((int(r["run_bytes"]), float(r["seconds_per_run"]), float(r.get("read_bytes_per_run") or
                                                                          r["run_bytes"]))
                 for r in rows if isinstance(r, dict) and r.get("seconds_per_run"))


#: our formats nearest each llama.cpp type, best first (the profile's CPU figure is taken at one of them)
OURS_FOR = {"Q8_0": ("int8",), "Q4_0": ("int4-g32", "int4", "int4-g64"), "Q4_K": ("int4-g32", "int4"),
            "Q2_K": ("int2",), "F16": ("f16",), "BF16": ("bf16",), "F32": ("f32",)}


def profile_format(profile, quant: str | None) -> str | None:
    """The format of the profile's CPU matmul rows nearest llama.cpp's ``quant`` (None: no CPU row)."""
    have = [r["fmt"] for r in profile.doc.get("matmul", []) if r.get("device_kind") == "cpu"]
    for fmt in OURS_FOR.get(str(quant or "").upper(), ()):
        if fmt in have:
            return fmt
    return have[0] if have else None


def heat_rows(setup, n_layers: int, n_experts: int):
    """[n_layers, E] selection probabilities of the setup's heat on llama.cpp's layers (0 on dense layers;
    MTP rows dropped: they are not ``blk.N`` layers llama.cpp decodes with)."""
    import numpy as np

    p = np.zeros((n_layers, n_experts))
    for row, lay in enumerate(setup.heat.layers):
        if lay < n_layers:
            p[lay] = setup.problem.probs[row]
    return p


def from_setup(setup, profile=None, quant: str | None = None) -> dict:
    """llama.cpp's inputs for a solve: {"geometry", "machine", "base" (a LlamaPlacement: the plan's context,
    -ub 512, -t the profile's cores), "probs", "bits", "ram_limit_bytes", "vram_bytes", "vram_device"}.

    The budgets are the solve's, in llama.cpp's terms: the RAM limit is the whole process's (the expert
    budget + dense + KV + working buffers: what ``--ram`` gave our engine), the VRAM the discrete GPUs'
    budgets (before the trunk took its share) pooled, as llama.cpp's layer split uses them; the rates
    are the first GPU's."""
    from colibri_plan.planner.llamacpp_cost import LlamaPlacement

    spec, b = setup.spec, setup.budgets
    bpw, bits_from = bits_per_weight(spec, quant)
    g = geometry(spec, bpw)
    ram = int(b.ram_budget_bytes + b.dense_bytes + b.kv_bytes + b.working_bytes)
    discrete = [x for x in setup.res.gpus if not x.unified]
    gpu = discrete[0] if discrete else None
    # llama.cpp splits whole layers over every GPU it sees: their budgets pooled (before the trunk's share)
    vram = sum(int(b.vram_budget_bytes.get(x.key, 0) + (b.trunk_vram_bytes or {}).get(x.key, 0))
               for x in discrete)
    n_gpus = max(1, sum(1 for x in discrete if b.vram_budget_bytes.get(x.key, 0) > 0))
    if profile is not None:
        m = dataclasses.replace(machine(profile, setup.res, ram, vram), n_gpus=n_gpus)
        cores = int(profile.doc["machine"].get("cores") or 0)
    else:
        from colibri_plan.planner.llamacpp_cost import LlamaMachine

        res = setup.res
        fault = sorted(res.disk_depth_gbps)[0][1] if res.disk_depth_gbps else res.disk_read_gbps
        m = LlamaMachine(cpu_gbps=res.cpu_gbps, cpu_batch_gbps=res.cpu_gbps, fault_gbps=fault,
                         gpu_gbps=gpu.matmul_gbps if gpu else 0.0,
                         gpu_batch_gbps=gpu.matmul_gbps if gpu else 0.0,
                         h2d_gbps=gpu.h2d_gbps if gpu else 0.0, ram_limit_bytes=ram, vram_bytes=vram,
                         n_gpus=n_gpus)
        cores = 0
    base = LlamaPlacement(context=max(1, int(b.context_tokens)), ubatch=512, threads=cores)
    return {"geometry": g, "machine": m, "base": base, "probs": heat_rows(setup, g.n_layers, g.n_experts),
            "bits": bits_from, "ram_limit_bytes": ram, "vram_bytes": vram,
            "vram_device": gpu.key if gpu else None}


def section(setup, profile=None, coef=None, quant: str | None = None) -> dict:
    """The plan's ``llamacpp`` section: llama.cpp's pick and ``--fit`` priced as llama.cpp runs them
    (:func:`~colibri_plan.planner.llamacpp_choice.choose`), with the budgets in its terms."""
    from colibri_plan.planner.llamacpp_choice import choose

    x = from_setup(setup, profile, quant)
    out = choose(x["geometry"], x["machine"], x["base"], coef, x["probs"])
    out["no_mmap"] = no_mmap_outcome(x["geometry"], x["machine"], x["base"], coef, x["probs"])
    out["budgets"] = {"ram_limit_bytes": x["ram_limit_bytes"], "vram_bytes": x["vram_bytes"],
                      "vram_device": x["vram_device"],
                      "accounting": "llama.cpp's buffers (model, KV, compute)"}
    out["bytes_per_weight_from"] = x["bits"]
    return out


def no_mmap_outcome(g, m, base, coef=None, probs=None) -> dict:
    """llama.cpp with ``--no-mmap`` at ``--fit``'s placement (all on the CPU without a GPU): its weights
    are read into anonymous memory, so when they and its buffers exceed the RAM limit the process is
    killed at load; the outcome is then "does not fit (OOM)", never a speed.

    Returns:
        {"args", "outcome": "runs" | "does not fit (OOM)", "why" (None when it runs), "decode_tok_s",
        "prefill_tok_s" (None when it does not fit), "memory"}.
    """
    from colibri_plan.planner.llamacpp_choice import fit_placement, llama_args
    from colibri_plan.planner.llamacpp_cost import LlamaCoefficients, predict

    pl = fit_placement(g, m, base) if m.gpu_gbps > 0 and m.vram_bytes else base
    pl = dataclasses.replace(pl, load="no-mmap")
    pred = predict(g, m, pl, coef or LlamaCoefficients(), probs)
    oom = pred["infeasible"]
    return {"args": llama_args(pl, g.n_layers), "outcome": "does not fit (OOM)" if oom else "runs",
            "why": oom,
            "decode_tok_s": None if oom else pred["decode_tok_s"],
            "prefill_tok_s": None if oom else pred["prefill_tok_s"], "memory": pred["memory"]}
