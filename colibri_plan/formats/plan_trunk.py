"""The plan's ``trunk`` section: where the dense trunk, attention and the KV cache live.

Optional (plans without it keep the trunk on the CPU, as before). Shape::

    "trunk": {
      "device": "cpu" | "cuda:0" | ...,        # runs norms, attention, shared experts, dense FFN, LM head
      "dense_format": "int8",                  # the pack's dense format the bytes were priced at
      "dense_bytes": 123456,                   # trunk bytes held on that device (the embedding stays in RAM)
      "kv": {"device": "cuda:0", "context_tokens": 4096, "page_tokens": 64,
             "bytes_per_token": 24576, "bytes": 100663296},
      "split": [{"first_layer": 0, "last_layer": 39, "device": "cuda:0"}, ...]   # optional, see below
    }

``kv.bytes`` = ceil(context_tokens / page_tokens) · page_tokens · bytes_per_token (whole 64-token pages,
as colibrì). Attention runs where the KV cache is; the engine keeps both with the trunk. On a GPU the
engine's cache holds float32 K and V, so ``solve`` writes ``bytes_per_token`` at
:data:`DEVICE_KV_BYTES_PER_VALUE` (twice the model spec's 16-bit figure) and takes those bytes out of the
GPU's budget (MLA's latent cache too: its attention runs on the trunk's device like GQA's). A CPU
trunk's cache holds float32 too: ``solve`` writes its ``bytes_per_token`` at
:data:`HOST_KV_BYTES_PER_VALUE` and the RAM budget charges those bytes (for the colibrì target, whose
cache is 16-bit: the spec's figure). ``kv.host: true`` was written by earlier versions for an MLA
family's GPU trunk, whose latent cache the engine then kept in RAM; the engine now keeps it on the
device, so such a plan priced no VRAM for it and is refused: re-create it. ``split`` (a
layer range per device, covering every layer once, in order) describes a trunk spread over several
GPUs, as llama.cpp's layer split does; it is a planning result that exports carry, and the engine runs
one trunk device (it refuses a split plan with one line).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from colibri_plan.errors import FormatError, MismatchError
from colibri_plan.formats import fields as f
from colibri_plan.formats.fields import At
from colibri_plan.quant import FORMATS

CPU = "cpu"
PAGE_TOKENS = 64
#: bytes per cached K/V value the model spec's ``kv_bytes_per_token`` counts (a bf16 cache: the families'
#: geometry, GGUF headers and the catalogue all count 2) ...
SPEC_KV_BYTES_PER_VALUE = 2
#: ... but a pack's spec built from its arch (``formats.pack_index.spec_from_arch``, source "pack: <path>":
#: fixtures and packs whose checkpoint spec could not be built) counts the engine's float32 already
ARCH_SPEC_KV_BYTES_PER_VALUE = 4
#: bytes per cached K/V value of the engine's device KV cache (``engine/kv_device.py``: float32 K and V);
#: the planner prices a device trunk's KV cache with it, so a change of the engine's cache dtype belongs
#: here, in one place both read
DEVICE_KV_BYTES_PER_VALUE = 4
#: bytes per cached value of a CPU trunk's cache (``engine/kv_device.py`` on a host backend: float32 K and
#: V, or MLA's latent and rope rows); the planner prices a CPU trunk's cache with it
HOST_KV_BYTES_PER_VALUE = 4
#: what every refusal of a malformed section advises
_REDO = "; re-create the plan with `colibri-plan solve`"
#: the section's place in messages ("trunk.kv.page_tokens must be ..."; values as Python shows them)
TRUNK = At("", _REDO[2:], ("trunk",), integer="an integer", repr_values=True)


def kv_bytes(context_tokens: int, bytes_per_token: int, page_tokens: int = PAGE_TOKENS) -> int:
    """Bytes of a paged KV cache holding ``context_tokens``: whole pages of ``page_tokens``."""
    pages = math.ceil(max(0, int(context_tokens)) / int(page_tokens))
    return pages * int(page_tokens) * int(bytes_per_token)


def spec_kv_bytes_per_value(source: str | None) -> int:
    """Bytes per K/V value a model spec's ``kv_bytes_per_token`` counts, from where the spec came from
    (``ModelSpec.source``): :data:`ARCH_SPEC_KV_BYTES_PER_VALUE` for a pack's arch-built spec ("pack: ..."),
    else :data:`SPEC_KV_BYTES_PER_VALUE`."""
    return ARCH_SPEC_KV_BYTES_PER_VALUE if str(source or "").startswith("pack:") else SPEC_KV_BYTES_PER_VALUE


def device_kv_bytes_per_token(spec_kv_bytes_per_token: int, source: str | None = None) -> int:
    """KV bytes per context token the engine's device cache holds for a model whose spec counts
    ``spec_kv_bytes_per_token`` at :func:`spec_kv_bytes_per_value` of ``source``: scaled to
    :data:`DEVICE_KV_BYTES_PER_VALUE`. E.g. 3072 (bf16, a catalogue spec) -> 6144 (float32); a
    fixture pack's 65536 (already float32) stays 65536."""
    have = spec_kv_bytes_per_value(source)
    return int(spec_kv_bytes_per_token) * DEVICE_KV_BYTES_PER_VALUE // have


