"""A plan for llama.cpp: whole-layer ``-ot`` overrides, ``-ngl``, the full command, the placement it runs.

llama.cpp stores a layer's experts as merged 3-D tensors ``blk.N.ffn_{gate,up,down}_exps``, so it cannot
place single experts: each GPU takes whole layers, those the plan serves most from VRAM first, as many as
fit its VRAM budget; the other layers stay on the CPU, read through ``mmap`` (the OS page cache is their
only cache). The export states how many experts moved tier and the share of selections served from GPU,
exported versus planned.

Three steps, so that a choice among llama.cpp's own options can slot in (issue 27):
:func:`llama_candidates` gives the layouts worth pricing (today one: the plan's whole layers),
:func:`llama_args` turns a :class:`LlamaLayout` into arguments and :func:`llama_command` into the line to
paste; :func:`llama_tiers` is the placement the layout runs, which
:func:`colibri_plan.planner.compare.engine_rows` prices as llama.cpp runs it.

The plan's trunk: on a GPU, ``-ngl <all layers>`` (dense tensors and KV cache there) with
``--tensor-split`` putting the trunk's layers where the plan does, but only with more than one GPU (it
means nothing on one); on the CPU ``-ngl 0``, said explicitly (llama.cpp's default offloads layers).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

import numpy as np

from colibri_plan.formats.plan import TIER_DISK, Plan, layer_probabilities
from colibri_plan.formats.plan_trunk import parse_trunk
from colibri_plan.planner.page_cache import page_cache_hit_rates

LLAMA_DEVICE = {"cuda": "CUDA", "vulkan": "Vulkan", "opencl": "OpenCL", "metal": "Metal"}
#: the llama.cpp program the pasteable line starts with (an OpenAI-compatible server)
LLAMA_BINARY = "llama-server"


@dataclass
class LlamaLayout:
    """One way to run a plan on llama.cpp.

    Attributes:
        layers: llama device name ("CUDA0", ..., "CPU") -> MoE layer ids whose experts it holds.
        assign: plan row index -> device position, for the rows that go whole to a GPU.
        ngl: ``-ngl`` (layers whose dense tensors and KV cache go to the GPUs; 0 keeps them on the CPU).
        tensor_split: ``--tensor-split`` (layers per device in plan order) or None (one GPU, or a CPU trunk).
        moved_experts: experts that change tier (VRAM <-> CPU) against the plan; moved_device_experts:
            VRAM experts that stay in VRAM on another GPU. gpu_share: share of routed selections served from
            a GPU, {"plan": f, "export": f}. notes: what the layout changes against the plan.
    """

    layers: dict[str, list[int]]
    assign: dict[int, int]
    ngl: int
    tensor_split: str | None
    moved_experts: int = 0
    moved_device_experts: int = 0
    gpu_share: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def patterns(self) -> list[str]:
        """The ``-ot`` override patterns, one per device."""
        return [f"blk\\.({'|'.join(str(x) for x in ids)})\\.ffn_(gate|up|down)_exps={dev}"
                for dev, ids in self.layers.items()]


def llama_device_name(key: str) -> str:
    """llama.cpp's device name for a plan device key: ``cuda:1`` -> ``CUDA1``, ``vulkan:0`` -> ``Vulkan0``."""
    backend, _, idx = key.partition(":")
    return f"{LLAMA_DEVICE.get(backend, backend.upper())}{idx}"


def plan_trunk(plan: Plan):
    """The plan's trunk placement (a CPU trunk for plans without the section)."""
    return parse_trunk(plan.doc, plan.device_keys, plan.doc["model"].get("n_layers"))


def _whole_layer_assignment(plan: Plan, rows: list[int], gpu_mass: np.ndarray,
                            mass: np.ndarray) -> dict[int, int]:
    """Row index -> device position for the rows that go whole to a GPU (the rest stay on the CPU).

    Rows are ranked by the plan's VRAM-resident selection mass ``gpu_mass`` [rows] (then total ``mass``,
    then layer order); each device in plan order takes the highest-ranked remaining rows while one whole
    layer (``n_experts x expert_bytes``) still fits its budget: ``budgets.vram_budget_bytes[key]``, or for
    a unified device without one, the bytes of the plan's own experts there.
    """
    layer_bytes = plan.n_experts * plan.expert_bytes
    vram = plan.doc["budgets"].get("vram_budget_bytes", {})
    counts = plan.counts()
    ranked = sorted(rows, key=lambda i: (-gpu_mass[i], -mass[i], i))
    out: dict[int, int] = {}
    for d, key in enumerate(plan.device_keys):
        budget = int(vram.get(key, counts[key] * plan.expert_bytes))
        n_fit = budget // layer_bytes if layer_bytes > 0 else 0
        take = [i for i in ranked if i not in out][:max(0, int(n_fit))]
        out.update((i, d) for i in take)
    return out


