"""Python side of bench/multi_gpu_verify.sh: VRAM budgets, a per-device smoke test, the summary table.

    python3 bench/multi_gpu_table.py budget --profile P --model PACK [--fraction 0.6]
    python3 bench/multi_gpu_table.py smoke [--backend cuda] [--devices 0,1]
    python3 bench/multi_gpu_table.py table DIR [--json OUT.json] [--names ours,hot-first]
    python3 bench/multi_gpu_table.py fake-gpus PROFILE      # local rehearsal only (no GPUs)

``budget`` prints ``RESERVE_GB PER_CARD_GB EXPERTS_GB GPUS``: the ``--vram-reserve`` that leaves each
discrete GPU of the profile ``fraction`` x the model's routed-expert bytes under ``--vram auto`` (budget =
free - reserve, planner/budgets.py), taken from the card with the least free memory.

``smoke`` runs one batched expert FFN (1 and 16 tokens) on every device, from the main thread and from a
worker thread (the engine computes device experts in worker threads, where CuPy's current device is 0),
against the numpy reference: a multi-GPU fault shows up here in seconds, naming the device.

``table`` reads DIR/plan-NAME.json and DIR/verify-NAME-rN.json and prints, per placement: experts per
device, tok/s median and spread over repeats, predicted vs measured, per-device expert time per MoE layer
(ms: the report's ``terms.expert_compute_s[device]`` / MoE layers), token-exactness, and the paired
per-repeat ratio of the first placement over the second; with --json it writes the same as JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

GB = 1e9


# ---- budget -------------------------------------------------------------------------------------
def budget(profile_path: str, model: str, fraction: float) -> dict:
    """The --vram-reserve (GB) that leaves each discrete GPU ``fraction`` x the routed experts' bytes.

    Raises:
        SystemExit: fewer than two discrete GPUs in the profile, or a fraction that makes one card hold
        every expert or two cards too few.
    """
    from colibri_plan.formats.profile import load_profile
    from colibri_plan.model import load_model_spec

    prof, spec = load_profile(profile_path), load_model_spec(model)
    gpus = [g for g in prof.gpus() if not g.get("unified_memory")]
    if len(gpus) < 2:
        raise SystemExit(f"budget: the profile lists {len(gpus)} discrete GPU(s); this bench needs two")
    experts = spec.routed_bytes()
    if not 1 / len(gpus) < fraction < 1:
        raise SystemExit(f"budget: --fraction {fraction} must lie in ({1 / len(gpus):.2f}, 1): below, the "
                         "cards cannot hold every expert; at 1 or more, one card holds them all")
    per_card = fraction * experts
    free = min(int(g.get("free_memory_bytes") or g["total_memory_bytes"]) for g in gpus)
    return {"reserve_gb": (free - per_card) / GB, "per_card_gb": per_card / GB, "experts_gb": experts / GB,
            "gpus": len(gpus), "min_free_gb": free / GB}


# ---- smoke --------------------------------------------------------------------------------------
def smoke(backend: str, devices: list[int], hidden: int = 6144, width: int = 2048, fmt: str = "int4") -> int:
    """Expert FFN on each device vs numpy, main thread and worker thread; returns failures."""
    import numpy as np

    from colibri_plan.backends import get_backend
    from colibri_plan.profiler.matmul_probe import random_weight

    rng = np.random.default_rng(0)
    mats = [random_weight(fmt, width, hidden), random_weight(fmt, width, hidden),
            random_weight(fmt, hidden, width)]
    ref_be = get_backend("numpy").open(0)
    ref_e = ref_be.upload_expert(*mats)
    failures = 0
    with ThreadPoolExecutor(1) as worker:
        for idx in devices:
            where = f"{backend}:{idx}"
            try:
                be = get_backend(backend).open(idx)
            except Exception as exc:  # noqa: BLE001 - report and go on with the next device
                print(f"smoke {where}: cannot open ({type(exc).__name__}: {exc})")
                failures += 1
                continue
            try:
                e = be.upload_expert(*mats)
                for tokens in (1, 16):
                    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
                    want = ref_be.expert_ffn([x], [ref_e])[0]
                    for thread in ("main", "worker"):
                        try:
                            got = (be.expert_ffn([x], [e]) if thread == "main"
                                   else worker.submit(be.expert_ffn, [x], [e]).result())[0]
                            err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
                            ok = bool(np.isfinite(got).all()) and err < 1e-3
                            print(f"smoke {where}: {tokens:2d} token(s), {thread} thread: "
                                  f"{'ok' if ok else 'WRONG'} (max rel. error {err:.1e})")
                        except Exception as exc:  # noqa: BLE001
                            ok = False
                            print(f"smoke {where}: {tokens:2d} token(s), {thread} thread: FAILED "
                                  f"({type(exc).__name__}: {exc})")
                        failures += not ok
            except Exception as exc:  # noqa: BLE001 - e.g. the upload failed: next device
                print(f"smoke {where}: FAILED ({type(exc).__name__}: {exc})")
                failures += 1
            finally:
                be.close()
    ref_be.close()
    return failures


# ---- table --------------------------------------------------------------------------------------
def _repeat(path: str) -> int:
    m = re.search(r"-r(\d+)\.json$", path)
    return int(m.group(1)) if m else 0


def _median_spread(values: list[float]) -> dict:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def placement_summary(d: Path, name: str) -> dict:
    """One placement: plan split, tok/s over repeats, per-device expert ms per MoE layer, exactness."""
    plan_file = d / f"plan-{name}.json"
    plan = json.loads(plan_file.read_text()) if plan_file.is_file() else None
    out: dict = {"name": name, "plan": str(plan_file) if plan else None}
    if plan:
        keys = [dev["key"] for dev in plan["devices"]]
        per_dev = {k: sum(len(layer["vram"].get(k, [])) for layer in plan["layers"]) for k in keys}
        out["experts"] = {**per_dev, "ram_pinned": sum(len(layer["ram_pinned"]) for layer in plan["layers"]),
                          "disk": sum(len(layer["disk"]) for layer in plan["layers"])}
        out["per_layer_split"] = [{"layer": la["layer"], **{k: len(la["vram"].get(k, [])) for k in keys},
                                   "ram_pinned": len(la["ram_pinned"]), "disk": len(la["disk"])}
                                  for la in plan["layers"]]
        out["predicted_tok_s"] = plan["predicted"]["tok_s"]
    files = sorted(glob.glob(str(d / f"verify-{name}-r*.json")), key=_repeat)
    reps = [json.loads(Path(f).read_text()) for f in files]
    out["repeats"] = [_repeat(f) for f in files]
    out["tok_s_runs"] = [r["measured"]["tok_s"] for r in reps]
    out["tok_s"] = _median_spread(out["tok_s_runs"])
    if not reps:
        return out
    n_moe = int(reps[0]["plan"].get("n_decode_layers") or len(plan["layers"] if plan else [1]))
    out["moe_layers"] = n_moe
    pred_t = reps[0]["predicted"]["terms"].get("expert_compute_s", {})
    devs = sorted({k for r in reps for k in r["measured"]["terms"].get("expert_compute_s", {})} | set(pred_t))
    meas = [r["measured"]["terms"].get("expert_compute_s", {}) for r in reps]
    out["expert_ms_per_layer"] = {
        k: {"predicted": pred_t[k] / n_moe * 1e3 if k in pred_t else None,
            "measured": _median_spread([m[k] / n_moe * 1e3 for m in meas if k in m])}
        for k in devs}
    out["expert_layer_wall_ms"] = _median_spread(
        [r["measured"]["terms"].get("expert_layers_s", 0.0) / n_moe * 1e3 for r in reps])
    out["predicted_tok_s"] = reps[0]["predicted"]["tok_s"]
    out["measured_over_predicted"] = (out["tok_s"]["median"] / out["predicted_tok_s"]
                                      if out["predicted_tok_s"] else None)
    out["token_exact"] = next((r["verdict"].get("token_exact") for r in reps
                               if r["verdict"].get("token_exact") is not None), None)
    out["tokens"] = reps[0]["measured"].get("tokens")
    out["tokens_same_every_repeat"] = all(r["measured"].get("tokens") == out["tokens"] for r in reps)
    return out


def summarize(d: Path, names: list[str]) -> dict:
    """Every placement, the paired per-repeat ratio names[0] / names[1], and the profile's peer links."""
    places = {n: placement_summary(d, n) for n in names}
    out: dict = {"dir": str(d), "placements": places}
    if len(names) >= 2:
        a, b = (dict(zip(places[n]["repeats"], places[n]["tok_s_runs"])) for n in names[:2])
        ratios = [a[r] / b[r] for r in sorted(set(a) & set(b)) if b[r] > 0]
        out["paired_ratio"] = {"of": f"{names[0]} / {names[1]}", **_median_spread(ratios), "runs": ratios}
        t0, t1 = places[names[0]].get("tokens"), places[names[1]].get("tokens")
        out["same_tokens_across_placements"] = t0 is not None and t0 == t1
    prof = d / "profile.json"
    if prof.is_file():
        peers = json.loads(prof.read_text()).get("peer_links")
        out["peer_links"] = peers if peers is not None else {"unavailable": "not in this profile"}
    return out


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def render(s: dict) -> str:
    """The summary as a text table."""
    lines = []
    for n, p in s["placements"].items():
        t = p["tok_s"]
        exact = {True: "yes", False: "NO", None: "-"}[p.get("token_exact")]
        lines.append(f"{n}: experts {p.get('experts', '-')}; tok/s median {_f(t['median'])} "
                     f"(min {_f(t['min'])}, max {_f(t['max'])}, {t['n']} runs); predicted "
                     f"{_f(p.get('predicted_tok_s'))}, measured/predicted "
                     f"{_f(p.get('measured_over_predicted'))}; token-exact {exact}; tokens same every "
                     f"repeat {p.get('tokens_same_every_repeat', '-')}")
        for layer in p.get("per_layer_split", []):
            lines.append(f"    layer {layer['layer']}: " + ", ".join(f"{k} {v}" for k, v in layer.items()
                                                                    if k != "layer"))
        if p.get("expert_ms_per_layer"):
            lines.append(f"    {'device':10s} {'pred ms/layer':>13s} {'meas ms/layer':>13s} {'min':>7s} "
                         f"{'max':>7s}")
            for k, v in p["expert_ms_per_layer"].items():
                m = v["measured"]
                lines.append(f"    {k:10s} {_f(v['predicted'], '{:13.3f}'):>13s} "
                             f"{_f(m['median'], '{:13.3f}'):>13s} {_f(m['min'], '{:7.3f}'):>7s} "
                             f"{_f(m['max'], '{:7.3f}'):>7s}")
            w = p["expert_layer_wall_ms"]
            lines.append(f"    {'wall':10s} {'':>13s} {_f(w['median'], '{:13.3f}'):>13s}")
    if "paired_ratio" in s:
        r = s["paired_ratio"]
        lines.append(f"paired tok/s ratio {r['of']}: median {_f(r['median'], '{:.3f}')} "
                     f"(min {_f(r['min'], '{:.3f}')}, max {_f(r['max'], '{:.3f}')}, {r['n']} pairs); "
                     f"same tokens across placements: {s.get('same_tokens_across_placements')}")
    peers = s.get("peer_links")
    if isinstance(peers, list):
        for e in peers:
            g = e["copy_gbps"]
            lines.append(f"peer {e['src']} -> {e['dst']}: peer access {e['can_access_peer']}, "
                         f"{_f(g.get('median'))} GB/s" if "median" in g else
                         f"peer {e['src']} -> {e['dst']}: {g.get('unavailable')}")
    elif isinstance(peers, dict):
        lines.append(f"peer links: {peers.get('unavailable')}")
    return "\n".join(lines)


