"""Backend parameters for tests that run on every backend: each name a pytest param, skipped with the
backend's own ``unavailable_reason()`` where it cannot run here."""

from __future__ import annotations

import pytest

from colibri_plan.backends import get_backend

#: the host backends first, then the GPU backends (OpenCL on PoCL and Vulkan on lavapipe in CI)
ALL_BACKENDS = ("numpy", "cpu", "opencl", "vulkan", "cuda")


def backend_params(names=ALL_BACKENDS) -> list:
    """pytest params of ``names``, each skipped with its backend's reason when unavailable here."""
    out = []
    for name in names:
        reason = get_backend(name).unavailable_reason()
        out.append(pytest.param(name, marks=pytest.mark.skipif(reason is not None, reason=str(reason))))
    return out


def count_calls(obj, attr: str) -> list[int]:
    """Wrap ``obj.attr(x, ws, gates)`` (a d_expert_ffn) so that each call appends len(ws) to the returned
    list; the call itself is unchanged."""
    calls: list[int] = []
    fn = getattr(obj, attr)
    setattr(obj, attr, lambda x, ws, g: calls.append(len(ws)) or fn(x, ws, g))
    return calls
