"""A long prefill on a device trunk computes the host tiers' experts on the device (engine/offload.py): each
touched pinned / LRU / streamed expert is uploaded, run with the device's own experts in one
``d_expert_ffn_rows`` call and freed. The manager's host compute is not called in such a prefill; the tokens
are the CPU engine's; the tier uses equal the host path's (a miss is read, checked and admitted to the LRU as
there). On the simulated GPU (the CUDA backend's host side on the stand-in cupy) and on a host "device" (the
numpy backend given a rows op), so the engine's logic runs without a GPU. Decode (one token) is unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from _backend_params import backend_params

from colibri_plan.backends import get_backend
from colibri_plan.engine.fixture import FixtureConfig, build_fixture
from colibri_plan.engine.forward import Model
from colibri_plan.engine.offload import OFFLOAD_ENV, PREFILL_OFFLOAD_TOKENS
from colibri_plan.engine.pack import open_pack
from colibri_plan.engine.placement import LayerPlacement, Placement
from colibri_plan.engine.residency import ResidencyManager

PROMPT = [(7 * i + 3) % 300 for i in range(PREFILL_OFFLOAD_TOKENS + 8)]  # a prefill that offloads
N_TOKENS = 6
LOCAL = [0, 1, 2, 3, 4, 5]  # in VRAM on the trunk's device (of 16, top-4)


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    d = tmp_path_factory.mktemp("offload") / "fx"
    build_fixture(d, FixtureConfig.small(layers=2, experts=16, top_k=4, vocab=300))
    with open_pack(d) as pack, Model(pack) as ref:
        want = ref.generate(PROMPT, N_TOKENS)
    return d, want


def _placement(arch, key: str) -> Placement:
    """LOCAL on ``key``, four pinned, an LRU of two, the rest streamed from disk, in every MoE layer."""
    return Placement({l: LayerPlacement(vram={key: list(LOCAL)}, ram_pinned=[8, 9, 10, 11], lru_slots=2)
                      for l in arch.moe_layers})


class _RowsNumpy(get_backend("numpy")):
    """The numpy backend with a ``d_expert_ffn_rows`` (each expert on its gathered rows, summed in order):
    a host "device" on which the trunk takes the prefill's device path."""

    optional_ops = frozenset({"d_expert_ffn_rows"})

    def d_expert_ffn_rows(self, x, experts, rows, gates):
        xh = self.d_get(x)
        out = np.zeros_like(xh)  # [T, H]
        for r, g, y in zip(rows, gates, self.expert_ffn([xh[np.asarray(r)] for r in rows], experts)):
            out[np.asarray(r)] += y * np.asarray(g, np.float32)[:, None]
        return self.d_put(out)


def _run(pack, be, key: str, before_prefill=None):
    """Prefill then greedy decode with ``be`` as the trunk's device: (tokens, the manager's stats after,
    the prefill's stats, layers whose run() the prefill called, the prefill's host expert_ffn calls, the
    device's bytes held before / after the prefill)."""
    cpu = get_backend("numpy").open(0)
    rm = ResidencyManager(pack, _placement(pack.arch, key), cpu, devices={key: be})
    calls = {"run": [], "ffn": 0}
    run, ffn = rm.run, cpu.expert_ffn
    rm.run = lambda layer, *a, **k: calls["run"].append(layer) or run(layer, *a, **k)
    cpu.expert_ffn = lambda *a: calls.__setitem__("ffn", calls["ffn"] + 1) or ffn(*a)
    try:
        with Model(pack, experts=rm, trunk_backend=be, context_tokens=64) as model:
            cache = model.new_cache()
            if before_prefill is not None:
                before_prefill(be)
            held = be.memory_used()
            tok = int(np.argmax(model.trunk.last_logits(np.array(PROMPT), cache)))
            after = be.memory_used()
            pre = rm.reset_stats()
            prefill_runs, prefill_ffn = list(calls["run"]), calls["ffn"]
            tokens = [tok]
            for _ in range(N_TOKENS - 1):
                tokens.append(int(np.argmax(model.trunk.last_logits(np.array([tokens[-1]]), cache))))
        return tokens, rm.stats, pre, prefill_runs, prefill_ffn, (held, after)
    finally:
        rm.close()
        cpu.close()


def _host_path(pack):
    """The host path's tokens and prefill stats with the same placement (the numpy trunk has no rows op:
    every routed expert of the prefill goes through the manager)."""
    be = get_backend("numpy").open(0)
    try:
        tokens, stats, pre, runs, ffn, _ = _run(pack, be, "numpy:0")
    finally:
        be.close()
    assert runs and ffn  # the host computed the prefill's experts
    return tokens, stats, pre


