"""`colibri-plan run`: greedy generation on the engine, with timings and routing statistics.

The command is three steps — open the weights (:func:`open_weights`), build the expert provider
(:func:`make_provider`; today every expert is held in RAM on one backend, a residency plan slots in
here), then :func:`generate` — so ``--plan`` only has to change the provider.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import click

from colibri_plan.cli.common import emit, json_option, progress
from colibri_plan.errors import InputError

_SPLIT = re.compile(r"[\s,]+")


def parse_prompt(text: str, where: str) -> list[int]:
    """Token ids from ``text``: integers separated by whitespace and/or commas.

    Raises:
        InputError: no ids, or an item that is not a non-negative integer (names ``where``).
    """
    items = [t for t in _SPLIT.split(text.strip()) if t]
    if not items:
        raise InputError(f"{where}: the prompt is empty; give at least one token id")
    ids = []
    for t in items:
        if not re.fullmatch(r"\d+", t):
            raise InputError(f"{where}: {t!r} is not a token id (non-negative integers separated by "
                             "spaces or commas)")
        ids.append(int(t))
    return ids


def read_prompt(prompt_ids: str | None, prompt_file: str | None) -> list[int]:
    """The prompt from exactly one of ``--prompt-ids`` / ``--prompt-file``.

    Raises:
        InputError: neither or both given; the file is missing/unreadable; bad ids.
    """
    if (prompt_ids is None) == (prompt_file is None):
        raise InputError("give exactly one of --prompt-ids 1,2,3 or --prompt-file FILE")
    if prompt_ids is not None:
        return parse_prompt(prompt_ids, "--prompt-ids")
    from colibri_plan.fileio import check_input_file

    path = check_input_file(prompt_file, "prompt file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read prompt file {path}: {exc}") from exc
    return parse_prompt(text, f"prompt file {path}")


def open_weights(model_path: str, quant: str | None = None):
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
    """``auto`` -> "cpu" (numba kernels) when usable here, else "numpy"; other names unchanged.

    Raises:
        click.BadParameter: an unknown backend name (a usage error, exit 2).
    """
    from colibri_plan.backends import get_backend
    from colibri_plan.errors import UnsupportedError

    if name != "auto":
        try:
            get_backend(name)
        except UnsupportedError as exc:
            raise click.BadParameter(str(exc), param_hint="--backend") from None
        return name
    return "cpu" if get_backend("cpu").is_available() else "numpy"


def make_provider(weights, backend: str, device_index: int = 0):
    """The expert provider: every routed expert uploaded once to ``backend`` (RAM for CPU backends).

    A plan-driven residency manager will be chosen here when ``run --plan`` exists.
    """
    from colibri_plan.engine.moe import RamExperts

    return RamExperts(weights, backend=backend, device_index=device_index)


def check_prompt(ids: list[int], vocab_size: int) -> None:
    """Raises InputError when an id is outside 0..vocab_size-1."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InputError(f"token id {bad[0]} is outside the vocabulary 0..{vocab_size - 1}"
                         + (f" ({len(bad)} ids out of range)" if len(bad) > 1 else ""))


def generate(weights, provider, prompt: list[int], n_tokens: int) -> dict:
    """Prefill ``prompt`` and decode ``n_tokens`` greedily; returns tokens, timings and the recorder.

    Returns:
        {"tokens", "prefill_s", "decode_s", "decode_tok_s", "step_s": [per decode step], "recorder"}.
    """
    import numpy as np

    from colibri_plan.engine.forward import Model

    model = Model(weights, experts=provider)
    # the cache doubles as it fills: start small so a long --tokens run does not allocate its KV up front
    cache = model.new_cache(capacity=min(len(prompt) + n_tokens + 1, 4096))
    t0 = time.perf_counter()
    logits = model.forward(prompt, cache)  # [T, V]
    prefill_s = time.perf_counter() - t0
    tokens, steps = [], []
    nxt = int(np.argmax(logits[-1]))
    for step in range(n_tokens):
        tokens.append(nxt)
        if step == n_tokens - 1:
            break
        t1 = time.perf_counter()
        logits = model.forward([nxt], cache)  # decode one token: [1, V]
        steps.append(time.perf_counter() - t1)
        nxt = int(np.argmax(logits[-1]))
    decode_s = float(sum(steps))
    return {"tokens": tokens, "prefill_s": prefill_s, "decode_s": decode_s,
            "decode_tok_s": (len(steps) / decode_s) if decode_s > 0 else None, "step_s": steps,
            "recorder": model.routing}


