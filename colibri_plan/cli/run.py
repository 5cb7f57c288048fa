"""`colibri-plan run`: greedy generation on the engine, with timings and routing statistics.

Options are parsed here; the run itself is :func:`colibri_plan.engine.runner.generate`, the same path
with or without ``--plan`` (without one every expert is resident: pinned RAM, or VRAM on a GPU backend).
"""

from __future__ import annotations

import click

from colibri_plan.cli.common import (
    Steps,
    emit,
    json_option,
    options_arg,
    parse_prompt,
    progress,
    read_prompt,
    warn,
)
from colibri_plan.run_options import DEFAULTS as D
from colibri_plan.run_options import RunOptions

__all__ = ["parse_prompt", "run"]


def _check_gpu_backend(backend: str, device_index: int) -> None:
    """Without a plan a GPU backend holds every expert (and the trunk) on ``device_index``: refuse one this
    machine lacks before the weights load, naming the backend's own reason (not a plan's)."""
    from colibri_plan.backends import get_backend
    from colibri_plan.errors import BackendUnavailableError

    cls = get_backend(backend)
    if not cls.is_available():
        raise BackendUnavailableError(f"--backend {backend}: unavailable here ({cls.unavailable_reason()}); "
                                      "run with --backend cpu (or numpy), or install that backend's stack")
    n = len(cls.list_devices())
    if device_index >= n:
        which = f" (indices 0..{n - 1}); give one of them" if n else "; run"
        raise BackendUnavailableError(f"--device {device_index}: {backend} has {n} device(s) here{which} "
                                      "or --backend cpu")


def _prefill_line(pt: dict | None) -> list[str]:
    """The prefill's measured split (RunReport.prefill_terms: totals over the prompt), or nothing."""
    if not pt:
        return []
    return [f"prefill: experts {pt['experts_s']:.3f} s (cpu {pt['expert_compute_s'].get('cpu', 0.0):.3f} s, "
            f"disk wait {pt['disk_wait_s']:.3f} s), disk {pt['disk_bytes'] / 1e6:.1f} MB read"]


def _human(rep, prompt_len: int, backend: str, pred: dict, written: dict) -> str:
    """The report for people: tokens, speed, the per-token split, hit rates, disk and memory."""
    dev = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in rep.expert_compute_s_per_token.items()
                    if k != "cpu") or "none"
    hr = ", ".join(f"{k} {v:.1%}" for k, v in rep.hit_rate.items())
    steps = rep.decode_steps or 0
    speed = (f"decode {rep.tok_s:.2f} tok/s measured over {steps} step{'s' if steps != 1 else ''}"
             if steps else "decode n/a (one token: it comes from the prefill, no decode step was timed)")
    ms = lambda v: f"{(v or 0.0) * 1e3:.1f} ms"   # noqa: E731
    pre = pred.get("prefill_s_at_prompt")
    pre = f" (plan predicted {pre:.3f} s)" if pre is not None else ""
    disk = (f"disk {rep.disk_bytes_per_token / 1e6:.1f} MB/token "
            f"({'O_DIRECT' if rep.o_direct else 'buffered'}); " if rep.o_direct is not None else "")
    return "\n".join([
        " ".join(str(x) for x in rep.tokens),
        speed + (f" (plan predicted {pred['tok_s']:.2f})" if pred.get("tok_s") else "")
        + f"; prefill {prompt_len} tokens in {rep.prefill_s:.3f} s{pre}; load {rep.load_s:.2f} s on "
        f"{backend}",
        f"per token: dense {ms(rep.dense_s_per_token)}, experts {ms(rep.expert_layers_s_per_token)} "
        f"(cpu {ms(rep.expert_compute_s_per_token.get('cpu'))}, disk wait {ms(rep.disk_wait_s_per_token)}, "
        f"devices: {dev})",
        *_prefill_line(rep.prefill_terms),
        f"trunk on {rep.trunk_device}" + (f": attention {ms(rep.attention_s_per_token)}/token"
                                          if rep.attention_s_per_token is not None else ""),
        f"hit rates: {hr}; LRU hit rate {(rep.lru_hit_rate or 0.0):.1%}",
        f"{disk}peak RSS {(rep.peak_rss_bytes or 0) / 2**30:.2f} GiB",
        *([f"re-pins: {rep.repins} swaps, {(rep.repin_bytes or 0) / 1e6:.1f} MB read, "
           f"{(rep.repin_s or 0.0) * 1e3:.1f} ms"] if rep.repins is not None else []),
        *(f"wrote {k.replace('_out', '')}: {v}" for k, v in written.items())])


