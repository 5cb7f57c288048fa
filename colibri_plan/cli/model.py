"""`colibri-plan model`: model specs (and, added at the end of this file, packs and fixtures)."""

from __future__ import annotations

import click

from colibri_plan.cli.common import emit, json_option, table

#: formats shown by `model show`, in order (every colibri_plan.quant format)
SHOW_FORMATS = ("bf16", "f16", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g32h", "int2")


def _scaled(n: float, unit: str) -> str:
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:,.2f} {prefix}{unit}"
    return f"{n:,.0f} {unit}"


def _gb(n: int) -> str:
    """Bytes, decimal prefixes (GB = 1e9 B, colibrì's convention)."""
    return _scaled(n, "B")


_mb = _gb


def _params(n: int) -> str:
    """Parameter counts: 19.42 B (billions), 9.22 k."""
    for div, prefix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:,.2f} {prefix}"
    return f"{n:,}"


def _ranges(ids) -> str:
    """[3, 4, 5, 9] -> "3..5, 9" """
    ids = list(ids)
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}..{x}")
            start = None
    return ", ".join(out)


def spec_report(spec) -> dict:
    """The `model show --json` document: the spec's fields, then derived figures per quant format.

    The spec fields sit at the top level, so the document is itself a valid spec file for
    ``load_model_spec``.
    """
    fmts = list(dict.fromkeys((*SHOW_FORMATS, spec.expert_format)))
    doc = spec.to_dict()
    doc.update({
        "fingerprint": spec.fingerprint(),
        "n_moe_layers": spec.n_moe_layers,
        "mtp_layers": list(spec.mtp_layers),
        "n_routed_experts": spec.n_routed_experts,
        "expert_params": spec.expert_params,
        "routed_params": spec.routed_params,
        "total_params": spec.total_params,
        "expert_bytes": spec.expert_bytes(),
        "routed_bytes": spec.routed_bytes(),
        "cold_bytes_per_token": spec.cold_bytes_per_token(),
        "dense_bytes_bf16": spec.dense_bytes("bf16"),
        "dense_bytes_format": spec.dense_format or "bf16",
        "dense_bytes": spec.dense_bytes(spec.dense_format or "bf16"),
        "by_format": {f: {"expert_bytes": spec.expert_bytes(f), "routed_bytes": spec.routed_bytes(f),
                          "cold_bytes_per_token": spec.cold_bytes_per_token(f),
                          "dense_bytes": spec.dense_bytes(f)} for f in fmts},
    })
    return doc


def _dense_line(spec, dense_file_bytes: int | None = None) -> str:
    """The "dense trunk" line: at the stored format when the model records it (a pack), else at bf16."""
    if spec.dense_format is None:
        return f"  dense trunk      {_gb(spec.dense_bytes('bf16'))} at bf16"
    line = f"  dense trunk      {_gb(spec.dense_bytes(spec.dense_format))} at {spec.dense_format} (as stored"
    if dense_file_bytes is not None:
        line += f"; file {dense_file_bytes:,} B"
    return line + ")"


def _pack_dense_file_bytes(name_or_path: str) -> int | None:
    """Bytes of a pack's dense file (None when ``name_or_path`` is not a pack or the file is absent)."""
    from pathlib import Path

    from colibri_plan.formats.pack_index import DENSE_NAME

    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "pack.json").is_file() and (p / DENSE_NAME).is_file():
        return (p / DENSE_NAME).stat().st_size
    return None


