"""Helper of bench/h200_trunk.sh: make the trunk-heavy fixture, and summarise the two verify reports.

    python bench/h200_trunk.py fixture OUT_DIR [--layers 16 --experts 32 --width 768 --vocab 32000 --heads 32]
    python bench/h200_trunk.py summary CPU_REPORT GPU_REPORT

``fixture``: a synthetic pack (engine/fixture.py) whose dense trunk matters, at Qwen3-30B-A3B's widths:
hidden 2048, 32 heads of 128 with 4 kv heads (q 4096x2048, o 2048x4096, k/v 512x2048 per layer), expert
width 768, int8 dense matrices and int8 experts (the trunk is about 19 MB per layer + a 65 MB LM head).
``summary``: token-exact (both plans against the all-RAM CPU reference), measured tok/s of both, their
ratio (GPU trunk / CPU trunk), and predicted vs measured (uncalibrated) for tok/s, dense and attention.
"""

from __future__ import annotations

import argparse
import json
import sys


def make_fixture(args) -> None:
    from colibri_plan.engine.fixture import FixtureConfig, build_fixture

    cfg = FixtureConfig(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                        width=args.width, vocab=args.vocab, heads=args.heads, kv_heads=args.kv_heads,
                        head_dim=128,
                        quant="int8", dense_format="int8")
    s = build_fixture(args.out, cfg)
    print(f"fixture {s['path']}: {args.layers} layers, {s['experts']} int8 experts of "
          f"{s['expert_block_bytes']:,} B, int8 trunk, {s['seconds']:.0f} s")


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.2f} ms"


def _ratio(pred, meas) -> str:
    return "-" if not pred or meas is None else f"x{meas / pred:.2f}"


def summary(args) -> int:
    reps = {}
    for name, path in (("trunk cpu", args.cpu_report), ("trunk gpu", args.gpu_report)):
        with open(path) as f:
            reps[name] = json.load(f)
    lines = []
    for name, r in reps.items():
        m, p = r["measured"], r["predicted"]
        pt = p.get("trunk") or {}
        exact = {True: "yes", False: "NO", None: "not checked"}[r["verdict"]["token_exact"]]
        tok = 1.0 / m["decode_s_median"] if m.get("decode_s_median") else m["tok_s"]
        mt, ptm = m["terms"], p.get("terms", {})
        lines += [f"{name}: device {m.get('trunk_device')} (plan: {pt.get('device', 'no trunk section')}); "
                  f"token-exact {exact}",
                  f"  tok/s measured {m['tok_s']:.2f} (median step {tok:.2f}), predicted {p['tok_s']:.2f} "
                  f"({_ratio(p['tok_s'], m['tok_s'])})",
                  f"  dense     predicted {_ms(pt.get('dense_s_per_token', ptm.get('dense_s')))}, measured "
                  f"{_ms(mt.get('dense_s'))}",
                  f"  attention predicted {_ms(pt.get('attention_s_per_token', ptm.get('attention_s')))}, "
                  f"measured {_ms(mt.get('attention_s'))}",
                  f"  experts   predicted {_ms(ptm.get('expert_layers_s'))}, measured "
                  f"{_ms(mt.get('expert_layers_s'))}; host round trip predicted "
                  f"{_ms(pt.get('host_roundtrip_s_per_token'))}"]
    cpu, gpu = reps["trunk cpu"]["measured"]["tok_s"], reps["trunk gpu"]["measured"]["tok_s"]
    exact = all(r["verdict"]["token_exact"] is True for r in reps.values())
    lines += [f"token-exact (both): {'yes' if exact else 'NO'}",
              f"measured tok/s: trunk cpu {cpu:.2f}, trunk gpu {gpu:.2f}; ratio gpu/cpu "
              f"{gpu / cpu if cpu else float('nan'):.2f} (acceptance: >= 2)",
              f"gpu plan predicted/measured tok/s: {reps['trunk gpu']['predicted']['tok_s']:.2f} / {gpu:.2f} "
              f"(acceptance: within +-25% before calibration: "
              f"{'yes' if gpu and abs(gpu / reps['trunk gpu']['predicted']['tok_s'] - 1) <= 0.25 else 'no'})"]
    print("\n".join(lines))
    return 0 if exact else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fixture")
    f.add_argument("out")
    for name, default in (("layers", 16), ("experts", 32), ("top-k", 8), ("hidden", 2048), ("width", 768),
                          ("vocab", 32000), ("heads", 32), ("kv-heads", 4)):
        f.add_argument(f"--{name}", type=int, default=default)
    s = sub.add_parser("summary")
    s.add_argument("cpu_report")
    s.add_argument("gpu_report")
    args = ap.parse_args(argv)
    if args.cmd == "fixture":
        make_fixture(args)
        return 0
    return summary(args)


if __name__ == "__main__":
    sys.exit(main())