def _text_options(f):
    """`run`'s text and sampling options (--prompt, --chat, --temperature, --top-p, --top-k, --seed),
    handed to the command as one ``text`` dict."""
    import functools

    @functools.wraps(f)
    def wrapper(*args, **kw):
        kw["text"] = {k: kw.pop(k) for k in ("prompt_text", "chat", "temperature", "top_p", "top_k", "seed")}
        return f(*args, **kw)
    for opt in reversed([
        click.option("--prompt", "prompt_text", default=None,
                     help="Prompt text (the model's tokenizer encodes it; the answer streams to stdout)."),
        click.option("--chat", is_flag=True, help="Send the text prompt through the model's chat template."),
        click.option("--temperature", type=click.FloatRange(0, 2), default=0.0, show_default=True,
                     help="Sampling temperature; 0 is greedy (argmax)."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
                     help="Nucleus sampling: keep the most probable tokens holding this mass."),
        click.option("--top-k", type=click.IntRange(0), default=0, show_default=True,
                     help="Keep the k most probable tokens (0 = all)."),
        click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=None,
                     help="Seed of the sampler (the same seed and prompt give the same tokens).")]):
        wrapper = opt(wrapper)
    return wrapper


def _read_prompt(prompt_ids, prompt_file, prompt_text) -> tuple[list[int] | None, str | None]:
    """(ids, None) or (None, text): --prompt is text, --prompt-file is ids when it holds only ids (as
    before), else text."""
    from colibri_plan.errors import InputError

    if prompt_text is None:
        try:
            return read_prompt(prompt_ids, prompt_file), None
        except InputError as exc:   # a file that is not ids is text (its reading errors stay as they are)
            if prompt_file is None or prompt_ids is not None or "is not a token id" not in str(exc):
                raise
            from pathlib import Path

            return None, Path(prompt_file).read_text(encoding="utf-8")
    if prompt_ids is not None or prompt_file is not None:
        raise InputError("give exactly one of --prompt-ids 1,2,3, --prompt TEXT or --prompt-file FILE")
    return None, prompt_text


@click.command("run")
@click.option("--model", "model_path", required=True, type=click.Path(),
              help="Expert pack folder (or a Hugging Face checkpoint folder).")
@click.option("--prompt-ids", default=None, help="Prompt token ids, e.g. 1,2,3.")
@click.option("--prompt-file", default=None, type=click.Path(),
              help="File of token ids (spaces/commas), or of prompt text when it is not ids.")
@click.option("--tokens", type=click.IntRange(1, 1_000_000), default=D.tokens, show_default=True,
              help="Tokens to generate.")
@click.option("--backend", default=D.backend, show_default=True,
              help="Backend for the experts: auto (cpu if usable, else numpy), cpu, numpy, opencl, ...")
@click.option("--device", "device_index", type=click.IntRange(0), default=D.device_index, show_default=True,
              help="Backend device index (a GPU backend without --plan holds every expert there).")
@click.option("--quant", default=D.quant,
              help="Expert format when --model is a checkpoint [default: f32]; a pack keeps its own.")
@click.option("--plan", "plan_path", type=click.Path(), default=None,
              help="Place experts as this plan says (VRAM / pinned RAM / LRU / O_DIRECT disk); needs a pack.")
@click.option("--trunk", type=click.Choice(["cpu", "device"]), default=D.trunk,
              help="Where the dense trunk, attention and KV cache run without --plan: device (the "
                   "--backend device; default for a GPU backend) or cpu (default for cpu/numpy). With --plan "
                   "the plan's trunk section decides; --trunk cpu runs it on the host instead.")
@click.option("--read-threads", type=click.IntRange(1, 64), default=D.read_threads,
              help="Concurrent O_DIRECT expert reads with --plan (queue depth) [default: the plan's "
                   "resources.disk_queue_depth, else 8].")
@click.option("--stats-out", type=click.Path(), default=None, help="Write routing counts (heat JSON).")
@click.option("--usage-out", type=click.Path(), default=None,
              help="Write routing counts (colibrì usage text).")
