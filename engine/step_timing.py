"""What the step probe (colibri_plan/profiler/step_probe.py) runs on the engine: a synthetic pack at a
model's widths (engine/fixture.py) and replayed decode tokens on it, timed (every expert in the GPU's VRAM,
the trunk on the GPU, as bench/cuda_step_profile.py opens a pack). The profiler layer does not import the
engine, so the CLI hands this module in (``StepSettings.runner``). ``geom`` is the profiler's
LayerGeometry and ``settings`` its StepSettings (duck-typed here)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from colibri_plan.errors import InputError, UnsupportedError


def fixture_config(geom, dense_fmt: str, layers: int, settings):
    """The :class:`~colibri_plan.engine.fixture.FixtureConfig` of a synthetic pack at ``geom``'s widths.

    Raises:
        InputError: the geometry has no expert width or vocabulary (a generic layer, not a model's).
    """
    from colibri_plan.engine.fixture import FixtureConfig

    vocab = int(getattr(geom, "vocab", 0) or settings.vocab)
    if not geom.expert_width or vocab < 2:
        raise InputError("step probe: the model's expert width and vocabulary are needed (profile --model)")
    k = max(1, int(geom.top_k))
    experts = min(int(geom.n_experts), settings.max_experts or 2 * k)
    return FixtureConfig(layers=int(layers), experts=max(k, experts), top_k=k, hidden=int(geom.hidden),
                         width=int(geom.expert_width), vocab=vocab, heads=int(geom.n_heads),
                         kv_heads=int(geom.n_kv_heads), head_dim=int(geom.head_dim), quant=geom.expert_fmt,
                         dense_format=dense_fmt)


def decode_rounds(pack_dir, be, key: str, settings,
            clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """Median seconds of one replayed decode token per round on ``be`` (every expert resident there)."""
    from colibri_plan.backends import get_backend
    from colibri_plan.engine.forward import Model
    from colibri_plan.engine.pack import open_pack
    from colibri_plan.engine.placement import Placement
    from colibri_plan.engine.residency import ResidencyManager

    out = []
    with open_pack(pack_dir) as pack:
        a = pack.arch
        host = get_backend("numpy").open(0)   # computes nothing: every expert is on the device
        rm = ResidencyManager(pack, Placement.all_resident(a.moe_layers, a.n_experts, key), host,
                              devices={key: be})
        try:
            with Model(pack, experts=rm, trunk_backend=be, context_tokens=settings.context_tokens) as model:
                trunk = model.trunk
                cache = model.new_cache(settings.context_tokens)
                ids = np.arange(2, 2 + settings.prompt_tokens) % a.vocab_size
                tok = int(np.argmax(trunk.last_logits(ids, cache)))
                for _ in range(settings.warm_tokens):
                    tok = int(np.argmax(trunk.last_logits(np.array([tok]), cache)))
                if trunk.graph_off is not None:
                    raise UnsupportedError(f"step probe: the decode step is not replayed ({trunk.graph_off})")
                for _ in range(settings.rounds):
                    secs = []
                    for _ in range(settings.round_tokens):
                        t0 = clock()
                        tok = int(np.argmax(trunk.last_logits(np.array([tok]), cache)))
                        secs.append(clock() - t0)
                    out.append(statistics.median(secs))
                if trunk.graph_off is not None:   # a capture refused mid-way: eager steps were timed
                    raise UnsupportedError(f"step probe: replay stopped ({trunk.graph_off})")
        finally:
            rm.close()
            host.close()
    return out


def build_pack(path, geom, dense_fmt: str, layers: int, settings):
    """Write the synthetic pack of ``layers`` layers at ``geom``'s widths to ``path``; returns its
    FixtureConfig."""
    from colibri_plan.engine.fixture import build_fixture

    cfg = fixture_config(geom, dense_fmt, layers, settings)
    build_fixture(path, cfg)
    return cfg
