"""Model weights under canonical engine names, and the Hugging Face safetensors importer.

Canonical dense names (float32 numpy arrays; W is [out, in] as in ``torch.nn.Linear``). The HF names
below are the common ones; each family's own (Mixtral's ``block_sparse_moe``, Qwen2-MoE's shared expert
and its gate, GLM's ``shared_experts`` and router bias) are declared in its file under
``colibri_plan/families/`` (``TENSORS``, :func:`colibri_plan.families.tensor_names`):

| name                                   | shape            | HF source (``model.layers.{i}.`` prefix)       |
|----------------------------------------|------------------|------------------------------------------------|
| embed                                  | [V, H]           | model.embed_tokens.weight                      |
| final_norm                             | [H]              | model.norm.weight                              |
| lm_head                                | [V, H]           | lm_head.weight (absent when tied)              |
| layers.{i}.attn_norm / ffn_norm        | [H]              | input_layernorm / post_attention_layernorm     |
| layers.{i}.attn.q / k / v / o          | [nh·d, H] ...    | self_attn.{q,k,v,o}_proj.weight                |
| layers.{i}.attn.q_bias / k_bias / ...  | [out]            | self_attn.{q,k,v,o}_proj.bias (when present)   |
| layers.{i}.attn.q_norm / k_norm        | [d] or [nh·d]    | self_attn.{q,k}_norm.weight                    |
| layers.{i}.router                      | [E, H]           | mlp.gate.weight / block_sparse_moe.gate.weight |
| layers.{i}.router_bias                 | [E]              | mlp.gate.e_score_correction_bias               |
| layers.{i}.shared.gate / up / down     | [Is, H], [H, Is] | mlp.shared_expert(s).{gate,up,down}_proj       |
| layers.{i}.shared_gate                 | [1, H]           | mlp.shared_expert_gate.weight (Qwen2-MoE)      |
| layers.{i}.ffn.gate / up / down        | [Id, H], [H, Id] | mlp.{gate,up,down}_proj (dense layers)         |
| layers.{i}.attn.indexer.wq_b / wk /    | [nI·dI, Rq] ...  | self_attn.indexer.{wq_b,wk,k_norm,             |
|   k_norm / k_norm_bias / weights_proj  |                  | weights_proj} (DSA; engine/mla.py)             |

Routed experts (never in ``dense``): ``expert(layer, e) -> (gate [I, H], up [I, H], down [H, I])``
QuantTensors; HF ``mlp.experts.{e}.{gate,up,down}_proj`` or Mixtral ``block_sparse_moe.experts.{e}.
{w1,w3,w2}`` (w1 = gate, w3 = up, w2 = down), or the fused ``mlp.experts.gate_up_proj`` [E, 2I, H] /
``mlp.experts.down_proj`` [E, H, I].
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from colibri_plan.engine.fp8 import block_size as fp8_block_size
from colibri_plan.engine.fp8 import is_fp8_scale
from colibri_plan.errors import FormatError, InputError, UnsupportedError
from colibri_plan.families import arch_from_config, plan_geometry, tensor_names
from colibri_plan.fileio import read_json_object
from colibri_plan.formats.arch import ArchConfig
from colibri_plan.formats.st_header import extra_layers, regular_file, tensor_files
from colibri_plan.quant import QuantTensor, check_format, quantize


class ModelWeights:
    """Base class of every weight source the forward pass can run.

    Attributes:
        arch: the architecture.
        dense: canonical name -> float32 array (see the module table).
        expert_format: quant format of the routed experts (``colibri_plan.quant.FORMATS``).
        source: where the weights came from ("checkpoint: <path>", "pack: <path>", "synthetic").

    Subclasses implement :meth:`_expert`; :meth:`expert` checks the ids first.
    """

    arch: ArchConfig
    dense: dict[str, np.ndarray]
    expert_format: str
    source: str

    def expert(self, layer: int, e: int) -> tuple[QuantTensor, QuantTensor, QuantTensor]:
        """(gate [I, H], up [I, H], down [H, I]) of expert ``e`` of MoE layer ``layer``, in ``expert_format``.

        Raises:
            InputError: ``layer`` is not a MoE layer or ``e`` is out of range.
        """
        if layer not in self.arch.moe_layers:
            raise InputError(f"layer {layer} has no routed experts "
                             f"(MoE layers: {_span(self.arch.moe_layers)})")
        if not 0 <= e < self.arch.n_experts:
            raise InputError(f"expert {e} out of range 0..{self.arch.n_experts - 1}")
        return self._expert(int(layer), int(e))

    def _expert(self, layer: int, e: int) -> tuple[QuantTensor, QuantTensor, QuantTensor]:
        raise NotImplementedError

    def expert_keys(self) -> Iterator[tuple[int, int]]:
        """(layer, expert) for every routed expert, layer-major."""
        for layer in self.arch.moe_layers:
            for e in range(self.arch.n_experts):
                yield layer, e

    def tensor(self, name: str) -> np.ndarray:
        """``dense[name]``.

        Raises:
            FormatError: no tensor of that name (says which model/source lacks it).
        """
        try:
            return self.dense[name]
        except KeyError:
            raise FormatError(f"{self.source}: dense tensor {name!r} is missing") from None


def _span(ids) -> str:
    ids = list(ids)
    return "none" if not ids else f"{ids[0]}..{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) \
        else ", ".join(map(str, ids))


def expected_dense_shapes(arch: ArchConfig, present: set[str] | None = None) -> dict[str, tuple[int, ...]]:
    """Canonical dense names -> shapes the forward pass needs for ``arch``.

    Optional tensors (attention biases, ``router_bias`` when not required) are included only when their
    name is in ``present``.
    """
    present = present or set()
    h, d, nh, nkv = arch.hidden_size, arch.head_dim, arch.n_heads, arch.n_kv_heads
    out = {"embed": (arch.vocab_size, h), "final_norm": (h,)}
    if not arch.tie_word_embeddings:
        out["lm_head"] = (arch.vocab_size, h)
    for i in range(arch.n_layers):
        p = f"layers.{i}."
        out.update({p + "attn_norm": (h,), p + "ffn_norm": (h,)})
        if arch.attention == "mla":  # q_a/q_b (or q), kv_a, kv_b, o: engine/mla.py
            from colibri_plan.engine.mla import mla_dense_shapes
            out.update(mla_dense_shapes(arch, i, present))
        else:
            out.update({p + "attn.q": (nh * d, h), p + "attn.k": (nkv * d, h), p + "attn.v": (nkv * d, h),
                        p + "attn.o": (h, nh * d)})
            for b, n in (("q", nh * d), ("k", nkv * d), ("v", nkv * d), ("o", h)):
                if p + f"attn.{b}_bias" in present or (arch.attention_bias and b != "o"):
                    out[p + f"attn.{b}_bias"] = (n,)
        if arch.qk_norm == "head":
            out[p + "attn.q_norm"] = (d,)
            out[p + "attn.k_norm"] = (d,)
        elif arch.qk_norm == "full":  # OLMoE sizes k_norm by (H // n_heads) · n_kv_heads
            out[p + "attn.q_norm"] = (h,)
            out[p + "attn.k_norm"] = ((h // nh) * nkv,)
        if arch.is_moe_layer(i):
            out[p + "router"] = (arch.n_experts, h)
            if arch.e_score_correction_bias or p + "router_bias" in present:
                out[p + "router_bias"] = (arch.n_experts,)
            si = arch.shared_intermediate_size
            if si:
                out.update({p + "shared.gate": (si, h), p + "shared.up": (si, h), p + "shared.down": (h, si)})
            if arch.shared_expert_gate:
                out[p + "shared_gate"] = (1, h)
        else:
            di = arch.dense_intermediate_size
            out.update({p + "ffn.gate": (di, h), p + "ffn.up": (di, h), p + "ffn.down": (h, di)})
    return out


def check_dense(arch: ArchConfig, dense: dict[str, np.ndarray], source: str) -> None:
    """Check that ``dense`` holds every tensor ``arch`` needs with the right shape.

    Raises:
        FormatError: lists missing and mis-shaped names (up to 5 each).
    """
    want = expected_dense_shapes(arch, set(dense))
    missing = [n for n in want if n not in dense]
    wrong = [f"{n} {tuple(dense[n].shape)} (want {want[n]})" for n in want
             if n in dense and tuple(dense[n].shape) != want[n]]
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:5])}" + (f" (+{len(missing) - 5} more)"
                                                                   if len(missing) > 5 else ""))
        if wrong:
            parts.append(f"wrong shape {', '.join(wrong[:5])}")
        raise FormatError(f"{source}: " + "; ".join(parts))


class InMemoryWeights(ModelWeights):
    """Weights held in RAM: ``experts[(layer, e)] = (gate, up, down)`` QuantTensors (fixtures, tests).

    Raises:
        FormatError: a dense tensor or an expert is missing or has the wrong shape.
    """

    def __init__(self, arch: ArchConfig, dense: dict[str, np.ndarray],
                 experts: dict[tuple[int, int], tuple[QuantTensor, QuantTensor, QuantTensor]],
                 expert_format: str, source: str = "synthetic"):
        self.arch, self.expert_format, self.source = arch, check_format(expert_format), source
        self.dense = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in dense.items()}
        check_dense(arch, self.dense, source)
        i, h = arch.moe_intermediate_size, arch.hidden_size
        for key in self.expert_keys():
            trio = experts.get(key)
            if trio is None:
                raise FormatError(f"{source}: expert {key[1]} of layer {key[0]} is missing")
            shapes = [(t.out_features, t.in_features) for t in trio]
            if shapes != [(i, h), (i, h), (h, i)] or any(t.fmt != expert_format for t in trio):
                raise FormatError(f"{source}: expert {key[1]} of layer {key[0]} has shapes {shapes} / "
                                  f"formats {[t.fmt for t in trio]}; want [{i},{h}],[{i},{h}],[{h},{i}] "
                                  f"in {expert_format}")
        self._experts = dict(experts)

    def _expert(self, layer, e):
        return self._experts[(layer, e)]


# ---- safetensors reading -------------------------------------------------------------------------

class _Tensors:
    """Every tensor of a checkpoint's safetensors files, by HF name, read as float32 on demand.

    The ``safetensors`` package (numpy framework) reads F32/F16/...; numpy has no bfloat16, so BF16
    tensors are read through a memory map of the file at the header's offsets and widened by a 16-bit
    shift (bf16 is the upper half of a float32).
    """

    def __init__(self, folder: Path):
        from safetensors import safe_open  # light, but only needed here
        self._safe_open = safe_open
        self.where: dict[str, Path] = {}
        self.meta: dict[str, tuple[str, tuple[int, ...], int]] = {}  # name -> (dtype, shape, abs offset)
        # headers checked as safetensors checks them; shards as the index maps them (no duplicates)
        for name, (f, info, start) in tensor_files(folder).items():
            self.where[name] = f
            self.meta[name] = (info["dtype"], tuple(info["shape"]), start + info["data_offsets"][0])
        self._maps: dict[Path, np.memmap] = {}
        self._handles: dict[Path, object] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][1]

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a float32 array."""
        dtype, shape, off = self.meta[name]
        if dtype == "BF16":
            f = self.where[name]
            if f not in self._maps:
                self._maps[f] = np.memmap(f, dtype=np.uint8, mode="r")
            count = int(np.prod(shape, dtype=np.int64))
            bits = self._maps[f][off: off + 2 * count].view("<u2").reshape(shape)
            return (bits.astype(np.uint32) << 16).view(np.float32)
        if dtype.startswith("F8"):  # block-scaled FP8 (DeepSeek-V3): dequantised per block, engine/fp8.py
            from colibri_plan.engine.fp8 import read_fp8
            return read_fp8(self, name)
        if dtype not in ("F32", "F16", "F64"):
            raise UnsupportedError(f"tensor {name} has dtype {dtype}; only F32/F16/BF16 weights are "
                                   "supported")
        f = self.where[name]
        try:
            if f not in self._handles:  # one open handle per shard (safetensors memory-maps it)
                self._handles[f] = self._safe_open(str(f), framework="np")
            return np.ascontiguousarray(self._handles[f].get_tensor(name), dtype=np.float32)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise FormatError(f"{f}: cannot read tensor {name} ({type(exc).__name__}: {exc}); the file is "
                              "corrupt; re-download it") from None