def write_stats(recorder, weights, stats_out: str | None, usage_out: str | None) -> dict:
    """Write the routing counts as a heat JSON (``stats_out``) and/or colibrì usage text (``usage_out``)."""
    from colibri_plan.formats.heat import save_heat, write_usage_text

    written = {}
    if not (stats_out or usage_out):
        return written
    fp = getattr(weights, "model_fingerprint", None)
    heat = recorder.to_heat(source=f"colibri-plan run: {getattr(weights, 'source', '')}",
                            model_fingerprint=fp)
    if heat.n_model_layers is None:
        heat.n_model_layers = weights.arch.n_layers
    if stats_out:
        written["stats_out"] = str(save_heat(heat, stats_out))
    if usage_out:
        written["usage_out"] = str(write_usage_text(heat, usage_out))
    return written


@click.command("run")
@click.option("--model", "model_path", required=True, type=click.Path(),
              help="Expert pack folder (or a Hugging Face checkpoint folder).")
@click.option("--prompt-ids", default=None, help="Prompt token ids, e.g. 1,2,3.")
@click.option("--prompt-file", default=None, type=click.Path(), help="File of token ids (spaces/commas).")
@click.option("--tokens", "n_tokens", type=click.IntRange(1, 1_000_000), default=16, show_default=True,
              help="Tokens to generate.")
@click.option("--backend", default="auto", show_default=True,
              help="Backend for the experts: auto (cpu if usable, else numpy), cpu, numpy, opencl, ...")
@click.option("--device", "device_index", type=int, default=0, show_default=True,
              help="Backend device index.")
@click.option("--quant", default=None,
              help="Expert format when --model is a checkpoint [default: f32]; a pack keeps its own.")
@click.option("--plan", "plan_path", type=click.Path(), default=None,
              help="Place experts as this plan says (VRAM / pinned RAM / LRU / O_DIRECT disk); needs a pack.")
@click.option("--read-threads", type=click.IntRange(1, 64), default=None,
              help="Concurrent O_DIRECT expert reads with --plan (queue depth) [default: the plan's "
                   "resources.disk_queue_depth, else 8].")
@click.option("--stats-out", type=click.Path(), default=None, help="Write routing counts (heat JSON).")
@click.option("--usage-out", type=click.Path(), default=None,
              help="Write routing counts (colibrì usage text).")
@json_option
def run(model_path, prompt_ids, prompt_file, n_tokens, backend, device_index, quant, plan_path,
        read_threads, stats_out, usage_out):
    """Greedy generation: prints the new token ids, tok/s, prefill and decode time.

    Without --plan every expert is held in RAM on one backend. With --plan the experts live where the
    plan says, and the report splits each decode token's time (dense, expert compute per device, disk
    wait), gives hit rates per tier, disk bytes per token and peak RSS, beside the plan's prediction. A plan
    whose pinned experts, LRU slots and buffers exceed this machine's available memory is refused before
    anything is allocated (COLIBRI_PLAN_NO_RAM_CHECK=1 runs it anyway)."""
    from colibri_plan.fileio import check_output_path

    for p in (stats_out, usage_out):  # before the run, not after it
        if p is not None:
            check_output_path(p, (model_path, plan_path, prompt_file))
    prompt = read_prompt(prompt_ids, prompt_file)
    backend = resolve_backend(backend)  # before the weights load and any progress line
    weights = open_weights(model_path, quant)
    check_prompt(prompt, weights.arch.vocab_size)
    if plan_path is not None:
        return run_with_plan(weights, plan_path, prompt, n_tokens, backend, read_threads, stats_out,
                             usage_out)
    progress(f"loading {weights.arch.n_moe_layers * weights.arch.n_experts} experts to {backend}")
    t0 = time.perf_counter()
    provider = make_provider(weights, backend, device_index)
    load_s = time.perf_counter() - t0
    try:
        out = generate(weights, provider, prompt, n_tokens)
    finally:
        provider.close()
    written = write_stats(out.pop("recorder"), weights, stats_out, usage_out)
    doc = {"model": str(model_path), "backend": backend, "prompt_tokens": len(prompt),
           "tokens": out["tokens"], "load_s": round(load_s, 4), "prefill_s": round(out["prefill_s"], 4),
           "prefill_tok_s": round(len(prompt) / out["prefill_s"], 3) if out["prefill_s"] > 0 else None,
           "decode_s": round(out["decode_s"], 4),
           "decode_tok_s": None if out["decode_tok_s"] is None else round(out["decode_tok_s"], 3),
           "decode_steps": len(out["step_s"]), **written}
    tok_s = "n/a (one token)" if doc["decode_tok_s"] is None else f"{doc['decode_tok_s']:.2f} tok/s"
    emit(doc, lambda: "\n".join([
        " ".join(str(t) for t in doc["tokens"]),
        f"prefill {len(prompt)} tokens in {doc['prefill_s']:.3f} s; decode {doc['decode_steps']} steps in "
        f"{doc['decode_s']:.3f} s ({tok_s}); load {doc['load_s']:.2f} s on {backend}",
        *(f"wrote {k.replace('_out', '')}: {v}" for k, v in written.items())]))


