"""`colibri-plan ep`: expert placement for expert-parallel serving engines (SGLang, vLLM), docs/ep.md."""

from __future__ import annotations

from pathlib import Path

import click

from colibri_plan.cli.common import Steps, collect_arg, emit, json_option, table, warn

#: GPUs of one node when --nodes is not given (an 8-GPU H200 host)
GPUS_PER_NODE = 8

#: share of a profiled GPU's memory the serving engine may use (--gpu-mem-fraction)
MEM_FRACTION = 0.85


@click.group("ep")
def ep():
    """Expert placement over GPUs and nodes for SGLang / vLLM expert parallelism."""


def routing_groups(model_name: str) -> tuple[int, int]:
    """(n_group, topk_group) of the model's router: group-limited top-k (DeepSeek-V3: 8, 4) or (1, 1),
    from the catalogue entry, the checkpoint's config.json or the pack's stored architecture."""
    import json

    from colibri_plan.model.catalogue import find_entry

    path = Path(model_name)
    arch = None
    if (path / "pack.json").is_file():
        from colibri_plan.formats.arch import ArchConfig
        from colibri_plan.formats.pack_index import read_index

        arch = ArchConfig.from_dict(read_index(path)["arch"])
    elif (path / "config.json").is_file():
        from colibri_plan.families import arch_from_config

        arch = arch_from_config(json.loads((path / "config.json").read_text()), plan_only=True)
    elif not path.exists() and find_entry(model_name) is not None:
        from colibri_plan.families import plan_geometry

        arch = plan_geometry(find_entry(model_name)["config"], model_name).arch
    return (int(arch.n_group), int(arch.topk_group)) if arch is not None else (1, 1)


def _expert_memory(spec, profile_path, gpu_memory_gb, mem_fraction) -> tuple[int | None, str]:
    """Bytes a GPU has for expert slots, and where the figure came from."""
    if gpu_memory_gb is not None:
        return int(gpu_memory_gb * 1e9), f"--gpu-memory-gb {gpu_memory_gb:g}"
    if profile_path is None:
        return None, "not checked (give --profile or --gpu-memory-gb)"
    from colibri_plan.errors import InputError
    from colibri_plan.formats.profile import resolve_profile

    profile, where = resolve_profile(profile_path)
    gpus = profile.gpus()
    if not gpus:
        raise InputError(f"profile {where} lists no GPU; give --gpu-memory-gb for the serving GPUs")
    total = min(int(g["total_memory_bytes"]) for g in gpus)
    dense = int(spec.dense_bytes("bf16"))
    left = int(total * mem_fraction) - dense
    name = min(gpus, key=lambda g: g["total_memory_bytes"])["name"]
    return left, (f"{name} from {where}: {total / 1e9:.1f} GB x {mem_fraction:g} - dense trunk "
                  f"{dense / 1e9:.1f} GB (bf16; KV cache and activations come out of the rest)")


@ep.command("solve")
@click.option("--model", "model_name", required=True, help="Catalogue name, checkpoint folder or pack.")
@click.option("--heat", default="synth", show_default=True,
              help="Heat file (engine JSON or colibrì usage text), or 'synth' (from real OLMoE routing).")
@click.option("--gpus", "n_gpus", required=True, type=int, help="GPUs of the expert-parallel group.")
@click.option("--nodes", "n_nodes", type=int, default=None,
              help=f"Nodes (default: GPUs / {GPUS_PER_NODE}, or 1 for fewer GPUs).")
@click.option("--redundant", "n_redundant", type=int, default=0, show_default=True,
              help="Redundant expert slots per layer (replicas of hot experts).")
@click.option("--quant", default=None, help="Expert format the engine serves (sizes the slots).")
@click.option("--profile", "profile_path", default=None, help="Profile whose GPU memory bounds the slots.")
@click.option("--gpu-memory-gb", type=float, default=None, help="Expert GB per GPU (overrides --profile).")
@click.option("--gpu-mem-fraction", type=click.FloatRange(0.05, 1.0), default=MEM_FRACTION, show_default=True,
              help="Share of a profiled GPU's memory the engine may use.")
