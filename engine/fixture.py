"""A deterministic synthetic MoE model written straight into the pack format (benchmarks, demo, tests).

Defaults give real GLM-5.2 routed-expert geometry — hidden 6144, expert width 2048, int4 per-row, 64
experts, top-8 — with 3 MoE layers, a 4096-token vocabulary and small GQA attention, about 3.6 GB on
disk. The architecture is a GLM-4.x-MoE decoder (``glm4_moe``: sigmoid router whose expert *choice*
adds a per-expert ``e_score_correction_bias``), so the engine's ordinary forward pass runs it.

Routing skew (method in ``docs/fixture.md``): each fixture layer takes the selection probabilities of a
recorded OLMoE layer (0, 7, 15 spread over the fixture's depth) on one text domain, and the per-expert
router bias is fitted so that top-k choice on ``sigmoid(x · Wᵀ) + bias`` for random unit-RMS inputs
reproduces those probabilities. Expert weights are random integer codes generated directly as bytes
(seeded per (seed, layer, expert), so any expert can be regenerated alone) with per-row scales chosen to
keep activations O(1). The LM head is the embedding with rows permuted by one long cycle, so greedy
decoding walks through the vocabulary instead of repeating a few tokens (routing stays varied).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from colibri_plan.engine.pack import PackWriter
from colibri_plan.engine.pack_target import check_pack_space
from colibri_plan.errors import InputError
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.quant import FLOAT_FORMATS, check_format, data_shape, quantize, scale_dtype, scales_shape

#: the OLMoE layers with recorded counts
_REAL_LAYERS = (0, 7, 15)
#: mean of q² of the zero-mean random codes of :func:`_zero_mean_codes` (int4: q in -7..7 with 0 twice as
#: likely; int2: -1..1 with 0 twice as likely; int8: -127..127, 0 twice as likely)
_Q2 = {4: 17.5, 2: 0.5, 8: 5376.0}


@dataclass(frozen=True)
class FixtureConfig:
    """Settings of a fixture (all sizes in elements).

    Attributes:
        layers, experts, top_k, hidden, width: MoE layers, routed experts per layer, top-k, H, expert I.
        vocab, heads, kv_heads, head_dim: the small trunk.
        quant: expert quant format. dense_format: format of the trunk's matrices in the pack
            (engine/dense_quant.py; f32 by default). seed: master seed. domain: OLMoE text domain for the
            routing skew.
        router_std: standard deviation of the router logits x · Wᵀ for unit-RMS x.
    """

    # the MoE part: GLM-5.2's expert geometry (H 6144, I 2048, top-8), few layers and experts
    layers: int = 3
    experts: int = 64
    top_k: int = 8
    hidden: int = 6144
    width: int = 2048
    # the small trunk
    vocab: int = 4096
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    quant: str = "int4"
    dense_format: str = "f32"
    seed: int = 0
    domain: str = "tulu"
    router_std: float = 1.0

    @classmethod
    def small(cls, **kw) -> FixtureConfig:
        """Small geometry for tests: hidden 256, width 128, vocab 512, head_dim 32 (64 experts, 3 layers)."""
        base = dict(hidden=256, width=128, vocab=512, head_dim=32)
        base.update({k: v for k, v in kw.items() if v is not None})
        return cls(**base)

    def arch(self) -> ArchConfig:
        """The fixture's ArchConfig (glm4_moe decoder, every layer MoE, no shared expert)."""
        return ArchConfig(
            family="glm4_moe", architecture="ColibriFixture", vocab_size=self.vocab,
            hidden_size=self.hidden,
            n_layers=self.layers, n_heads=self.heads, n_kv_heads=self.kv_heads, head_dim=self.head_dim,
            n_experts=self.experts, top_k=self.top_k, moe_intermediate_size=self.width,
            moe_layers=tuple(range(self.layers)), partial_rotary_factor=0.5, rms_norm_eps=1e-5,
            scoring="sigmoid", norm_topk_prob=True, routed_scaling_factor=1.0,
            e_score_correction_bias=True)

    def check(self) -> None:
        """Raises InputError / UnsupportedError for impossible settings."""
        check_format(self.quant)
        for name in ("layers", "experts", "top_k", "hidden", "width", "vocab", "heads", "kv_heads",
                     "head_dim"):
            if int(getattr(self, name)) < 1:
                raise InputError(f"fixture: --{name.replace('_', '-')} must be >= 1")
        if self.top_k > self.experts:
            raise InputError(f"fixture: top-k {self.top_k} > experts {self.experts}")
        if self.vocab < 2:
            raise InputError("fixture: vocab must be >= 2")


