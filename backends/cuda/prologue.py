"""The CUDA backend's ``d_attention_prologue`` (optional op, issue 25): a GQA layer's per-head q/k RMSNorm,
RoPE of q and k and the KV cache append in one launch of ``shaders/cuda/trunk.cu``'s ``tr_qkv_prologue``
(``tr_qkv_prologue_at`` inside a captured decode step: the position and the caches' addresses read on
the device, as ``tr_rope_at`` / ``tr_copy_rows_at`` do), instead of six (two rmsnorm, two tr_rope, two
row copies). Inside a replayed CUDA graph each launch costs ~3 µs on an H200, so this is ~15 µs a layer.

Same bits as the unfused ops: the norm sums in the order of matmul.cu's ``rmsnorm`` at one warp per row
(``rms_threads`` for a head of at most 1024 floats), RoPE is ``tr_rope``'s expression, the rows are copied.
One warp per head row, ``PRO_WARPS`` rows per block; heads wider than ``PRO_MAX_HEAD_DIM`` are refused
(UnsupportedError, before any launch: the engine then runs the unfused ops).
"""

from __future__ import annotations

import math

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.prologue_args import check_prologue_args
from colibri_plan.errors import InputError, UnsupportedError

PRO_WARPS = 4  # trunk.cu PRO_WARPS: head rows (one warp each) per block
PRO_MAX_HEAD_DIM = 1024  # trunk.cu PRO_MAX_D: the widest head a warp's shared row buffer holds
_MAX_BLOCKS = 65535  # the kernel strides over the rows: any grid covers them


class CudaPrologue:
    """``d_attention_prologue`` (module docstring).

    Args:
        backend: the open CUDA backend; dops: its :class:`~colibri_plan.backends.cuda.device.CudaDeviceOps`.
    """

    HOOKS = ("d_attention_prologue",)

    def __init__(self, backend, dops):
        self.be, self.d = backend, dops

    def d_attention_prologue(self, q: DArray, k: DArray, v: DArray, norms, eps: float, rope,
                             k_cache: DArray, v_cache: DArray, row0: int) -> DArray:
        """What ``d_rmsnorm`` per head, ``d_rope`` and the cache append (``d_write_rows`` of k and v) give,
        in one launch: q float32 [T, Hq, d], k and v [T, Hkv, d]; ``norms`` None or (q_norm, k_norm) [d]
        each, RMSNorm of every head row with ``eps``; ``rope`` None or (table [P, rd/2, 2], rd,
        interleave), at positions row0..row0+T-1; roped k and v written to rows row0..row0+T-1 of
        ``k_cache`` / ``v_cache`` [C, Hkv, d] in place -> the roped q [T, Hq, d] (a new array). Queued on
        the stream, no host wait; inside a captured step the position and the caches' addresses are
        read on the device (the caches must be among the step's slots).

        Raises:
            InputError: arrays of another backend or of shapes that do not fit, rows past the cache or
            positions past the table. UnsupportedError: a head wider than PRO_MAX_HEAD_DIM.
        """
        T, hq, hkv, d = self._check(q, k, v, norms, rope, k_cache, v_cache, row0)
        if not math.isfinite(eps):
            raise InputError(f"d_attention_prologue: eps must be finite, got {eps!r}")
        ops = self.d
        g = ops.graph
        name = "tr_qkv_prologue" if g is None else "tr_qkv_prologue_at"
        kern = ops._d_state()["launches"].get(name) or ops._d_kernel(name)
        ops._d_go()
        qo = ops._d_empty(T * hq * d)  # [T, Hq, d]
        rows = T * (hq + 2 * hkv)
        if rows:
            qw, kw = (0, 0) if norms is None else (ops._ptr(norms[0]), ops._ptr(norms[1]))
            tp, rd, inter = (0, 0, 0) if rope is None else (ops._ptr(rope[0]), int(rope[1]),
                                                            int(bool(rope[2])))
            kp, vp = ops._ptr(k_cache), ops._ptr(v_cache)
            # a captured step: the caches through their slots, the position as *posp + delta
            tail = (kp, vp, T, hq, hkv, d, rd, inter, float(eps), int(row0)) if g is None else (
                g.slot(kp), g.slot(vp), T, hq, hkv, d, rd, inter, float(eps), g.posp, int(row0) - g.pos)
            kern(min(-(-rows // PRO_WARPS), _MAX_BLOCKS), 1, 1, 32 * PRO_WARPS, 0, ops._dstate["sptr"],
                 ops._ptr(q), ops._ptr(k), ops._ptr(v), qw, kw, tp, qo.data.ptr, *tail)
        return DArray((T, hq, d), qo, id(self.be))

    def _check(self, q, k, v, norms, rope, k_cache, v_cache, row0: int) -> tuple[int, int, int, int]:
        """(T, Hq, Hkv, d) of valid arguments (d_attention_prologue's Raises)."""
        T, hq, hkv, d = check_prologue_args(self.be, q, k, v, norms, rope, k_cache, v_cache, row0)
        if d > PRO_MAX_HEAD_DIM:
            raise UnsupportedError(f"cuda d_attention_prologue: head_dim {d} is over {PRO_MAX_HEAD_DIM} (one "
                                   "warp's row buffer); use the unfused ops")
        return T, hq, hkv, d
