"""What a prompt may ask of the engine before its prefill starts: positions the model was trained for, and
host memory for the prefill of a CPU trunk.

A 20,000-token prompt used to die inside the prefill with a raw ``ArrayMemoryError`` (its attention scores
[Hkv, g, T, T] for the whole prompt: 5.96 GiB); the host attention now works in tiles of query rows
(``backends/reference.py``, the cpu backend's kernel holds one row), and what is left — the KV cache
and the activations of T rows — is estimated here and refused with the figures when MemAvailable cannot
hold it. Positions beyond ``max_position_embeddings`` (config.json) were never trained: RoPE runs past
its range and the output is garbage, so they are refused too (0: unknown, not checked).
"""

from __future__ import annotations

import os

from colibri_plan.errors import BudgetError, InputError
from colibri_plan.formats.arch import ArchConfig

#: set to 1 to skip the memory checks (this one and engine/session.py's check_ram_fits, which imports it)
NO_RAM_CHECK_ENV = "COLIBRI_PLAN_NO_RAM_CHECK"
#: bytes the host attention's tiles take at most (scores, their exponentials, the mask: 3 x the tile)
_TILE_BYTES = 3 * (64 << 20)
#: live [T, width] float32 buffers of one layer's prefill beyond the named ones (temporaries, residual)
_SLACK_BUFFERS = 4


def check_positions(arch: ArchConfig, tokens: int, what: str, fix: str) -> None:
    """Refuse ``tokens`` positions beyond ``arch.max_position_embeddings`` (unknown: 0, not checked).

    Args:
        what: what asked for them ("the prompt (20,000 tokens) + --tokens 8"); fix: what to do instead.

    Raises:
        InputError: naming both figures.
    """
    most = int(getattr(arch, "max_position_embeddings", 0) or 0)
    if most and tokens > most:
        raise InputError(f"{what} needs {tokens:,} positions, beyond the model's max_position_embeddings "
                         f"{most:,} (config.json): it was never trained past them and its output would be "
                         f"garbage; {fix}")


def prefill_host_bytes(arch: ArchConfig, n_prompt: int, context_tokens: int) -> dict:
    """Host bytes a CPU trunk's prefill of ``n_prompt`` rows allocates beyond the weights: the float32 KV
    cache of ``context_tokens`` positions in every layer (MLA: its latent and rope rows), the activations
    of the prompt's rows through the widest layer, and the attention tiles.

    Returns:
        {"kv_bytes", "activation_bytes", "attention_bytes", "total_bytes"} (ints).
    """
    a = arch
    if a.attention == "mla":
        per_pos = (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    else:
        per_pos = 2 * a.n_kv_heads * a.head_dim * 4
    kv = per_pos * int(context_tokens) * a.n_layers
    widths = (3 * a.hidden_size + 2 * a.n_heads * a.head_dim + 2 * a.n_kv_heads * a.head_dim
              + 3 * max(a.dense_intermediate_size, a.shared_intermediate_size, a.moe_intermediate_size)
              + a.n_experts + _SLACK_BUFFERS * a.hidden_size)
    act = int(n_prompt) * widths * 4
    return {"kv_bytes": kv, "activation_bytes": act, "attention_bytes": _TILE_BYTES,
            "total_bytes": kv + act + _TILE_BYTES}


def check_prefill_memory(arch: ArchConfig, n_prompt: int, context_tokens: int,
                         available: int | None = None) -> None:
    """Refuse a CPU trunk's prefill that MemAvailable cannot hold (:func:`prefill_host_bytes`), before it
    starts. Skipped when the available memory is unknown or ``$COLIBRI_PLAN_NO_RAM_CHECK`` is 1.

    Raises:
        BudgetError: with the estimate's parts and the memory available.
    """
    from colibri_plan import meminfo

    if os.environ.get(NO_RAM_CHECK_ENV) == "1":
        return
    available = meminfo.mem_available_bytes() if available is None else available
    need = prefill_host_bytes(arch, n_prompt, context_tokens)
    if available is not None and need["total_bytes"] > available:
        raise BudgetError(f"the prefill of a {n_prompt:,}-token prompt needs about "
                          f"{need['total_bytes'] / 1e9:.2f} GB of RAM (KV cache for {context_tokens:,} "
                          f"positions {need['kv_bytes'] / 1e9:.2f} GB, activations "
                          f"{need['activation_bytes'] / 1e9:.2f} GB, attention tiles "
                          f"{need['attention_bytes'] / 1e9:.2f} GB) but {available / 1e9:.2f} GB are "
                          f"available (MemAvailable); give a shorter prompt, or set {NO_RAM_CHECK_ENV}=1 "
                          "to run it anyway")
