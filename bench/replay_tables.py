"""Markdown tables of bench/replay_llamacpp.py's result files, every figure tagged with its file and key
(tests/_doc_figures.py's convention), as docs/replay.md quotes them.

    .venv/bin/python bench/replay_tables.py bench/results/replay-q8_0-4gb.json

A ``placements`` file gives one row per placement (decode and prefill tok/s, median and range over the
interleaved rounds; llama.cpp's model buffers from its load log; the cgroup's peak, anonymous memory and
page cache of the first round); a ``beyond-ram`` file one row per engine, with the prediction beside the
measurement and our token check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MiB = 1024 * 1024


def _tag(file: str, *exprs: str) -> str:
    return f"<!-- fig {file}: {'; '.join(exprs)} -->"


def _rate(file: str, key: str, st: dict | None, digits: int = 1) -> str:
    """``median (min–max)`` of a tok/s statistic, tagged."""
    if not st:
        return "failed"
    return (f"{st['median']:,.{digits}f} ({st['min']:,.{digits}f}–{st['max']:,.{digits}f})"
            + _tag(file, f"{key}.median", f"range {key}.runs.*"))


def _peak(file: str, key: str, run: dict) -> str:
    """The cgroup's peak and its anonymous / page-cache parts (MiB), tagged."""
    c = run["cgroup"]
    return (f"{c['max_usage_bytes'] / MiB:,.0f} ({c['peak'].get('rss', 0) / MiB:,.0f} / "
            f"{c['peak'].get('cache', 0) / MiB:,.0f})"
            + _tag(file, f"{key}.cgroup.max_usage_bytes / {MiB}", f"{key}.cgroup.peak.rss / {MiB}",
                   f"{key}.cgroup.peak.cache / {MiB}"))


def placements_table(doc: dict, file: str) -> str:
    lines = ["| placement | decode tok/s | prefill tok/s | llama.cpp model buffers, MiB | "
             "cgroup peak MiB (anon / cache) |", "|---|---|---|---|---|"]
    for p in doc["placements"]:
        key = f"placements[name={p['name']}]"
        bufs = [b for b in p["completion"]["buffers"] if b["kind"] == "model"]
        buf = " + ".join(f"{b['buffer_type']} {b['mib']:,.0f}" + _tag(
            file, f"{key}.completion.buffers[buffer_type={b['buffer_type']},kind=model].mib") for b in bufs)
        peak = _peak(file, f"{key}.runs.0", p["runs"][0]) if p["runs"] else "-"
        lines.append(f"| {p['name']} | {_rate(file, key + '.decode_tok_s', p['decode_tok_s'])} | "
                     f"{_rate(file, key + '.prefill_tok_s', p['prefill_tok_s'])} | {buf or '-'} | {peak} |")
    return "\n".join(lines)


def beyond_table(doc: dict, file: str) -> str:
    lines = ["| row | decode tok/s | predicted tok/s | measured / predicted | prefill tok/s | "
             "cgroup peak MiB (anon / cache) | token-exact |", "|---|---|---|---|---|---|---|"]
    for name, r in doc["rows"].items():
        key = f'rows."{name}"'
        pred = (f"{r['predicted_tok_s']:.2f}" + _tag(file, f"{key}.predicted_tok_s")
                if r.get("predicted_tok_s") else "-")
        ratio = (f"{r['measured_over_predicted']:.2f}" + _tag(file, f"{key}.measured_over_predicted")
                 if r.get("measured_over_predicted") else "-")
        peak = _peak(file, f"{key}.runs.0", r["runs"][0]) if r["runs"] else "-"
        if r["runs"] and not r["runs"][0]["ok"]:
            peak += f", killed (oom_kill {r['runs'][0]['cgroup']['oom_kills']})"
        exact = r.get("token_exact")
        lines.append(f"| {name} | {_rate(file, key + '.decode_tok_s', r.get('decode_tok_s'), 2)} | {pred} | "
                     f"{ratio} | {_rate(file, key + '.prefill_tok_s', r.get('prefill_tok_s'))} | {peak} | "
                     f"{'-' if exact is None else 'yes' if exact else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    for path in argv:
        doc = json.loads(Path(path).read_text())
        file = Path(path).name
        print(placements_table(doc, file) if doc["mode"] == "placements" else beyond_table(doc, file))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
