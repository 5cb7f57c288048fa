"""Hand-made machine profiles and model specs for the solver tests (toy numbers, not measurements)."""

from __future__ import annotations

from colibri_plan.formats.model_spec import ModelSpec
from colibri_plan.formats.profile import MachineProfile, machine_fingerprint, save_profile


def st(v: float) -> dict:
    return {"min": v, "median": v, "max": v, "repetitions": 1}


def toy_profile(gpus=(), *, ram_available_bytes: int = 64 * 10**9, cpu_gbps: float = 20.0,
                ram_gbps: float = 40.0, disk_gbps: float | None = 2.0, fmt: str = "int4",
                shape=(32, 64)) -> MachineProfile:
    """A valid profile. ``gpus``: list of dicts {gbps, free_bytes, unified=False, h2d=25, d2h=25}."""
    devices = [{"backend": "numpy", "index": 0, "name": "toy cpu", "kind": "cpu",
                "total_memory_bytes": ram_available_bytes, "free_memory_bytes": ram_available_bytes,
                "unified_memory": False, "formats": [fmt], "driver": "toy"}]
    links = []
    matmul = [{"backend": "numpy", "device_index": 0, "device_name": "toy cpu", "device_kind": "cpu",
               "fmt": fmt, "out_features": shape[0], "in_features": shape[1], "tokens": 1,
               "weight_gbps": st(cpu_gbps), "seconds": st(1e-3)}]
    for i, g in enumerate(gpus):
        unified = bool(g.get("unified", False))
        devices.append({"backend": "cuda", "index": i, "name": f"toy gpu {i}",
                        "kind": "igpu" if unified else "gpu",
                        "total_memory_bytes": g["free_bytes"], "free_memory_bytes": g["free_bytes"],
                        "unified_memory": unified, "formats": [fmt], "driver": "toy"})
        links.append({"backend": "cuda", "device_index": i, "device_name": f"toy gpu {i}",
                      "unified_memory": unified,
                      "block_bytes": 1 << 20, "h2d_pinned_gbps": st(g.get("h2d", 25.0)),
                      "h2d_pageable_gbps": st(5.0), "d2h_pinned_gbps": st(g.get("d2h", 25.0)),
                      "d2h_pageable_gbps": st(5.0)})
        matmul.append({"backend": "cuda", "device_index": i, "device_name": f"toy gpu {i}",
                       "device_kind": "gpu",
                       "fmt": fmt, "out_features": shape[0], "in_features": shape[1], "tokens": 1,
                       "weight_gbps": st(g["gbps"]), "seconds": st(1e-4)})
    machine = {"cpu_model": "toy", "cores": 2, "ram_total_bytes": ram_available_bytes,
               "ram_available_bytes": ram_available_bytes, "os": "Linux"}
    machine["fingerprint"] = machine_fingerprint(machine, devices)
    disk = {"unavailable": "not measured (toy)"} if disk_gbps is None else {
        "path": "/tmp", "filesystem": "ext4", "o_direct": True, "page_cache_method": "O_DIRECT",
        "block_bytes": 1 << 20, "random": [
            {"queue_depth": 1, "read_gbps": st(disk_gbps / 2), "latency_ms": {"p50": 1.0, "p99": 2.0}},
            {"queue_depth": 4, "read_gbps": st(disk_gbps), "latency_ms": {"p50": 2.0, "p99": 4.0}}],
        "sequential": {"read_gbps": st(disk_gbps)}}
    return MachineProfile({"machine": machine, "disk": disk, "ram": {"read_gbps": st(ram_gbps), "threads": 2},
                           "devices": devices, "links": links, "matmul": matmul})


def toy_spec(name: str = "toy-moe", n_layers: int = 4, moe_layers=(1, 2, 3), n_experts: int = 8,
             top_k: int = 2, hidden: int = 64, inter: int = 32, fmt: str = "int4", vocab: int = 256,
             dense_params: int = 100_000) -> ModelSpec:
    return ModelSpec(name=name, family="qwen3_moe", n_layers=n_layers, moe_layers=tuple(moe_layers),
                     n_experts=n_experts, top_k=top_k, n_shared_experts=0, hidden_size=hidden,
                     moe_intermediate_size=inter, shared_intermediate_size=0, vocab_size=vocab,
                     expert_format=fmt, dense_params=dense_params, kv_bytes_per_token=1024,
                     source="test: toy")


def write_toy_files(folder):
    """``folder``/profile.json (one 60 GB/s GPU with 2.06 GB free, 3.1 GB of RAM available) and
    ``folder``/model.json (16 experts, hidden 2048, width 1024): what the solve CLI tests run on."""
    from colibri_plan.model import save_model_spec

    prof = toy_profile(gpus=[{"gbps": 60.0, "free_bytes": 2_060_000_000}], ram_available_bytes=3_100_000_000)
    save_profile(prof, folder / "profile.json")
    save_model_spec(toy_spec(n_experts=16, hidden=2048, inter=1024), folder / "model.json")
    return folder