_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)$")


class CheckpointWeights(ModelWeights):
    """A Hugging Face checkpoint: dense tensors in RAM (float32), experts read and quantized on demand."""

    def __init__(self, folder: Path, arch: ArchConfig, tensors: _Tensors, dense: dict[str, np.ndarray],
                 expert_names: dict[tuple[int, int], list], expert_format: str):
        self.folder, self.arch, self.dense = folder, arch, dense
        self.expert_format, self.source = expert_format, f"checkpoint: {folder}"
        self._t, self._names = tensors, expert_names

    def _expert(self, layer, e):
        i, h = self.arch.moe_intermediate_size, self.arch.hidden_size
        names = self._names[(layer, e)]
        if isinstance(names, tuple):  # fused: (gate_up name, down name)
            gu, dn = self._t.get(names[0])[e], self._t.get(names[1])[e]  # [2I, H], [H, I]
            mats = [gu[:i], gu[i:], dn]
        else:
            mats = [self._t.get(n) for n in names]
        for m, want, role in zip(mats, [(i, h), (i, h), (h, i)], ("gate", "up", "down")):
            if tuple(m.shape) != want:
                raise FormatError(f"{self.source}: expert {e} of layer {layer} {role} has shape "
                                  f"{tuple(m.shape)}, want {want}")
        return tuple(quantize(m, self.expert_format) for m in mats)


