"""The backend contract: every op with its shapes and dtypes, as one :class:`Protocol`, and the optional ops
a backend declares (``Backend.supports``) instead of being probed with ``getattr``.

Lifecycle::

    cls = get_backend("opencl")
    reason = cls.unavailable_reason()       # None when usable; never raises, never imports heavy stacks
    devices = cls.list_devices()            # [DeviceInfo]
    be = cls.open(index)                    # heavy imports happen here
    w = be.upload(qt)                       # QuantTensor -> DeviceWeight, once per tensor
    y = be.matmul(x, w)                     # x [T, in] float32 -> y [T, out] float32
    x_dev = be.d_put(x)                     # device activations: the d_* ops below
    be.free(w); be.close()

Conventions: host arrays are C-contiguous float32 numpy arrays; a :class:`DArray` is a float32,
C-contiguous, row-major activation on the device whose ``shape`` is metadata; sizes are bytes (ints);
times are seconds. Every op checks its arguments once (``InputError``: a wrong shape or dtype, a weight or
array of another backend, a closed backend); a device that cannot run a case raises ``UnsupportedError``
naming the limit; an allocation the device refuses is a ``DeviceOutOfMemoryError`` with the bytes asked
and held, and leaves nothing allocated.

Device-activation ops (``x``, ``a``, ``b`` ... DArrays unless said otherwise):

| op | shapes | result |
|---|---|---|
| ``d_put(host)`` / ``d_get(a)`` | any float32 | a device copy / a host copy |
| ``d_zeros(shape)`` / ``d_view(a, shape)`` | any / same size | zeros (KV pages) / the same buffer reshaped |
| ``d_matmul(x, w)`` | x [T, in], w DeviceWeight [out, in] | x · Wᵀ [T, out] |
| ``d_matmul_many(x, [w1, ...])`` | x [T, in], w_i [out_i, in] | [x · W_iᵀ [T, out_i], ...] (q/k/v, gate/up) |
| ``d_rmsnorm(x, weight, eps)`` | x [N, d], weight [d] | x / sqrt(mean(x²) + eps) · weight |
| ``d_add(a, b)`` | a [N, d], b [N, d] or [d] | a + b (b broadcast over rows when 1-D) |
| ``d_silu_mul(g, u)`` | g, u [N, d] | SiLU(g) · u |
| ``d_scale_rows(a, s)`` | a [N, d], s host float32 [N] | a[i] · s[i] |
| ``d_rope(x, table, pos0, rd, interleave)`` | x [T, heads, d], table [P, rd/2, 2] | x rotated |
| ``d_write_rows(dst, row0, src)`` | dst [C, ...], src [T, ...] | dst[row0:row0+T] = src, in place |
| ``d_write_rows(dst, row0, src, col0)`` | dst [C, D], src [T, W], col0 + W ≤ D | the block, in place |
| ``d_head_matmul(x, w)`` | x [T, B, K], w [B, N, K] a DArray | y[t, b] = w[b] · x[t, b], [T, B, N] |
| ``d_attention(q, k, v, n_keys, pos0, scale, window)`` | q [T, Hq, d], k/v [C, Hkv, d] | [T, Hq·d] |
| ``d_expert_ffn(x, experts, gates)`` | x [T, H], n ExpertWeights, host gates [n] | Σ_i g_i·FFN_i(x) [T, H] |
| ``d_router_topk(x, w, bias, rule)`` | x [T, H], w [E, H], bias [E] / None | (ids int32, weights) [T, K] |

RoPE (``rope_table``): ``table[p, i] = (cos(p·f_i)·af, sin(p·f_i)·af)``, position ``pos0 + t`` rotates row
``t``; rotate_half pairs channel i with i + rd/2, interleaved pairs (2i, 2i+1); channels ≥ rd unchanged.
Attention (causal GQA): query row t at position pos0 + t sees key rows lo..pos0+t (lo = pos0 + t −
window + 1 for a sliding window, else 0) of the first n_keys; query head h reads kv head h // (Hq / Hkv);
float32 accumulation. MLA runs it on its latent cache: one kv head, d = qk_rope_head_dim + kv_lora_rank.
Routed experts: FFN_i(x) = down_i(SiLU(x·gate_iᵀ) ⊙ x·up_iᵀ) of experts uploaded here, summed in the
engine's float32 order (0 + y_0·g_0 + y_1·g_1 ...).
Routing (``d_router_topk``, optional): the host rule of :mod:`colibri_plan.backends.routing` on the device;
ids come down with ``d_get_ids`` (int32), weights with ``d_get``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from colibri_plan.backends.handles import DArray, DeviceInfo, DeviceWeight, ExpertWeights
from colibri_plan.quant import QuantTensor

#: optional ops: name -> what it is. A backend lists those it has in its class's ``optional_ops``;
#: ``Backend.supports(name)`` answers from that declaration (ggml's ``supports_op``), never by probing.
OPTIONAL_OPS = {
    "d_router_topk": "the router GEMV and top-k rule on the device x, ids and weights left on the device",
    "d_expert_ffn_rows": "a prefill's routed experts on the device x, each on its own tokens' rows (CUDA)",
    "expert_ffn_sum": "a decode step's routed sum in one call on host arrays (cpu)",
    "upload_expert_mapped": ("an expert in mapped page-locked host memory that the device's kernels read "
                             "over the bus, zero-copy (a discrete GPU computing the pinned tier; CUDA)"),
    "d_capture_step": ("a decode step captured once and replayed, its experts indexed on the device; with "
                       "experts on the host, captured as segments between hand-offs (CUDA)"),
    "d_attention_prologue": ("a GQA layer's per-head q/k RMSNorm, RoPE and KV cache append in one launch, "
                             "the bits of those ops (CUDA, cpu)"),
}


@runtime_checkable
class ComputeBackend(Protocol):
    """What every backend offers (``Backend`` checks the arguments; a backend binds the hooks). Host arrays
    float32 numpy, device arrays :class:`DArray` (shapes: the table above)."""

    name: str
    formats: tuple[str, ...]  # quant formats its kernels take
    device: DeviceInfo

    @classmethod
    def unavailable_reason(cls) -> str | None: ...  # why it cannot run here, or None; never raises
    @classmethod
    def list_devices(cls) -> list[DeviceInfo]: ...  # empty when unavailable; never raises
    @classmethod
    def supports(cls, op: str) -> bool: ...  # an optional op (OPTIONAL_OPS) declared; True for the rest
    def upload(self, qt: QuantTensor) -> DeviceWeight: ...  # once per tensor
    def upload_expert(self, gate: QuantTensor, up: QuantTensor, down: QuantTensor) -> ExpertWeights: ...
    def matmul(self, x: np.ndarray, w: DeviceWeight) -> np.ndarray: ...  # [T, in] -> [T, out]
    # each x_i [T_i, H] -> down_i(SiLU(gate_i x_i) · up_i x_i) [T_i, H]; gate/up [I, H], down [H, I]
    def expert_ffn(self, xs: Sequence[np.ndarray], experts: Sequence[ExpertWeights]) -> list[np.ndarray]: ...
    def last_gpu_seconds(self) -> float | None: ...  # the device's time of the last op, if measured
    def free(self, w: DeviceWeight) -> None: ...
    def memory_used(self) -> int: ...  # bytes of weights held
    def synchronize(self) -> None: ...
    def close(self) -> None: ...
    def d_put(self, host: np.ndarray) -> DArray: ...
    def d_get(self, a: DArray) -> np.ndarray: ...
    def d_get_ids(self, ids: DArray) -> np.ndarray: ...  # int32 host copy of d_router_topk's ids
    # d_router_topk's (ids int32, weights float32) on the host, in one copy where they share a buffer
    def d_get_routing(self, ids: DArray, weights: DArray) -> tuple[np.ndarray, np.ndarray]: ...
    def d_zeros(self, shape: tuple[int, ...]) -> DArray: ...
    def d_view(self, a: DArray, shape: tuple[int, ...]) -> DArray: ...
    def d_matmul(self, x: DArray, w: DeviceWeight) -> DArray: ...
    def d_matmul_many(self, x: DArray, ws: Sequence[DeviceWeight]) -> list[DArray]: ...
    def d_rmsnorm(self, x: DArray, weight: DArray, eps: float) -> DArray: ...
    def d_add(self, a: DArray, b: DArray) -> DArray: ...
    def d_silu_mul(self, g: DArray, u: DArray) -> DArray: ...
    def d_scale_rows(self, a: DArray, s: np.ndarray) -> DArray: ...
    def d_rope(self, x: DArray, table: DArray, pos0: int, rotary_dim: int, interleave: bool) -> DArray: ...
    def d_write_rows(self, dst: DArray, row0: int, src: DArray, col0: int = 0) -> None: ...
    def d_head_matmul(self, x: DArray, w: DArray) -> DArray: ...
    def d_attention(self, q: DArray, k: DArray, v: DArray, n_keys: int, pos0: int, scale: float,
                    window: int = 0) -> DArray: ...
    def d_expert_ffn(self, x: DArray, experts: Sequence[ExpertWeights], gates: np.ndarray) -> DArray: ...
    # optional: router logits x·Wᵀ and routing.RouteRule's top-k -> (ids [T, K] int32 bits, weights [T, K])
    def d_router_topk(self, x: DArray, w_router: DeviceWeight, bias: DArray | None, rule
                      ) -> tuple[DArray, DArray]: ...


#: the ops every backend has (the Protocol's methods); ``supports`` answers True for these
REQUIRED_OPS = frozenset(n for n in vars(ComputeBackend) if not n.startswith("_") and n not in OPTIONAL_OPS
                         and callable(getattr(ComputeBackend, n, None)))