def target_probabilities(cfg: FixtureConfig) -> np.ndarray:
    """Per fixture layer, the selection probability of each expert, float64 [layers, E] (rows sum to
    top_k): the OLMoE layer nearest in relative depth on ``cfg.domain``, resampled to E experts.

    Raises:
        InputError: unknown domain.
    """
    from colibri_plan.heatsynth import real_heat, resample_profile

    heat = real_heat("olmoe", cfg.domain)
    probs = heat.probabilities()  # [3, 64], rows sum to 8
    rows = []
    for i in range(cfg.layers):
        rel = i / max(cfg.layers - 1, 1)
        j = int(np.argmin([abs(rel - r / _REAL_LAYERS[-1]) for r in _REAL_LAYERS]))
        p = probs[j]
        if cfg.experts == p.size and cfg.top_k == heat.top_k:
            rows.append(p.copy())  # keep OLMoE's own expert order
        else:
            ranked = resample_profile(p, cfg.experts, cfg.top_k)
            perm = np.random.default_rng([cfg.seed, 7, i]).permutation(cfg.experts)
            out = np.empty(cfg.experts)
            out[perm] = ranked
            rows.append(out)
    return np.array(rows)


def fit_router_bias(logits: np.ndarray, target: np.ndarray, top_k: int, iters: int = 400) -> np.ndarray:
    """Per-expert bias b [E] such that top-k of ``sigmoid(logits) + b`` picks expert e with frequency
    close to ``target[e]``.

    Args:
        logits: float [M, E] router logits of M sample inputs.
        target: float [E] selection probabilities (sum == top_k).

    Method: stochastic approximation, b_e += step · (target_e − observed_e), with the step shrinking
    over the iterations; the observed frequency is the share of the M samples choosing e.
    """
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))  # [M, E]
    m, e = scores.shape
    b = np.log(np.maximum(target, 1e-6) / top_k) * 0.1  # start in the right order
    for it in range(iters):
        biased = scores + b  # [M, E]
        top = np.argpartition(-biased, top_k - 1, axis=1)[:, :top_k]  # ids [M, K]
        freq = np.bincount(top.ravel(), minlength=e) / m
        step = 0.5 * (1.0 - it / iters) + 0.02
        b += step * (target - freq)
    return b.astype(np.float32)


def _zero_mean_codes(raw: bytes, bits: int) -> np.ndarray:
    """Random bytes -> packed codes whose values have mean 0: the most negative value (code 0 of int4 /
    int2, -128 of int8) is replaced by zero. Uniform codes would have mean -0.5, a rank-one common
    component that adds up over the width and makes every token's hidden state drift the same way
    (it concentrated the routing of deeper layers at full size)."""
    a = np.frombuffer(raw, dtype=np.uint8)
    return _code_table(bits)[a].view(np.int8 if bits == 8 else np.uint8)


def _code_table(bits: int) -> np.ndarray:
    """uint8 [256]: each byte with every code equal to the most negative value replaced by zero."""
    a = np.arange(256, dtype=np.uint8)
    if bits == 8:
        return np.where(a == 0x80, 0, a).astype(np.uint8)
    zero, mask = (8, 0x0F) if bits == 4 else (2, 0x03)
    out = np.zeros_like(a)
    for shift in range(0, 8, bits):
        c = (a >> shift) & mask
        out |= (np.where(c == 0, zero, c).astype(np.uint8) << shift).astype(np.uint8)
    return out


def _matrix(rng: np.random.Generator, fmt: str, out_f: int, in_f: int, std_out: float) -> list[np.ndarray]:
    """Random stored arrays of one [out, in] weight whose product with unit-RMS x has std ~``std_out``."""
    if fmt in FLOAT_FORMATS:
        w = rng.standard_normal((out_f, in_f), dtype=np.float32) * np.float32(std_out / np.sqrt(in_f))
        return [quantize(w, fmt).data]
    shape = data_shape(fmt, out_f, in_f)
    bits = 8 if fmt == "int8" else 2 if fmt == "int2" else 4
    data = _zero_mean_codes(rng.bytes(int(np.prod(shape))), bits)
    base = std_out / np.sqrt(_Q2[bits] * in_f)
    scales = (base * rng.uniform(0.75, 1.25, size=scales_shape(fmt, out_f, in_f))).astype(scale_dtype(fmt))
    return [data.reshape(shape), scales]


