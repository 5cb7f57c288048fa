"""``replay_llamacpp.py reprice FILE`` and ``fault-probe``: re-price a stored beyond-ram replay with the
current planner, without re-running llama.cpp (issue 27).

``reprice`` rebuilds llama.cpp's inputs from what the result file stores: the geometry from the model's
sizes and the GGUF's bytes, the CPU rate the run's profile measured (``ours.predicted.prefill.figures``),
the batched CPU rate from ``--profile`` (a profile of the same machine: the run's own was not kept), the
page-fault probe from ``--fault-probe`` (``fault-probe``'s JSON), llama.cpp's coefficients from
``--coef``, and the heat from ``--heat`` or, when that file is gone, rebuilt from the stored
``heat_shares`` (each layer's selection shares interpolated on the cumulative curve the file records).
It rewrites the llama.cpp rows' ``predicted_tok_s``, ``predicted_prefill_tok_s``,
``measured_over_predicted``, ``predicted_from`` and, for ``--no-mmap``, ``predicted_outcome``; the
previous figures go under ``before_reprice`` and ``repriced`` says what re-priced them. Our rows keep
their predictions (each is its plan's own; our engine's cost model is not what changed).

``fault-probe`` runs :func:`colibri_plan.profiler.fault.probe_faults` on a test file in ``--path`` and
writes its JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from colibri_plan.planner.llamacpp_cost import (
    LlamaCoefficients,
    LlamaGeometry,
    LlamaMachine,
    LlamaPlacement,
    predict,
)
from colibri_plan.planner.llamacpp_inputs import _batched_gbps, fault_runs, no_mmap_outcome

#: the replay's projection slice (GLM-style expert, 1024 wide, hidden 2048, Q8_0) is one probed run
SHARE_POINTS = ("top_10pct", "top_20pct", "top_30pct", "top_50pct")


def geometry_from(doc: dict) -> LlamaGeometry:
    """llama.cpp's geometry of the stored model: Q8_0 at the GGUF's bytes per parameter."""
    sz, md = doc["model"]["sizes"], doc["model"]
    h, i, e = sz["hidden_size"], sz["moe_intermediate_size"], sz["n_routed_experts"]
    n, dense_k = sz["num_hidden_layers"], sz["first_k_dense_replace"]
    tests = [t for r in doc["rows"]["llama.cpp mmap"]["runs"] for t in r.get("tests", [])]
    params = int(tests[0]["model_n_params"]) if tests else None
    bpw = md["gguf_bytes"] * 8 / params if params else 8.5
    expert = int(3 * h * i * bpw / 8)
    head = int(sz["vocab_size"] * h * bpw / 8)
    moe = tuple(lay >= dense_k for lay in range(n))
    dense = (md["gguf_bytes"] - sum(moe) * e * expert - 2 * head) // n    # embedding looked up, not read
    head_dim = h // sz["num_attention_heads"]
    return LlamaGeometry(n_layers=n, moe=moe, n_experts=e, top_k=sz["num_experts_per_tok"],
                         expert_bytes=expert, layer_dense_bytes=int(dense), head_bytes=head,
                         kv_bytes_per_token_layer=2 * sz["num_key_value_heads"] * head_dim * 2,
                         hidden_size=h, vocab_size=sz["vocab_size"])


def heat_from(doc: dict, g: LlamaGeometry, heat_path: str | None) -> tuple[np.ndarray, str]:
    """[n_layers, E] selection probabilities and where they came from: the heat file when it exists
    (its per-layer counts), else every MoE layer at the stored cumulative shares."""
    path = heat_path or doc["model"].get("heat")
    if path and Path(path).is_file():
        from colibri_plan.formats.heat import load_heat

        heat = load_heat(path)
        p = np.zeros((g.n_layers, g.n_experts))
        for row, lay in enumerate(heat.layers):
            if lay < g.n_layers:
                c = np.asarray(heat.counts[row], dtype=np.float64)
                p[lay] = g.top_k * c / max(1.0, c.sum())
        return np.minimum(p, 1.0), f"heat file {path}"
    sh = doc["model"]["heat_shares"]
    xs = [0.0] + [int(k.split("_")[1][:-3]) / 100 for k in SHARE_POINTS] + [1.0]
    ys = [0.0] + [float(sh[k]) for k in SHARE_POINTS] + [1.0]
    cum = np.interp(np.arange(g.n_experts + 1) / g.n_experts, xs, ys)
    layer = np.minimum(1.0, g.top_k * np.diff(cum))           # hottest first; llama.cpp's order is index
    rng = np.random.default_rng(0)                             # order: the ranks sit at random indices
    p = np.zeros((g.n_layers, g.n_experts))
    for lay in range(g.n_layers):
        if g.moe[lay]:
            p[lay] = layer[rng.permutation(g.n_experts)]
    return p, ("rebuilt from the stored heat_shares (the heat file is gone): each MoE layer's shares "
               "interpolated on the cumulative curve " + ", ".join(f"{k} {sh[k]:.3f}" for k in SHARE_POINTS)
               + ", ranks at random expert indices (seed 0)")


def machine_from(doc: dict, profile_doc: dict, probe: dict) -> tuple[LlamaMachine, dict]:
    """llama.cpp's machine: the run's CPU rate (its plan's prefill figures), ``profile_doc``'s batched
    CPU rate and QD1 disk rate, the probe's fault runs, the cgroup limit. Also {what: where from}."""
    from colibri_plan.formats.profile import MachineProfile

    fig = doc["ours"]["predicted"]["prefill"]["figures"]
    cpu = float(fig["cpu"]["gbps"])
    prof = MachineProfile(profile_doc) if not isinstance(profile_doc, MachineProfile) else profile_doc
    batch = _batched_gbps(prof, "cpu", 0, cpu)
    runs = fault_runs({"disk": {"mmap_fault": probe}})
    m = LlamaMachine(cpu_gbps=cpu, cpu_batch_gbps=batch, fault_gbps=prof.disk_read_gbps(1),
                     ram_limit_bytes=int(doc["budget"]["limit_bytes"]), fault_runs=runs)
    return m, {"cpu_gbps": "the run's plan (ours.predicted.prefill.figures.cpu.gbps)",
               "cpu_batch_gbps": "--profile's batched int8 matmul", "fault_runs": "--fault-probe"}


def reprice(doc: dict, *, probe: dict, profile_doc: dict, coef: LlamaCoefficients, heat_path: str | None,
            sources: dict) -> dict:
    """``doc`` with its llama.cpp rows re-priced (module docstring); returns the ``repriced`` record."""
    g = geometry_from(doc)
    probs, heat_src = heat_from(doc, g, heat_path)
    m, m_src = machine_from(doc, profile_doc, probe)
    s = doc["settings"]
    # llama-bench's pp test is one micro-batch of n_prompt tokens; its context holds prompt + generation
    base = LlamaPlacement(context=int(s["context"]), ubatch=min(int(s["ubatch"]), int(s["n_prompt"])),
                          threads=int(s["threads"]))
    pred = predict(g, m, base, coef, probs)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    by = f"bench/replay_llamacpp.py reprice at planner commit {_commit()} ({stamp})"
    row = doc["rows"]["llama.cpp mmap"]
    row.setdefault("before_reprice", {k: row.get(k) for k in ("predicted_tok_s", "predicted_from",
                                                              "measured_over_predicted")})
    t = pred["terms"]
    row.update(predicted_tok_s=pred["decode_tok_s"], predicted_prefill_tok_s=pred["prefill_tok_s"],
               predicted_from=f"llama.cpp cost model (mmap, page faults: {t.get('fault_regime', 'GB/s')}) "
                              f"re-priced by {by}",
               predicted_terms={k: float(v) if not isinstance(v, str) else v for k, v in t.items()})
    _ratios(row)
    # the same model without the fault probe (faults at the QD1 disk GB/s, dense assumed cached): what
    # the probe changes
    plain = predict(g, dataclasses.replace(m, fault_runs=()), base, coef, probs)
    row["predicted_without_fault_probe"] = {"decode_tok_s": plain["decode_tok_s"],
                                            "prefill_tok_s": plain["prefill_tok_s"],
                                            "fault_bytes": plain["terms"]["fault_bytes"]}
    nm_row = doc["rows"]["llama.cpp no-mmap"]
    nm = no_mmap_outcome(g, m, base, coef, probs)
    nm_row.setdefault("before_reprice", {k: nm_row.get(k) for k in ("predicted_tok_s", "predicted_from")})
    killed = any(r.get("cgroup", {}).get("oom_killed") for r in nm_row["runs"])
    nm_row.update(predicted_tok_s=nm["decode_tok_s"], predicted_prefill_tok_s=nm["prefill_tok_s"],
                  predicted_outcome=nm["outcome"], predicted_why=nm["why"],
                  measured_outcome="OOM-killed" if killed else "ran",
                  outcome_matches=(nm["outcome"] == "does not fit (OOM)") == killed,
                  predicted_from="llama.cpp cost model (no-mmap: weights in anonymous memory) re-priced by "
                                 + by)
    _ratios(nm_row)
    rec = {"by": by, "rows": ["llama.cpp mmap", "llama.cpp no-mmap"],
           "kept": "ours and hot-first keep their plans' own predictions (our engine's cost model did not "
                   "change)",
           "inputs": {"geometry": {k: getattr(g, k) for k in ("n_layers", "n_experts", "top_k",
                                                              "expert_bytes", "layer_dense_bytes",
                                                              "head_bytes")},
                      "machine": {"cpu_gbps": m.cpu_gbps, "cpu_batch_gbps": m.cpu_batch_gbps,
                                  "fault_gbps": m.fault_gbps, "ram_limit_bytes": m.ram_limit_bytes,
                                  "fault_runs": [list(r) for r in m.fault_runs]},
                      "machine_from": m_src, "heat": heat_src,
                      "placement": {"context": base.context, "ubatch": base.ubatch, "threads": base.threads},
                      "coefficients": coef.calibrated_on, **sources}}
    doc["repriced"] = rec
    return rec


def _ratios(row: dict) -> None:
    d, p = row.get("decode_tok_s"), row.get("prefill_tok_s")
    row["measured_over_predicted"] = (d["median"] / row["predicted_tok_s"]
                                      if d and row.get("predicted_tok_s") else None)
    row["measured_over_predicted_prefill"] = (p["median"] / row["predicted_prefill_tok_s"]
                                              if p and row.get("predicted_prefill_tok_s") else None)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_reprice(a, log) -> dict:
    from colibri_plan.planner.llamacpp_calibrate import load as load_coef

    doc = json.loads(Path(a.file).read_text())
    probe_doc = json.loads(Path(a.fault_probe).read_text())
    if not isinstance(doc, dict) or doc.get("mode") != "beyond-ram":
        raise ValueError(f"{a.file} is not a beyond-ram result (bench/replay_llamacpp.py beyond-ram)")
    if not isinstance(probe_doc, dict) or probe_doc.get("kind") != "mmap-fault-probe":
        raise ValueError(f"{a.fault_probe} is not a fault-probe result "
                         "(bench/replay_llamacpp.py fault-probe)")
    coef = load_coef(a.coef) if a.coef else LlamaCoefficients()
    rec = reprice(doc, probe=probe_doc["probe"], profile_doc=json.loads(Path(a.profile).read_text()),
                  coef=coef, heat_path=a.heat, sources={"fault_probe": a.fault_probe, "profile": a.profile,
                                                        "coef": a.coef})
    log(f"re-priced {', '.join(rec['rows'])}: {rec['by']}")
    return doc


def run_fault_probe(a, machine: dict) -> dict:
    """``fault-probe``: a test file of ``--size-gb`` in ``--path`` (removed afterwards), probed."""
    from colibri_plan.profiler.disk import write_test_file
    from colibri_plan.profiler.fault import probe_faults

    f = Path(a.path) / f".colibri-fault-probe-{os.getpid()}.bin"
    try:
        write_test_file(f, int(a.size_gb * 2**30) // 4096 * 4096)
        runs = [int(r) for r in a.runs.split(",")]
        probe = probe_faults(f, runs)
    finally:
        f.unlink(missing_ok=True)
    return {"kind": "mmap-fault-probe", "schema_version": 1,
            "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": machine,
            "path": str(a.path), "file_bytes": int(a.size_gb * 2**30), "probe": probe}
