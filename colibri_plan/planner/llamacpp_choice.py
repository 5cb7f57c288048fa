"""The llama.cpp placement ``solve --target llama.cpp`` recommends, chosen by llama.cpp's predicted speed.

Only what llama.cpp can express is searched (:mod:`.llamacpp_cost` prices each): ``-ngl N`` (the last N
layers, the head counting as the last), a contiguous run of MoE layers whose merged expert tensors stay
on the GPU (at the front or at the back of the GPU layers; every other layer's ``=CPU``), optionally one
more layer beside the run with ``ffn_down_exps`` apart from gate/up (either half on the GPU), the KV cache
on the GPU or not (``-nkvo``), ``-ub``, and ``--no-mmap`` / ``--mlock`` where the RAM limit holds the
host weights. Context and threads are the plan's (``-c``, ``-t`` = the profile's cores); every candidate
fits the budgets in llama.cpp's own accounting (:func:`~.llamacpp_cost.check_placement`).

The pick: the fastest predicted decode; among those within :data:`NOISE` of it, the fastest prefill.
It is compared with llama.cpp's own ``--fit`` (every layer's dense tensors on the GPU, the experts of
the first MoE layers there while they fit, the rest ``=CPU``): when the pick is not faster than ``--fit``
by more than :data:`NOISE` on decode or on prefill, the answer is "keep --fit" with the figures (a
cost-based abstain), since a predicted gain inside the measurement noise is no gain.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from colibri_plan.planner.llamacpp_cost import PROJECTIONS, LlamaCoefficients, LlamaPlacement, check_placement
from colibri_plan.planner.llamacpp_cost import predict as _predict

#: relative spread of llama-bench tok/s between interleaved repeats (issue 27's H200 replay: 91.1-98.0
#: around 97.6 decode): a predicted difference smaller than this is not acted on
NOISE = 0.05
UBATCHES = (256, 512, 1024, 2048)


def _moe_gpu_layers(g, ngl: int) -> list[int]:
    pl = LlamaPlacement(ngl=ngl)
    return [lay for lay in range(g.n_layers) if g.moe[lay] and pl.on_gpu(lay, g.n_layers)]


def _with_run(base: LlamaPlacement, g, run: list[int], partial: tuple[int, tuple] | None) -> LlamaPlacement:
    """``base`` with the experts of ``run`` (and ``partial``: (layer, projections on the GPU)) on the GPU,
    every other GPU layer's experts ``=CPU``."""
    cpu = {}
    for lay in _moe_gpu_layers(g, base.ngl):
        if lay in run:
            continue
        on = partial[1] if partial and partial[0] == lay else ()
        keep = tuple(p for p in PROJECTIONS if p not in on)
        if keep:
            cpu[lay] = keep
    return dataclasses.replace(base, cpu_experts=cpu)


def fit_placement(g, m, base: LlamaPlacement) -> LlamaPlacement | None:
    """llama.cpp's ``--fit`` as it places: the most layers on the GPU (all when their dense tensors fit),
    then the experts of the first MoE layers while they fit. None when nothing fits (CPU only)."""
    for ngl in range(g.n_layers + 1, -1, -1):
        moe = _moe_gpu_layers(g, ngl)
        for k in range(len(moe), -1, -1):
            pl = _with_run(dataclasses.replace(base, ngl=ngl), g, moe[:k], None)
            if check_placement(g, m, pl) is None:
                return pl
    return None


def candidates(g, m, base: LlamaPlacement):
    """Every feasible placement of the module docstring's family with the most experts its run can hold."""
    seen = set()
    for kv in (True, False):
        for ngl in range(g.n_layers + 1, -1, -1):
            moe = _moe_gpu_layers(g, ngl)
            b = dataclasses.replace(base, ngl=ngl, kv_on_gpu=kv)
            for front in (True, False):
                for half in ((), ("gate", "up"), ("down",)):
                    for k in range(len(moe), -1, -1):
                        run = moe[:k] if front else moe[len(moe) - k:]
                        nxt = (moe[k] if k < len(moe) else None) if front else \
                            (moe[len(moe) - k - 1] if k < len(moe) else None)
                        if half and nxt is None:
                            continue                               # no layer beside the run
                        pl = _with_run(b, g, run, (nxt, half) if half else None)
                        if check_placement(g, m, pl) is None:
                            key = (pl.ngl, pl.kv_on_gpu, tuple(sorted(pl.cpu_experts.items())))
                            if key not in seen:
                                seen.add(key)
                                yield pl
                            break                                  # the most this run holds


