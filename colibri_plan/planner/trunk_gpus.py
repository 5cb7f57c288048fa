"""The trunk's GPU split as a decision of the solver: one GPU, or spread over the GPUs by layers as the
colibrì C engine spreads it (pure, hand-checkable).

colibrì (reference notes §1.7, its docs/cuda.md and ENVIRONMENT.md): ``CUDA_DENSE=1`` puts the dense
trunk's tensors on the GPUs of ``COLI_GPU=n`` / ``COLI_GPUS=a,b,...`` (one list for experts and trunk;
default ``CUDA_DENSE=0``: the trunk on the CPU), round-robin with each layer's tensors together: layer l
on device ``l mod n`` of the list, and the hidden state hops to the next device at every layer ("per-layer
P2P hops"). So under ``--target colibri`` the trunk options are:

* ``cpu``: ``CUDA_DENSE=0``; experts on any GPU.
* one GPU ``cuda:i``: ``COLI_GPU=i CUDA_DENSE=1``; colibrì's one device list then holds the experts too,
  so the other GPUs hold none (:attr:`TrunkOption.expert_devices`).
* ``split`` (spread): ``COLI_GPUS=<all discrete CUDA GPUs> CUDA_DENSE=1``; each GPU holds its layers'
  share of the trunk and KV cache (the VRAM freed on the first GPU goes to experts) and computes them at
  its own rate; per token::

      dense_s = Σ_d trunk_s(d, its layers) + Σ_d n_moe_d · roundtrip_s(d) + handoffs · hop_s
      handoffs = layer boundaries whose two layers sit on different GPUs (n_layers − 1 with ≥ 2 GPUs)
      hop_s   = the first GPU's host round trip of the hidden state (measured ``device_ops``, else the
                links' H2D + D2H with their latencies): GPU to GPU through the host

The solver prices each option with the expert placement it leaves and keeps the fastest
(:mod:`.trunk_solve`); :func:`gpu_split_section` is the plan's record of the decision, and
:func:`gpu_split_line` the line ``solve -v`` prints beside the reads line. Our engine runs one trunk device:
under ``--target colibri-plan`` the section says so (one GPU), and no spread is offered.
"""

from __future__ import annotations

import math

from colibri_plan.formats.plan_trunk import CPU, kv_bytes
from colibri_plan.planner.trunk_layer import TrunkWork

#: the plan's ``trunk_gpus`` section version (absent in older plans, which load as before)
SECTION_VERSION = 1
SPLIT = "split"


def round_robin_layers(n_layers: int, keys: list[str]) -> tuple[tuple[int, int, str], ...]:
    """colibrì's layer spread: layer l on ``keys[l % len(keys)]``, as ((first, last, key), ...) ranges
    covering 0..n_layers-1 (consecutive layers on one device merged: one range with one device).
    E.g. 5 layers over (a, b): ((0,0,a), (1,1,b), (2,2,a), (3,3,b), (4,4,a))."""
    out: list[list] = []
    for layer in range(max(0, n_layers)):
        key = keys[layer % len(keys)]
        if out and out[-1][2] == key:
            out[-1][1] = layer
        else:
            out.append([layer, layer, key])
    return tuple(tuple(r) for r in out)


def handoffs(split) -> int:
    """Layer boundaries in ``split`` ((first, last, key), ...) whose two sides are on different devices."""
    return sum(1 for a, b in zip(split, split[1:]) if a[2] != b[2])


def spread_option(figs, spec, keys: list[str], context_tokens: int, ram_charged: int,
                  kv_bytes_per_token: int, price, option_cls, *, dense_bytes: int):
    """The ``split`` option of ``--target colibri``: the trunk spread over ``keys`` by
    :func:`round_robin_layers` (module docstring for its seconds).

    Args:
        figs: key -> :class:`~colibri_plan.planner.trunk.TrunkFigures`. keys: the GPUs, in COLI_GPUS order.
        ram_charged: bytes the RAM budget charged for trunk + KV (it gets them back).
        kv_bytes_per_token: the cache's bytes per context token (all layers), as the one-GPU options price
            it, so the options compare like with like. price: ``price(key, work, share) -> (dense_s,
            attention_s, _)``, planner.trunk's ``price_trunk`` of one GPU's layers; option_cls: its
            TrunkOption (both passed in: trunk imports this module). dense_bytes: planner.trunk's
            ``dense_read_bytes`` (the trunk's bytes less the embedding table).

    Returns:
        TrunkOption "split" (``vram_bytes``: each GPU's share of dense + paged KV bytes, rounded up).
    """
    dense = dense_bytes
    kv_paged = kv_bytes(context_tokens, kv_bytes_per_token)
    n = spec.n_layers
    moe = {lid for lid in spec.moe_layers if lid < n}
    parts = round_robin_layers(n, keys)
    layers = {k: [lid for a, b, kk in parts if kk == k for lid in range(a, b + 1)] for k in keys}
    dense_s = attention_s = roundtrip_s = 0.0
    vram = {}
    for key, ls in layers.items():
        if not ls:
            continue
        share = len(ls) / n
        n_moe = sum(1 for lid in ls if lid in moe)
        work = TrunkWork(int(dense * share), len(ls), 0, context_tokens, int(kv_bytes_per_token * share))
        d, at, _ = price(key, work, share)
        dense_s, attention_s = dense_s + d, attention_s + at
        roundtrip_s += n_moe * figs[key].roundtrip_s
        vram[key] = int(math.ceil((dense + kv_paged) * share))
    hand_s = handoffs(parts) * figs[parts[0][2]].roundtrip_s
    roundtrip_s += hand_s
    return option_cls(SPLIT, parts[0][2], parts, dense_s + roundtrip_s, attention_s, roundtrip_s, dense,
                      kv_paged, vram, ram_charged, {k: figs[k].sources for k in vram}, kv_bytes_per_token,
                      handoff_s=hand_s)