def host_kv_bytes_per_token(spec_kv_bytes_per_token: int, source: str | None = None) -> int:
    """KV bytes per context token the engine's host cache holds (GQA K and V, or the MLA latent and rope
    rows) for a model whose spec counts ``spec_kv_bytes_per_token`` at :func:`spec_kv_bytes_per_value` of
    ``source``: scaled to :data:`HOST_KV_BYTES_PER_VALUE`. E.g. 3072 (bf16, a checkpoint, catalogue or
    GGUF spec) -> 6144 (float32); a fixture pack's 65536 (already float32) stays 65536."""
    have = spec_kv_bytes_per_value(source)
    return int(spec_kv_bytes_per_token) * HOST_KV_BYTES_PER_VALUE // have


@dataclass(frozen=True)
class TrunkPlacement:
    """A validated ``trunk`` section (see the module docstring). ``device`` "cpu" = the host."""

    device: str = CPU
    dense_format: str | None = None
    dense_bytes: int = 0
    kv_device: str = CPU
    context_tokens: int = 0
    page_tokens: int = PAGE_TOKENS
    kv_bytes_per_token: int = 0
    kv_bytes: int = 0
    split: tuple[tuple[int, int, str], ...] = field(default_factory=tuple)

    @property
    def on_device(self) -> bool:
        """True when the trunk runs on a GPU (not the host CPU)."""
        return self.device != CPU

    def to_dict(self) -> dict:
        out = {"device": self.device, "dense_format": self.dense_format, "dense_bytes": self.dense_bytes,
               "kv": {"device": self.kv_device, "context_tokens": self.context_tokens,
                      "page_tokens": self.page_tokens, "bytes_per_token": self.kv_bytes_per_token,
                      "bytes": self.kv_bytes}}
        if self.split:
            out["split"] = [{"first_layer": a, "last_layer": b, "device": d} for a, b, d in self.split]
        return out


def parse_trunk(doc: dict, device_keys: list[str], n_layers: int | None = None) -> TrunkPlacement:
    """The trunk placement of a plan document (a CPU trunk when the section is absent).

    Args:
        doc: the plan document. device_keys: the plan's device keys ("cuda:0", ...).
        n_layers: the model's decoder layers, to check ``split`` covers them (None: not checked).

    Raises:
        FormatError: a malformed section, a device that is neither "cpu" nor one of the plan's devices,
            KV bytes that do not match pages × bytes per token, a split that is not a cover of the layers,
            or ``kv.host`` true (a plan of an earlier version, module docstring).
    """
    sec = f.mapping(doc, "trunk", At("", _REDO[2:]), optional=True)
    if sec is None:
        return TrunkPlacement()
    known = [CPU, *device_keys]

    def dev(d, key, at):
        if d.get(key) not in known:
            (at / key).refuse(f"is {d.get(key)!r}; the plan knows {', '.join(known)}: solve the plan again "
                              "for this machine (--trunk cpu, or one of the profile's GPUs)", hint="")
        return d[key]

    device = dev(sec, "device", TRUNK)
    fmt = f.text(sec, "dense_format", TRUNK, optional=True, choices=FORMATS,
                 want=f"a format name ({', '.join(FORMATS)})")
    kv = f.mapping(sec, "kv", TRUNK, want="an object with device, context_tokens, page_tokens, "
                                          "bytes_per_token, bytes")
    kv_at = TRUNK / "kv"
    kv_dev = dev(kv, "device", kv_at)
    page = f.whole(kv, "page_tokens", kv_at, lo=1)
    ctx, bpt = f.whole(kv, "context_tokens", kv_at, lo=0), f.whole(kv, "bytes_per_token", kv_at, lo=0)
    total = f.whole(kv, "bytes", kv_at, lo=0)
    if total != kv_bytes(ctx, bpt, page):
        raise FormatError(f"trunk.kv.bytes is {total}, but {ctx} tokens in {page}-token pages of "
                          f"{bpt} B per token take {kv_bytes(ctx, bpt, page)}{_REDO}")
    split = []
    parts = sec.get("split") or []
    if not isinstance(parts, list):
        (TRUNK / "split").refuse(f"must be a list of {{first_layer, last_layer, device}}, got "
                                 f"{type(parts).__name__}")
    for i, part in enumerate(parts):
        at = TRUNK / "split" / i
        f.mapping(parts, i, TRUNK / "split")
        split.append((f.whole(part, "first_layer", at, lo=0), f.whole(part, "last_layer", at, lo=0),
                      dev(part, "device", at)))
    if split:
        want = 0
        for a, b, _ in split:
            if a != want or b < a:
                raise FormatError(f"trunk.split must cover the layers in order from 0; a range starts "
                                  f"at {a}, expected {want}{_REDO}")
            want = b + 1
        if n_layers is not None and want != n_layers:
            raise FormatError(f"trunk.split covers layers 0..{want - 1}; the model has {n_layers}{_REDO}")
    if "host" in kv and f.flag(kv, "host", kv_at):   # absent or false: the cache is with the trunk
        raise FormatError("trunk.kv.host is true: an earlier version kept an MLA model's latent cache in RAM "
                          "beside a GPU trunk and priced no VRAM for it; the engine now keeps it on the "
                          f"trunk's device ({device}), so the plan's budgets no longer hold" + _REDO)
    return TrunkPlacement(device, fmt, f.whole(sec, "dense_bytes", TRUNK, lo=0), kv_dev, ctx, page, bpt,
                          total, tuple(split))


