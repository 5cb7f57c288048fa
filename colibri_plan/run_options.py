"""The options of one engine run (`colibri-plan run`, `verify`), each default written here once.

A leaf module: the CLI builds :class:`RunOptions` from its flags (their click defaults are read from
:data:`DEFAULTS`), and :func:`colibri_plan.engine.runner.generate` and
:func:`colibri_plan.verify.verify_plan` take it whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    """How to run the engine (the ``run`` / ``verify`` flags in brackets).

    Attributes:
        tokens: new token ids to generate, >= 1; the first comes out of the prefill, so ``tokens - 1``
            decode steps are timed [run --tokens]. ``verify --tokens`` counts the decode steps it times
            and generates one more.
        backend: "auto" (cpu when its kernels are usable here, else numpy), "cpu", "numpy" or a GPU
            backend; with a plan a host backend [--backend; verify's default: :data:`VERIFY_DEFAULTS`].
        device_index: device of a GPU backend, which holds every expert without a plan [run --device].
        quant: expert format a Hugging Face checkpoint is quantized to at load; None: f32 (a pack keeps
            its own) [run --quant].
        read_threads: concurrent O_DIRECT expert reads (the queue depth); None: the plan's
            ``resources.disk_queue_depth``, else 8 [run --read-threads].
        trunk: where the dense trunk, attention and KV cache run: None (the plan's trunk section, or
            without a plan the backend's device: cpu for a host backend), "cpu" or "device" [run --trunk].
    """

    tokens: int = 16
    backend: str = "auto"
    device_index: int = 0
    quant: str | None = None
    read_threads: int | None = None
    trunk: str | None = None


#: the defaults, for the CLI's flags (`run`)
DEFAULTS = RunOptions()
#: `verify`'s: its RAM-resident and streamed experts run on a host backend, cpu unless numpy is asked for
VERIFY_DEFAULTS = RunOptions(backend="cpu")
