"""`colibri-plan profile`: measure this machine and write a profile file."""

from __future__ import annotations

import re

import click

from colibri_plan.cli.common import Steps, emit, json_option, options_arg, progress, warn
from colibri_plan.cli.profiles import render  # noqa: F401 - the profile tables (re-exported)
from colibri_plan.errors import InputError
from colibri_plan.profiler.options import DEFAULTS as D
from colibri_plan.profiler.options import PROBES, ProfileOptions

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30}


def parse_bytes(text: str | None) -> int | None:
    """'64MiB', '1GiB', '1048576' -> bytes (None stays None).

    Raises:
        InputError: not a size.
    """
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"{text!r} is not a size; write e.g. 1048576, 64MiB or 1GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    from colibri_plan.formats.fields import whole_text

    vals = [whole_text(v) for v in text.split(",") if v.strip()]
    if None in vals:   # int() would take "1_0" and Unicode digits
        raise InputError(f"{text!r} is not a comma-separated list of integers (digits 0-9)")
    if not vals or min(vals) < 1:
        raise InputError(f"{text!r}: give positive integers, e.g. 1,4,8")
    return vals


def _names(values) -> list[str] | None:
    out = [v.strip() for item in values or () for v in item.split(",") if v.strip()]
    return out or None


def _listed(value: str | None, hint: str) -> list[str] | None:
    """A comma-separated option: None when not given; given, it must name something (a usage error,
    exit 2, rather than a crash or a silent default, for ``--formats ,``)."""
    if value is None:
        return None
    out = _names([value])
    if out is None:
        raise click.BadParameter(f"names nothing ({value!r}); give a comma-separated list, or leave the "
                                 "option out for the default", param_hint=hint)
    return out


def _shapes(text: str | None) -> list[tuple[int, int]] | None:
    """'4096x4096,1024x4096' -> [(4096, 4096), (1024, 4096)] ([out, in] GEMV shapes)."""
    if text is None:
        return None
    out = []
    for item in (v.strip() for v in text.split(",") if v.strip()):
        m = re.fullmatch(r"([0-9]+)\s*[xX]\s*([0-9]+)", item)
        if not m or min(int(m.group(1)), int(m.group(2))) < 1:
            raise InputError(f"{item!r} is not a GEMV shape; write OUTxIN, e.g. 4096x4096,1024x4096")
        out.append((int(m.group(1)), int(m.group(2))))
    if not out:
        raise InputError(f"{text!r}: give at least one OUTxIN shape, e.g. 4096x4096")
    return out


def model_arch(model: str | None):
    """The ArchConfig of ``--model`` whose trunk shapes the trunk probe adds: from an expert pack's index,
    a checkpoint folder's config.json or a catalogue entry's config (plan-only families included).

    Returns:
        (ArchConfig or None, why None: a warning line, or None).
    """
    if model is None:
        return None, None
    import json
    from pathlib import Path

    from colibri_plan.errors import ColibriError
    from colibri_plan.families import arch_from_config
    from colibri_plan.formats.arch import ArchConfig

    path = Path(model).expanduser()
    try:
        if path.is_dir() and (path / "pack.json").is_file():
            from colibri_plan.formats.pack_index import read_index

            return ArchConfig.from_dict(read_index(path)["arch"]), None
        if path.is_dir() and (path / "config.json").is_file():
            cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
            return arch_from_config(cfg, plan_only=True, where=str(path / "config.json")), None
        if not path.exists():
            from colibri_plan.model.catalogue import find_entry

            entry = find_entry(model)
            if entry is not None:
                return arch_from_config(entry["config"], plan_only=True, where=f"catalogue {model}"), None
            return None, None  # not a model at all: run_profile says so
    except (ColibriError, ValueError, OSError) as exc:
        return None, f"the trunk probe measures generic shapes only: {model}'s architecture: {exc}"
    return None, (f"the trunk probe measures generic shapes only: {model} holds no architecture (GGUF "
                  "headers and spec files give sizes, not projection shapes)")


def _stage_progress(bar: Steps, stages: list[str]):
    """A ``fn(message)`` callback for :func:`run_profile`: every message is a line (or the bar's text);
    the bar counts the probes done, read from the message's ``probe:`` prefix."""

    def cb(message: str) -> None:
        stage = message.split(":", 1)[0]
        bar.say(message)
        if stage in stages:
            bar.set(stages.index(stage))

    return cb


def _value(convert, hint: bool = False):
    """An option callback that converts the flag's text (``convert(value)``, or ``convert(value, flag)``
    with ``hint``), so the command gets :class:`ProfileOptions`' types; an option left out stays None
    (:func:`~colibri_plan.cli.common.options_arg` then keeps the field's default)."""
    return lambda _ctx, param, value: convert(value, param.opts[0]) if hint else convert(value)