@_text_options
@json_option
@options_arg(RunOptions)
def run(opts, model_path, prompt_ids, prompt_file, plan_path, stats_out, usage_out, text):
    """Greedy generation: prints the new token ids, tok/s, prefill and decode time.

    Without --plan every expert is resident (pinned RAM on cpu/numpy, VRAM on a GPU backend); with --plan
    the experts live where the plan says. Either way the same engine run reports each decode token's
    time (dense, expert compute per device, disk wait), hit rates per tier, disk bytes per token and peak
    RSS, beside the plan's prediction when there is one. Experts the run must hold in RAM beyond this
    machine's available memory are refused before anything is allocated (COLIBRI_PLAN_NO_RAM_CHECK=1 runs
    it anyway). A text prompt (--prompt, --chat) streams the answer to stdout (the report goes to stderr)
    and ends at the model's EOS; --temperature > 0 samples (--top-p, --top-k, --seed)."""
    import dataclasses

    from colibri_plan.engine import runner
    from colibri_plan.engine.moe import RoutingRecorder
    from colibri_plan.errors import UnsupportedError
    from colibri_plan.fileio import check_output_path

    for p in (stats_out, usage_out):  # before the run, not after it
        if p is not None:
            check_output_path(p, (model_path, plan_path, prompt_file))
    prompt, text_in = _read_prompt(prompt_ids, prompt_file, text["prompt_text"])
    if text["chat"] and text_in is None:
        raise click.UsageError("--chat needs a text prompt (--prompt TEXT or a --prompt-file of text)")
    from colibri_plan.cli.common import get_ctx
    from colibri_plan.text.sampling import SamplingParams, make_sampler, tap

    sampler = base = make_sampler(SamplingParams(text["temperature"], text["top_p"], text["top_k"],
                                                 text["seed"]))
    codec, pieces = None, []
    try:
        backend = runner.resolve_backend(opts.backend)  # before the weights load and any progress line
    except UnsupportedError as exc:
        raise click.BadParameter(str(exc), param_hint="--backend") from None
    opts = dataclasses.replace(opts, backend=backend)
    if plan_path is None and backend not in runner.HOST_BACKENDS:
        _check_gpu_backend(backend, opts.device_index)
    plan = None
    if plan_path is not None:
        from colibri_plan.formats.plan import load_plan

        plan = load_plan(plan_path)
    weights = runner.open_weights(model_path, opts.quant)
    try:
        if text_in is not None:
            from colibri_plan.engine.pack_text import encode_prompt

            prompt, codec = encode_prompt(weights, text_in, text["chat"])
            stream, streamed = codec.stream(), not get_ctx().json

            def show(tok: int) -> None:   # the text each new token completes, as it is chosen
                pieces.append(stream.push(tok))
                if streamed:
                    click.echo(pieces[-1], nl=False)
            sampler = tap(sampler, show)
        runner.check_prompt(prompt, weights.arch.vocab_size)
        if plan is not None:
            from colibri_plan.verify import (
                context_warning,
                dense_format_warning,
                machine_warning,
                this_machine_fingerprint,
            )

            runner.check_plan(plan, weights)
            warnings = (machine_warning(plan, this_machine_fingerprint()),
                        dense_format_warning(plan, weights.path),
                        context_warning(plan, len(prompt) + opts.tokens))
            for w in warnings:
                if w:
                    warn(w)
        else:
            progress(f"loading {weights.arch.n_moe_layers * weights.arch.n_experts} experts to {backend}")
        recorder = RoutingRecorder(weights.arch)
        with Steps("run", total=opts.tokens) as bar:  # one step per generated token
            rep = runner.generate(weights, prompt, opts, plan=plan, recorder=recorder, sample=sampler,
                                  stop_ids=codec.stop_ids if codec else (),
                                  progress=None if codec and not get_ctx().json else
                                  lambda m: bar.say(m, verbose_only=True, advance=1))
        if codec is not None:
            pieces.append(stream.flush())
        if rep.io_warning:
            warn(rep.io_warning)
        written = runner.write_stats(recorder, weights, stats_out, usage_out)
    finally:
        close = getattr(weights, "close", None)
        if close is not None:
            close()
    pred = dict(plan.doc.get("predicted", {})) if plan is not None else {}
    if plan is not None:   # the plan's prefill at this prompt's length (its curve), None without one
        from colibri_plan.verify import predicted_prefill_at

        pred["prefill_s_at_prompt"] = predicted_prefill_at(pred, len(prompt))
    doc = {"model": str(model_path), "plan": None if plan_path is None else str(plan_path),
           "backend": backend, **rep.to_dict(), **written}
    if codec is not None:
        doc.update(text="".join(pieces), seed=getattr(base, "seed", None))
    if plan is not None:
        doc["predicted"] = {k: pred.get(k) for k in ("tok_s", "decode_s_per_token", "hit_rate",
                                                      "disk_bytes_per_token")}
        doc["predicted"]["prefill_s"] = pred["prefill_s_at_prompt"]
    if codec is not None and not get_ctx().json:   # the text went to stdout as it came; the report after it
        click.echo(pieces[-1])
        click.echo(_human(rep, len(prompt), backend, pred, written).split("\n", 1)[1], err=True)
        return
    emit(doc, lambda: _human(rep, len(prompt), backend, pred, written))
