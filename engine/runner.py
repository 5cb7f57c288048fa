"""The engine's public entry: open the weights, place the experts, generate, measure.

One run path for `colibri-plan run` (with or without ``--plan``), `verify` and the benchmarks:

1. :func:`open_weights` — an expert pack folder, or a Hugging Face checkpoint folder held in memory;
2. :func:`placement_for` — the plan's placement (:meth:`Placement.from_plan`), or without a plan every
   expert resident: pinned in RAM for a host backend ("cpu", "numpy"), in VRAM on ``<backend>:<device>``
   otherwise;
3. :func:`trunk_placement` — where the dense trunk, attention and the KV cache run: the plan's ``trunk``
   section, or without a plan the ``--backend`` device (``--trunk device``, the default for a GPU
   backend) or the host (``--trunk cpu``, the default for cpu/numpy);
4. :func:`generate` — :func:`colibri_plan.engine.session.run_placement` with that placement: a
   :class:`~colibri_plan.engine.residency.ResidencyManager` serves the experts, greedy decoding, and a
   :class:`~colibri_plan.formats.report.RunReport` in the plan's vocabulary.

So `run` without a plan and `run --plan` differ only in the placement, and give the same tokens.
Nothing here prints; progress goes to an optional callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from colibri_plan.backends import HOST_BACKENDS
from colibri_plan.engine.placement import Placement
from colibri_plan.errors import InputError
from colibri_plan.formats.report import RunReport
from colibri_plan.run_options import DEFAULTS, RunOptions


def open_weights(model_path: str | Path, quant: str | None = None):
    """A ModelWeights for an expert pack folder (``pack.json``) or a Hugging Face checkpoint folder
    (experts quantized to ``quant`` at load; default f32).

    Raises:
        InputError: the path is neither, or ``quant`` is given for a pack whose expert format differs (a
        pack's format is fixed when it is made).
    """
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.formats.pack_index import is_pack

    path = Path(model_path)
    if not path.exists():
        raise InputError(f"model {path} does not exist; give an expert pack folder (colibri-plan model pack "
                         "/ model fixture) or a Hugging Face checkpoint folder")
    if is_pack(path):
        pack = open_pack(path)
        if quant is not None and quant != pack.expert_format:
            pack.close()
            raise InputError(f"--quant {quant}: {path} is a pack of {pack.expert_format} experts, and a "
                             "pack's format is fixed when it is made; leave --quant out, or make another "
                             f"pack with `colibri-plan model pack --quant {quant}`")
        return pack
    if (path / "config.json").is_file():
        from colibri_plan.engine.weights import load_checkpoint

        return load_checkpoint(path, expert_format=quant or "f32")
    raise InputError(f"{path} is neither an expert pack (no pack.json) nor a checkpoint (no config.json)")


def resolve_backend(name: str) -> str:
    """``auto`` -> "cpu" (numba kernels) when usable here, else "numpy"; other names checked and returned.

    Raises:
        UnsupportedError: an unknown backend name.
    """
    from colibri_plan.backends import get_backend

    if name != "auto":
        get_backend(name)
        return name
    return "cpu" if get_backend("cpu").is_available() else "numpy"


def check_prompt(ids: Sequence[int], vocab_size: int) -> None:
    """Raises InputError when an id is outside 0..vocab_size-1."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}"
                         + (f" ({len(bad)} ids out of range)" if len(bad) > 1 else ""))


def check_context(arch, n_prompt: int, n_tokens: int) -> None:
    """Refuse, before any work, a run whose context (``n_prompt`` + ``n_tokens`` new tokens) passes a DSA
    model's ``index_topk`` (DeepSeek-V3.2, GLM-5 run as MLA up to it: colibri_plan/engine/mla.py).

    Raises:
        UnsupportedError: one line naming index_topk.
    """
    from colibri_plan.engine.mla import check_dsa_context

    check_dsa_context(arch, 0, int(n_prompt) + int(n_tokens))


def check_plan(plan, weights) -> None:
    """Refuse a plan made for another model or expert format than ``weights``, or for a checkpoint folder.

    Raises:
        InputError: ``weights`` is not an expert pack. MismatchError: the plan is for another model.
    """
    from colibri_plan.formats.plan import check_model

    if not hasattr(weights, "expert_location"):
        raise InputError("a plan needs an expert pack (colibri-plan model pack / model fixture), not a "
                         "checkpoint folder: streaming reads experts from the pack's experts.bin")
    check_model(plan, weights.spec(), where=str(weights.path))


def placement_for(weights, plan=None, backend: str = "cpu", device_index: int = 0) -> Placement:
    """Where the experts live: as ``plan`` (a :class:`colibri_plan.formats.plan.Plan`) says, or without a
    plan all resident — pinned in RAM on a host backend, in VRAM on ``<backend>:<device_index>`` else."""
    if plan is not None:
        return Placement.from_plan(plan)
    arch = weights.arch
    device = None if backend in HOST_BACKENDS else f"{backend}:{int(device_index)}"
    return Placement.all_resident(arch.moe_layers, arch.n_experts, device)


#: ``--trunk`` choices of `run`
TRUNK_CHOICES = ("cpu", "device")


