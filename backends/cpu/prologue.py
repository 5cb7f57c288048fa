"""The CPU backend's ``d_attention_prologue`` (optional op): a GQA layer's per-head q/k RMSNorm, RoPE and
KV cache append in one numba call (``kernels.qkv_prologue``) instead of six calls and their Python: at 16
threads on an H200 host a CPU decode token spent 36.5% of its time outside the kernels
(bench/results/h200-cpu16/cpu-decode-overhead-16.json). Same bits as the unfused ops (the same kernels
in the same order)."""

from __future__ import annotations

import math

import numpy as np

from colibri_plan.backends.handles import DArray
from colibri_plan.backends.prologue_args import check_prologue_args
from colibri_plan.backends.reference import HostArrays
from colibri_plan.errors import InputError

_EMPTY_W = np.zeros((1, 1), np.float32)
_EMPTY_TABLE = np.zeros((1, 1, 2), np.float32)


class CpuPrologue:
    """``d_attention_prologue`` on host arrays (module docstring); ``backend`` the open CPU backend."""

    HOOKS = ("d_attention_prologue",)

    def __init__(self, backend):
        self.be = backend

    def d_attention_prologue(self, q: DArray, k: DArray, v: DArray, norms, eps: float, rope,
                             k_cache: DArray, v_cache: DArray, row0: int) -> DArray:
        """What ``d_rmsnorm`` per head, ``d_rope`` and the cache append give (contract: backends/cuda/
        prologue.py's op of the same name): q float32 [T, Hq, d], k and v [T, Hkv, d] -> the roped q
        [T, Hq, d]; roped k and v written to rows row0..row0+T-1 of the caches [C, Hkv, d] in place.

        Raises:
            InputError: the arguments do not fit (backends/prologue_args.py) or eps is not finite.
        """
        T, hq, hkv, d = check_prologue_args(self.be, q, k, v, norms, rope, k_cache, v_cache, row0)
        if not math.isfinite(eps):
            raise InputError(f"d_attention_prologue: eps must be finite, got {eps!r}")
        h = HostArrays._host
        qq, kk, vv = (np.ascontiguousarray(h(a)) for a in (q, k, v))  # [T, Hq, d], [T, Hkv, d] x2
        qw, kw = (_EMPTY_W, _EMPTY_W) if norms is None else (h(norms[0]).reshape(1, -1),
                                                             h(norms[1]).reshape(1, -1))
        table, rd, inter = (_EMPTY_TABLE, 0, False) if rope is None else (h(rope[0]), int(rope[1]),
                                                                          bool(rope[2]))
        qo = np.empty((T, hq, d), np.float32)
        self.be._k.qkv_prologue(qq, kk, vv, qw, kw, norms is not None, np.float32(eps), table, rd, inter,
                                int(row0), h(k_cache), h(v_cache), qo, np.empty_like(qq), np.empty_like(kk))
        return DArray((T, hq, d), qo, id(self.be))