def _human(spec, dense_file_bytes: int | None = None) -> str:
    mtp = f" + {len(spec.mtp_layers)} MTP row(s) (id {_ranges(spec.mtp_layers)})" if spec.mtp_layers else ""
    shared = (f"{spec.n_shared_experts} (total width {spec.shared_intermediate_size})"
              if spec.n_shared_experts else "none")
    lines = [
        f"{spec.name}  ({spec.family}, fingerprint {spec.fingerprint()})",
        f"  source           {spec.source}",
        f"  layers           {spec.n_layers}; MoE rows {spec.n_moe_layers}: "
        f"{_ranges(spec.decode_moe_layers)}{mtp}",
        f"  routed experts   {spec.n_experts} per row, top-{spec.top_k}, {spec.n_routed_experts:,} in all",
        f"  shared experts   {shared}",
        f"  hidden / expert  H {spec.hidden_size}, I {spec.moe_intermediate_size}"
        + (" (+ biases)" if spec.expert_bias else ""),
        f"  vocab            {spec.vocab_size:,}",
        f"  parameters       {_params(spec.total_params)} (dense {_params(spec.dense_params)}, "
        f"routed {_params(spec.routed_params)})",
        _dense_line(spec, dense_file_bytes),
        f"  KV cache         {spec.kv_bytes_per_token:,} B per context token",
        f"  expert format    {spec.expert_format}: {spec.expert_bytes():,} B per expert, "
        f"{_gb(spec.cold_bytes_per_token())} cold per token",
        "",
    ]
    fmts = list(dict.fromkeys((*SHOW_FORMATS, spec.expert_format)))
    rows = [[("* " if f == spec.expert_format else "  ") + f, f"{spec.expert_bytes(f):,}",
             _mb(spec.expert_bytes(f)), _gb(spec.routed_bytes(f)), _gb(spec.cold_bytes_per_token(f))]
            for f in fmts]
    lines.append(table(rows, ["format", "B/expert", "per expert", "all routed", "cold/token"]))
    return "\n".join(lines)


@click.group("model")
def model():
    """Model specs, packs and fixtures."""


@model.command("show")
@click.argument("name_or_path")
@click.option("--quant", "quant", default=None, metavar="FMT",
              help="Expert quant format (int4, int4-g64, int8, ...); default: the model's.")
@json_option
def show(name_or_path, quant):
    """Show a model's geometry and sizes: a catalogue NAME (see `model list`), a Hugging Face
    checkpoint folder, a .gguf file or a spec JSON file."""
    from colibri_plan.model import load_model_spec

    spec = load_model_spec(name_or_path, quant=quant)
    doc = spec_report(spec)
    dense_file = _pack_dense_file_bytes(name_or_path)
    if dense_file is not None:
        doc["dense_file_bytes"] = dense_file
    emit(doc, lambda: _human(spec, dense_file))


@model.command("list")
@json_option
def list_models():
    """List the built-in catalogue of real MoE models, and which the bundled engine can run (the others
    are plan-only: `solve` plans them, `colibri-plan model support` says why the engine cannot yet)."""
    from colibri_plan.errors import UnsupportedError
    from colibri_plan.families import ENGINE_FAMILIES
    from colibri_plan.model.catalogue import entries, spec_from_entry

    docs, rows = [], []
    for e in entries():
        try:
            s = spec_from_entry(e)
        except UnsupportedError:  # a partial entry: listed, not sized
            docs.append({"name": e["name"], "display": e.get("display"), "partial": True})
            rows.append([e["name"], "?", "", "", "partial", "", "", "plan only"])
            continue
        docs.append({"name": s.name, "display": e.get("display"), "aliases": e.get("aliases", []),
                     "n_routed_experts": s.n_routed_experts, "top_k": s.top_k,
                     "expert_bytes": s.expert_bytes(), "expert_format": s.expert_format,
                     "total_params": s.total_params, "engine_runs": s.family in ENGINE_FAMILIES})
        rows.append([s.name, s.n_moe_layers, s.n_experts, s.top_k, f"{s.n_routed_experts:,}",
                     _mb(s.expert_bytes()), _params(s.total_params),
                     "runs" if s.family in ENGINE_FAMILIES else "plan only"])
    emit({"models": docs}, lambda: "\n".join([
        table(rows, ["name", "MoE rows", "E", "k", "experts", "int4 expert", "params", "bundled engine"]), "",
        "runs: `solve` plans it and the bundled engine packs, runs and verifies it; plan only: `solve` plans "
        "it (for colibrì or llama.cpp too), the bundled engine cannot run it yet (`colibri-plan model "
        "support` says why)"]))


# Further sub-commands register below with model.add_command(...).

from colibri_plan.cli.model_pack import fixture as _fixture  # noqa: E402
from colibri_plan.cli.model_pack import pack as _pack  # noqa: E402
from colibri_plan.cli.model_pack import verify as _verify  # noqa: E402
from colibri_plan.cli.model_support import support as _support  # noqa: E402

model.add_command(_pack)
model.add_command(_verify)
model.add_command(_fixture)
model.add_command(_support)