def trunk_placement(weights, plan=None, trunk: str | None = None, backend: str = "cpu",
                    device_index: int = 0):
    """Where the trunk runs, as a :class:`~colibri_plan.formats.plan_trunk.TrunkPlacement`.

    With a plan: its ``trunk`` section (``trunk`` None; as :meth:`Placement.from_plan` reads it), or the
    host (``trunk`` "cpu", to compare).
    Without: ``trunk`` "device" runs it on ``<backend>:<device_index>`` (the default for a GPU backend),
    "cpu" on the host (the default for cpu/numpy); the KV cache then reserves the run's context.

    Raises:
        InputError: ``trunk`` "device" with a plan (the plan's section decides), or an unknown choice.
        FormatError: a malformed trunk section.
    """
    from colibri_plan.formats.plan_trunk import TrunkPlacement, parse_trunk

    if trunk not in (None, *TRUNK_CHOICES):
        raise InputError(f"--trunk {trunk}: use one of {', '.join(TRUNK_CHOICES)}")
    if plan is not None:
        if trunk == "device":
            raise InputError("--trunk device: with a plan, the trunk runs where the plan's trunk section "
                             "says; solve with --trunk <device> (or give --trunk cpu to run it on the host)")
        if trunk == "cpu":
            return TrunkPlacement()
        return parse_trunk(plan.doc, plan.device_keys, weights.arch.n_layers)
    if (trunk or ("cpu" if backend in HOST_BACKENDS else "device")) == "cpu":
        return TrunkPlacement()
    key = f"{backend}:{int(device_index)}"
    return TrunkPlacement(device=key, kv_device=key)


def generate(weights, prompt: Sequence[int], opts: RunOptions = DEFAULTS, *, plan=None, recorder=None,
             progress: Callable[[str], None] | None = None, sample: Callable | None = None,
             stop_ids: Sequence[int] = ()) -> RunReport:
    """Generate ``opts.tokens`` new ids greedily from ``prompt`` and measure the run (module docstring).

    Args:
        weights: from :func:`open_weights` (``opts.quant`` is read there); a plan needs an expert pack.
        prompt: token ids (checked against the vocabulary).
        opts: :class:`~colibri_plan.run_options.RunOptions`: ``tokens`` >= 1 (the first comes from the
            prefill: ``tokens - 1`` decode steps are timed); ``backend`` (resolved by
            :func:`resolve_backend`): with a plan a host backend (the plan names its GPUs), without one
            a GPU backend holds every expert on ``device_index``; ``read_threads`` concurrent O_DIRECT
            reads (None: the plan's, else 8); ``trunk`` None, "cpu" or "device" (:func:`trunk_placement`).
        plan: a loaded plan (already checked with :func:`check_plan`), or None for all experts resident.
        recorder: a RoutingRecorder that records routing (e.g. for routing statistics).
        progress: optional ``fn(message)`` once per token.
        sample, stop_ids: ``fn(logits float32 [V]) -> id`` and the ids that end the run
            (:meth:`~colibri_plan.engine.forward.Model.generate`); None, (): greedy, ``opts.tokens`` ids.

    Returns:
        A RunReport (tokens, prefill, load, decode terms, hit rates, disk bytes, peak RSS).

    Raises:
        InputError: a bad prompt, a plan with a GPU ``backend`` or on a checkpoint folder.
        UnsupportedError: an unknown backend; prompt + tokens passes a DSA model's index_topk
            (:func:`check_context`); a split trunk.
        The engine's errors: BudgetError (RAM), DeviceOutOfMemoryError, BackendUnavailableError,
        IntegrityError.
    """
    from colibri_plan.engine.session import run_placement

    backend, device_index, n_tokens = resolve_backend(opts.backend), opts.device_index, opts.tokens
    check_prompt(prompt, weights.arch.vocab_size)
    check_context(weights.arch, len(prompt), n_tokens)
    if plan is not None and backend not in HOST_BACKENDS:
        raise InputError(f"--backend {backend}: with a plan, CPU-resident and streamed experts run on a "
                         "host backend (cpu or numpy); GPU experts use the devices the plan names")
    placement = placement_for(weights, plan, backend, device_index)
    where = trunk_placement(weights, plan, opts.trunk, backend, device_index)
    threads = opts.read_threads or (plan.read_threads if plan is not None else 8)
    cpu = backend if backend in HOST_BACKENDS else "cpu"
    return run_placement(weights, placement, list(prompt), n_tokens, cpu_backend=cpu, read_threads=threads,
                         recorder=recorder, progress=progress, trunk=where, sample=sample,
                         stop_ids=stop_ids)


def write_stats(recorder, weights, stats_out: str | None, usage_out: str | None) -> dict:
    """Write the routing counts as a heat JSON (``stats_out``, with the token-level ``trace`` of top-k ids
    per MoE layer, size-bounded: docs/heat.md) and/or colibrì usage text (``usage_out``, counts only).

    Returns:
        {"stats_out": path, "usage_out": path} for what was written.
    """
    from colibri_plan.formats.heat import save_heat, write_usage_text

    written: dict = {}
    if not (stats_out or usage_out):
        return written
    fp = getattr(weights, "model_fingerprint", None)
    heat = recorder.to_heat(source=f"colibri-plan run: {getattr(weights, 'source', '')}",
                            model_fingerprint=fp)
    if heat.n_model_layers is None:
        heat.n_model_layers = weights.arch.n_layers
    trace = recorder.trace() if hasattr(recorder, "trace") else None
    if trace is not None and trace.steps:   # the order of the routing: what an LRU cache feels
        heat.trace = trace
    if stats_out:
        written["stats_out"] = str(save_heat(heat, stats_out))
    if usage_out:
        written["usage_out"] = str(write_usage_text(heat, usage_out))
    return written

