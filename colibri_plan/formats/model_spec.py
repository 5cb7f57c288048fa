"""ModelSpec: the geometry and byte sizes of one Mixture-of-Experts model.

A ModelSpec is what the cost model and the solver need to know about a model: how many MoE layers
(rows) there are, how many routed experts each holds, how many a token selects (top-k), how large one
expert is in every quant format, how large the dense trunk is, and how many KV-cache bytes a context
token costs. It is built from a Hugging Face checkpoint folder, a GGUF header, a JSON spec file or the
built-in catalogue (see :func:`colibri_plan.model.load_model_spec`); it never holds weights.

Conventions:

- One routed expert is a SwiGLU MLP: gate [I, H], up [I, H], down [H, I] (I = ``moe_intermediate_size``,
  H = ``hidden_size``). Its bytes in a format are the sum of :func:`colibri_plan.quant.tensor_bytes`
  of the three matrices (data plus float32 scales). gpt-oss experts also carry biases
  (``expert_bias``): 2·I + H values, counted at 4 B each in integer formats (their float32 scales'
  width) and at the element size in float formats.
- A multi-token-prediction (MTP) head with routed experts is an extra MoE row whose layer id is
  ``n_layers`` (GLM-5.2: rows 3..77 plus 78 -> 76 rows x 256 = 19,456 experts). MTP rows hold experts
  (they count in :attr:`ModelSpec.n_routed_experts` and in the on-disk total) but a plain decode step
  does not run them, so :meth:`ModelSpec.cold_bytes_per_token` leaves them out — as colibrì's
  published "75 x 8 x 18.92 MB = 11.35 GB per token" does.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibri_plan import fileio, quant
from colibri_plan.errors import FormatError, InputError
from colibri_plan.fileio import read_json_object, write_document
from colibri_plan.formats import fields as fd
from colibri_plan.formats.arch import MAX_EXPERTS, MAX_LAYERS, MAX_ROUTED_EXPERTS, MAX_SIZE
from colibri_plan.formats.fields import At

#: dict keys a serialised spec must have (``to_dict`` writes exactly these plus the optional ones)
_REQUIRED = ("name", "family", "n_layers", "moe_layers", "n_experts", "top_k", "n_shared_experts",
             "hidden_size", "moe_intermediate_size", "shared_intermediate_size", "vocab_size",
             "expert_format", "dense_params", "kv_bytes_per_token", "source")
_INT_FIELDS = ("n_layers", "n_experts", "top_k", "n_shared_experts", "hidden_size",
               "moe_intermediate_size", "shared_intermediate_size", "vocab_size", "dense_params",
               "kv_bytes_per_token")


@dataclass(frozen=True)
class ModelSpec:
    """Geometry of an MoE model (all counts are integers; bytes are bytes).

    Attributes:
        name: "glm-5.2", or the checkpoint folder / GGUF file name.
        family: architecture family ("glm_moe_dsa", "deepseek_v3", "qwen3_moe", "mixtral", ...).
        n_layers: transformer layers, not counting an MTP head.
        moe_layers: sorted layer ids that hold routed experts; an MTP head is id ``n_layers``.
        n_experts: routed experts per MoE layer (E).
        top_k: routed experts a token selects per MoE layer (k).
        n_shared_experts: always-on shared experts per MoE layer.
        hidden_size: H.
        moe_intermediate_size: routed expert width I.
        shared_intermediate_size: total shared-expert width (n_shared · I_shared), 0 if none.
        vocab_size: tokenizer vocabulary (embedding rows).
        expert_format: default quant format of routed experts (a :data:`colibri_plan.quant.FORMATS` name).
        dense_params: parameters outside routed experts (attention, embeddings, LM head, shared experts,
            dense FFN layers, routers, norms, MTP trunk).
        kv_bytes_per_token: KV-cache bytes per context token, all layers together.
        source: where the figures came from: "catalogue: <source>", "checkpoint: <path>", "gguf: <path>".
        expert_bias: experts carry biases (gpt-oss).
        dense_format: the format the dense trunk is stored in when that is known (an expert pack records
            it: f32 for packs this tool writes), else None; planning then assumes ``expert_format``.
            Not part of the geometry or the fingerprint.

    Raises:
        FormatError: on construction, when a field is of the wrong type or out of range.
    """

    name: str
    family: str
    n_layers: int
    moe_layers: tuple[int, ...]
    n_experts: int
    top_k: int
    n_shared_experts: int
    hidden_size: int
    moe_intermediate_size: int
    shared_intermediate_size: int
    vocab_size: int
    expert_format: str
    dense_params: int
    kv_bytes_per_token: int
    source: str
    expert_bias: bool = False
    dense_format: str | None = None

    def __post_init__(self):
        at = At(f"model spec {self.name!r}", repr_values=True)
        for name in _INT_FIELDS:   # numpy integers become ints (the fingerprint writes JSON)
            v = fd.whole(self.__dict__, name, at, lo=0, want="a non-negative integer")
            object.__setattr__(self, name, v)
        for name in ("n_layers", "n_experts", "top_k", "hidden_size", "moe_intermediate_size"):
            if getattr(self, name) <= 0:
                at.fail(f"{name} must be positive")
        for name, most in (("n_layers", MAX_LAYERS), ("n_experts", MAX_EXPERTS), ("hidden_size", MAX_SIZE),
                        ("moe_intermediate_size", MAX_SIZE), ("shared_intermediate_size", MAX_SIZE),
                        ("vocab_size", MAX_SIZE), ("dense_params", 2**53), ("kv_bytes_per_token", 2**53)):
            if getattr(self, name) > most:  # before a planner sizes a table or a product by it
                at.fail(f"{name} {getattr(self, name)} is more than {most:,}; no real model comes near: the "
                        "spec is corrupt")
        if self.top_k > self.n_experts:
            raise FormatError(f"model spec {self.name!r}: top_k {self.top_k} > n_experts {self.n_experts}")
        layers = tuple(self.moe_layers)
        if not layers or not all(fd.is_whole(i) for i in layers):
            raise FormatError(f"model spec {self.name!r}: moe_layers must be a non-empty list of layer ids")
        if list(layers) != sorted(set(layers)) or layers[0] < 0:
            raise FormatError(f"model spec {self.name!r}: moe_layers must be sorted, unique and >= 0")
        if layers[-1] > 2 * MAX_LAYERS or len(layers) * self.n_experts > MAX_ROUTED_EXPERTS:
            raise FormatError(f"model spec {self.name!r}: {len(layers)} MoE rows (ids up to {layers[-1]}) x "
                              f"{self.n_experts} experts is beyond any real model (at most "
                              f"{MAX_ROUTED_EXPERTS:,} routed experts); the spec is corrupt")
        object.__setattr__(self, "moe_layers", layers)
        try:
            quant.check_format(self.expert_format)
            if self.dense_format is not None:
                quant.check_format(self.dense_format)
        except Exception as exc:
            raise FormatError(f"model spec {self.name!r}: {exc}") from None

    # --- counts -------------------------------------------------------------------------------------
    @property
    def n_moe_layers(self) -> int:
        """MoE rows, MTP rows included."""
        return len(self.moe_layers)

    @property
    def n_routed_experts(self) -> int:
        """All routed experts: n_moe_layers · n_experts."""
        return self.n_moe_layers * self.n_experts

    @property
    def mtp_layers(self) -> tuple[int, ...]:
        """MoE rows that belong to an MTP head (layer id >= n_layers)."""
        return tuple(i for i in self.moe_layers if i >= self.n_layers)

    @property
    def decode_moe_layers(self) -> tuple[int, ...]:
        """MoE rows a plain decode step runs (MTP rows excluded)."""
        return tuple(i for i in self.moe_layers if i < self.n_layers)

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert: 3·H·I (+ 2·I + H biases when ``expert_bias``)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return 3 * h * i + ((2 * i + h) if self.expert_bias else 0)

    @property
    def routed_params(self) -> int:
        """Parameters of all routed experts."""
        return self.n_routed_experts * self.expert_params

    @property
    def total_params(self) -> int:
        """dense_params + routed_params."""
        return self.dense_params + self.routed_params

    # --- bytes --------------------------------------------------------------------------------------
    def expert_bytes(self, fmt: str | None = None) -> int:
        """Bytes of one routed expert (gate [I,H] + up [I,H] + down [H,I]) in ``fmt`` (default
        ``expert_format``), scales included, via :func:`colibri_plan.quant.tensor_bytes`.

        Raises:
            UnsupportedError: unknown format.
        """
        fmt = fmt or self.expert_format
        h, i = self.hidden_size, self.moe_intermediate_size
        n = 2 * quant.tensor_bytes(fmt, i, h) + quant.tensor_bytes(fmt, h, i)
        if self.expert_bias:
            n += (2 * i + h) * (4 if fmt not in ("f16", "bf16") else 2)
        return n

    def routed_bytes(self, fmt: str | None = None) -> int:
        """Bytes of all routed experts in ``fmt`` (MTP rows included)."""
        return self.n_routed_experts * self.expert_bytes(fmt)

    def dense_bytes(self, fmt: str = "bf16") -> int:
        """Bytes of the dense trunk if every dense parameter were stored in ``fmt``.

        Float formats are exact (params · element size). Integer formats are an estimate: params·bits/8
        plus scales (float32; float16 for int4-gGh), one per ``hidden_size`` values for per-row formats
        (rows of width H) and one per G values for ``int4-gG``; real packs keep norms and routers in float.
        """
        quant.check_format(fmt)
        if fmt in quant.FLOAT_FORMATS:
            return self.dense_params * quant.bits(fmt) // 8
        g = quant.group_size(fmt) or self.hidden_size
        n_scales = -(-self.dense_params // g)
        return self.dense_params * quant.bits(fmt) // 8 + quant.scale_dtype(fmt).itemsize * n_scales

    def cold_bytes_per_token(self, fmt: str | None = None) -> int:
        """Routed-expert bytes one decode token reads when nothing is cached:
        decode MoE rows · top_k · expert_bytes (MTP rows excluded, see the module docstring)."""
        return len(self.decode_moe_layers) * self.top_k * self.expert_bytes(fmt)

    def kv_bytes(self, context_tokens: int) -> int:
        """KV-cache bytes for ``context_tokens`` tokens."""
        return int(context_tokens) * self.kv_bytes_per_token

    # --- identity and files -------------------------------------------------------------------------
    def geometry(self) -> dict:
        """The structural fields that decide expert ids and sizes (no name, source or estimates)."""
        return {"family": self.family, "n_layers": self.n_layers, "moe_layers": list(self.moe_layers),
                "n_experts": self.n_experts, "top_k": self.top_k, "n_shared_experts": self.n_shared_experts,
                "hidden_size": self.hidden_size, "moe_intermediate_size": self.moe_intermediate_size,
                "shared_intermediate_size": self.shared_intermediate_size, "vocab_size": self.vocab_size,
                "expert_bias": self.expert_bias}

    def fingerprint(self) -> str:
        """16-hex fingerprint of :meth:`geometry`: equal for the catalogue entry and a checkpoint of the
        same architecture; plans refuse a model whose fingerprint differs."""
        return fileio.fingerprint(self.geometry())

    def with_format(self, fmt: str) -> ModelSpec:
        """A copy whose ``expert_format`` is ``fmt``.

        Raises:
            UnsupportedError: unknown format.
        """
        quant.check_format(fmt)
        return dataclasses.replace(self, expert_format=fmt)

    def to_dict(self) -> dict:
        """A JSON-ready dict (``moe_layers`` as a list); :meth:`from_dict` reads it back."""
        d = dataclasses.asdict(self)
        d["moe_layers"] = list(self.moe_layers)
        if d["dense_format"] is None:  # unknown: left out, as in files written before the field existed
            del d["dense_format"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        """Build a spec from :meth:`to_dict` output (extra keys, e.g. derived figures, are ignored).

        Raises:
            FormatError: not a dict, a required field missing, or a field of the wrong type.
        """
        if not isinstance(d, dict):
            raise FormatError("a model spec must be a JSON object")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise FormatError(f"model spec is missing field(s) {', '.join(missing)}")
        if not isinstance(d["moe_layers"], (list, tuple)):
            raise FormatError("model spec field moe_layers must be a list of layer ids")
        kw = {k: d[k] for k in _REQUIRED}
        kw["moe_layers"] = tuple(d["moe_layers"])
        kw["expert_bias"] = bool(d.get("expert_bias", False))
        kw["dense_format"] = d.get("dense_format")
        at = At("model spec", repr_values=True)
        for k in ("name", "family", "expert_format", "source"):
            fd.text(kw, k, at)
        fd.text(kw, "dense_format", at, optional=True)
        return cls(**kw)


SPEC_KIND = "model_spec"
SPEC_SCHEMA_VERSION = 1


def load_spec_file(path: Path) -> ModelSpec:
    """Read a model spec document (kind "model_spec", or ``model show --json`` output without a kind).

    Raises:
        FormatError: another kind of document or another schema version; InputError: a config.json.
    """
    doc = read_json_object(path, "model spec file")
    if doc.get("kind") not in (None, SPEC_KIND):
        raise FormatError(f"{path} has kind {doc.get('kind')!r}, not a model spec: a spec file has kind "
                          f"{SPEC_KIND!r} (or none, as `colibri-plan model show --json` writes it)")
    if doc.get("kind") == SPEC_KIND and doc.get("schema_version") != SPEC_SCHEMA_VERSION:
        raise FormatError(f"{path} has model_spec schema_version {doc.get('schema_version')!r}; this "
                          f"colibri-plan reads version {SPEC_SCHEMA_VERSION}")
    if "model_type" in doc or "architectures" in doc:
        raise InputError(f"{path} is a Hugging Face config.json; pass its checkpoint folder instead "
                         "(config.json alone is enough; safetensors headers there are checked against it)")
    return ModelSpec.from_dict(doc.get("spec", doc))


def save_model_spec(spec: ModelSpec, path: str | os.PathLike) -> Path:
    """Write ``spec`` as a JSON document (kind "model_spec", schema_version 1), atomically."""
    return write_document(path, SPEC_KIND, SPEC_SCHEMA_VERSION,
                                 {"spec": spec.to_dict(), "fingerprint": spec.fingerprint()})
