"""The options of one profile (`colibri-plan profile`), each default written here once.

:class:`ProfileOptions` is built by the CLI from its flags (a flag left out keeps the field's default) and
passed whole to :func:`colibri_plan.profiler.run.run_profile`. Light on purpose: the CLI imports it to
build its flags, before any probe module loads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only
    from colibri_plan.formats.arch import ArchConfig

#: the probes, in the order they run
PROBES = ("disk", "ram", "links", "matmul", "trunk")
#: formats a dense trunk is stored in (`model pack --dense-quant`), the likeliest first: the trunk probe's
#: GEMV formats
DENSE_FORMATS = ("int8", "int4", "bf16", "f16", "f32")


@dataclass(frozen=True)
class ProfileOptions:
    """What to measure and how hard (the ``profile`` flags in brackets). ``None`` sizes take the mode's
    value (:func:`colibri_plan.profiler.run.mode_settings`: ``quick`` or default).

    Attributes:
        path: folder or file on the disk to probe; None: a temporary file in the current folder [--path].
        model: model whose expert size and shapes are measured at; None: GLM-5.2 [--model].
        quick: fewer repetitions, a smaller test file, queue depths 1 and 4 [--quick].
        backends: backend names to use; None: all [--backends]. probes: which of :data:`PROBES` to run
            [--probes].
        block_bytes: disk read size in bytes; None: the model's expert block [--block-bytes].
        file_bytes: disk test-file bytes [--file-bytes]. queue_depths: disk queue depths [--queue-depths].
        ram_bytes: bytes of the RAM bandwidth buffer [--ram-bytes]. disk_seconds: seconds per disk
            figure [--disk-seconds].
        hidden, width: expert H and I (elements) of the matmul figures; None: the model's [--hidden,
            --width]. formats: expert formats timed (the model's is added) [--formats].
        dense_formats: formats of the trunk's GEMV figures [--dense-formats]. trunk_shapes: [out, in]
            GEMV shapes; None: the generic ones [--trunk-shapes]. contexts: attention context lengths,
            tokens [--contexts]. trunk_seconds: trunk probe seconds per device [--trunk-seconds].
        model_arch: the model's ArchConfig (``profile --model`` reads it): its trunk shapes join
            ``dense_gemv`` and its layer is the ``trunk_layer`` figure; None: generic shapes.
        step_runner: :mod:`colibri_plan.engine.step_timing`, handed in by the CLI with ``model_arch``: the
            ``step_graph`` figure of a GPU that replays its decode step; None: not measured.
    """

    path: str | None = None
    model: str | None = None
    quick: bool = False
    backends: Sequence[str] | None = None
    probes: Sequence[str] = PROBES
    block_bytes: int | None = None
    file_bytes: int | None = None
    queue_depths: Sequence[int] | None = None
    ram_bytes: int | None = None
    hidden: int | None = None
    width: int | None = None
    formats: Sequence[str] = ("int4", "int4-g64")
    disk_seconds: float | None = None
    model_arch: ArchConfig | None = None
    trunk_shapes: Sequence[tuple[int, int]] | None = None
    dense_formats: Sequence[str] = DENSE_FORMATS
    contexts: Sequence[int] | None = None
    trunk_seconds: float | None = None
    step_runner: object = None


#: the defaults, for the CLI's flags
DEFAULTS = ProfileOptions()