def _check_offloaded(got, ref, want, arch):
    tokens, stats, pre, runs, ffn, (held, after) = got
    ref_tokens, ref_stats, ref_pre = ref
    assert ref_tokens == want and tokens == want
    assert runs == [] and ffn == 0  # the manager's host compute was not called in the prefill
    assert held == after  # the uploads were freed
    assert pre.uses == ref_pre.uses and pre.disk_bytes == ref_pre.disk_bytes  # tiers as the host path's
    assert all(pre.uses[t] > 0 for t in ("vram", "ram_pinned", "disk")), pre.uses
    assert pre.offloaded == sum(pre.uses.values()) - pre.uses["vram"] and pre.offload_h2d_bytes > 0
    assert stats.uses == ref_stats.uses  # decode: same LRU contents after the prefill, same hits
    assert stats.offloaded == 0  # decode (T = 1) keeps the host path


def test_prefill_offload_on_a_host_device(fx):
    folder, want = fx
    with open_pack(folder) as pack:
        ref = _host_path(pack)
        be = _RowsNumpy.open(0)
        try:
            got = _run(pack, be, "numpy:0")
        finally:
            be.close()
        _check_offloaded(got, ref, want, pack.arch)


def test_prefill_offload_takes_only_what_fits_in_the_device(fx):
    """Room for one expert beyond the device's own: one host expert a layer goes up, the rest stay on the
    host path (the manager's run()), same tokens and tier uses."""
    folder, want = fx

    class Small(_RowsNumpy):
        cap = None

        def capacity_bytes(self):
            return self.cap

    with open_pack(folder) as pack:
        ref = _host_path(pack)
        be = Small.open(0)
        room = sum(q.nbytes for q in pack.expert(pack.arch.moe_layers[0], 0))  # one expert's bytes
        try:
            tokens, _, pre, runs, _, _ = _run(pack, be, "numpy:0", lambda b: setattr(
                b, "cap", b.memory_used() + 3 * room // 2))
        finally:
            be.close()
    assert tokens == want and runs == list(pack.arch.moe_layers)
    assert pre.offloaded == len(pack.arch.moe_layers) and pre.uses == ref[2].uses


def test_prefill_offload_off_by_the_switch_and_below_the_threshold(fx, monkeypatch):
    folder, want = fx
    monkeypatch.setenv(OFFLOAD_ENV, "0")
    with open_pack(folder) as pack:
        be = _RowsNumpy.open(0)
        try:
            tokens, _, pre, runs, ffn, _ = _run(pack, be, "numpy:0")
        finally:
            be.close()
    assert tokens == want and runs == list(pack.arch.moe_layers) and ffn and pre.offloaded == 0


def test_prefill_offload_on_the_simulated_cuda_backend(fx, monkeypatch):
    """backends/cuda's host side (uploads through the staging buffer, the rows op's tables and launches,
    frees) under the engine on the stand-in cupy."""
    folder, want = fx
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from tests.test_backend_cuda_device_sim import device_cupy
    from tests.test_backend_cuda_sim import Sim

    monkeypatch.setitem(sys.modules, "cupy", device_cupy(Sim()))
    be = get_backend("cuda").open(0)
    rows_calls, rows_op = [], be._d_expert_rows
    be._d_expert_rows = lambda x, ws, rows, gates: rows_calls.append((x.shape[0], len(ws))) or rows_op(
        x, ws, rows, gates)
    try:
        with open_pack(folder) as pack:
            ref = _host_path(pack)
            got = _run(pack, be, "cuda:0")
    finally:
        be.close()
    _check_offloaded(got, ref, want, pack.arch)
    pre = got[2]
    # one rows call per MoE layer of the prefill, with the device's experts and the offloaded ones
    prefill = [c for c in rows_calls if c[0] == len(PROMPT)]
    assert len(prefill) == len(pack.arch.moe_layers)
    assert sum(n for _, n in prefill) == sum(pre.uses.values())


@pytest.mark.parametrize("backend", backend_params(("cuda",)))
def test_prefill_offload_on_a_gpu(fx, backend):
    """The real GPU (skipped here without one): the uploads, the rows op and the frees on the device."""
    folder, want = fx
    be = get_backend(backend).open(0)
    try:
        with open_pack(folder) as pack:
            ref = _host_path(pack)
            got = _run(pack, be, f"{backend}:0")
    finally:
        be.close()
    _check_offloaded(got, ref, want, pack.arch)