@click.option("--gpu-tflops", type=float, default=None, help="Cost model: effective TFLOP/s of a GPU [500].")
@click.option("--internode-gbps", type=float, default=None, help="Cost model: per-GPU internode GB/s [50].")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True)
@click.option("--out", "out_path", default=None, help="Placement file to write (for ep show / export).")
@click.option("--layers", "show_layers", is_flag=True, help="One line per MoE layer.")
@json_option
@collect_arg({"n_gpus", "n_nodes", "n_redundant"}, "deploy", dict)
@collect_arg({"profile_path", "gpu_memory_gb", "gpu_mem_fraction"}, "mem", dict)
@collect_arg({"gpu_tflops", "internode_gbps"}, "rates", dict)
def solve(model_name, heat, deploy, quant, mem, rates, seed, out_path, show_layers):
    """Place every MoE layer's experts and redundant replicas over GPUs and nodes, balanced from heat
    and chosen with a cost model; compare with DeepSeek's eplb on the same inputs."""
    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.ep_placement import EP_KIND, save_ep_placement
    from colibri_plan.formats.heat_align import align_heat, load_heat_arg
    from colibri_plan.heatsynth import synth_heat
    from colibri_plan.model import load_model_spec
    from colibri_plan.planner import ep_cost
    from colibri_plan.planner.ep import EpTopology
    from colibri_plan.planner.ep_make import EpSettings, build_placement, slot_memory

    n_gpus, n_redundant = deploy["n_gpus"], deploy.get("n_redundant", 0)
    n_nodes, profile_path = deploy.get("n_nodes"), mem.get("profile_path")
    if out_path:
        check_output_path(out_path, [p for p in (model_name, heat, profile_path) if p and Path(p).exists()],
                          kind=EP_KIND)
    if n_nodes is None:
        n_nodes = n_gpus // GPUS_PER_NODE if n_gpus >= GPUS_PER_NODE and n_gpus % GPUS_PER_NODE == 0 else 1
    spec = load_model_spec(model_name, quant)
    EpTopology.make(spec.n_experts, n_gpus, n_nodes, n_redundant)   # bad counts: one line, before any work
    n_group, topk_group = routing_groups(model_name)
    h = load_heat_arg(heat)
    if h in ("synth", "uniform"):
        warn(f"no heat file: synthesising {spec.name}'s heat from real OLMoE routing (seed {seed}); record "
             "the engine's own counts (SGLang's expert distribution recorder, `colibri-plan run --stats-out`)"
             " for a placement of your traffic")
        h = synth_heat(spec, seed=seed)
    h = align_heat(h, spec)
    for w in h.warnings:
        warn(w)
    n_moe = sum(1 for layer in spec.moe_layers if layer < spec.n_layers)
    mem_bytes, mem_source = _expert_memory(spec, profile_path, mem.get("gpu_memory_gb"),
                                           mem.get("gpu_mem_fraction", MEM_FRACTION))
    memory = slot_memory(spec, n_moe, mem_bytes, mem_source)
    with Steps(f"placing {n_moe} MoE layers on {n_gpus} GPUs") as bar:
        settings = EpSettings(n_gpus, n_nodes, n_redundant, n_group, topk_group,
                              rates.get("gpu_tflops") or ep_cost.DEFAULT_GPU_TFLOPS,
                              rates.get("internode_gbps") or ep_cost.DEFAULT_INTERNODE_GBPS, seed=seed)
        pl = build_placement(spec, h, settings, memory, progress=bar.count)
    if out_path:
        save_ep_placement(pl, out_path)
    data = show_data(pl.doc, out_path or "(not written)", show_layers)
    emit(data, lambda: human(data) + (f"\nPlacement written to {out_path}" if out_path else ""))


def show_data(doc: dict, path: str, show_layers: bool) -> dict:
    """The JSON of `ep solve` / `ep show`: the placement's facts without its slot tables."""
    data = {"file": path, "model": doc["model"], "heat": doc["heat"], "topology": doc["topology"],
            "memory": doc["memory"], "cost_model": doc["cost_model"], "summary": doc["summary"],
            "solver": doc["solver"]}
    if show_layers:
        data["layers"] = [{k: v for k, v in e.items() if k not in ("load", "physical_to_logical", "eplb",
                                                                   "candidates")}
                          | {"eplb": {k: v for k, v in e["eplb"].items() if k != "physical_to_logical"}}
                          for e in doc["layers"]]
    return data