def _positive(_ctx, param, value):
    """Option callback: a number > 0, or None; otherwise a usage error (exit 2) naming the flag."""
    if value is not None and value <= 0:
        raise click.BadParameter(f"must be positive, got {value}", param_hint=param.opts[0])
    return value


@click.group("profile", invoke_without_command=True)
@click.option("--path", type=click.Path(), default=D.path,
              help="Folder or file on the disk to probe (default: a temporary file in the current folder).")
@click.option("--model", default=D.model,
              help="Model whose expert size/shapes to measure at (default GLM-5.2).")
@click.option("--quick", is_flag=True, default=D.quick,
              help="Fewer repetitions, smaller test file, queue depths 1 and 4.")
@click.option("--out", "out", type=click.Path(), default="profile.json", show_default=True,
              help="Where to write the profile ('-' to write nothing).")
@click.option("--backends", multiple=True, callback=_value(_names),
              help="Backends to use (comma-separated or repeated; default all).")
@click.option("--probes", default=None, callback=_value(_listed, hint=True),
              help="Probes to run, comma-separated: disk,ram,links,matmul,trunk (default all; leave out "
                   "trunk to skip the dense-trunk, device-op and attention figures).")
@click.option("--block-bytes", default=None, hidden=True, callback=_value(parse_bytes))
@click.option("--file-bytes", default=None, hidden=True, callback=_value(parse_bytes))
@click.option("--ram-bytes", default=None, hidden=True, callback=_value(parse_bytes))
@click.option("--queue-depths", default=None, hidden=True, callback=_value(_ints))
@click.option("--disk-seconds", type=float, default=D.disk_seconds, hidden=True, callback=_positive)
@click.option("--hidden", type=int, default=D.hidden, hidden=True, callback=_positive)
@click.option("--width", type=int, default=D.width, hidden=True, callback=_positive)
@click.option("--formats", default=None, callback=_value(_listed, hint=True),
              help="Quant formats to time matmul at (comma-separated; default int4,int4-g64 + the model's).")
@click.option("--dense-formats", default=None, callback=_value(_listed, hint=True),
              help="Formats to time the trunk's GEMV at (comma-separated; default int8,int4,bf16,f16,f32).")
@click.option("--trunk-shapes", default=None, hidden=True, callback=_value(_shapes),
              help="OUTxIN GEMV shapes, comma-separated.")
@click.option("--contexts", default=None, hidden=True, callback=_value(_ints),
              help="Attention context lengths, comma-separated.")
@click.option("--trunk-seconds", type=float, default=D.trunk_seconds, hidden=True, callback=_positive,
              help="Trunk probe budget per device.")
@json_option
@options_arg(ProfileOptions)
def profile(opts, out):
    """Measure NVMe reads (O_DIRECT, expert-sized blocks, queue depth 1..N), RAM bandwidth, host<->GPU
    links, the matmul throughput of every backend and the dense trunk (GEMV at trunk shapes, small
    device ops, decode attention) of every device and the host CPU; write the profile file.

    Without this machine: `profile synth` builds a profile from stated figures (--gpu 24G --ram 64G
    --nvme gen4 --cpu 16), `profile list` names the shipped ones, `profile show` prints one.
    """
    import dataclasses

    if click.get_current_context().invoked_subcommand is not None:
        return   # `profile synth|list|show`: nothing to measure

    from colibri_plan.formats.profile import save_profile
    from colibri_plan.profiler.run import run_profile

    model, path = opts.model, opts.path
    if out != "-":
        from pathlib import Path

        from colibri_plan.fileio import check_output_path

        # before minutes of measuring; a --path folder may take the output, a --path file may not
        check_output_path(out, [p for p in (model, path) if p and Path(p).exists()
                                and not (p == path and Path(p).is_dir())])
    if "trunk" in opts.probes:
        arch, why = model_arch(model)
        from colibri_plan.engine import step_timing

        opts = dataclasses.replace(opts, model_arch=arch,
                                   step_runner=step_timing if arch is not None else None)
        if why:
            warn(why)
    stages = ["machine", *[p for p in PROBES if p in opts.probes]]
    with Steps("profile", total=len(stages)) as bar:
        prof = run_profile(opts, progress=_stage_progress(bar, stages))
    for w in prof.doc["warnings"]:
        warn(w)
    if out != "-":
        save_profile(prof, out)
        progress(f"profile written to {out} ({prof.doc['duration_s']:.1f} s)")
    emit(prof.doc, lambda: render(prof.doc))


from colibri_plan.cli.profiles import list_profiles as _list  # noqa: E402
from colibri_plan.cli.profiles import show as _show  # noqa: E402
from colibri_plan.cli.profiles import synth as _synth  # noqa: E402

profile.add_command(_synth)
profile.add_command(_list)
profile.add_command(_show)