def colibri_gpus(figs) -> list[str]:
    """The discrete CUDA GPUs colibrì can spread its trunk over (its CUDA_DENSE is CUDA only)."""
    return [k for k, f in figs.items() if k != CPU and f.discrete and k.startswith("cuda:")]


def _why(target: str, chosen: str, spread: dict | None, one_tok: float | None) -> str:
    """The section's reason, in words (its figures from the trunk report's rows)."""
    if target != "colibri":
        return {"one": "our engine runs one trunk device: one GPU", "cpu": "the trunk on the CPU"}.get(
            chosen, "our engine runs one trunk device; the layer split is for exports (llama.cpp "
                    "--tensor-split)")
    if spread is None:
        return "no spread: fewer than two discrete CUDA GPUs"
    if spread.get("tok_s") is None:
        return f"no spread: it does not fit ({spread.get('why') or 'not solved'})"
    one = f"{one_tok:.3f}" if one_tok is not None else "(none fits)"
    name = {"spread": "spread", "one": "one GPU", "cpu": "the CPU"}[chosen]
    return (f"spread over {len(spread['vram_trunk_bytes'])} GPUs {spread['tok_s']:.3f} tok/s against one "
            f"GPU {one} ({name} chosen)")


def gpu_split_section(setup, report: dict) -> dict:
    """The plan's ``trunk_gpus`` section: the GPU split decision, priced (``report``: trunk_solve's
    ``{"mode", "chosen", "options"}``).

    Returns:
        {"version", "target", "chosen": "cpu" | "one" | "spread", "devices": [keys], "handoffs",
        "handoff_s_per_token", "one_gpu": {option, tok_s} | None (the fastest one-GPU option),
        "spread": {tok_s, handoffs, why} | None, "env": {var: value} (what colibrì reads; {} for other
        targets), "why"}.
    """
    target = setup.knobs.get("target", "colibri-plan")
    rows = {r["option"]: r for r in report["options"]}
    opt = setup.trunk
    one = [r for k, r in rows.items() if k not in (CPU, SPLIT) and r.get("tok_s") is not None]
    best_one = max(one, key=lambda r: r["tok_s"]) if one else None
    spread = rows.get(SPLIT)
    chosen = CPU if opt.name == CPU else ("spread" if opt.split else "one")
    devices = list(dict.fromkeys(k for _, _, k in opt.split)) if opt.split else (
        [] if chosen == CPU else [opt.device])
    env = {}
    if target == "colibri":
        env = {"one": lambda: {"COLI_GPU": devices[0].split(":")[1], "CUDA_DENSE": "1"},
               "spread": lambda: {"COLI_GPUS": ",".join(k.split(":")[1] for k in devices), "CUDA_DENSE": "1"},
               CPU: lambda: {"CUDA_DENSE": "0"}}[chosen]()
    one_tok = best_one["tok_s"] if best_one else None
    spread_sec = None
    if spread:
        parts = [(r["first_layer"], r["last_layer"], r["device"]) for r in spread["split"]]
        spread_sec = {"tok_s": spread.get("tok_s"), "handoffs": handoffs(parts), "why": spread.get("why")}
    return {"version": SECTION_VERSION, "target": target, "chosen": chosen, "devices": devices,
            "handoffs": handoffs(opt.split) if opt.split else 0,
            "handoff_s_per_token": float(getattr(opt, "handoff_s", 0.0)),
            "one_gpu": {"option": best_one["option"], "tok_s": one_tok} if best_one else None,
            "spread": spread_sec, "env": env, "why": _why(target, chosen, spread, one_tok)}


def gpu_split_line(sec: dict) -> str:
    """The "Trunk GPUs:" line of ``solve -v`` (beside the reads line)."""
    where = {"cpu": "on the CPU", "one": f"on one GPU ({', '.join(sec['devices'])})",
             "spread": f"spread over {', '.join(sec['devices'])} by layers ({sec['handoffs']} hand-offs, "
                       f"{sec['handoff_s_per_token'] * 1e3:.2f} ms/token)"}[sec["chosen"]]
    env = " ".join(f"{k}={v}" for k, v in sec.get("env", {}).items())
    return f"Trunk GPUs: {where}{f' [{env}]' if env else ''}: {sec['why']}"