def _dense(cfg: FixtureConfig, arch: ArchConfig, bias: np.ndarray, routers: np.ndarray) -> dict:
    rng = np.random.default_rng([cfg.seed, 1])
    H, V, d = cfg.hidden, cfg.vocab, cfg.head_dim
    f32 = np.float32
    embed = rng.standard_normal((V, H), dtype=f32)
    cycle = rng.permutation(V)  # next(cycle[i]) = cycle[i + 1]: one cycle through every token
    sigma = np.empty(V, dtype=np.int64)
    sigma[cycle] = np.roll(cycle, -1)
    lm_head = np.empty_like(embed)
    lm_head[sigma] = embed  # row sigma(t) = embed[t]: argmax after token t is sigma(t)
    dense = {"embed": embed, "lm_head": lm_head, "final_norm": np.ones(H, f32)}
    for layer in range(cfg.layers):
        p = f"layers.{layer}."
        dense[p + "attn_norm"] = np.ones(H, f32)
        dense[p + "ffn_norm"] = np.ones(H, f32)
        dense[p + "attn.q"] = rng.standard_normal((cfg.heads * d, H), dtype=f32) / f32(np.sqrt(H))
        dense[p + "attn.k"] = rng.standard_normal((cfg.kv_heads * d, H), dtype=f32) / f32(np.sqrt(H))
        dense[p + "attn.v"] = rng.standard_normal((cfg.kv_heads * d, H), dtype=f32) / f32(np.sqrt(H))
        dense[p + "attn.o"] = (rng.standard_normal((H, cfg.heads * d), dtype=f32)
                               * f32(0.3 / np.sqrt(cfg.heads * d)))
        dense[p + "router"] = routers[layer]
        dense[p + "router_bias"] = bias[layer]
    return dense


def build_fixture(out_dir, cfg: FixtureConfig | None = None, overwrite: bool = False,
                  progress=None) -> dict:
    """Write the fixture pack to ``out_dir`` (atomic, streaming: one expert in memory at a time).

    Args:
        progress: optional ``fn(done_experts, total)``.

    Returns:
        a summary dict: path, experts, expert_block_bytes, experts_file_bytes, seconds, target top-8
        shares per layer.

    Raises:
        InputError: bad settings, ``out_dir`` exists, unknown domain.
    """
    cfg = cfg or FixtureConfig()
    cfg.check()
    arch = cfg.arch()
    t0 = time.perf_counter()
    target = target_probabilities(cfg)  # [layers, E]
    rng = np.random.default_rng([cfg.seed, 2])
    std = cfg.router_std / np.sqrt(cfg.hidden)
    routers = (rng.standard_normal((cfg.layers, cfg.experts, cfg.hidden), dtype=np.float32) * np.float32(std))
    biases = []
    for layer in range(cfg.layers):
        # calibration inputs: random unit-RMS hidden states, as rmsnorm makes the router's input
        xs = np.random.default_rng([cfg.seed, 3, layer]).standard_normal((4096, cfg.hidden),
                                                                          dtype=np.float32)
        biases.append(fit_router_bias(xs @ routers[layer].T, target[layer], cfg.top_k))
    biases = np.array(biases)
    name = Path(out_dir).name
    with PackWriter(out_dir, arch, cfg.quant, name=name, source="synthetic fixture",
                    overwrite=overwrite) as w:
        total = cfg.layers * cfg.experts
        check_pack_space(w.out, total * w.layout.block_bytes, 0)   # a full disk fails before the experts
        for layer in range(cfg.layers):
            for e in range(cfg.experts):
                erng = np.random.default_rng([cfg.seed, 100 + layer, e])
                parts = (_matrix(erng, cfg.quant, cfg.width, cfg.hidden, 1.0)
                         + _matrix(erng, cfg.quant, cfg.width, cfg.hidden, 1.0)
                         + _matrix(erng, cfg.quant, cfg.hidden, cfg.width, 1.0))
                w.add_expert_parts(layer, e, parts)
                if progress is not None:
                    progress(layer * cfg.experts + e + 1, total)
        w.write_dense(_dense(cfg, arch, biases, routers), cfg.dense_format)
        top8 = [float(np.sort(t)[::-1][:8].sum() / t.sum()) for t in target]
        extra = {"fixture": {**cfg.__dict__,
                             "routing": f"OLMoE top-k counts on {cfg.domain}; each layer uses the recorded "
                                        "OLMoE layer (0, 7, 15) nearest in relative depth (docs/fixture.md)",
                             "target_probabilities": target.round(6).tolist(), "target_top8_share": top8}}
        path = w.commit(extra=extra)
    return {"path": str(path), "experts": cfg.layers * cfg.experts,
            "expert_block_bytes": w.layout.block_bytes,
            "experts_file_bytes": w.layout.block_bytes * cfg.layers * cfg.experts,
            "seconds": time.perf_counter() - t0, "target_top8_share": top8}


def top8_share(counts: np.ndarray, n: int = 8) -> np.ndarray:
    """Per row of ``counts`` [rows, E], the share of selections on its ``n`` most-selected experts."""
    c = np.asarray(counts, dtype=np.float64)
    return np.sort(c, axis=1)[:, ::-1][:, :n].sum(axis=1) / np.maximum(c.sum(axis=1), 1e-300)


def fixture_prompt(vocab: int, n_tokens: int, seed: int = 0) -> list[int]:
    """``n_tokens`` distinct token ids (while the vocabulary allows), seeded: the measurement prompt."""
    rng = np.random.default_rng([seed, 5])
    ids = rng.permutation(vocab)
    reps = -(-n_tokens // vocab)
    return [int(i) for i in np.tile(ids, reps)[:n_tokens]]
