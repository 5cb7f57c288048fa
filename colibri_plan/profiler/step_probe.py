"""Step probe: the decode step as the engine replays it from a captured graph (section ``step_graph``).

The trunk probes (:mod:`colibri_plan.profiler.trunk_probe`, :mod:`~colibri_plan.profiler.trunk_layer_probe`)
time eager op sequences: every op launched from the host, a MoE layer's routing handed to numpy. On a GPU
backend that declares the optional op ``d_capture_step`` (CUDA), the engine instead replays the whole
decode step (engine/decode_graph.py): one launch, the routing and the experts on the device, the logits
and routings down in one synchronisation. Neither the eager layer nor the per-call ``expert_ffn`` figures
say what that costs, so this probe runs the real engine on it:

- two synthetic packs (engine/fixture.py) with the model's widths (hidden, heads, KV heads, head dim,
  vocabulary, expert width, top-k; the dense trunk in the probe's dense format, the experts in the model's
  expert format) and ``layers_short`` and ``layers_long`` MoE layers (default 2 and 4);
- each opened as the engine opens a plan with every expert in this GPU's VRAM and the trunk on it
  (:class:`~colibri_plan.engine.forward.Model` with a
  :class:`~colibri_plan.engine.residency.ResidencyManager`, as bench/cuda_step_profile.py does), a short
  prompt and ``warm_tokens`` decode steps (the first ones compile and capture), then ``rounds`` rounds of
  ``round_tokens`` decode tokens, each token timed alone (its logits come back to the host, so a token's
  wall time is its whole step); a round's figure is the median of its tokens (the eager timed step the
  engine samples now and then, or a recapture, is an outlier the median drops);
- per round, :func:`split_step`: layer = (long − short) / (layers_long − layers_short), fixed = short −
  layers_short · layer (embedding row in, final norm, LM head, logits out, the host's share of a step).

The experts of a fixture layer are at most ``max_experts`` (default 2 · top-k, fewer to build than the
model's; a token still reads top-k distinct experts per layer, so the bytes a step reads are the model's).
The entry records the shapes, so a planner uses it for a model of those shapes only
(:func:`colibri_plan.formats.profile_trunk.step_graph`).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from colibri_plan.errors import InputError, UnsupportedError
from colibri_plan.formats.profile import stat
from colibri_plan.profiler.trunk_layer_probe import LayerGeometry

#: seconds below which a difference of two timed steps is noise: figures are floored there (a profile's
#: seconds must be positive)
FLOOR_S = 1e-9


@dataclass(frozen=True)
class StepSettings:
    """How the step probe runs (tokens; see the module docstring).

    Attributes:
        layers_short, layers_long: MoE layers of the two synthetic packs. prompt_tokens: the prompt each
            cache starts with. warm_tokens: decode steps before timing (compiles, captures; past them the
            position stays in one attention bucket for the timed rounds). rounds, round_tokens: timed
            rounds and tokens per round. context_tokens: the cache the model reserves. max_experts:
            experts per fixture layer at most (at least top-k). vocab: the vocabulary when the geometry
            has none. runner: what builds and decodes the packs, :mod:`colibri_plan.engine.step_timing`
            (handed in by the CLI: the profiler layer does not import the engine); None: no step probe.
    """

    layers_short: int = 2
    layers_long: int = 4
    prompt_tokens: int = 4
    warm_tokens: int = 62
    rounds: int = 4
    round_tokens: int = 8
    context_tokens: int = 256
    max_experts: int = 0
    vocab: int = 0
    runner: object = None


def split_step(short_s: list[float], long_s: list[float], layers_short: int,
               layers_long: int) -> tuple[list[float], list[float]]:
    """Per-layer and fixed seconds of a replayed step from the two packs' step seconds, round by round.

    Args:
        short_s, long_s: seconds of one decode token (one figure per round, same length) with
            ``layers_short`` and ``layers_long`` layers (``layers_long > layers_short``).

    Returns:
        ([layer seconds], [fixed seconds]) per round: layer = (long − short) / (layers_long −
        layers_short), fixed = short − layers_short · layer, each floored at :data:`FLOOR_S`. E.g. 2 and
        4 layers, 310 µs and 520 µs: layer 105 µs, fixed 100 µs.

    Raises:
        InputError: lists of other lengths, or layers_long <= layers_short.
    """
    if len(short_s) != len(long_s) or not short_s:
        raise InputError(f"step probe: {len(short_s)} short and {len(long_s)} long rounds; need as many, "
                         ">= 1")
    if layers_long <= layers_short:
        raise InputError(f"step probe: layers_long {layers_long} must be more than layers_short "
                         f"{layers_short}")
    layer, fixed = [], []
    for s, lo in zip(short_s, long_s):
        per = (float(lo) - float(s)) / (layers_long - layers_short)
        layer.append(max(per, FLOOR_S))
        fixed.append(max(float(s) - layers_short * max(per, 0.0), FLOOR_S))
    return layer, fixed


def probe_step(be, base: dict, geom: LayerGeometry, dense_fmt: str, settings: StepSettings | None = None,
               workdir: str | None = None, progress: Callable[[str], None] | None = None) -> dict:
    """The ``step_graph`` entry of an opened GPU backend that declares ``d_capture_step``.

    Args:
        base: backend, device_index, device_name. geom: the model's layer (``profile --model``; with
            ``vocab``). dense_fmt: the trunk's format in the packs. workdir: where the packs are written
            (a temporary folder, removed after; None: the system's).

    Raises:
        UnsupportedError: the backend captures no step, or the engine did not replay it. InputError: no
        model shapes. Whatever the engine raises (the caller records the device as skipped).
    """
    from colibri_plan.quant import tensor_bytes

    st = settings or StepSettings()
    say = progress or (lambda _m: None)
    if st.runner is None:
        raise UnsupportedError("step probe: no engine runner was handed in (colibri_plan.engine.step_timing)")
    if not be.supports("d_capture_step"):
        raise UnsupportedError(f"{base['backend']} captures no decode step (no d_capture_step)")
    key = f"{base['backend']}:{base['device_index']}"
    runs = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="colibri-step-", dir=workdir) as tmp:
        for n in (st.layers_short, st.layers_long):
            say(f"trunk: {key} step_graph: {n}-layer pack ({dense_fmt} trunk)")
            cfg = st.runner.build_pack(Path(tmp) / f"step{n}", geom, dense_fmt, n, st)
            runs[n] = st.runner.decode_rounds(Path(tmp) / f"step{n}", be, key, st)
    layer, fixed = split_step(runs[st.layers_short], runs[st.layers_long], st.layers_short, st.layers_long)
    h, w, fmt = int(geom.hidden), int(geom.expert_width), geom.expert_fmt
    expert_bytes = 2 * tensor_bytes(fmt, w, h) + tensor_bytes(fmt, h, w)
    experts = cfg.experts
    return {**base, "fmt": dense_fmt, "expert_fmt": fmt, "hidden": h, "n_heads": int(geom.n_heads),
            "n_kv_heads": int(geom.n_kv_heads), "head_dim": int(geom.head_dim), "vocab": int(cfg.vocab),
            "n_experts": int(geom.n_experts), "fixture_experts": int(experts), "top_k": int(geom.top_k),
            "expert_width": w, "expert_bytes": int(expert_bytes),
            # q/k/v/o in the dense format + the router [E, H] float32: what a layer reads beside its experts
            "layer_trunk_bytes": int(geom.weight_bytes(dense_fmt) + 4 * experts * h),
            "context_tokens": int(st.prompt_tokens + st.warm_tokens + st.rounds * st.round_tokens // 2),
            "layers_short": int(st.layers_short), "layers_long": int(st.layers_long),
            "round_tokens": int(st.round_tokens), "step_short_seconds": stat(runs[st.layers_short]),
            "step_long_seconds": stat(runs[st.layers_long]), "layer_seconds": stat(layer),
            "fixed_seconds": stat(fixed), "probe_seconds": round(time.perf_counter() - t_start, 2),
            "method": f"synthetic packs of {st.layers_short} and {st.layers_long} layers at the model's "
                      "widths, every expert in VRAM, the trunk on the device; per round the median of "
                      f"{st.round_tokens} replayed decode tokens; layer = (long - short) / "
                      f"{st.layers_long - st.layers_short}, fixed = short - {st.layers_short} x layer"}