def check_trunk_budgets(doc: dict, trunk: TrunkPlacement) -> None:
    """The trunk against the plan's budgets: a trunk on a discrete GPU had its bytes taken out of that
    GPU's expert budget (``budgets.trunk_vram_bytes``, at least dense + KV bytes), and every device it
    names has an expert budget ≥ 0. A plan edited by hand to move the trunk fails here on load, not at
    run time on the GPU host.

    Raises:
        FormatError: naming the device and the bytes.
    """
    b = doc.get("budgets") or {}
    took = b.get("trunk_vram_bytes") or {}
    if not isinstance(took, dict) or not all(f.is_whole(v) and v >= 0 for v in took.values()):
        At("", _REDO[2:], ("budgets", "trunk_vram_bytes"), repr_values=True).refuse(
            f"must map devices to bytes (whole numbers >= 0), got {f.shown(took, python=True)}")
    devices = [d for d in doc.get("devices") or [] if isinstance(d, dict)]
    discrete = {d.get("key") for d in devices if not d.get("unified")}
    if trunk.on_device and trunk.device in discrete and not took:
        raise FormatError(f"plan trunk is on {trunk.device} but budgets.trunk_vram_bytes is empty: the "
                          f"trunk's VRAM was not taken out of the expert budget{_REDO}")
    kv_vram = trunk.kv_bytes
    if took and sum(took.values()) < trunk.dense_bytes + kv_vram:
        raise FormatError(f"plan budgets take {sum(took.values())} B of VRAM for the trunk, less than its "
                          f"{trunk.dense_bytes} B dense + {kv_vram} B KV{_REDO}")
    vram = b.get("vram_budget_bytes") or {}
    for k in took:
        if k not in {d.get("key") for d in devices} or not f.is_number(vram.get(k)) or vram[k] < 0:
            raise FormatError(f"plan budgets.trunk_vram_bytes names {k}, whose expert budget is missing or "
                              f"negative{_REDO}")


def check_trunk_kv_figure(trunk: TrunkPlacement, kv_bytes_per_token: int, model: str) -> None:
    """Refuse a trunk section whose KV bytes per token are below the model's ``kv_bytes_per_token`` (its
    ModelSpec's figure, all layers together: the one solve writes, so like is compared with like).

    The units differ by the spec's source (a checkpoint's spec counts a 16-bit cache, a pack made from
    the arch counts the engine's float32 cache, a catalogue entry may carry a measured figure), so a
    plan solved from another source of the same model may legitimately carry a larger figure; only a
    smaller one is refused: it under-prices the KV cache of the planned context (a hand edit).
    ``model`` names the model (and where it was read) for the message.

    Raises:
        MismatchError: with both figures and the bytes of the planned context at each.
    """
    need = int(kv_bytes_per_token)
    if trunk.kv_bytes_per_token >= need:
        return
    ctx, page = trunk.context_tokens, trunk.page_tokens
    raise MismatchError(
        f"plan trunk.kv.bytes_per_token is {trunk.kv_bytes_per_token:,} B, below the {need:,} B per token of "
        f"the KV cache of {model} (its spec's figure, the one solve prices): the plan prices its "
        f"{ctx}-token KV cache ({page}-token pages) at {trunk.kv_bytes:,} B where the model's takes "
        f"{kv_bytes(ctx, need, page):,} B{_REDO}")
