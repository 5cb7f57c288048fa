"""Where a CPU decode token goes: the ``cpu`` backend's numba kernels against everything else (Python in
the engine and the backend, numpy's small ops, the router's BLAS call), per token, and tok/s.

For each pack it builds ``Model(pack, backend_name="cpu")`` (every expert in RAM, the host trunk), then
in ``--rounds`` rounds prefills a 4-token prompt and decodes ``--tokens`` tokens twice: once plain (the
tok/s figure) and once with every numba kernel of the backend wrapped by a timer (the kernel namespace
is wrapped before the model uploads its weights, so the kernels chosen at upload are the wrapped ones).
"kernel" = wall time inside those calls (numba's dispatch, its thread pool and the compiled code);
"other" = the decode wall time minus that: the host overhead of issue 14's item 4. Per layer, the
trunk's attention, MoE block and dense FFN are timed too ("sections": wall, kernel inside, python =
the difference; "rest" = the wall outside them). The wrappers add
~0.3 µs a call (~100 calls a token); the plain runs show what they cost. Medians over rounds.

``--roots NAME=DIR ...`` runs each round once per source tree (a ``git worktree`` of this repository,
e.g. before/after a change), interleaved in fresh worker processes, the package imported from DIR
(through the editable install's path mapping); without it the installed tree runs alone. The machine
may be shared: the load average before and after is recorded.

    .venv/bin/python bench/cpu_decode_overhead.py PACK [PACK ...] [--tokens 32] [--rounds 5]
        [--roots before=/tmp/before after=.] [--out bench/results/cpu-decode-overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

PROMPT = [1, 5, 9, 22]


def _use_root(root: str) -> None:
    """Import ``colibri_plan`` from the source tree ``root`` instead of the installed one (the editable
    install's mapping of package names to folders, rewritten before the first import)."""
    import importlib

    here = str(Path(__file__).resolve().parents[1])
    root = str(Path(root).resolve())
    if root == here:
        return
    finders = [m for m in sys.modules if m.startswith("__editable__") and m.endswith("_finder")]
    if not finders:
        raise SystemExit("--roots needs the editable install (pip install -e .)")
    f = importlib.import_module(finders[0])
    for k, v in list(f.MAPPING.items()):
        f.MAPPING[k] = v.replace(here, root)
    for k, v in list(f.NAMESPACES.items()):
        f.NAMESPACES[k] = [p.replace(here, root) for p in v]


def worker(pack: str, tokens: int, root: str | None) -> dict:
    """One process: plain and instrumented decodes of ``pack`` (a JSON-ready dict)."""
    if root:
        _use_root(root)
    import numpy as np
    from numba.core.registry import CPUDispatcher

    from colibri_plan.backends.cpu import backend as cpu_backend

    k = cpu_backend._load_kernels()
    acc: dict[str, float] = defaultdict(float)
    cnt: dict[str, int] = defaultdict(int)
    on = [False]
    pc = time.perf_counter

    total = [0.0]  # kernel seconds so far (all names): the sections below read it before and after

    def wrap(name, f):
        def timed(*a):
            if not on[0]:
                return f(*a)
            t0 = pc()
            r = f(*a)
            dt = pc() - t0
            acc[name] += dt
            total[0] += dt
            cnt[name] += 1
            return r
        return timed

    for name, v in list(vars(k).items()):
        if isinstance(v, CPUDispatcher):
            setattr(k, name, wrap(name, v))
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.trunk import Trunk

    seg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # "attn.3" -> [wall s, kernel s]

    def section(kind, f):
        def timed(self, x, key, *a):
            if not on[0]:
                return f(self, x, key, *a)
            k0, t0 = total[0], pc()
            r = f(self, x, key, *a)
            s = seg[f"{kind}.{key}"]
            s[0] += pc() - t0
            s[1] += total[0] - k0
            return r
        return timed

    # per layer: attention, the MoE block (router, routed + shared experts), a dense FFN (by its prefix)
    for attr, kind in (("_gqa", "attn"), ("_mla_attn", "attn"), ("_moe", "moe")):
        setattr(Trunk, attr, section(kind, getattr(Trunk, attr)))
    Trunk._swiglu = section("ffn", Trunk._swiglu)

    m = Model(open_pack(pack), backend_name="cpu")

    def decode(timed: bool) -> tuple[float, list[int]]:
        cache = m.new_cache(256)
        tok = int(np.argmax(m._last_logits(PROMPT, cache)))
        out = []
        acc.clear()
        cnt.clear()
        seg.clear()
        on[0] = timed
        t0 = pc()
        for _ in range(tokens):
            tok = int(np.argmax(m._last_logits([tok], cache)))
            out.append(tok)
        wall = pc() - t0
        on[0] = False
        return wall / tokens, out

    decode(False)  # warm-up: kernels loaded, caches, thread pool
    plain_s, toks = decode(False)
    timed_s, toks2 = decode(True)
    kernel_s = sum(acc.values()) / tokens
    m.close()
    sections = {k: {"wall_s_per_token": v[0] / tokens, "kernel_s_per_token": v[1] / tokens}
                for k, v in seg.items() if not k.startswith("ffn.layers.") or ".shared." not in k}
    return {"sections": sections, "plain_s_per_token": plain_s, "timed_s_per_token": timed_s,
            "kernel_s_per_token": kernel_s,
            "other_s_per_token": timed_s - kernel_s, "tokens": toks, "tokens_same": toks == toks2,
            "kernels": {n: {"s_per_token": acc[n] / tokens, "calls_per_token": cnt[n] / tokens}
                        for n in sorted(acc, key=acc.get, reverse=True)}}


def _run(pack: str, tokens: int, root: str | None) -> dict:
    argv = [sys.executable, __file__, "--worker", pack, "--tokens", str(tokens)]
    if root:
        argv += ["--root", root]
    r = subprocess.run(argv, capture_output=True, text=True, check=False)
    if r.returncode:
        raise SystemExit(f"worker failed ({r.returncode}): {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _med(xs):
    return statistics.median(xs) if xs else 0.0


def summarize(runs: list[dict]) -> dict:
    """Medians over rounds: tok/s (plain), ms/token of the instrumented run, kernel and other, share."""
    plain = [r["plain_s_per_token"] for r in runs]
    timed = [r["timed_s_per_token"] for r in runs]
    kern = [r["kernel_s_per_token"] for r in runs]
    other = [r["other_s_per_token"] for r in runs]
    names = sorted({n for r in runs for n in r["kernels"]})
    return {"tok_s": 1.0 / _med(plain), "tok_s_min_max": [1.0 / max(plain), 1.0 / min(plain)],
            "plain_ms": 1e3 * _med(plain), "timed_ms": 1e3 * _med(timed), "kernel_ms": 1e3 * _med(kern),
            "other_ms": 1e3 * _med(other), "other_ms_min_max": [1e3 * min(other), 1e3 * max(other)],
            "other_share": _med([o / t for o, t in zip(other, timed)]),
            "kernels": {n: {"ms_per_token": 1e3 * _med([r["kernels"].get(n, {}).get("s_per_token", 0.0)
                                                        for r in runs]),
                            "calls_per_token": runs[-1]["kernels"].get(n, {}).get("calls_per_token", 0.0)}
                        for n in names},
            "sections": _sections(runs),
            "tokens": runs[0]["tokens"][:8], "tokens_same_all": all(r["tokens"] == runs[0]["tokens"]
                                                                     and r["tokens_same"] for r in runs)}


def _sections(runs: list[dict]) -> dict:
    """Per layer section ("attn.3", "moe.3", "ffn.layers.0.ffn."), medians over rounds of ms a token:
    wall, kernel (inside the numba kernels) and python (wall - kernel: the engine's and the backend's
    host code, numpy's small ops, the router's BLAS call); "rest" = the token's wall outside every
    section (embedding, norms and residual adds, the LM head, the loop)."""
    names = sorted({n for r in runs for n in r.get("sections", {})},
                   key=lambda n: (n.split(".")[0], int(n.split(".")[1]) if n.split(".")[1].isdigit() else 0))
    if not names:
        return {}
    out = {}
    for n in names:
        w = [r["sections"].get(n, {}).get("wall_s_per_token", 0.0) for r in runs]
        k = [r["sections"].get(n, {}).get("kernel_s_per_token", 0.0) for r in runs]
        out[n] = {"wall_ms": 1e3 * _med(w), "kernel_ms": 1e3 * _med(k),
                  "python_ms": 1e3 * _med([a - b for a, b in zip(w, k)])}
    rest_w = [r["timed_s_per_token"] - sum(v["wall_s_per_token"] for v in r["sections"].values())
              for r in runs]
    rest_k = [r["kernel_s_per_token"] - sum(v["kernel_s_per_token"] for v in r["sections"].values())
              for r in runs]
    out["rest"] = {"wall_ms": 1e3 * _med(rest_w), "kernel_ms": 1e3 * _med(rest_k),
                   "python_ms": 1e3 * _med([a - b for a, b in zip(rest_w, rest_k)])}
    return out


def report(res: dict) -> None:
    print(f"{'pack':28} {'tree':8} {'tok/s':>7} {'ms/tok':>7} {'kernel':>7} {'other':>7} {'other %':>8}  "
          f"other ms min..max")
    for pack, trees in res["packs"].items():
        for tree, s in trees.items():
            print(f"{Path(pack).name[:28]:28} {tree:8} {s['tok_s']:7.1f} {s['timed_ms']:7.2f} "
                  f"{s['kernel_ms']:7.2f} {s['other_ms']:7.2f} {100 * s['other_share']:7.1f}%  "
                  f"{s['other_ms_min_max'][0]:.2f}..{s['other_ms_min_max'][1]:.2f}")
        for tree, s in trees.items():
            sec = s.get("sections", {})
            if sec:
                print(f"  {tree} per section, ms a token (python / kernel): " + ", ".join(
                    f"{n} {v['python_ms']:.2f}/{v['kernel_ms']:.2f}" for n, v in sec.items()))
        for tree, s in trees.items():
            ks = ", ".join(f"{n} {v['ms_per_token']:.2f} ms ({v['calls_per_token']:.0f})"
                           for n, v in sorted(s["kernels"].items(), key=lambda kv: -kv[1]["ms_per_token"]))
            print(f"  {tree} kernels/token: {ks}")


def _at_least_1(text: str) -> int:
    """--tokens / --rounds: a whole number >= 1 (0 would leave no timings to take the median of)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packs", nargs="+")
    ap.add_argument("--tokens", type=_at_least_1, default=32)
    ap.add_argument("--rounds", type=_at_least_1, default=5)
    ap.add_argument("--roots", nargs="*", default=[], help="NAME=DIR source trees, interleaved")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a.packs[0], a.tokens, a.root)))
        return 0
    missing = [x for x in a.packs if not (Path(x) / "pack.json").exists()]
    if missing:
        ap.error(f"not a pack (no pack.json): {' '.join(missing)}; make one with "
                 "`colibri-plan model fixture`")
    bad = [r for r in a.roots
           if "=" not in r or not r.split("=", 1)[0] or not Path(r.split("=", 1)[1]).is_dir()]
    if bad:
        ap.error(f"--roots takes NAME=DIR with DIR a source tree (a folder), got {' '.join(bad)}")
    roots = dict(r.split("=", 1) for r in a.roots) or {"tree": None}
    load0 = os.getloadavg()
    runs: dict = {p: {n: [] for n in roots} for p in a.packs}
    for _ in range(a.rounds):
        for p in a.packs:
            for name, root in roots.items():
                runs[p][name].append(_run(p, a.tokens, root))
    res = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
           "load_before": load0, "load_after": os.getloadavg(), "tokens": a.tokens, "rounds": a.rounds,
           "roots": {n: r for n, r in roots.items()},
           "packs": {p: {n: summarize(rs) for n, rs in trees.items()} for p, trees in runs.items()},
           "runs": runs}
    report(res)
    if a.out:
        from colibri_plan.fileio import atomic_write_text

        atomic_write_text(a.out, json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