def run_with_plan(weights, plan_path: str, prompt: list[int], n_tokens: int, backend: str,
                  read_threads: int | None, stats_out: str | None, usage_out: str | None) -> None:
    """`run --plan`: refuse a plan for another model, warn about another machine, run, report."""
    from colibri_plan.cli.common import warn
    from colibri_plan.engine.moe import RoutingRecorder
    from colibri_plan.engine.pack import PackedModel
    from colibri_plan.engine.placement import Placement
    from colibri_plan.engine.session import run_placement
    from colibri_plan.formats.plan import check_model, load_plan
    from colibri_plan.verify import machine_warning, this_machine_fingerprint

    if not isinstance(weights, PackedModel):
        raise InputError("--plan needs an expert pack (colibri-plan model pack / model fixture), not a "
                         "checkpoint folder: streaming reads experts from the pack's experts.bin")
    plan = load_plan(plan_path)
    check_model(plan, weights.spec(), where=str(weights.path))
    w = machine_warning(plan, this_machine_fingerprint())
    if w:
        warn(w)
    if backend not in ("cpu", "numpy"):
        raise InputError(f"--backend {backend}: with --plan, CPU-resident and streamed experts run on a "
                         "host backend (cpu or numpy); GPU experts use the devices the plan names")
    recorder = RoutingRecorder(weights.arch)
    rep = run_placement(weights, Placement.from_layers(plan.doc["layers"]), prompt, n_tokens,
                        cpu_backend=backend, read_threads=read_threads or plan.read_threads,
                        recorder=recorder,
                        progress=lambda m: progress(m, verbose_only=True))
    if rep.io_warning:
        warn(rep.io_warning)
    written = write_stats(recorder, weights, stats_out, usage_out)
    pred = plan.doc.get("predicted", {})
    doc = {"model": str(weights.path), "plan": str(plan_path), "backend": backend, **rep.to_dict(),
           "predicted": {k: pred.get(k) for k in ("tok_s", "decode_s_per_token", "hit_rate",
                                                   "disk_bytes_per_token")},
           **written}

    def human() -> str:
        t = rep.terms
        dev = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t["device_s"].items()) or "none"
        hr = ", ".join(f"{k} {v:.1%}" for k, v in rep.hit_rates.items())
        lines = [" ".join(str(x) for x in rep.tokens),
                 (f"decode {rep.tok_s:.2f} tok/s measured over {rep.decode_steps} step"
                  f"{'s' if rep.decode_steps != 1 else ''}" if rep.decode_steps
                  else "decode n/a (one token: it comes from the prefill, no decode step was timed)")
                 + (f" (plan predicted {pred['tok_s']:.2f})" if pred.get("tok_s") else "")
                 + f"; prefill {len(prompt)} tokens in {rep.prefill_s:.2f} s",
                 f"per token: dense {t['dense_s'] * 1e3:.1f} ms, experts {t['expert_wall_s'] * 1e3:.1f} ms "
                 f"(cpu {t['expert_cpu_s'] * 1e3:.1f} ms, disk wait {t['disk_wait_s'] * 1e3:.1f} ms, "
                 f"devices: {dev})",
                 f"hit rates: {hr}; LRU hit rate {rep.lru_hit_rate:.1%}",
                 f"disk {rep.disk_bytes_per_token / 1e6:.1f} MB/token "
                 f"({'O_DIRECT' if rep.o_direct else 'buffered'}); "
                 f"peak RSS {rep.peak_rss_bytes / 2**30:.2f} GiB",
                 *(f"wrote {k.replace('_out', '')}: {v}" for k, v in written.items())]
        return "\n".join(lines)

    emit(doc, human)
