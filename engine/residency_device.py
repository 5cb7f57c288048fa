"""The device tiers of :class:`~colibri_plan.engine.residency.ResidencyManager`: which experts a trunk's GPU
holds (in VRAM, or in mapped pinned host memory it computes), their use counts when a captured decode step
served them, and the exchange of a VRAM and a mapped expert (engine/promote.py). A mixin: it reads the
manager's ``_vram``, ``_pinned_dev``, ``devices``, ``stats``, ``observers``, ``_lock`` and ``pack``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from colibri_plan.errors import InputError


class DeviceTiers:
    """Device-tier queries and changes of the residency manager (module docstring)."""

    _mapped_mask = None  # count_local_step's [MoE layers, E] of the mapped pinned experts, built lazily

    def _on(self, backend, layer: int, e: int) -> tuple[str | None, tuple | None]:
        """("vram" | "ram_pinned", (device key, ExpertWeights)) of expert ``e`` of ``layer`` when it is
        held on ``backend`` itself (VRAM, or mapped pinned memory it computes: engine/unified.py), else
        (None, None)."""
        for tier, where in (("vram", self._vram), ("ram_pinned", self._pinned_dev)):
            held = where.get((layer, e))
            if held is not None and self.devices[held[0]] is backend:
                return tier, held
        return None, None

    def held_on(self, backend, layer: int) -> tuple[str | None, dict[int, object]]:
        """The experts of MoE ``layer`` held on ``backend`` itself, in its VRAM or pinned in host memory it
        maps: (its device key, or None when none is, {expert id: ExpertWeights}). A captured decode step
        (engine/decode_graph.py) reads their addresses once; the tiers hold still unless a repinner moves
        them (``repinner``)."""
        if self._closed:
            raise InputError("residency manager is closed")
        out, key = {}, None
        for (lay, e), (k, ew) in [*self._vram.items(), *self._pinned_dev.items()]:
            if lay == layer and self.devices.get(k) is backend:
                out[e], key = ew, k
        return key, out

    def count_local_step(self, layers: Sequence[int], ids: np.ndarray) -> None:
        """Count the uses of one token's chosen experts in several MoE layers, served on a trunk's device
        without :meth:`local_experts` (a replayed decode step, whose experts all live there):
        "ram_pinned" for the pinned ones it maps, "vram" for the rest. ids int [len(layers), K], row j the
        choices of ``layers[j]``. The ``observers`` are not called: the step feeds its promoter itself
        (engine/decode_graph.py)."""
        if self._mapped_mask is None:  # [MoE layers, E]: mapped pinned (the tiers change by swap_tiers)
            arch = self.pack.arch
            self._mask_row = {layer: r for r, layer in enumerate(arch.moe_layers)}
            self._mapped_mask = np.zeros((len(self._mask_row), arch.n_experts), bool)
            for lay, e in self._pinned_dev:
                self._mapped_mask[self._mask_row[lay], e] = True
        ids = np.asarray(ids, np.int64)
        rows = np.array([self._mask_row[layer] for layer in layers], np.int64)
        n_pinned = int(self._mapped_mask[rows[:, None], ids].sum())
        self.stats.uses["ram_pinned"] += n_pinned
        self.stats.uses["vram"] += ids.size - n_pinned

    def tiers_on(self, backend, layer: int) -> tuple[list[int], list[int]]:
        """(ids in VRAM, ids in mapped pinned memory) of MoE ``layer``'s experts held on ``backend``."""
        def on(tier: dict) -> list[int]:
            return sorted(e for (lay, e), (k, _) in tier.items()
                          if lay == layer and self.devices[k] is backend)
        return on(self._vram), on(self._pinned_dev)

    def held_weights(self, layer: int, e: int):
        """The ExpertWeights holding expert ``e`` of ``layer`` in VRAM or mapped pinned memory.

        Raises:
            InputError: the expert is in neither."""
        held = self._vram.get((layer, e)) or self._pinned_dev.get((layer, e))
        if held is None:
            raise InputError(f"expert {e} of layer {layer} is not held in VRAM or mapped pinned memory")
        return held[1]

    def swap_tiers(self, layer: int, hot: int, cold: int) -> None:
        """After the backend exchanged their bytes (``d_expert_exchange``): mapped pinned expert ``hot``
        of ``layer`` now lives in VRAM expert ``cold``'s buffers and ``cold`` in ``hot``'s.

        Raises:
            InputError: ``hot`` is not mapped pinned or ``cold`` not in VRAM."""
        if (layer, hot) not in self._pinned_dev or (layer, cold) not in self._vram:
            raise InputError(f"swap_tiers: layer {layer}: expert {hot} is not mapped pinned or {cold} is "
                             "not in VRAM")
        with self._lock:
            mapped, vram = self._pinned_dev.pop((layer, hot)), self._vram.pop((layer, cold))
            self._vram[(layer, hot)], self._pinned_dev[(layer, cold)] = vram, mapped
            if self._mapped_mask is not None:
                self._mapped_mask[self._mask_row[layer], [hot, cold]] = (False, True)