def load_checkpoint(path, expert_format: str = "f32") -> ModelWeights:
    """Open a Hugging Face checkpoint folder (config.json + *.safetensors).

    Dense tensors are read at once as float32 (BF16 bits shifted into float32, F16 widened); routed
    experts are read on demand by ``expert(layer, e)`` and quantized to ``expert_format`` with
    :func:`colibri_plan.quant.quantize`. Tensors of layers >= ``num_hidden_layers`` (multi-token
    prediction heads) and rotary buffers are ignored; any other unknown tensor is an error, since
    silently dropping a weight would give wrong outputs.

    Raises:
        InputError: the folder, config.json or safetensors files are missing.
        UnsupportedError: unsupported family / attention variant / dtype, unknown format.
        FormatError: tensors missing, of the wrong shape, or unexpected for the family.
    """
    check_format(expert_format)
    folder = Path(path)
    cfg_path = folder / "config.json"
    if not folder.is_dir() or not regular_file(cfg_path, "config.json"):
        raise InputError(f"{folder}: not a Hugging Face checkpoint folder (config.json missing)")
    config = read_json_object(cfg_path, "Hugging Face config.json")
    arch = arch_from_config(config, where=str(cfg_path))
    arch.check_supported()
    names = tensor_names(arch.family)
    tensors = _Tensors(folder)
    tensors.fp8_block = fp8_block_size(config)  # FP8 checkpoints: quantization_config.weight_block_size
    mtp = extra_layers(tensors.where, arch.n_layers, plan_geometry(config, str(cfg_path)).mtp_layers,
                       str(folder))
    dense: dict[str, np.ndarray] = {}
    experts: dict[tuple[int, int], list] = {}
    unknown = []
    for name in tensors.where:
        if name.endswith("rotary_emb.inv_freq") or is_fp8_scale(tensors.meta, name):  # scales: read_fp8
            continue
        top = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm",
               "lm_head.weight": "lm_head"}.get(name)
        if top:
            if not (top == "lm_head" and arch.tie_word_embeddings):
                dense[top] = tensors.get(name)
            continue
        m = _LAYER_RE.match(name)
        if not m:
            unknown.append(name)
            continue
        layer, rest = int(m.group(1)), m.group(2)
        if layer >= arch.n_layers:  # multi-token-prediction layers (checked by extra_layers): not decoded
            continue
        em = names.expert.match(rest)
        if em and arch.is_moe_layer(layer):
            experts.setdefault((layer, int(em.group(1))), [None] * 3)[names.roles[em.group(2)]] = name
        elif rest in names.fused and arch.is_moe_layer(layer):
            for e in range(arch.n_experts):
                slot = experts.setdefault((layer, e), [None, None])
                slot[0 if names.fused[rest] == "gate_up" else 1] = name
        elif rest in names.layer:
            dense[f"layers.{layer}.{names.layer[rest]}"] = tensors.get(name)
        else:
            unknown.append(name)
    if unknown:
        raise FormatError(f"{folder}: {len(unknown)} tensor(s) this {arch.family} importer does not "
                          f"understand, e.g. {', '.join(unknown[:3])}")
    check_dense(arch, dense, f"{folder}")
    unused = sorted(set(dense) - set(expected_dense_shapes(arch, set(dense))))
    if unused:   # weights of a known role the config gives no place (n_shared_experts: 0 over shared ones)
        raise FormatError(f"{folder}: the weights hold {len(unused)} tensor(s) config.json leaves unused, "
                          f"e.g. {', '.join(unused[:3])} (engine names); running without them gives other "
                          "outputs: the config does not belong to these weights (check n_shared_experts and "
                          "the layer fields), fix config.json")
    _check_expert_names(arch, experts, tensors, folder)
    weights = CheckpointWeights(folder, arch, tensors, dense, experts, expert_format)
    if mtp:  # named, never dropped silently
        weights.source += (f" (MTP layer(s) {', '.join(map(str, mtp))} not loaded: the decoder does not "
                           "run them)")
    return weights