def llama_args(pl: LlamaPlacement, n_layers: int) -> list[str]:
    """llama.cpp's arguments (common parser: llama-server, llama-cli) for ``pl``."""
    groups: dict[tuple, list[int]] = {}
    for lay, projs in sorted(pl.cpu_experts.items()):
        if pl.on_gpu(lay, n_layers):
            groups.setdefault(tuple(projs), []).append(lay)
    out = ["-ngl", str(pl.ngl)]
    for projs, lays in groups.items():
        ids = "|".join(str(x) for x in lays)
        name = projs[0] if len(projs) == 1 else "(" + "|".join(projs) + ")"
        out += ["-ot", f"blk\\.({ids})\\.ffn_{name}_exps=CPU"]
    out += [] if pl.kv_on_gpu else ["-nkvo"]
    out += ["-c", str(pl.context), "-ub", str(pl.ubatch)]
    out += ["-t", str(pl.threads)] if pl.threads else []
    out += [] if pl.repack else ["--no-repack"]
    return out + {"mmap": [], "no-mmap": ["--no-mmap"], "mlock": ["--mlock"]}[pl.load]


def _summary(g, pl, pred) -> dict:
    return {"args": llama_args(pl, g.n_layers), "decode_tok_s": pred["decode_tok_s"],
            "prefill_tok_s": pred["prefill_tok_s"], "memory": pred["memory"],
            "gpu_expert_layers": [lay for lay in range(g.n_layers) if g.moe[lay]
                                  and pl.on_gpu(lay, g.n_layers) and lay not in pl.cpu_experts],
            "fault_bytes_per_token": pred["terms"]["fault_bytes"]}


def _versus(pred: dict, ref: dict, ref_name: str) -> tuple[float, float, str]:
    """(decode gain, prefill gain, the sentence) of predicted figures ``pred`` over ``ref``'s."""
    gain_d = pred["decode_tok_s"] / ref["decode_tok_s"] - 1
    gain_p = pred["prefill_tok_s"] / ref["prefill_tok_s"] - 1
    return gain_d, gain_p, (f"predicted decode {pred['decode_tok_s']:.1f} vs {ref['decode_tok_s']:.1f} tok/s "
                            f"({gain_d:+.0%}), prefill {pred['prefill_tok_s']:.0f} vs "
                            f"{ref['prefill_tok_s']:.0f} tok/s ({gain_p:+.0%}) for {ref_name}")


