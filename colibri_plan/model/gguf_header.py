"""Size a GGUF model from its header (key/values and tensor infos) via the ``gguf`` package's GGUFReader.

GGUFReader memory-maps the file and parses only the header; no tensor data is touched. Keys used
(``{arch}`` = ``general.architecture``, as llama.cpp's converter writes them):

- ``{arch}.block_count`` (decoder blocks, an MTP/NextN block included), ``{arch}.nextn_predict_layers``;
- ``{arch}.embedding_length`` (H), ``{arch}.expert_count`` (E), ``{arch}.expert_used_count`` (top-k),
  ``{arch}.expert_feed_forward_length`` (I; Mixtral-style files have only ``{arch}.feed_forward_length``),
  ``{arch}.expert_shared_count`` (the shared width comes from the ``ffn_gate_shexp`` tensor);
- ``{arch}.attention.head_count_kv``, ``.key_length``, ``.value_length``, ``.kv_lora_rank``,
  ``{arch}.rope.dimension_count`` for the KV cache.

Tensor infos give the ground truth: blocks holding ``blk.N.ffn_{gate,up,down}_exps.weight`` (or fused
``ffn_gate_up_exps``) are the MoE rows; GGML lists dimensions fastest first, so ``ffn_gate_exps`` is
[H, I, E] and ``ffn_down_exps`` [I, H, E]. They are checked against the key/values.
"""

from __future__ import annotations

import re
from pathlib import Path

from colibri_plan.errors import FormatError, InputError, UnsupportedError
from colibri_plan.formats.model_spec import ModelSpec

_EXPS = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight$")
#: GGUF architecture -> the Hugging Face model_type we use as family
_FAMILY = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v3",
           "glm4moe": "glm4_moe", "olmoe": "olmoe", "gpt-oss": "gpt_oss", "llama": "mixtral",
           "qwen3next": "qwen3_next", "dots1": "dots1"}


def _reader(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, KeyError, OverflowError, TypeError, OSError) as exc:  # gguf on junk
        raise FormatError(f"{path} is not a readable GGUF file ({exc}); check the download") from exc


def gguf_spec(path: str | Path) -> ModelSpec:
    """ModelSpec of a GGUF file, from its header only.

    Raises:
        InputError: the file does not exist.
        FormatError: not a GGUF file, a needed key missing, or tensor infos that disagree with the keys.
        UnsupportedError: the file describes a model without routed experts.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"GGUF file {path} does not exist")
    r = _reader(path)

    def get(key: str, default=None):
        field = r.get_field(key)
        if field is None:
            return default
        try:
            if hasattr(field, "contents"):
                return field.contents()
            # gguf < 0.11 has no contents(): scalars and strings sit in parts[data[0]]
            part = field.parts[field.data[0]]
            if field.types and field.types[0].name == "STRING":
                return bytes(part).decode("utf-8")
            return part.tolist()[0] if len(field.data) == 1 else [p.tolist()[0] for p in
                                                                   (field.parts[i] for i in field.data)]
        except (IndexError, ValueError, UnicodeDecodeError) as exc:
            raise FormatError(f"{path}: GGUF key {key} is unreadable ({exc})") from exc

    arch = get("general.architecture")
    if not isinstance(arch, str):
        raise FormatError(f"{path}: GGUF header has no general.architecture")

    def need(key: str) -> int:
        v = get(f"{arch}.{key}")
        if not isinstance(v, int) or isinstance(v, bool):
            raise FormatError(f"{path}: GGUF header lacks integer key {arch}.{key}")
        return v

    n_experts = get(f"{arch}.expert_count") or 0
    if not n_experts:
        raise UnsupportedError(f"{path}: GGUF architecture {arch!r} has no {arch}.expert_count: not a "
                               "Mixture-of-Experts model; colibri-plan sizes MoE models only")
    blocks, hidden, top_k = need("block_count"), need("embedding_length"), need("expert_used_count")
    nextn = get(f"{arch}.nextn_predict_layers") or 0
    n_layers = blocks - nextn
    inter = get(f"{arch}.expert_feed_forward_length") or need("feed_forward_length")
    if isinstance(inter, list):  # per-layer list in some files
        inter = max(inter)

    size = path.stat().st_size
    rows: dict[int, set] = {}
    dense = 0
    for t in r.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise FormatError(f"{path}: tensor {t.name} lies past the end of the file: the file is "
                              "truncated; re-download it")
        m = _EXPS.match(t.name)
        if not m:
            if "_exps." not in t.name:
                dense += int(t.n_elements)
            continue
        shape = [int(d) for d in t.shape]  # GGML order: fastest dimension first
        if len(shape) != 3 or shape[2] != n_experts:
            raise FormatError(f"{path}: tensor {t.name} has dims {shape}; {arch}.expert_count says "
                              f"{n_experts} experts")
        role = m.group(2)
        h_dim, i_dim = (shape[1], shape[0]) if role == "down" else (shape[0], shape[1])
        if role == "gate_up":
            i_dim //= 2
        if h_dim != hidden or i_dim != inter:
            raise FormatError(f"{path}: tensor {t.name} has dims {shape}, expected H {hidden} and I {inter} "
                              f"from {arch}.embedding_length / expert_feed_forward_length")
        rows.setdefault(int(m.group(1)), set()).add(role)
    if not rows:
        raise FormatError(f"{path}: no blk.N.ffn_*_exps tensors although {arch}.expert_count is {n_experts}")
    moe_layers = tuple(sorted(rows))
    if moe_layers[-1] >= blocks:
        raise FormatError(f"{path}: expert tensors in block {moe_layers[-1]} but block_count is {blocks}")

    # shared experts: the ffn_gate_shexp tensor [H, n_shared * I_shared] is the ground truth
    shexp = next((t for t in r.tensors if re.match(r"^blk\.\d+\.ffn_gate_shexp\.weight$", t.name)), None)
    shared_total = int(shexp.shape[1]) if shexp is not None else 0
    shared_n = (get(f"{arch}.expert_shared_count") or 1) if shared_total else 0
    embd = next((t for t in r.tensors if t.name == "token_embd.weight"), None)
    vocab = get(f"{arch}.vocab_size") or (int(embd.shape[1]) if embd is not None else 0)
    if not vocab:
        tokens = r.get_field("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0

    kv_lora = get(f"{arch}.attention.kv_lora_rank")
    if kv_lora:
        per_layer = kv_lora + (get(f"{arch}.rope.dimension_count") or 0)
    else:
        heads = get(f"{arch}.attention.head_count") or 1
        heads = max(heads) if isinstance(heads, list) else heads
        kv_heads = get(f"{arch}.attention.head_count_kv") or heads
        kv_heads = max(kv_heads) if isinstance(kv_heads, list) else kv_heads
        k_len = get(f"{arch}.attention.key_length") or hidden // heads
        v_len = get(f"{arch}.attention.value_length") or k_len
        per_layer = kv_heads * (k_len + v_len)
    kv = blocks * per_layer * 2  # bf16/f16 cache, every block (sliding-window layers not told apart)

    return ModelSpec(
        name=path.stem, family=_FAMILY.get(arch, arch), n_layers=n_layers, moe_layers=moe_layers,
        n_experts=int(n_experts), top_k=top_k, n_shared_experts=int(shared_n), hidden_size=hidden,
        moe_intermediate_size=int(inter), shared_intermediate_size=int(shared_total), vocab_size=int(vocab),
        expert_format="int4", dense_params=dense, kv_bytes_per_token=int(kv),
        source=f"gguf: {path.resolve()}",
        expert_bias=arch == "gpt-oss")