def _check_expert_names(arch: ArchConfig, experts: dict, tensors: _Tensors, folder: Path) -> None:
    """Every routed expert has its three matrices (fused tensors become (gate_up, down) tuples)."""
    stray = sorted(k for k in experts if k[1] >= arch.n_experts)
    if stray:
        raise FormatError(f"{folder}: expert {stray[0][1]} of layer {stray[0][0]} exceeds "
                          f"n_experts {arch.n_experts}")
    for key in [(lay, e) for lay in arch.moe_layers for e in range(arch.n_experts)]:
        names = experts.get(key)
        if names is None or None in names:
            raise FormatError(f"{folder}: expert {key[1]} of layer {key[0]} is missing "
                              f"(gate/up/down tensors not all found)")
        if len(names) == 2:
            e, i, h = arch.n_experts, arch.moe_intermediate_size, arch.hidden_size
            if tensors.shape(names[0]) != (e, 2 * i, h) or tensors.shape(names[1]) != (e, h, i):
                raise UnsupportedError(f"{folder}: fused expert tensors of layer {key[0]} have shapes "
                                       f"{tensors.shape(names[0])}, {tensors.shape(names[1])}; only "
                                       f"[E, 2I, H] / [E, H, I] are understood")
            experts[key] = tuple(names)