def choose(g, m, base: LlamaPlacement, coef: LlamaCoefficients | None = None, probs: np.ndarray | None = None,
           noise: float = NOISE) -> dict:
    """The recommended placement and the verdict against ``--fit`` (module docstring).

    Returns:
        {"verdict": "use" | "keep --fit", "why", "chosen": {args, decode_tok_s, prefill_tok_s, memory,
        gpu_expert_layers, fault_bytes_per_token}, "fit": the same for --fit (None without a GPU),
        "candidates": how many were priced, "noise", "calibrated_on"}.
    """
    coef = coef or LlamaCoefficients()

    def price(pl):
        return _predict(g, m, pl, coef, probs)

    cands = [(pl, price(pl)) for pl in candidates(g, m, base)] if m.gpu_gbps > 0 and m.vram_bytes else []
    cpu_only = dataclasses.replace(base, ngl=0)
    cands.append((cpu_only, price(cpu_only)))
    best_d = max(p["decode_tok_s"] for _, p in cands)
    pl, pred = max((c for c in cands if c[1]["decode_tok_s"] >= best_d * (1 - noise)),
                   key=lambda c: (c[1]["prefill_tok_s"], c[1]["decode_tok_s"]))
    for ub in UBATCHES:                                 # -ub: a longer micro-batch amortises the copies
        alt = dataclasses.replace(pl, ubatch=ub)
        if check_placement(g, m, alt) is None:
            pa = price(alt)
            if pa["prefill_tok_s"] > pred["prefill_tok_s"] * (1 + 1e-9) and \
                    pa["decode_tok_s"] >= pred["decode_tok_s"] * (1 - 1e-9):
                pl, pred = alt, pa
    if pred["terms"]["fault_bytes"] > 0:                # page faults: pin the weights if the RAM holds them
        for load in ("mlock", "no-mmap"):
            alt = dataclasses.replace(pl, load=load)
            if check_placement(g, m, alt) is None:
                pl, pred = alt, price(alt)
                break
    fit = fit_placement(g, m, base) if m.gpu_gbps > 0 and m.vram_bytes else None
    fit_pred = price(fit) if fit is not None else None
    out = {"chosen": _summary(g, pl, pred), "fit": _summary(g, fit, fit_pred) if fit is not None else None,
           "candidates": len(cands) + len(UBATCHES), "noise": noise, "calibrated_on": coef.calibrated_on}
    if fit_pred is None:  # no GPU: fit has nothing to place, so the reference is llama.cpp's defaults
        gain_d, gain_p, figures = _versus(pred, price(cpu_only), "llama.cpp's defaults")
        if gain_d > noise or gain_p > noise:
            out["verdict"] = "use"
            out["why"] = (f"no GPU in the budget (--fit has nothing to place); faster than llama.cpp's "
                          f"defaults beyond the {noise:.0%} noise: {figures}")
        else:
            out["verdict"] = "keep --fit"
            out["why"] = (f"no GPU in the budget: --fit has nothing to place, and the best CPU placement is "
                          f"within the {noise:.0%} noise of llama.cpp's defaults: {figures}")
        return out
    gain_d, gain_p, figures = _versus(pred, fit_pred, "--fit")
    if gain_d <= noise and gain_p <= noise:
        out["verdict"] = "keep --fit"
        out["why"] = (f"the best placement llama.cpp can express is within the {noise:.0%} noise of --fit: "
                      f"{figures}; --fit also adapts to the memory free at start-up")
    elif gain_d < -noise or gain_p < -noise:    # never recommend a loss on either figure
        out["verdict"] = "keep --fit"
        out["why"] = f"no placement beats --fit on both decode and prefill: {figures}"
    else:
        out["verdict"], out["why"] = "use", f"faster than --fit beyond the {noise:.0%} noise: {figures}"
    return out


def export_hook(out: dict, sec, where: str = "plan") -> dict:
    """``export --to llama.cpp`` of a plan solved with ``--target llama.cpp``: the pick's arguments
    replace the whole-layer approximation (kept under ``approximation``), or "keep --fit" says why.

    Raises:
        FormatError: a ``llamacpp`` section that is not what ``solve`` writes (named).
    """
    from colibri_plan.errors import FormatError

    ok = isinstance(sec, dict) and sec.get("verdict") in ("use", "keep --fit") and isinstance(
        sec.get("chosen"), dict) and isinstance(sec["chosen"].get("args"), list) and all(
        isinstance(a, str) for a in sec["chosen"]["args"]) and isinstance(sec.get("why"), str)
    if not ok:
        raise FormatError(f"{where}: llamacpp must be the section `solve --target llama.cpp` writes (verdict "
                          "'use' or 'keep --fit', chosen.args a list of strings, why); re-solve the plan")
    args = sec["chosen"]["args"]
    res = {**out, "approximation": {k: out[k] for k in ("args", "patterns", "layers") if k in out},
           "choice": sec, "verdict": sec["verdict"]}
    if sec["verdict"] == "keep --fit":
        res.update(args="", patterns=[], notes=[f"keep --fit: {sec['why']}",
                                                "run llama.cpp with its defaults (no -ngl/-ot): --fit places "
                                                "the layers in the memory it finds free"])
        return res
    ots = [args[i + 1] for i, a in enumerate(args) if a == "-ot"]
    text = " ".join(f'"{a}"' if ("\\" in a or "|" in a) else a for a in args)
    ngl = int(args[args.index("-ngl") + 1]) if "-ngl" in args else None
    res.update(args=text, patterns=ots, ngl=ngl,
               notes=[f"chosen among the placements llama.cpp can express by its predicted speed "
                      f"({sec.get('calibrated_on', 'uncalibrated')}): {sec['why']}", *out.get("notes", [])])
    return res
