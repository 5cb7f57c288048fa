"""What the trunk probe measures: trunk-like GEMV shapes, a model's own trunk shapes, cheap weights,
the host CPU as a device (see :mod:`colibri_plan.profiler.trunk_probe`)."""

from __future__ import annotations

import numpy as np

from colibri_plan.formats.arch import ArchConfig
from colibri_plan.profiler.options import DENSE_FORMATS  # noqa: F401 - re-exported (trunk_probe)
from colibri_plan.quant import QuantTensor, quantize

#: trunk-like [out, in] shapes: 4096-wide attention projections, a GQA k/v projection, a 14336-wide FFN
TRUNK_SHAPES = ((4096, 4096), (1024, 4096), (4096, 1024), (14336, 4096), (4096, 14336))
#: decode context lengths of the attention figure, tokens
CONTEXTS = (256, 4096, 32768)
#: backends that compute on the host itself (their memory is the machine's RAM)
HOST_BACKENDS = ("numpy", "cpu")


def tiled_weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> QuantTensor:
    """A valid QuantTensor [out, in] in ``fmt`` whose rows repeat a random block of at most 64 rows
    (building it costs a copy, not a quantization of out · in values)."""
    rows = min(64, out_features)
    block = quantize(np.random.default_rng(seed).standard_normal((rows, in_features), np.float32), fmt)
    reps = -(-out_features // rows)

    def tile(a: np.ndarray | None) -> np.ndarray | None:
        if a is None:
            return None
        return np.ascontiguousarray(np.tile(a, (reps,) + (1,) * (a.ndim - 1))[:out_features])

    return QuantTensor(fmt, out_features, in_features, tile(block.data), tile(block.scales))


def model_dense_shapes(arch: ArchConfig, name: str = "model") -> list[tuple[int, int, str]]:
    """The distinct [out, in] GEMV shapes of a model's trunk, from its
    :class:`~colibri_plan.formats.arch.ArchConfig`: attention projections (GQA q/k/v/o, or MLA's q_a/q_b
    or q, kv_a, kv_b and o), the fused shared-expert MLP, the dense FFN layers' MLP and the LM head.

    Returns:
        [(out_features, in_features, "NAME tensor")], one per distinct shape (the first tensor names it).
    """
    a, h = arch, arch.hidden_size
    named: list[tuple[str, int, int]] = []
    if a.attention == "mla":
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            named += [("q_a_proj", a.q_lora_rank, h), ("q_b_proj", a.n_heads * qk, a.q_lora_rank)]
        else:
            named.append(("q_proj", a.n_heads * qk, h))
        named += [("kv_a_proj", a.kv_lora_rank + a.qk_rope_head_dim, h),
                  ("kv_b_proj", a.n_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                  ("o_proj", h, a.n_heads * a.v_head_dim)]
    else:
        named += [("q_proj", a.n_heads * a.head_dim, h), ("k_proj", a.n_kv_heads * a.head_dim, h),
                  ("o_proj", h, a.n_heads * a.head_dim)]
    for what, width in (("shared_expert", a.shared_intermediate_size),
                        ("dense_mlp", a.dense_intermediate_size if len(a.moe_layers) < a.n_layers else 0)):
        if width:
            named += [(f"{what} gate/up", width, h), (f"{what} down", h, width)]
    named.append(("lm_head", a.vocab_size, h))
    out: dict[tuple[int, int], str] = {}
    for what, o, i in named:
        if o > 0 and i > 0:
            out.setdefault((int(o), int(i)), f"{name} {what}")
    return [(o, i, s) for (o, i), s in out.items()]


def host_device() -> dict | None:
    """The host CPU as a device dict: the ``cpu`` backend (numba), else ``numpy``; None when neither
    lists a device (never raises)."""
    from colibri_plan.backends import get_backend

    for name in HOST_BACKENDS[::-1]:
        try:
            cls = get_backend(name)
            devs = [] if cls.unavailable_reason() else cls.list_devices()
        except Exception:  # noqa: BLE001 - discovery never raises
            devs = []
        if devs:
            return devs[0].to_dict()
    return None
