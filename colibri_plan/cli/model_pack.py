"""`colibri-plan model pack | verify | fixture`: expert packs (registered on the `model` group)."""

from __future__ import annotations

import time

import click

from colibri_plan.cli.common import Steps, collect_arg, emit, get_ctx, json_option, progress
from colibri_plan.errors import IntegrityError
from colibri_plan.quant import FORMATS

#: formats `model pack --dense-quant` accepts (colibri_plan.engine.dense_quant.DENSE_FORMATS)
DENSE_FORMATS = ("f32", "f16", "bf16", "int8", "int4", "int4-g32", "int4-g64", "int4-g128")

#: a count or size option of `model fixture`: a whole number >= 1 (else a usage error)
_POS = click.IntRange(1, None)

#: expert formats `model pack` and `model fixture` accept (f16 packs work too but are not advertised)
PACK_FORMATS = ("f32", "bf16", "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int2")
#: the FixtureConfig fields `model fixture` sets (colibri_plan.engine.fixture; a flag left out keeps the
#: field's default, or FixtureConfig.small's with --small)
FIXTURE_FIELDS = ("layers", "experts", "top_k", "hidden", "width", "vocab", "quant", "seed", "domain")


def _checkpoint_spec(checkpoint, weights, fmt):
    """The foundation's ModelSpec of the checkpoint when it can be built, else one from the arch."""
    from pathlib import Path

    from colibri_plan.errors import ColibriError
    from colibri_plan.formats.pack_index import spec_from_arch

    try:
        from colibri_plan.model import load_model_spec

        return load_model_spec(str(checkpoint)).with_format(fmt)
    except (ColibriError, ImportError) as exc:
        progress(f"note: model spec derived from the architecture ({exc})", verbose_only=True)
        n_dense = sum(int(v.size) for v in weights.dense.values())
        return spec_from_arch(weights.arch, fmt, n_dense, Path(checkpoint).name, f"checkpoint: {checkpoint}")


@click.command("pack")
@click.argument("checkpoint", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path())
@click.option("--quant", "fmt", type=click.Choice(FORMATS), default="int4", show_default=True,
              help="Quant format of the routed experts.")
@click.option("--dense-quant", "dense_fmt", type=click.Choice(DENSE_FORMATS), default=None,
              help="Format of the dense trunk's matrices [int8 for bf16/fp16/fp8 checkpoints, f32 for f32].")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (atomically).")
@json_option
def pack(checkpoint, out, fmt, dense_fmt, force):
    """Convert a Hugging Face checkpoint folder into an expert pack OUT (atomic; see docs/pack-format.md)."""
    from colibri_plan.engine.pack import check_pack_output, write_pack
    from colibri_plan.engine.weights import load_checkpoint
    from colibri_plan.formats.pack_index import pack_summary

    check_pack_output(out, force, inputs=(checkpoint,))  # before loading: never into/over the checkpoint
    t0 = time.perf_counter()
    weights = load_checkpoint(checkpoint, expert_format="f32")
    spec = _checkpoint_spec(checkpoint, weights, fmt)
    if dense_fmt is None:  # f32 checkpoints stay token-exact; narrower ones get an int8 trunk
        dtypes = {m[0] for m in weights._t.meta.values()}
        dense_fmt = "f32" if dtypes <= {"F32", "F64"} else "int8"
    with Steps("packed experts") as bar:
        path = write_pack(weights, out, fmt, overwrite=force, spec=spec, progress=bar.count,
                          dense_format=dense_fmt)
    doc = pack_summary(path)
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    doc.pop("arch")
    doc["dense_format"] = dense_fmt
    from colibri_plan.engine.pack_text import pack_text_line

    doc["text"] = pack_text_line(path, checkpoint)
    emit(doc, lambda: (f"wrote {path}: {doc['experts']} experts in {fmt}, dense trunk {dense_fmt}, "
                       f"{doc['expert_block_bytes']:,} B per expert block, "
                       f"{doc['experts_file_bytes'] / 1e9:.3f} GB experts.bin, "
                       f"fingerprint {doc['fingerprint']} ({doc['seconds']:.1f} s)\n{doc['text']}"))


