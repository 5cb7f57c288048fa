"""Run every probe and assemble the profile document (see :mod:`colibri_plan.formats.profile`).

Two modes: ``quick`` (CI; under ~30 s on a 2-core machine: smaller test file, queue depths {1, 4},
fewer repetitions) and ``default`` (under ~120 s there). Every size can be overridden (tests use tiny
blocks and files). Sections the machine lacks, or that were not asked for, are ``{"unavailable": why}``;
the optional trunk sections (``dense_gemv``, ``device_ops``, ``attention``, ``trunk_layer``, and with
``--model`` on a GPU that replays its decode step ``step_graph``) are left out when the
``trunk`` probe is not asked for, as in profiles written before it existed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone

from colibri_plan import __version__
from colibri_plan.errors import InputError
from colibri_plan.formats.profile import MachineProfile, machine_fingerprint
from colibri_plan.profiler import disk as disk_mod
from colibri_plan.profiler.links import HOST_BACKENDS, probe_links, probe_peer_links
from colibri_plan.profiler.machine import (
    list_all_devices,
    list_host_memory_devices,
    machine_info,
    relabel_rows,
)
from colibri_plan.profiler.matmul_probe import MatmulSettings, probe_matmul
from colibri_plan.profiler.options import PROBES, ProfileOptions
from colibri_plan.profiler.ram import probe_ram
from colibri_plan.profiler.step_probe import StepSettings
from colibri_plan.profiler.trunk_layer_probe import LayerGeometry
from colibri_plan.profiler.trunk_probe import SECTIONS as TRUNK_SECTIONS
from colibri_plan.profiler.trunk_probe import TrunkSettings, probe_trunk
from colibri_plan.profiler.trunk_shapes import CONTEXTS, TRUNK_SHAPES, host_device, model_dense_shapes

#: GLM-5.2 routed expert geometry, used when no model is named (colibri_plan/data/models.json)
DEFAULT_MODEL = {"name": "glm-5.2 (built-in default)", "hidden": 6144, "width": 2048, "expert_format": "int4",
                 "top_k": 8, "expert_bytes": disk_mod.DEFAULT_BLOCK_BYTES}


def mode_settings(quick: bool) -> dict:
    """Sizes and repetitions of a mode."""
    if quick:
        return {"mode": "quick", "file_bytes": 256 << 20, "queue_depths": [1, 4], "disk_repetitions": 3,
                "disk_seconds": 0.3, "ram_bytes": 256 << 20, "ram_repetitions": 5, "link_repetitions": 3,
                "matmul_repetitions": 3, "matmul_budget_s": 0.15, "ffn_budget_s": 0.6,
                "device_budget_s": 5.0, "trunk_repetitions": 3, "trunk_budget_s": 3.0,
                "trunk_chain_s": 0.005, "trunk_max_bytes": 128 << 20}
    return {"mode": "default", "file_bytes": 1 << 30, "queue_depths": [1, 4, 8, 16], "disk_repetitions": 3,
            "disk_seconds": 1.0, "ram_bytes": 1 << 30, "ram_repetitions": 7, "link_repetitions": 5,
            "matmul_repetitions": 7, "matmul_budget_s": 1.0, "ffn_budget_s": 3.0,
            "device_budget_s": 30.0, "trunk_repetitions": 5, "trunk_budget_s": 8.0,
            "trunk_chain_s": 0.01, "trunk_max_bytes": 512 << 20}


def resolve_model(name: str | None) -> dict:
    """Expert geometry of ``name`` (default GLM-5.2) via :func:`colibri_plan.model.load_model_spec`; the
    built-in GLM-5.2 figures when model specs are not importable.

    Raises:
        InputError: a model was named but model specs cannot be loaded here.
    """
    try:
        from colibri_plan.model import load_model_spec
    except ImportError as exc:
        if name is None:
            return dict(DEFAULT_MODEL)
        raise InputError(f"--model {name}: model specs are not available in this build ({exc}); "
                         "leave out --model to use the GLM-5.2 expert size") from None
    spec = load_model_spec(name or "glm-5.2")
    return {"name": spec.name, "hidden": spec.hidden_size, "width": spec.moe_intermediate_size,
            "expert_format": spec.expert_format, "top_k": spec.top_k, "expert_bytes": spec.expert_bytes(),
            "fingerprint": spec.fingerprint()}


def _loadavg() -> list[float] | None:
    """1, 5 and 15-minute load averages (None where the OS has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _reasons(skipped: list[dict]) -> str:
    return "; ".join(f"{s['backend']}: {s['reason']}" for s in skipped) or "no backend devices"


def run_profile(opts: ProfileOptions, progress: Callable[[str], None] | None = None) -> MachineProfile:
    """Measure this machine.

    Returns:
        A validated :class:`MachineProfile` (not yet saved).

    Raises:
        InputError: bad options (unknown probe, missing --path, unloadable model).
    """
    say = progress or (lambda _m: None)
    bad = set(opts.probes) - set(PROBES)
    if bad:
        raise InputError(f"unknown probe(s) {', '.join(sorted(bad))}; use {', '.join(PROBES)}")
    from colibri_plan.backends import BACKEND_NAMES
    from colibri_plan.quant import check_format

    unknown = [b for b in opts.backends or () if b not in BACKEND_NAMES]
    if unknown:
        raise InputError(f"unknown backend(s) {', '.join(unknown)}; use {', '.join(BACKEND_NAMES)}")
    for f in (*opts.formats, *opts.dense_formats):
        check_format(f)
    if "disk" in opts.probes and opts.path is not None and not os.path.exists(opts.path):
        raise InputError(f"--path {opts.path} does not exist; give a folder or a file on the disk to probe")
    if "disk" in opts.probes and opts.path is not None and os.path.isdir(opts.path) \
            and not os.access(opts.path, os.W_OK | os.X_OK):  # checked before minutes of other probes
        raise InputError(f"--path {opts.path}: cannot write a test file in this folder (permission "
                         "denied); give a folder you can write to, or an existing large file")
    t_start = time.perf_counter()
    load_start = _loadavg()
    st = mode_settings(opts.quick)
    model = resolve_model(opts.model)
    hidden = opts.hidden or model["hidden"]
    width = opts.width or model["width"]
    block = disk_mod.align_up(opts.block_bytes or model["expert_bytes"])
    # the model's own format first: a mode's per-device budget that runs out skips the last formats, and
    # `solve` needs this one (profile --quick --model PACK left it out on a slow machine)
    formats = list(dict.fromkeys([model["expert_format"], *opts.formats]))
    settings = {**st, "block_bytes": block, "hidden": hidden, "width": width, "formats": formats,
                "file_bytes": opts.file_bytes or st["file_bytes"],
                "queue_depths": list(opts.queue_depths or st["queue_depths"]),
                "ram_bytes": opts.ram_bytes or st["ram_bytes"],
                "disk_seconds": opts.disk_seconds or st["disk_seconds"]}
    not_asked = {p: {"unavailable": f"not measured (probe {p} not selected)"}
                 for p in PROBES if p not in opts.probes and p != "trunk"}
    skipped: list[dict] = []
    warnings: list[str] = []

    say("machine: cpu, memory, devices")
    machine = machine_info()
    devices, dev_skipped = list_all_devices(opts.backends)
    devices = list_host_memory_devices(devices, opts.backends)   # lavapipe/PoCL, only when named
    skipped += [{**s, "what": "devices"} for s in dev_skipped]
    # the fingerprint names the machine, not the backends asked for: it counts every GPU found
    machine["fingerprint"] = machine_fingerprint(machine, list_all_devices()[0] if opts.backends else devices)

    doc = {"source": f"measured by colibri-plan {__version__} `profile` ({st['mode']} mode)",
           "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "machine": machine, "model": model, "settings": settings, "devices": devices}

    durations = {}
    if "disk" in opts.probes:
        t0 = time.perf_counter()
        try:
            doc["disk"] = disk_mod.probe_disk(opts.path, block, settings["file_bytes"],
                                              settings["queue_depths"], st["disk_repetitions"],
                                              settings["disk_seconds"], say)
            warnings += doc["disk"]["warnings"]
        except OSError as exc:
            if opts.path is not None:  # a disk the user named must be measured, or the command fails
                raise InputError(f"--path {opts.path}: the disk probe failed ({exc}); give a folder you can "
                                 "write to (a test file is created there) or an existing large file") from exc
            doc["disk"] = {"unavailable": f"disk probe failed: {exc}"}
            warnings.append(f"{doc['disk']['unavailable']}: the profile has no disk figure, so `solve` can "
                            "only place models whose experts all fit in RAM/VRAM; re-run with `--path DIR`, "
                            "DIR a writable folder on the disk that holds the model")
        durations["disk"] = time.perf_counter() - t0
    if "ram" in opts.probes:
        t0 = time.perf_counter()
        doc["ram"] = probe_ram(settings["ram_bytes"], st["ram_repetitions"], progress=say)
        durations["ram"] = time.perf_counter() - t0
    ram = doc.get("ram") or not_asked["ram"]
    linkable = [d for d in devices if d["backend"] not in HOST_BACKENDS]
    if "links" in opts.probes:
        t0 = time.perf_counter()
        if linkable:
            links, s = probe_links(linkable, ram, block, st["link_repetitions"], progress=say)
            skipped += [{**x, "what": "links"} for x in s]
            doc["links"] = links if links else {"unavailable": _reasons(s)}
        else:
            doc["links"] = {"unavailable": "no GPU or accelerator device found: " + _reasons(dev_skipped)}
        doc["peer_links"] = probe_peer_links(devices, block, st["link_repetitions"], progress=say)
        durations["links"] = time.perf_counter() - t0
    compute = list(devices)
    if not opts.backends and {"numpy", "cpu"} <= {d["backend"] for d in devices}:
        compute = [d for d in devices if d["backend"] != "numpy"]
    if "matmul" in opts.probes:
        t0 = time.perf_counter()
        if len(compute) < len(devices):
            skipped.append({"backend": "numpy", "what": "matmul", "reason": "the reference backend; the cpu "
                            "backend is the host's compute path (measure it with --backends numpy)"})
        if compute:
            cfg = MatmulSettings(formats, hidden, width, repetitions=st["matmul_repetitions"],
                                 ffn_experts=int(model["top_k"]), budget_s=st["matmul_budget_s"],
                                 ffn_budget_s=st["ffn_budget_s"], device_budget_s=st["device_budget_s"])
            rows, ffn, s = probe_matmul(compute, cfg, say)
            skipped += s
            rows, ffn = relabel_rows(rows, devices), relabel_rows(ffn, devices)
            doc["matmul"] = rows if rows else {"unavailable": _reasons(s)}
            doc["expert_ffn"] = ffn if ffn else {"unavailable": _reasons(s)}
        else:
            doc["matmul"] = {"unavailable": "no compute backend is usable: " + _reasons(dev_skipped)}
            doc["expert_ffn"] = dict(doc["matmul"])
        durations["matmul"] = time.perf_counter() - t0
    else:
        doc["expert_ffn"] = not_asked["matmul"]
    if "trunk" in opts.probes:
        t0 = time.perf_counter()
        skipped += _run_trunk(doc, opts, st, compute, model, machine, say)
        durations["trunk"] = time.perf_counter() - t0
    for p, v in not_asked.items():
        doc.setdefault(p, v)
    doc["skipped"] = skipped
    doc["warnings"] = warnings
    doc["conditions"] = {"load_average_start": load_start, "load_average_end": _loadavg(),
                         "note": "a busy machine lowers every figure; compare profiles taken at low load"}
    doc["duration_s"] = round(time.perf_counter() - t_start, 2)
    doc["probe_seconds"] = {k: round(v, 2) for k, v in durations.items()}
    return MachineProfile(doc)


def _layer_geometry(opts: ProfileOptions, model: dict) -> LayerGeometry | None:
    """The decoder layer the trunk_layer figure runs: the model's (``--model``), else a generic one with
    the model's expert width and format (the host's expert calls)."""
    fmt = model.get("expert_format", "int4")
    if opts.model_arch is not None:
        return LayerGeometry.from_arch(opts.model_arch, model.get("name", "model"), fmt)
    return LayerGeometry(expert_width=int(model.get("width", 0)), expert_fmt=fmt)


def _run_trunk(doc: dict, opts: ProfileOptions, st: dict, compute: list[dict], model: dict, machine: dict,
               say: Callable[[str], None]) -> list[dict]:
    """The trunk probe on the matmul probe's devices plus the host CPU; fills ``doc``'s trunk sections
    and ``settings["trunk"]``; returns the skipped entries."""
    devices = list(compute)
    if not any(d["backend"] in HOST_BACKENDS for d in devices):  # the trunk may stay on the host
        host = host_device()
        if host is not None:
            devices.insert(0, host)
    cfg = TrunkSettings(shapes=[tuple(s) for s in (opts.trunk_shapes or TRUNK_SHAPES)],
                        formats=list(opts.dense_formats), contexts=list(opts.contexts or CONTEXTS),
                        repetitions=st["trunk_repetitions"], chain_s=st["trunk_chain_s"],
                        budget_s=opts.trunk_seconds or st["trunk_budget_s"], max_bytes=st["trunk_max_bytes"],
                        layer=_layer_geometry(opts, model),
                        step=StepSettings(runner=opts.step_runner)
                        if opts.model_arch is not None and opts.step_runner is not None else None)
    extra = model_dense_shapes(opts.model_arch, model["name"]) if opts.model_arch is not None else []
    doc["settings"]["trunk"] = {
        "shapes": [list(s) for s in cfg.shapes], "model_shapes": [list(s) for s in extra],
        "formats": list(cfg.formats), "contexts": list(cfg.contexts), "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden": cfg.hidden,
        "budget_s_per_device": cfg.budget_s, "max_bytes": cfg.max_bytes,
        "layer": None if cfg.layer is None else asdict(cfg.layer),
        "step": None if cfg.step is None else {k: v for k, v in cfg.step.__dict__.items() if k != "runner"}}
    got, skipped = probe_trunk(devices, cfg, extra, machine.get("ram_available_bytes"), say)
    for name in TRUNK_SECTIONS:
        doc[name] = got.get(name) or {"unavailable": _reasons(skipped)}
    return skipped