def human(data: dict) -> str:
    """The placement as text: topology, memory, ours beside eplb, and with layers one line each."""
    m, t, s, mem = data["model"], data["topology"], data["summary"], data["memory"]
    e = s["eplb"]
    groups = f", group-limited top-{m['top_k']} ({m['topk_group']} of {m['n_group']} groups)" \
        if m["n_group"] > 1 else f", top-{m['top_k']}"
    slots = t["gpu_slots"]
    lines = [f"ep placement {data['file']}: {m['name']} ({m['expert_format']}, {len(m['moe_layers'])} MoE "
             f"layers x {m['n_experts']} experts{groups})",
             f"heat: {data['heat']['source']}",
             f"topology: {t['gpus']} GPUs in {t['nodes']} node(s) of {t['gpus_per_node']}; "
             f"{t['slots']} slots per layer ({m['n_experts']} experts + {t['redundant']} redundant), "
             + (f"{slots[0]} per GPU" if len(set(slots)) == 1 else
                f"{min(slots)}-{max(slots)} per GPU (uneven: SGLang/vLLM exports refuse it)"),
             f"memory: one slot {mem['slot_bytes'] / 1e9:.2f} GB over all MoE layers; "
             + (f"a GPU holds {mem['max_slots_per_gpu']} ({mem['source']})" if mem.get("max_slots_per_gpu")
                else mem["source"]),
             f"cost model: {data['cost_model']['gpu_tflops']:g} TFLOP/s per GPU, "
             f"{data['cost_model']['internode_gbps']:g} GB/s internode per GPU"]
    rows = [["colibri-plan", f"{s['balancedness']:.4f}", f"{s['balancedness_layer_mean']:.4f}",
             f"{s['sends_per_token']:.3f}", f"{s['moe_s_per_token'] * 1e6:.3f}",
             ", ".join(f"{k} {v}" for k, v in sorted(s["methods"].items()))],
            [f"DeepSeek eplb ({e['policy']})", f"{e['balancedness']:.4f}",
             f"{e['balancedness_layer_mean']:.4f}",
             f"{e['sends_per_token']:.3f}", f"{e['moe_s_per_token'] * 1e6:.3f}", "-"]]
    lines.append(table(rows, ["placement", "balancedness", "layer mean", "sends/token", "MoE us/token",
                              "layers by candidate"], right=(1, 2, 3, 4)))
    lines.append(f"solver: {data['solver']['seconds']} s; traces: {data['solver']['trace']}")
    if "layers" in data:
        lrows = [[x["layer"], f"{x['balancedness']:.4f}", f"{x['eplb']['balancedness']:.4f}",
                  f"{x['max_load']:.4f}", f"{x['sends_per_token']:.3f}", max(x["replicas"]),
                  sum(1 for r in x["replicas"] if r > 1), x["method"]] for x in data["layers"]]
        lines.append(table(lrows, ["layer", "balancedness", "eplb", "max load", "sends/token", "max replicas",
                                   "replicated experts", "candidate"], right=(1, 2, 3, 4, 5, 6)))
    return "\n".join(lines)


@ep.command("show")
@click.argument("path")
@click.option("--layers", "show_layers", is_flag=True, help="One line per MoE layer.")
@json_option
def show(path, show_layers):
    """Print a placement: topology, memory, balancedness and sends beside eplb's, per layer with --layers."""
    from colibri_plan.formats.ep_placement import load_ep_placement

    pl = load_ep_placement(path)
    data = show_data(pl.doc, path, show_layers)
    emit(data, lambda: human(data))


@ep.command("export")
@click.argument("path")
@click.option("--to", "target", required=True, type=click.Choice(["sglang", "sglang-count", "vllm", "eplb"]),
              help="sglang: --init-expert-location mapping; sglang-count: its logical_count form; vllm: "
                   "vLLM-Ascend expert_map_path; eplb: DeepSeek eplb's tensors.")
@click.option("--out", "out_path", required=True, help="JSON file to write.")
@json_option
def export(path, target, out_path):
    """Export a placement for SGLang, vLLM or as DeepSeek eplb's tensors."""
    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.ep_export import launch_hint, write_export
    from colibri_plan.formats.ep_placement import load_ep_placement

    check_output_path(out_path, [path], kind=None)
    pl = load_ep_placement(path)
    write_export(pl, target, out_path)
    hint = launch_hint(pl, target, out_path)
    emit({"written": out_path, "target": target, "layers": len(pl.moe_layers), "slots": pl.n_slots,
          "gpus": pl.n_gpus, "launch": hint}, f"wrote {out_path} ({target})\n{hint}")