def _probs(plan: Plan) -> np.ndarray:
    probs = layer_probabilities(plan)                               # [rows, E]
    return np.full(plan.tiers().shape, 1.0 / max(1, plan.n_experts)) if probs is None else probs


def _rows(plan: Plan) -> list[int]:
    n_layers = plan.doc["model"].get("n_layers", max(plan.layer_ids) + 1)
    return [i for i, lid in enumerate(plan.layer_ids) if lid < n_layers]   # MTP rows have no blk.N experts


def _trunk_flags(plan: Plan) -> tuple[int, str | None]:
    """(-ngl, --tensor-split) for the plan's trunk (module docstring)."""
    n_layers = int(plan.doc["model"].get("n_layers") or max(plan.layer_ids) + 1)
    t = plan_trunk(plan)
    if not t.on_device:
        return 0, None
    layers = {k: 0 for k in plan.device_keys}
    for a, b, k in t.split or ((0, n_layers - 1, t.device),):
        layers[k] += b - a + 1
    split = ",".join(str(layers[k]) for k in plan.device_keys) if len(plan.device_keys) > 1 else None
    return n_layers + 1, split


def llama_candidates(plan: Plan) -> list[LlamaLayout]:
    """The layouts of ``plan`` worth pricing on llama.cpp: the plan's GPU layers whole, hottest VRAM share
    first, as many as fit each VRAM budget (devices in plan order); every other layer on the CPU."""
    tiers, keys, probs, rows = plan.tiers(), plan.device_keys, _probs(plan), _rows(plan)
    on_gpu = tiers >= 0                                             # [rows, E]
    gpu_mass = np.sum(np.where(on_gpu, probs, 0.0), axis=1)         # [rows] VRAM-served selections per token
    mass = probs.sum(axis=1)                                        # [rows] ~ top-k
    assign = _whole_layer_assignment(plan, rows, gpu_mass, mass)
    by_dev: dict[str, list[int]] = {}
    moved = moved_dev = 0
    for i in rows:
        row = tiers[i]
        if i in assign:
            d = assign[i]
            name = llama_device_name(keys[d])
            moved += int(np.sum(row < 0))                           # RAM/disk experts promoted to VRAM
            moved_dev += int(np.sum((row >= 0) & (row != d)))       # VRAM experts of other GPUs
        else:
            name = "CPU"
            moved += int(np.sum(row >= 0))                          # VRAM experts demoted to the CPU
        by_dev.setdefault(name, []).append(plan.layer_ids[i])
    total = float(mass[rows].sum()) if rows else 0.0
    share_plan = float(gpu_mass[rows].sum()) / total if total > 0 else 0.0
    share_export = float(sum(mass[i] for i in assign)) / total if total > 0 else 0.0
    order = [llama_device_name(k) for k in keys] + ["CPU"]
    by_dev = {dev: sorted(by_dev[dev]) for dev in order if dev in by_dev}      # device order, ids ascending
    n_gpu_layers = ", ".join(f"{dev} {len(ids)}" for dev, ids in by_dev.items() if dev != "CPU")
    ngl, split = _trunk_flags(plan)
    notes = ["llama.cpp keeps each layer's experts in merged 3-D tensors blk.N.ffn_{gate,up,down}_exps: "
             "per-expert placement is not expressible; whole layers go to the GPUs, hottest VRAM share "
             f"first, as many as fit each VRAM budget (layers: {n_gpu_layers or 'none'}), the rest to the "
             "CPU",
             f"{moved} experts change tier (VRAM <-> CPU) against the plan; {moved_dev} more stay in VRAM "
             "on another GPU",
             f"selections served from GPU: export {share_export:.1%}, plan {share_plan:.1%}",
             *_mmap_notes(plan, probs, [i for i in rows if i not in assign])]
    if ngl:
        notes.append(f"-ngl {ngl} puts every layer's dense tensors and KV cache on the GPU"
                     + (f"s, --tensor-split {split} as the plan's trunk" if split else " as the plan's trunk")
                     + " (its VRAM is in the plan's budgets); the -ot rules keep the experts the plan leaves "
                       "in RAM or on disk on the CPU")
    else:
        notes.append("-ngl 0: the plan runs the dense trunk and KV cache on the CPU (solve --trunk auto lets "
                     "it try the GPU)")
    return [LlamaLayout(by_dev, assign, ngl, split, moved, moved_dev,
                        {"plan": share_plan, "export": share_export}, notes)]