@click.command("verify")
@click.argument("pack_dir", metavar="PACK", type=click.Path())
@json_option
def verify(pack_dir):
    """Re-check every expert checksum, the index against experts.bin and the dense tensors' checksum."""
    from colibri_plan.formats.pack_verify import verify_pack

    t0 = time.perf_counter()
    with Steps("checked experts") as bar:
        report = verify_pack(pack_dir, progress=bar.count)
    report["seconds"] = round(time.perf_counter() - t0, 3)
    if get_ctx().json:
        emit(report)
    elif report["ok"]:
        emit(report, f"OK: {pack_dir}: {report['experts']} experts ({report['expert_format']}), "
                     f"{report['experts_bytes']:,} B, every checksum matches ({report['seconds']:.1f} s)")
    if not report["ok"]:
        shown = 10  # a truncated file can put every expert out of bounds: the first few say enough
        for p in report["problems"][:shown]:
            click.echo(f"  {p}", err=True)
        if len(report["problems"]) > shown:
            click.echo(f"  ... {len(report['problems']) - shown} more (--json lists them all)", err=True)
        raise IntegrityError(f"pack {pack_dir} failed verification: {len(report['problems'])} problem(s); "
                             f"first: {report['problems'][0]}")


@click.command("fixture")
@click.argument("out", type=click.Path())
@click.option("--layers", type=_POS, default=None, help="MoE layers [3].")
@click.option("--experts", type=_POS, default=None, help="Routed experts per layer [64].")
@click.option("--top-k", type=_POS, default=None, help="Experts per token [8].")
@click.option("--hidden", type=_POS, default=None, help="Hidden size H [6144; 256 with --small].")
@click.option("--width", type=_POS, default=None, help="Expert width I [2048; 128 with --small].")
@click.option("--vocab", type=_POS, default=None, help="Vocabulary [4096; 512 with --small].")
@click.option("--quant", type=click.Choice(PACK_FORMATS), default=None, help="Expert format [int4].")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=None, help="Seed [0].")
@click.option("--domain", default=None, help="OLMoE text domain whose routing skew is copied [tulu].")
@click.option("--small", is_flag=True, help="Small geometry for tests (hidden 256, width 128, vocab 512).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@json_option
@collect_arg(FIXTURE_FIELDS, "given", dict)
def fixture(out, given, small, force):
    """Write a deterministic synthetic MoE model in the pack format (GLM-5.2 expert geometry by default:
    hidden 6144, width 2048, int4, 64 experts x 3 layers, about 3.6 GB)."""
    from colibri_plan.engine.fixture import FixtureConfig, build_fixture
    from colibri_plan.engine.pack import check_pack_output

    cfg = FixtureConfig.small(**given) if small else FixtureConfig(**given)   # left out: its default
    if cfg.top_k > cfg.experts:  # checked before the progress line and the output folder
        raise click.BadParameter(f"{cfg.top_k} is more than the {cfg.experts} experts per layer",
                                 param_hint="--top-k")
    est = cfg.layers * cfg.experts
    check_pack_output(out, force)  # before minutes of generating
    progress(f"fixture: {est} experts of H {cfg.hidden} x I {cfg.width} in {cfg.quant} -> {out}")
    with Steps("generated experts", total=est) as bar:
        doc = build_fixture(out, cfg, overwrite=force, progress=bar.count)
    doc["seconds"] = round(doc["seconds"], 3)
    emit(doc, lambda: (f"wrote {doc['path']}: {doc['experts']} experts, "
                       f"{doc['expert_block_bytes']:,} B each, {doc['experts_file_bytes'] / 1e9:.2f} GB "
                       f"in {doc['seconds']:.1f} s; target top-8 share per layer "
                       + ", ".join(f"{s:.0%}" for s in doc["target_top8_share"])))
