"""`colibri-plan heat`: show, synthesise and convert routing statistics (expert heat)."""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np

from colibri_plan.cli.common import emit, json_option, table, warn
from colibri_plan.errors import InputError


@click.group("heat")
def heat():
    """Routing statistics (expert heat): engine JSON, colibrì usage/STATS text, real OLMoE/Mixtral counts."""


def _summary(h, spec=None) -> dict:
    """Per-layer skew from the counts; selection probabilities only when tokens or top-k are known."""
    k = h.top_k or (spec.top_k if spec else None)
    p = h.probabilities(k) if (h.tokens or k) else None
    rows = []
    for i, layer in enumerate(h.layers):
        c = np.sort(h.counts[i])[::-1]
        tot = c.sum() or 1.0
        rows.append({"layer": layer, "selections": float(c.sum()),
                     "top_k_share": float(c[:k].sum() / tot) if k else None,
                     "top_10pct_share": float(c[: max(1, len(c) // 10)].sum() / tot),
                     "hottest_p": float(p[i].max()) if p is not None else None,
                     "coldest_p": float(p[i].min()) if p is not None else None})
    return {"source": h.source, "n_experts": h.n_experts, "rows": len(h.layers), "top_k": k,
            "tokens": h.tokens, "total_selections": h.total(), "fingerprint": h.fingerprint(),
            "model_fingerprint": h.model_fingerprint, "layers": rows, "warnings": list(h.warnings)}


def _fmt(v, pattern):
    return "-" if v is None else pattern.format(v)


@heat.command("show")
@click.argument("path")
@click.option("--model", "model_name", default=None,
              help="Check the heat against this model (and use its top-k).")
@json_option
def show(path, model_name):
    """Summarise a heat file: rows, experts, skew per layer (share of the hottest top-k and 10%)."""
    from colibri_plan.formats.heat import load_heat
    from colibri_plan.formats.heat_align import align_heat

    h = load_heat(path)
    spec = None
    if model_name:
        from colibri_plan.model import load_model_spec

        spec = load_model_spec(model_name)
        h = align_heat(h, spec)
    data = _summary(h, spec)
    for w in data["warnings"]:
        warn(w)

    def human():
        head = (f"{data['source']}\n{data['rows']} rows x {data['n_experts']} experts, "
                f"top-k {data['top_k']}, "
                f"tokens {data['tokens']}, {data['total_selections']:.0f} selections, fingerprint "
                f"{data['fingerprint']}")
        rows = [[r["layer"], f"{r['selections']:.0f}", _fmt(r["top_k_share"], "{:.1%}"),
                 f"{r['top_10pct_share'] * 100:.1f}%", _fmt(r["hottest_p"], "{:.4f}"),
                 _fmt(r["coldest_p"], "{:.5f}")] for r in data["layers"]]
        header = ["layer", "selections", "top-k share", "top-10% share", "max p", "min p"]
        return head + "\n" + table(rows, header)

    emit(data, human)


@heat.command("synth")
@click.argument("model_name")
@click.option("--out", "out_path", required=True, help="Heat file to write.")
@click.option("--format", "fmt", type=click.Choice(["json", "usage"]), default="json", show_default=True)
@click.option("--domain", default=None, help="Text domain of the real counts (default: a seeded mix).")
@click.option("--source-model", type=click.Choice(["olmoe", "mixtral"]), default="olmoe", show_default=True)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**32 - 1))
@click.option("--uniform", is_flag=True, help="Write uniform heat instead (a fallback that says so).")
@json_option
def synth(model_name, out_path, fmt, domain, source_model, seed, uniform):
    """Synthesise whole-model heat for MODEL from real OLMoE/Mixtral per-layer routing (docs/heat.md)."""
    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.heat import save_heat, write_usage_text
    from colibri_plan.formats.heat_align import uniform_heat
    from colibri_plan.heatsynth import synth_heat
    from colibri_plan.model import load_model_spec

    check_output_path(out_path, [model_name] if Path(model_name).exists() else [])
    spec = load_model_spec(model_name)
    if uniform:
        h, msg = uniform_heat(spec)
        warn(msg)
    else:
        h = synth_heat(spec, domain=domain, seed=seed, source_model=source_model)
    (write_usage_text if fmt == "usage" else save_heat)(h, out_path)
    data = {"written": out_path, "format": fmt, **_summary(h, spec)}
    emit(data, lambda: f"wrote {out_path} ({fmt}): {data['rows']} rows x {data['n_experts']} experts, "
                       f"{h.source}")


@heat.command("convert")
@click.argument("src")
@click.argument("dst")
@click.option("--to", "fmt", type=click.Choice(["json", "usage"]), required=True)
@click.option("--model", "model_name", default=None, help="Align to this model (fills top-k, fingerprint).")
@json_option
def convert(src, dst, fmt, model_name):
    """Convert a heat file between the JSON heat document and colibrì's usage/STATS text."""
    from colibri_plan.fileio import check_output_path
    from colibri_plan.formats.heat import load_heat, save_heat, write_usage_text
    from colibri_plan.formats.heat_align import align_heat

    check_output_path(dst, [p for p in (src, model_name) if p and Path(p).exists()])
    h = load_heat(src)
    if not np.any(h.counts > 0):  # an empty usage file could not be read back (no header, no rows)
        raise InputError(f"{src}: heat is empty: no selections recorded; nothing to convert")
    if model_name:
        from colibri_plan.model import load_model_spec

        spec = load_model_spec(model_name)
        h = align_heat(h, spec)
    (write_usage_text if fmt == "usage" else save_heat)(h, dst)
    emit({"written": dst, "format": fmt, "rows": len(h.layers), "n_experts": h.n_experts},
         f"wrote {dst} ({fmt}): {len(h.layers)} rows x {h.n_experts} experts")