# ---- rehearsal ----------------------------------------------------------------------------------
def fake_gpus(path: str) -> None:
    """Local rehearsal only: make a ``--backends cpu,numpy`` profile's two host devices stand in for two
    discrete GPUs (keys cpu:0 and numpy:0, 1 GB free each, link figures = the RAM bandwidth), so the
    bench's solve / verify / table steps run end to end on a machine without GPUs."""
    from colibri_plan.formats.profile import load_profile, save_profile

    doc = load_profile(path).doc
    ram = doc["ram"]["read_gbps"]
    for d in doc["devices"]:
        d.update(kind="gpu", unified_memory=False, total_memory_bytes=2_000_000_000,
                 free_memory_bytes=1_000_000_000, name=f"{d['backend']} stand-in GPU")
    block = doc["settings"]["block_bytes"]
    doc["links"] = [{"backend": d["backend"], "device_index": d["index"], "device_name": d["name"],
                     "device_kind": "gpu", "unified_memory": False, "block_bytes": block,
                     **{k: dict(ram) for k in ("h2d_pinned_gbps", "h2d_pageable_gbps", "d2h_pinned_gbps",
                                               "d2h_pageable_gbps")}, "method": "rehearsal: RAM bandwidth"}
                    for d in doc["devices"]]
    keys = [f"{d['backend']}:{d['index']}" for d in doc["devices"]]
    doc["peer_links"] = [{"src": a, "dst": b, "block_bytes": block,
                          "can_access_peer": True, "peer_access_enabled": True, "copy_gbps": dict(ram),
                          "method": "rehearsal: RAM bandwidth"} for a in keys for b in keys if a != b]
    save_profile(doc, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("budget")
    b.add_argument("--profile", required=True)
    b.add_argument("--model", required=True)
    b.add_argument("--fraction", type=float, default=0.6)
    s = sub.add_parser("smoke")
    s.add_argument("--backend", default="cuda")
    s.add_argument("--devices", default="0,1")
    s.add_argument("--hidden", type=int, default=6144)
    s.add_argument("--width", type=int, default=2048)
    t = sub.add_parser("table")
    t.add_argument("dir")
    t.add_argument("--names", default="ours,hot-first")
    t.add_argument("--json", default=None)
    f = sub.add_parser("fake-gpus")
    f.add_argument("profile")
    a = ap.parse_args(argv)
    if a.cmd == "budget":
        r = budget(a.profile, a.model, a.fraction)
        print(f"{r['reserve_gb']:.6f} {r['per_card_gb']:.6f} {r['experts_gb']:.6f} {r['gpus']}")
        print(f"budget: experts {r['experts_gb']:.3f} GB; {a.fraction} x that = {r['per_card_gb']:.3f} GB "
              f"per card = least free {r['min_free_gb']:.3f} GB - reserve {r['reserve_gb']:.3f} GB",
              file=sys.stderr)
    elif a.cmd == "smoke":
        return 1 if smoke(a.backend, [int(i) for i in a.devices.split(",")], a.hidden, a.width) else 0
    elif a.cmd == "table":
        summary = summarize(Path(a.dir), a.names.split(","))
        print(render(summary))
        if a.json:
            Path(a.json).write_text(json.dumps(summary, indent=1) + "\n")
    else:
        fake_gpus(a.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