def llama_args(layout: LlamaLayout) -> list[str]:
    """The llama.cpp arguments of ``layout``: ``-ngl N [--tensor-split a,b] -ot PATTERN ...``."""
    out = ["-ngl", str(layout.ngl)]
    if layout.tensor_split:
        out += ["--tensor-split", layout.tensor_split]
    for p in layout.patterns:
        out += ["-ot", p]
    return out


def llama_command(layout: LlamaLayout, model_path: str, binary: str = LLAMA_BINARY) -> str:
    """The line to paste: ``llama-server -m MODEL.gguf -ngl ... -ot ...``, every word shell-quoted."""
    return " ".join(shlex.quote(w) for w in [binary, "-m", model_path, *llama_args(layout)])


def llama_tiers(plan: Plan, layout: LlamaLayout) -> tuple[np.ndarray, np.ndarray]:
    """(tiers [rows, E], LRU slots [rows]) llama.cpp runs: the layout's GPU rows whole on their device,
    everything else read through mmap (disk tier; the page cache serves what it holds), no LRU."""
    tiers = np.full(plan.tiers().shape, TIER_DISK, dtype=np.int64)
    for i, d in layout.assign.items():
        tiers[i] = d
    return tiers, np.zeros(len(tiers), dtype=np.int64)


def _mmap_notes(plan: Plan, probs: np.ndarray, cpu_rows: list[int]) -> list[str]:
    """What mmap implies for the exported layout: the CPU layers' experts are page-cache pages, no pins
    and no LRU; the page cache holds what llama.cpp and the OS leave (the plan's ``knobs.page_cache``
    pool) and serves a share predicted by :mod:`colibri_plan.planner.page_cache`."""
    text = ("CPU layers are read through mmap: the OS page cache, not the plan's pins or LRU, decides what "
            "stays in RAM; cold experts are page faults (queue depth 1)")
    pool = ((plan.doc.get("knobs") or {}).get("page_cache") or {}).get("pool_bytes")
    if not cpu_rows or pool is None:
        return [text]
    b = plan.expert_bytes
    q = probs[cpu_rows]
    hit = page_cache_hit_rates(q, int(pool) // b)
    share = float((q * hit).sum() / q.sum()) if q.sum() > 0 else 0.0
    return [text + f"; memory pressure: the page cache can hold about {int(pool) / 1e9:.2f} GB of the model "
            f"file (available memory - dense, KV, buffers and OS headroom), serving about {share:.0%} of the "
            "CPU layers' selections from RAM: anything else that takes memory (--mlock, other programs, "
            "a larger context) shrinks it and slows decoding"]


def export_llama_cpp(plan: Plan, model_path: str | None = None, binary: str = LLAMA_BINARY) -> dict:
    """The plan as llama.cpp arguments (see the module docstring), for the first of
    :func:`llama_candidates`.

    Args:
        model_path: the GGUF file for ``-m`` in ``command``; None: a named placeholder to replace.

    Returns:
        {"args": "-ngl ... -ot ..." (one shell-quoted line), "command": the full line, "patterns", "layers":
        {device: [layer ids]}, "ngl", "tensor_split" (None on one GPU or with a CPU trunk),
        "moved_experts", "moved_device_experts", "gpu_share": {"plan", "export"}, "notes"}.
    """
    layout = llama_candidates(plan)[0]
    model = model_path or placeholder_gguf(plan)
    out = {"args": " ".join(shlex.quote(w) for w in llama_args(layout)),
           "command": llama_command(layout, model, binary), "model_path": model, "patterns": layout.patterns,
           "layers": layout.layers, "ngl": layout.ngl, "tensor_split": layout.tensor_split,
           "moved_experts": layout.moved_experts, "moved_device_experts": layout.moved_device_experts,
           "gpu_share": layout.gpu_share, "notes": list(layout.notes)}
    if "llamacpp" in plan.doc:   # solved with --target llama.cpp: its priced pick (planner/llamacpp_choice)
        from colibri_plan.planner.llamacpp_choice import export_hook

        out = export_hook(out, plan.doc["llamacpp"])
        out["command"] = " ".join([binary, "-m", shlex.quote(model), *([out["args"]] if out["args"] else [])])
    return out


def placeholder_gguf(plan: Plan) -> str:
    """The ``-m`` path shown when no GGUF file was named: ``/path/to/MODEL.gguf``, to replace."""
    return f"/path/to/{plan.doc['model'].get('name', 'model')}.gguf"
